"""Pair verifiers of Lookahead Reasoning (papers.md §2): does a draft step mean the same as the target's?

Both learn from the labelled step pairs of the data folder (``pairs`` table, split by question):

- **Embedding threshold**: cosine of sentence embeddings (``infer.embedder.SentenceEmbedder``); the
  threshold is fitted on the training-question pairs with ``probes.threshold.fit_threshold`` (highest
  recall at ``verifiers.target_precision``, plus the F1-optimal one). The embedder is not trained, so
  those pairs are held out from it; test pairs are never used. Baselines: fixed cosine thresholds
  (0.85 / 0.95 in the paper) and accept-all.
- **Judge LoRA**: an instruct causal LM asked with ``infer.judge_prompt`` whether the two steps mean the
  same; its probability is the softmax over the two answer tokens' logits after ONE forward pass
  (``judge_probability``). Fine-tuned with PEFT LoRA on class-balanced training pairs (orientation of each
  pair drawn at random) with cross-entropy on those two logits, i.e. exactly the read-out used at run
  time. Its decision threshold is fitted on the VALIDATION pairs, which the LoRA never trained on (a
  threshold fitted on its own training pairs would trust its overfitted confidence). Baselines: the
  untrained base model with the same prompt (the paper's prompted judge), and accept-all.

A threshold is only fitted on at least ``MIN_FIT_POSITIVES`` equivalent and as many non-equivalent
pairs; with fewer the verifier keeps a stated default (judge: P >= 0.5; embedding: the highest fixed
cosine threshold) and the checkpoint and report say that no threshold could be fitted.

Validation metrics of both: AUROC, and precision / recall / acceptance at the chosen threshold.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from specprobe.infer.checkpoint_format import ADAPTER_CONFIG, write_judge_meta
from specprobe.infer.judge_prompt import (
    NO_WORD,
    PREFILL,
    PROMPT_VERSION,
    YES_WORD,
    answer_token_ids,
    judge_answer_logits,
    judge_probability,
)
from specprobe.infer.models import describe_source, load_model
from specprobe.probes.metrics import auroc
from specprobe.probes.splits import stratified_subsample
from specprobe.probes.threshold import ThresholdFit, decisions_at, fit_threshold
from specprobe.train import judge_steps
from specprobe.train.judge_steps import Earlier, JudgeSteps, LoopState, eval_digests, run_key
from specprobe.train.probes_train import TrainingDataError

LogFn = Callable[[dict[str, Any]], None]
MIN_FIT_POSITIVES = 10  # equivalent (and non-equivalent) pairs needed to fit a decision threshold


@dataclass
class FittedThreshold:
    """A threshold fitted on named pairs, or the reason none could be (then `fit` is None)."""

    fit: ThresholdFit | None
    fit_on: str
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"fit_on": self.fit_on, "fit_error": self.error, **(self.fit.to_dict() if self.fit else {})}


def fit_on_pairs(scores: np.ndarray, labels: np.ndarray, target_precision: float, fit_on: str) -> FittedThreshold:
    """`fit_threshold` on these pairs when both classes have at least MIN_FIT_POSITIVES pairs."""
    y = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if min(n_pos, n_neg) < MIN_FIT_POSITIVES:
        return FittedThreshold(None, fit_on, f"{fit_on}: {n_pos} equivalent and {n_neg} non-equivalent pairs; "
                                             f"fitting needs at least {MIN_FIT_POSITIVES} of each")
    return FittedThreshold(fit_threshold(scores, y, target_precision), fit_on)


# ----------------------------------------------------------------------------- pairs
@dataclass
class PairSet:
    """Labelled step pairs (row-aligned arrays) and the context text of each pair's context."""

    context_ids: np.ndarray
    questions: np.ndarray
    a: np.ndarray
    b: np.ndarray
    labels: np.ndarray  # bool: equivalent
    source: np.ndarray
    contexts: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: Any) -> PairSet:
        idx = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index, dtype=np.int64)
        return PairSet(self.context_ids[idx], self.questions[idx], self.a[idx], self.b[idx], self.labels[idx],
                       self.source[idx], self.contexts)

    def context_of(self, i: int) -> str:
        return self.contexts.get(str(self.context_ids[i]), "")

    @property
    def n_positive(self) -> int:
        return int(self.labels.sum())


def _column(table, name: str) -> np.ndarray:
    return np.asarray(table.column(name).to_pylist(), dtype=object)


def load_pairs(ds) -> PairSet:
    """The pairs table of a `data_gen.store.ProbeDataset`, with the context texts."""
    pairs = ds.pairs
    contexts = ds.contexts
    texts = dict(zip(contexts.column("context_id").to_pylist(), contexts.column("context_text").to_pylist()))
    labels = np.asarray(pairs.column("equivalent").to_pylist(), dtype=bool)
    return PairSet(_column(pairs, "context_id"), _column(pairs, "question_id"), _column(pairs, "a_text"),
                   _column(pairs, "b_text"), labels, _column(pairs, "source"), texts)


def check_pairs(train: PairSet, val: PairSet, what: str) -> None:
    """Clear errors before training: empty splits, one class only, missing texts."""
    if len(train) == 0:
        raise TrainingDataError(f"{what}: no training pairs (the pairs table is empty or every question went to "
                                "validation); generate more data or lower probe.val_fraction")
    if len(val) == 0:
        raise TrainingDataError(f"{what}: no validation pairs; generate more data or raise probe.val_fraction")
    pos = train.n_positive
    if pos == 0 or pos == len(train):
        kind = "equivalent" if pos else "non-equivalent"
        raise TrainingDataError(f"{what}: single-class training pairs: all {len(train)} are {kind}; a "
                                "verifier needs both equivalent and non-equivalent pairs")
    for name, arr in (("a_text", train.a), ("b_text", train.b)):
        bad = [i for i, t in enumerate(arr) if not isinstance(t, str) or not t.strip()]
        if bad:
            raise TrainingDataError(f"{what}: training pair {bad[0]} (context {train.context_ids[bad[0]]!r}) has "
                                    f"an empty {name}")


# ----------------------------------------------------------------------------- metrics
OPERATING_POINT_KEYS = ("threshold", "precision", "recall", "acceptance_rate", "f1", "n", "n_positive")


def operating_point(scores: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, Any]:
    """Precision, recall, acceptance and F1 of `score >= threshold` (`probes.threshold.decisions_at`; None where
    undefined), as metrics.json keeps them."""
    decided = decisions_at(scores, labels, threshold)
    return {k: decided[k] for k in OPERATING_POINT_KEYS}


def score_report(scores: np.ndarray, labels: np.ndarray, thresholds: dict[str, float]) -> dict[str, Any]:
    """AUROC plus one operating point per named threshold."""
    y = np.asarray(labels, dtype=np.float64)
    value = auroc(np.asarray(scores, dtype=np.float64), y, threshold=0.5) if len(y) else float("nan")
    return {"auroc": None if not np.isfinite(value) else float(value),
            **{name: operating_point(scores, labels, t) for name, t in thresholds.items()}}


def accept_all_report(labels: np.ndarray) -> dict[str, Any]:
    return score_report(np.ones(len(labels)), labels, {"chosen": 1.0})


# ----------------------------------------------------------------------------- embedding threshold
@dataclass
class EmbeddingResult:
    model: str
    fitted: FittedThreshold
    default_threshold: float  # used when no threshold could be fitted
    metrics: dict[str, Any]
    seconds: float

    score_description = "cosine of the two steps' sentence embeddings (pooled as the embedder's model says)"

    @property
    def fit(self) -> ThresholdFit | None:
        return self.fitted.fit

    @property
    def threshold(self) -> float:
        return self.fit.threshold if self.fit is not None else self.default_threshold


def train_embedding(train: PairSet, val: PairSet, vcfg, device: str | None = None, embedder=None,
                    test: PairSet | None = None) -> EmbeddingResult:
    """Fit the cosine threshold on `train` and score it (and its baselines) on `val` (and `test`)."""
    if embedder is None:
        from specprobe.infer.embedder import SentenceEmbedder

        embedder = SentenceEmbedder(vcfg.embedding_model, device=device)
    start = time.perf_counter()
    train_scores = embedder.cosine(list(train.a), list(train.b)).double().numpy()
    fitted = fit_on_pairs(train_scores, train.labels, vcfg.target_precision,
                          "training-question pairs (the embedder is not trained on them)")
    default = max(vcfg.embedding_fixed_thresholds, default=0.95)
    result = EmbeddingResult(vcfg.embedding_model, fitted, default, {}, 0.0)
    seconds = time.perf_counter() - start
    metrics: dict[str, Any] = {"threshold_fit": fitted.to_dict(), "n_train": len(train), "seconds": seconds}
    for split, pairs in (("val", val), ("test", test)):
        if pairs is None or len(pairs) == 0:
            continue
        scores = embedder.cosine(list(pairs.a), list(pairs.b)).double().numpy()
        fixed = {f"cosine>={t:g}": t for t in vcfg.embedding_fixed_thresholds}
        chosen = {"chosen": result.threshold}
        if result.fit is not None:
            chosen["f1_optimal"] = result.fit.f1_optimal.threshold
        metrics[split] = {
            "verifier": score_report(scores, pairs.labels, chosen),
            "fixed": score_report(scores, pairs.labels, fixed),
            "accept_all": accept_all_report(pairs.labels),
        }
    result.metrics, result.seconds = metrics, seconds
    return result


# ----------------------------------------------------------------------------- judge LoRA
def balanced_pairs(pairs: PairSet, max_pairs: int, seed: int = 0) -> tuple[list[tuple[str, str, str]], np.ndarray]:
    """Equal numbers of equivalent and non-equivalent pairs (at most `max_pairs` in all), shuffled, each
    pair's (a, b) order drawn at random. Returns ((context, step_a, step_b) items, labels)."""
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(pairs.labels), np.flatnonzero(~pairs.labels)
    k = min(len(pos), len(neg), max(1, max_pairs // 2))
    chosen = np.concatenate([rng.choice(pos, k, replace=False), rng.choice(neg, k, replace=False)])
    rng.shuffle(chosen)
    swap = rng.random(len(chosen)) < 0.5
    items = [(pairs.context_of(i), pairs.b[i], pairs.a[i]) if s else (pairs.context_of(i), pairs.a[i], pairs.b[i])
             for i, s in zip(chosen, swap)]
    return items, pairs.labels[chosen].copy()


def pair_items(pairs: PairSet, limit: int | None = None, seed: int = 0) -> tuple[list[tuple[str, str, str]], np.ndarray]:
    """(context, a, b) items of `pairs` in their stored orientation (a = reference, b = the compared step, as
    at run time: target step then draft step); a seeded stratified subset of `limit` when there are more."""
    idx = stratified_subsample(pairs.labels, limit, seed)
    return [(pairs.context_of(i), pairs.a[i], pairs.b[i]) for i in idx], pairs.labels[idx].copy()


@dataclass
class JudgeResult:
    base: str
    model: Any  # PeftModel
    tokenizer: Any
    fitted: FittedThreshold
    metrics: dict[str, Any]
    losses: list[float]
    seconds: float
    vcfg: Any

    @property
    def fit(self) -> ThresholdFit | None:
        return self.fitted.fit

    @property
    def threshold(self) -> float:
        return self.fit.threshold if self.fit is not None else 0.5

    def save(self, folder) -> None:
        """PEFT adapter (adapter_config.json + adapter_model.safetensors) and judge.json in `folder`."""
        folder = Path(folder)
        self.model.save_pretrained(str(folder), safe_serialization=True)
        _portable_base(folder, describe_source(self.base))
        yes, no = answer_token_ids(self.tokenizer)
        v = self.vcfg
        write_judge_meta(
            folder, base_model=self.base, threshold=self.threshold, prompt_version=PROMPT_VERSION,
            answer_tokens={"yes": yes, "no": no}, base_model_id=describe_source(self.base),
            prompt="specprobe.infer.judge_prompt.build_judge_prompt (default max_context_chars)", prefill=PREFILL,
            answer_words=[YES_WORD, NO_WORD],
            probability="softmax over the logits of the two answer tokens after the prefill; P(yes)",
            fit=None if self.fit is None else self.fit.to_dict(), fit_on=self.fitted.fit_on,
            fit_error=self.fitted.error, dtype=self.metrics.get("dtype"),
            lora={"r": v.judge_lora_r, "alpha": v.judge_lora_alpha, "dropout": v.judge_lora_dropout,
                  "target_modules": list(v.judge_target_modules), "last_layers": v.judge_lora_layers},
            training={"steps": v.judge_steps, "lr": v.judge_lr, "batch_size": v.judge_batch_size,
                      "balanced_pairs": self.metrics.get("n_train"), "seed": v.seed,
                      "first_loss": self.losses[0] if self.losses else None,
                      "last_loss": self.losses[-1] if self.losses else None})


def lora_model(model, vcfg):
    """Wrap a causal LM with a fresh LoRA adapter (seeded initialisation)."""
    from peft import LoraConfig, get_peft_model

    layers = None
    if vcfg.judge_lora_layers is not None:
        total = int(model.config.num_hidden_layers)
        layers = list(range(max(0, total - vcfg.judge_lora_layers), total))
    config = LoraConfig(r=vcfg.judge_lora_r, lora_alpha=vcfg.judge_lora_alpha, lora_dropout=vcfg.judge_lora_dropout,
                        target_modules=list(vcfg.judge_target_modules), layers_to_transform=layers, bias="none",
                        task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=judge_steps.cuda_devices(model)):  # the caller's generators stay as they were
        judge_steps.seed_generators(model, vcfg.seed)
        try:
            return get_peft_model(model, config)
        except ValueError as err:
            raise ValueError(f"verifiers.judge_target_modules {list(vcfg.judge_target_modules)} do not fit the "
                             f"judge base model: {err}") from None


def judge_train_loop(model, tokenizer, items: Sequence[tuple[str, str, str]], labels: np.ndarray, vcfg,
                     log_fn: LogFn | None = None, progress: bool = False, steps: JudgeSteps | None = None,
                     earlier: Earlier | None = None) -> LoopState:
    """`judge_steps` AdamW steps of cross-entropy on the two answer-token logits (seeded: dropout draws from
    torch's generator seeded with verifiers.seed + 2, inside a fork of it); returns the loop state, whose
    `losses` are the step losses. steps: where the state is saved every few steps; earlier: a state to continue."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=vcfg.judge_lr, weight_decay=0.0)
    # class 0 = yes ("aligned") = equivalent, matching the [yes, no] column order of the logits
    targets = torch.as_tensor(~np.asarray(labels, dtype=bool), dtype=torch.long)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=judge_steps.cuda_devices(model)):
        judge_steps.seed_generators(model, vcfg.seed + 2)
        loop = JudgeSteps.restore(earlier, model, opt) if earlier else LoopState.fresh(len(items), vcfg.seed)
        if log_fn is not None:  # the earlier run's steps, so the logged curve is whole
            for step, loss in enumerate(loop.losses):
                log_fn({"step": step, "loss": loss, "last": step == vcfg.judge_steps - 1})
        if steps is not None and loop.step == 0:
            steps.save(model, opt, loop, 0.0)  # the base's scores, so a stop in the first steps keeps them
        model.train()
        for step in tqdm(range(loop.step, vcfg.judge_steps), desc="judge LoRA steps", unit="step",
                         disable=not progress, initial=loop.step, total=vcfg.judge_steps):
            idx = loop.next_batch(vcfg.judge_batch_size)
            logits = judge_answer_logits(model, tokenizer, [items[i] for i in idx])
            loss = torch.nn.functional.cross_entropy(logits, targets[idx].to(logits.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loop.losses.append(float(loss.item()))
            loop.step = step + 1
            if steps is not None and steps.due(loop.step, vcfg.judge_steps):
                steps.save(model, opt, loop, time.perf_counter() - start)
            if log_fn is not None:
                log_fn({"step": step, "loss": loop.losses[-1], "last": step == vcfg.judge_steps - 1})
    model.eval()
    return loop


def _probabilities(model, tokenizer, items, batch_size: int, desc: str = "", progress: bool = False) -> np.ndarray:
    return judge_probability(model, tokenizer, items, batch_size=batch_size,
                             progress=desc if progress else None).double().numpy()


def train_judge(train: PairSet, val: PairSet, vcfg, device: str | None = None, log_fn: LogFn | None = None,
                model=None, test: PairSet | None = None, progress: bool = False, state_dir: str | Path | None = None,
                message: Callable[[str], None] = print) -> JudgeResult:
    """Fine-tune the judge LoRA on balanced training pairs; score it and its untrained base on `val` (and
    `test`). progress: bars for the scoring passes and the LoRA steps (minutes on a CPU). state_dir: where the
    training state is kept every ``verifiers.judge_save_every`` steps; a state there from an earlier run of the
    same training is continued (`judge_steps`); message: where such news goes."""
    start = time.perf_counter()
    base, tokenizer = model if model is not None else load_model(vcfg.judge_base, kind="causal_lm", device=device,
                                                                  dtype=vcfg.judge_dtype)
    batch = max(vcfg.judge_batch_size, 8)
    evals = {split: pair_items(p, vcfg.judge_eval_pairs, vcfg.seed)
             for split, p in (("val", val), ("test", test)) if p is not None and len(p)}
    items, labels = balanced_pairs(train, vcfg.judge_max_pairs, vcfg.seed)
    dtype = str(base.dtype).removeprefix("torch.")  # the scale the threshold is on
    steps, earlier = None, None
    if state_dir is not None and vcfg.judge_save_every > 0:
        device_type = next(base.parameters()).device.type
        steps = JudgeSteps(state_dir, vcfg.judge_save_every, run_key(vcfg, dtype, device_type, items, labels),
                           eval_digests(evals))
        earlier, note = steps.earlier(vcfg.judge_steps)
        if note:
            message(note)
        if earlier is not None:
            steps.saved, steps.saved_step = True, earlier.step
    # the earlier run's base scores, if it scored the same pairs (the same base: its dtype and device are in the key)
    base_probs = earlier.base_probs_for(eval_digests(evals)) if earlier is not None else None
    if base_probs is None:
        base_probs = {split: _probabilities(base, tokenizer, split_items, batch, f"judge base, {split} pairs",
                                            progress) for split, (split_items, _) in evals.items()}
    if steps is not None:
        steps.base_probs = base_probs
    peft_model = lora_model(base, vcfg)
    try:
        loop = judge_train_loop(peft_model, tokenizer, items, labels, vcfg, log_fn, progress, steps, earlier)
    except BaseException:
        if steps is not None and steps.saved:
            message(f"judge LoRA: its state after step {steps.saved_step} of {vcfg.judge_steps} is in "
                    f"{steps.folder}; the same command continues from there")
        raise
    losses = loop.losses
    probs = {split: _probabilities(peft_model, tokenizer, split_items, batch, f"judge LoRA, {split} pairs", progress)
             for split, (split_items, _) in evals.items()}
    if "val" in probs:
        fitted = fit_on_pairs(probs["val"], evals["val"][1], vcfg.target_precision,
                              "validation pairs (the LoRA did not train on them)")
    else:
        fitted = FittedThreshold(None, "validation pairs", "no validation pairs")
    threshold = fitted.fit.threshold if fitted.fit is not None else 0.5
    metrics: dict[str, Any] = {"n_train": len(items), "threshold_fit": fitted.to_dict(),
                               "dtype": dtype,
                               "loss_first": losses[0], "loss_last": losses[-1],
                               "loss_first_10": float(np.mean(losses[:10])), "loss_last_10": float(np.mean(losses[-10:])),
                               "losses": list(losses)}  # the whole curve, for probe-eval's training figure
    for split, (_, split_labels) in evals.items():
        metrics[split] = {
            "verifier": score_report(probs[split], split_labels, {"chosen": threshold, "p>=0.5": 0.5}),
            "base": score_report(base_probs[split], split_labels, {"p>=0.5": 0.5}),
            "accept_all": accept_all_report(split_labels),
        }
    if earlier is not None:
        metrics["resumed"] = {"after_step": earlier.step, "earlier_seconds": loop.seconds}
    seconds = time.perf_counter() - start + loop.seconds
    metrics["seconds"] = seconds
    return JudgeResult(vcfg.judge_base, peft_model, tokenizer, fitted, metrics, losses, seconds, vcfg)


def _portable_base(folder: Path, base_id: str) -> None:
    """PEFT records the base model as the folder it was loaded from (for offline models a local cache path);
    record the public id instead in adapter_config.json and the adapter's card, so the adapter travels."""
    config = folder / ADAPTER_CONFIG
    meta = json.loads(config.read_text(encoding="utf-8"))
    local = meta.get("base_model_name_or_path")
    meta["base_model_name_or_path"] = base_id
    config.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    card = folder / "README.md"
    if local and local != base_id and card.is_file():
        card.write_text(card.read_text(encoding="utf-8").replace(local, base_id), encoding="utf-8")
