"""The pair-verifier part of probe-eval: embedding threshold and judge-LoRA on held-out step pairs.

Each verifier scores the same held-out pairs (the data's `pairs` table restricted to held-out
questions, at most eval.max_pairs of them); the report shows ROC and precision-recall curves with the
checkpoint's chosen threshold marked, acceptance and precision at that threshold, and how the
verifiers' decisions agree with each other and with the labels.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from specprobe.infer import checkpoint_format as fmt
from specprobe.infer.judge_prompt import judge_probability
from specprobe.infer.verifiers import load_embedding_threshold, load_judge_lora
from specprobe.probes.splits import stratified_subsample
from specprobe.train.pair_verifiers import load_pairs
from specprobe.train.report import evaluate as ev
from specprobe.train.report.inputs import PartError
from specprobe.train.report.sections import EvalContext, Figure, PartResult, guarded


def heldout_pairs(ctx: EvalContext):
    """Held-out pairs (train.pair_verifiers.PairSet), subsampled to eval.max_pairs keeping the share of
    equivalent pairs."""

    pairs = load_pairs(ctx.ds)
    held = pairs.take(ctx.heldout.mask(pairs.questions))
    if len(held) == 0:
        raise PartError(f"no step pairs of held-out questions in {ctx.ds.folder}")
    return held.take(stratified_subsample(held.labels, ctx.cfg.max_pairs, ctx.cfg.seed))


def embedding_scores(ctx: EvalContext, pairs) -> tuple[np.ndarray, np.ndarray, dict[str, float], dict[str, Any]]:
    """Cosines of every pair under the runtime's embedding verifier; its thresholds (chosen, F1-optimal)."""

    if not (ctx.ckpt.folder / fmt.EMBEDDING_JSON).is_file():
        raise PartError(f"the checkpoint has no {fmt.EMBEDDING_JSON}; was 'embedding' in verifiers.train?")
    info = ctx.ckpt.part(ctx.ckpt.embedding).raw
    verifier = load_embedding_threshold(ctx.ckpt.folder, device=ctx.device, model=ctx.embedding_model)
    scores = verifier.embedder.cosine(list(pairs.a), list(pairs.b)).double().numpy()
    thresholds = {"chosen": verifier.threshold}
    f1 = ((info.get("fit") or {}).get("f1_optimal") or {}).get("threshold")
    if f1 is not None:
        thresholds["f1_optimal"] = float(f1)
    return np.arange(len(pairs)), scores, thresholds, {"model": verifier.describe().get("model"), **fit_info(info)}


def judge_scores(ctx: EvalContext, pairs) -> tuple[np.ndarray, np.ndarray, dict[str, float], dict[str, Any]]:
    """P(aligned) of the runtime's judge-LoRA on a subset of eval.judge_max_pairs pairs; its threshold."""

    if not (ctx.ckpt.folder / fmt.JUDGE_DIR / fmt.JUDGE_JSON).is_file():
        raise PartError(f"the checkpoint has no {fmt.JUDGE_DIR}/{fmt.JUDGE_JSON}; was 'judge' in verifiers.train?")
    meta = ctx.ckpt.part(ctx.ckpt.judge).raw
    judge = load_judge_lora(ctx.ckpt.folder, device=ctx.device, base_model=ctx.judge_base)
    idx = stratified_subsample(pairs.labels, ctx.cfg.judge_max_pairs, ctx.cfg.seed + 1)
    items = [(pairs.context_of(i), pairs.a[i], pairs.b[i]) for i in idx]
    scores = judge_probability(judge.model, judge.tokenizer, items, batch_size=judge.batch_size,
                               progress="judge LoRA pairs" if ctx.progress else None).double().numpy()
    return idx, scores, {"chosen": judge.threshold}, {"model": judge.model_id, **fit_info(meta)}


def fit_info(saved: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint says about how its threshold was fitted: on which pairs, the target precision,
    whether it was met, or why no threshold could be fitted (embedding_threshold.json / judge.json)."""
    fit = saved.get("fit") or {}
    return {"target_precision": fit.get("target_precision"), "met_target": fit.get("met_target"),
            "n_fit": fit.get("n"), "n_fit_positive": fit.get("n_positive"),
            "fit_on": saved.get("fit_on"), "fit_error": saved.get("fit_error")}


SCORERS = {"embedding": embedding_scores, "judge": judge_scores}


def baselines(ctx: EvalContext, name: str, scores: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    """Operating points to set beside a verifier's, on the same pairs: accepting every pair, and for the
    embedding verifier the same cosines at the config's fixed thresholds (verifiers.embedding_fixed_thresholds;
    what a threshold chosen without any labels would do). The judge's untrained base model is not scored here
    (minutes per hundred pairs on a CPU): `judge_base_at_training` quotes the checkpoint's own test figures."""
    out = {"accept all": ev.at_threshold(scores, labels, -math.inf)}
    if name == "embedding":
        fixed = ctx.ckpt.section("verifiers").get("embedding_fixed_thresholds") or []
        out.update({f"cosine>={t:g}": ev.at_threshold(scores, labels, float(t)) for t in fixed})
    return out


def verifier_entry(ctx: EvalContext, name: str, pairs) -> tuple[dict[str, Any], np.ndarray, np.ndarray, dict]:
    """(metrics block, indices of the pairs scored, scores, thresholds) of one verifier."""
    idx, scores, thresholds, info = SCORERS[name](ctx, pairs)
    labels, source = pairs.labels[idx], pairs.source[idx]
    block = ev.verifier_block(scores, labels, pairs.questions[idx], thresholds["chosen"], **ctx.bootstrap())
    block.update(info=info, thresholds=thresholds,
                 other_thresholds={k: ev.at_threshold(scores, labels, t) for k, t in thresholds.items() if k != "chosen"},
                 by_source={str(s): ev.at_threshold(scores[source == s], labels[source == s], thresholds["chosen"])
                            for s in sorted(set(source.tolist()))},
                 baselines=baselines(ctx, name, scores, labels),
                 versus_accept_all=ev.precision_over_accept_all(scores, labels, pairs.questions[idx],
                                                                thresholds["chosen"], **ctx.bootstrap()))
    if name == "judge":  # the base model on the training run's test pairs (balanced), as probe-train scored it
        base = ((ctx.ckpt.metrics.get("judge") or {}).get("test") or {}).get("base")
        block["judge_base_at_training"] = base
    return block, idx, scores, thresholds


def verifiers_part(ctx: EvalContext) -> PartResult:
    pairs = heldout_pairs(ctx)
    blocks: dict[str, Any] = {}
    decisions: dict[str, tuple[np.ndarray, np.ndarray]] = {"label": (np.arange(len(pairs)), pairs.labels.astype(bool))}
    curves: dict[str, Any] = {}
    for name in ctx.cfg.verifiers:
        out = guarded(ctx, f"verifiers/{name}", lambda n=name: verifier_entry(ctx, n, pairs))
        if out is None:
            continue
        block, idx, scores, thresholds = out
        blocks[name] = block
        decisions[name] = (idx, scores >= thresholds["chosen"])
        curves[name] = {"roc": block.get("roc"), "pr": block.get("pr"), "positive_rate": float(pairs.labels[idx].mean()),
                        "points": {"chosen": block["at_threshold"], **block["other_thresholds"]}}
    if not blocks:
        raise PartError("no pair verifier could be evaluated (see the skipped parts)")
    metrics = {"pairs": {"n": len(pairs), "n_positive": int(pairs.labels.sum()),
                         "n_questions": len(set(pairs.questions.tolist())),
                         "sources": {str(s): int((pairs.source == s).sum()) for s in sorted(set(pairs.source.tolist()))}},
               "by_verifier": blocks, "agreement": ev.agreement_on_common(decisions)}
    figures = []
    if any(c["roc"] for c in curves.values()):
        figures.append(Figure("verifiers_roc_pr.png", "Pair verifiers on held-out pairs: ROC and precision-recall, "
                              "chosen thresholds marked", "verifiers", "verifier_curves", {"curves": curves}))
    return PartResult(metrics, figures)
