"""Step verifiers behind one interface, and loading them from a probe-train checkpoint.

Every verifier answers the same question: may this drafted step stand in for what the target would
write here? `verify(items)` returns one `Verdict` per item (accepted, score, acceptance probability);
`score(context, step, reference=None)` returns the acceptance probability of a single step.

| kind | needs | decision |
|---|---|---|
| probe | hidden states of the draft step under both models | accept with prob min(1, p/max(q, eps)) (SemanticSpec) |
| embedding | the target's own step | cosine(draft, target) >= threshold |
| judge | the target's own step | judge-LoRA P(aligned) >= threshold, one forward pass |
| llm_judge | the target's own step | prompted instruct model P(aligned) >= threshold, one forward pass |
| exact | the target's own step | equal after lower-casing and removing all whitespace |
| accept_all / reject_all / bernoulli | nothing | always / never / with prob α (for measurement) |

Random draws are seeded per decision (`VerifyItem.seed`), so a decision does not depend on how many
draws happened before it (the async runtime verifies in a timing-dependent order).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specprobe.infer import checkpoint_format as ckpt
from specprobe.infer.acceptance_estimate import LatentDifficulty
from specprobe.infer.checkpoint_format import CheckpointError
from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER, Prefix, context_text
from specprobe.infer.judge_prompt import PROMPT_VERSION, answer_token_ids, judge_probability
from specprobe.infer.models import describe_source, load_model
from specprobe.probes.acceptance import DEFAULT_EPS, bernoulli, make_rng, semantic_accept_prob
from specprobe.probes.features import same_model_name

log = logging.getLogger(__name__)

VERIFIER_KINDS = ("probe", "embedding", "judge", "llm_judge", "exact", "accept_all", "reject_all", "bernoulli")
CHECKPOINT_KINDS = ("probe", "embedding", "judge")


@dataclass(frozen=True)
class StepContext:
    """What a step is judged after: the question and the steps before it."""

    question: str
    steps: tuple[str, ...] = ()

    def text(self, delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
        return context_text(self.question, self.steps, delimiter)


def as_context(context: StepContext | str) -> StepContext:
    return context if isinstance(context, StepContext) else StepContext(str(context))


@dataclass
class VerifyItem:
    """One drafted step to judge.

    target: the target's own step at the same position (pair verifiers). draft_features /
    target_features: pooled hidden states of the draft step, (rows, hidden), under the draft and target
    model (probe pair). seed: seed of this decision's random draw (stochastic verifiers). meta: where
    the step sits in the cycle (position, branch); verifiers ignore it.
    """

    context: StepContext
    draft: str
    target: str | None = None
    draft_features: torch.Tensor | None = None
    target_features: torch.Tensor | None = None
    seed: int | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class Verdict:
    accepted: bool
    score: float  # the verifier's own score (cosine, P(aligned), min(1, p/q), α, 0/1)
    prob: float  # probability the decision was drawn with (0 or 1 for deterministic verifiers)
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        score = None if self.score is None or (isinstance(self.score, float) and math.isnan(self.score)) else self.score
        return {"accepted": self.accepted, "score": score, "prob": self.prob, **self.detail}


class Verifier:
    """Base class: subclasses implement `_score(items) -> [(score, prob, detail)]`."""

    name = "verifier"
    needs_target_step = False  # compares the draft with the target's own step (Lookahead Reasoning)
    needs_features = False  # reads both models' hidden states of the draft step (SemanticSpec)

    def _score(self, items: Sequence[VerifyItem]) -> list[tuple[float, float, dict]]:
        raise NotImplementedError

    def verify(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        items = list(items)
        if not items:
            return []
        if self.needs_target_step:
            missing = [i for i, it in enumerate(items) if it.target is None]
            if missing:
                raise ValueError(f"the {self.name} verifier compares each draft with the target's own step; "
                                 f"items {missing} have none")
        verdicts = []
        for item, (score, prob, detail) in zip(items, self._score(items)):
            if prob >= 1.0:
                accepted = True
            elif prob <= 0.0:
                accepted = False
            else:
                accepted = bernoulli(prob, make_rng(item.seed))
            verdicts.append(Verdict(bool(accepted), float(score), float(prob), dict(detail)))
        return verdicts

    def score(self, context: StepContext | str, step: str, reference: str | None = None) -> float:
        """Acceptance probability of `step` after `context` (reference: the target's own step)."""
        item = VerifyItem(as_context(context), step, reference)
        return self._score_single(item)

    def _score_single(self, item: VerifyItem) -> float:
        return float(self._score([item])[0][1])

    def describe(self) -> dict:
        return {"name": self.name}


# ----------------------------------------------------------------------------- measurement verifiers
class AcceptAll(Verifier):
    name = "accept_all"

    def _score(self, items):
        return [(1.0, 1.0, {}) for _ in items]


class RejectAll(Verifier):
    name = "reject_all"

    def _score(self, items):
        return [(0.0, 0.0, {}) for _ in items]


class BernoulliVerifier(Verifier):
    """Accepts each step independently with probability α (seeded per decision). With a `LatentDifficulty`
    (system-speed runs with heterogeneous acceptance), α is that of the step's answer position, easy or hard."""

    name = "bernoulli"

    def __init__(self, alpha: float, difficulty: LatentDifficulty | None = None):
        if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
            raise ValueError(f"bernoulli alpha must be in [0, 1], got {alpha}")
        self.alpha, self.difficulty = float(alpha), difficulty

    def _alpha(self, item: VerifyItem) -> float:
        if self.difficulty is None:
            return self.alpha
        return self.difficulty.alpha(item.context.question, len(item.context.steps))

    def _score(self, items):
        return [(a, a, {}) for a in map(self._alpha, items)]

    def describe(self):
        if self.difficulty is None:
            return {"name": self.name, "alpha": self.alpha}
        return {"name": self.name, "difficulty": self.difficulty.describe()}


# ----------------------------------------------------------------------------- pair verifiers
def normalize_exact(text: str) -> str:
    """Lower-case with all whitespace removed."""
    return "".join(text.lower().split())


class ExactMatch(Verifier):
    name = "exact"
    needs_target_step = True

    def _score(self, items):
        out = []
        for it in items:
            same = normalize_exact(it.draft) == normalize_exact(it.target)
            out.append((float(same), float(same), {}))
        return out


class EmbeddingThreshold(Verifier):
    """cosine(embed(draft), embed(target)) >= threshold (LR's embedding verifier)."""

    name = "embedding"
    needs_target_step = True

    def __init__(self, embedder, threshold: float):
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"cosine threshold must be in [-1, 1], got {threshold}")
        self.embedder, self.threshold = embedder, float(threshold)

    def _score(self, items):
        cos = self.embedder.cosine([it.draft for it in items], [it.target for it in items]).tolist()
        return [(c, float(c >= self.threshold), {}) for c in cos]

    def describe(self):
        return {"name": self.name, "model": getattr(self.embedder, "name", None), "threshold": self.threshold}


class JudgeVerifier(Verifier):
    """An LLM judge decided by one forward pass (`infer.judge_prompt`): P(aligned) >= threshold.

    Serves both the prompted instruct model (llm_judge) and the judge-LoRA (a PEFT model).
    """

    needs_target_step = True

    def __init__(self, model, tokenizer, threshold: float = 0.5, name: str = "llm_judge", batch_size: int = 8,
                 model_id: str | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"judge threshold must be in [0, 1], got {threshold}")
        answer_token_ids(tokenizer)  # fail early on a tokenizer that cannot tell the answers apart
        self.model, self.tokenizer = model, tokenizer
        self.threshold, self.name, self.batch_size, self.model_id = float(threshold), name, batch_size, model_id

    def _score(self, items):

        batch = [(it.context.text(), it.target, it.draft) for it in items]
        probs = judge_probability(self.model, self.tokenizer, batch, batch_size=self.batch_size).tolist()
        return [(p, float(p >= self.threshold), {}) for p in probs]

    def describe(self):
        return {"name": self.name, "model": self.model_id, "threshold": self.threshold}


class VLLMJudgeVerifier(JudgeVerifier):
    """The same one-token judge served by a vLLM engine (`infer.engines.vllm_engine.VLLMJudge`), with the
    judge-LoRA adapter applied per request through vLLM's LoRA support when one is given."""

    def __init__(self, judge, threshold: float = 0.5, name: str = "llm_judge", model_id: str | None = None):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"judge threshold must be in [0, 1], got {threshold}")
        self.judge, self.model, self.tokenizer = judge, None, judge.engine.tokenizer
        self.threshold, self.name, self.batch_size, self.model_id = float(threshold), name, 0, model_id

    def _score(self, items):
        probs = self.judge.probability([(it.context.text(), it.target, it.draft) for it in items]).tolist()
        return [(p, float(p >= self.threshold), {}) for p in probs]


def _is_vllm(engine) -> bool:
    return engine is not None and engine.capabilities.kind == "vllm"


# ----------------------------------------------------------------------------- model identity
def check_probe_model(spec, model_id: str, revision: str | None, name: str = "probe") -> None:
    """CheckpointError unless `model_id` names the model the probe was trained on (`same_model_name`: the same id,
    or a local copy of it; org-a/model and org-b/model are different weights) and, when both revisions are known,
    the same revision. `spec` is a probes.features.FeatureSpec."""
    if not same_model_name(model_id, spec.model_id):
        raise CheckpointError(f"{name} was trained on {spec.model_id!r}, but the engine runs {model_id!r}: a different "
                              "model id (the full id counts, or a local folder of the same name written as a path, "
                              "./models/X). Load that model, retrain the probe, or pass allow_model_mismatch "
                              "(probe-bench: runtime.allow_model_mismatch=true) if it is the same weights under "
                              "another name")
    if spec.revision and revision and spec.revision != revision:
        raise CheckpointError(f"{name} was trained on {spec.model_id!r} at revision {spec.revision}, but the engine "
                              f"runs revision {revision}; load that revision or retrain the probe "
                              "(allow_model_mismatch, in probe-bench runtime.allow_model_mismatch=true, skips this check)")


# ----------------------------------------------------------------------------- probe pair
class ProbePairVerifier(Verifier):
    """SemanticSpec: p = target probe on the target's hidden states of the draft step, q = draft probe on
    the draft's own; accept with probability min(1, p / max(q, eps))."""

    name = "probe"
    needs_features = True

    def __init__(self, probe_target, probe_draft, eps: float = DEFAULT_EPS, target_engine=None, draft_engine=None,
                 allow_model_mismatch: bool = False):
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.probe_target, self.probe_draft, self.eps = probe_target, probe_draft, float(eps)
        self.target_engine = self.draft_engine = None
        if target_engine is not None or draft_engine is not None:
            self.bind(target_engine, draft_engine, allow_model_mismatch=allow_model_mismatch)

    def bind(self, target_engine, draft_engine, *, allow_model_mismatch: bool = False) -> None:
        """Check that the engines' models are the ones the probes were trained on, and keep them."""
        for role, probe, engine in (("target", self.probe_target, target_engine),
                                    ("draft", self.probe_draft, draft_engine)):
            if engine is None:
                continue
            try:
                probe.spec.check_compatible(engine.info.num_layers, engine.info.hidden_size, engine.info.model_id,
                                            allow_model_mismatch=allow_model_mismatch)
            except ValueError as err:
                raise CheckpointError(f"probe_{role} does not fit the {role} model: {err}") from None
            if not allow_model_mismatch:
                check_probe_model(probe.spec, engine.info.model_id, engine.info.revision, f"probe_{role}")
        self.target_engine, self.draft_engine = target_engine, draft_engine

    # what the decoding loops request from `score_chain` / `score`
    def layers(self, role: str) -> list[int]:
        return list((self.probe_target if role == "target" else self.probe_draft).spec.layers)

    def pooled(self, scored, role: str) -> torch.Tensor:
        """The (len(layers), hidden) feature of one ScoredStep, pooled as the probe was trained."""
        probe = self.probe_target if role == "target" else self.probe_draft
        feats = scored.mean_hidden if probe.spec.pooling == "mean" else scored.last_hidden
        if feats is None:
            raise ValueError("no hidden states for this step (is it empty?)")
        return feats

    def p(self, features: torch.Tensor) -> torch.Tensor:
        """Target probe probabilities for (B, rows, hidden) features (all rows or the probe's layers)."""
        return self.probe_target.predict_proba(features)

    def q(self, features: torch.Tensor) -> torch.Tensor:
        return self.probe_draft.predict_proba(features)

    def _score(self, items):
        missing = [i for i, it in enumerate(items) if it.draft_features is None or it.target_features is None]
        if missing:
            if self.target_engine is None or self.draft_engine is None:
                raise ValueError("the probe verifier needs hidden states of each draft step under both models: "
                                 "pass draft_features/target_features or bind the engines (bind(target, draft))")
            for i in missing:
                items[i].target_features, items[i].draft_features = self._features(items[i])
        p = self.p(torch.stack([it.target_features for it in items])).tolist()
        q = self.q(torch.stack([it.draft_features for it in items])).tolist()
        out = []
        for pi, qi in zip(p, q):
            prob = float(semantic_accept_prob(pi, qi, self.eps))
            out.append((prob, prob, {"p": pi, "q": qi}))
        return out

    def _features(self, item: VerifyItem) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = item.context
        feats = []
        for role, engine in (("target", self.target_engine), ("draft", self.draft_engine)):
            prefix = Prefix(ctx.question, ctx.steps)  # given steps: each followed by the delimiter
            scored = engine.score(prefix, [item.draft], hidden=True, layers=self.layers(role)).steps[0]
            feats.append(self.pooled(scored, role))
        return feats[0], feats[1]

    def describe(self):
        return {"name": self.name, "eps": self.eps, "target_probe": self.probe_target.spec.to_dict(),
                "draft_probe": self.probe_draft.spec.to_dict()}


# ----------------------------------------------------------------------------- loading
_NO_PROBES = "train the probes (verifiers.train includes 'probes') or use another verifier"


def load_probe_pair(path: str | Path, *, target_engine=None, draft_engine=None, eps: float = DEFAULT_EPS,
                    allow_model_mismatch: bool = False, device: str | torch.device = "cpu") -> ProbePairVerifier:
    checkpoint = ckpt.Checkpoint(path, strict=False)
    probes = [checkpoint.probe(ckpt.probe_name(role), map_location=device, missing=_NO_PROBES)
              for role in ("target", "draft")]
    return ProbePairVerifier(probes[0], probes[1], eps, target_engine, draft_engine, allow_model_mismatch)


def load_embedding_threshold(path: str | Path, *, device: str | None = None, embedder=None,
                             model: str | None = None) -> EmbeddingThreshold:
    """The embedding-threshold verifier of a checkpoint; `model`: the embedder to load instead of the one the
    file names (the same model, where this machine has it)."""
    entry = ckpt.Checkpoint(path, strict=False).embedding()
    if embedder is None:
        from specprobe.infer.embedder import SentenceEmbedder

        embedder = SentenceEmbedder(entry.model if model is None else model, device=device)
    return EmbeddingThreshold(embedder, entry.threshold)


def load_judge_lora(path: str | Path, *, device: str | None = None, threshold: float | None = None,
                    cache_dir: str | None = None, vllm_engine=None, base_model: str | None = None) -> JudgeVerifier:
    """The judge-LoRA verifier of a checkpoint: PEFT on transformers, or, with `vllm_engine` (a vLLM engine on
    the adapter's base model, started with enable_lora), the adapter served by vLLM. `base_model`: the base to
    load instead of the one judge.json names (the same model where this machine has it; its tokenizer must give
    the adapter's answer tokens)."""
    from peft import PeftModel

    entry = ckpt.read_judge(path)
    if base_model is not None:
        entry = replace(entry, base_model=base_model)
    if entry.prompt_version is not None and entry.prompt_version != PROMPT_VERSION:
        raise CheckpointError(f"the judge adapter was trained with judge prompt version {entry.prompt_version}, "
                              f"this runtime builds version {PROMPT_VERSION}; retrain the judge or use a matching "
                              "specprobe")
    thr = entry.threshold if threshold is None else threshold
    if vllm_engine is not None:
        from specprobe.infer.engines.vllm_engine import VLLMJudge

        if describe_source(entry.base_model) != vllm_engine.info.model_id:
            raise CheckpointError(f"the judge adapter's base model is {entry.base_model}, but the vLLM engine serves "
                                  f"{vllm_engine.info.model_id}; LoRA adapters only apply to their own base model")
        served = str(vllm_engine.info.extra.get("dtype", "")).removeprefix("torch.")
        if entry.dtype and served and served != entry.dtype:
            log.warning("the judge's threshold was fitted on %s probabilities; the vLLM engine serves %s, so "
                        "P(aligned) near the threshold may differ (start the engine with models.dtype=%s)",
                        entry.dtype, served, entry.dtype)
        return VLLMJudgeVerifier(VLLMJudge(vllm_engine, str(entry.adapter_dir)), thr, name="judge",
                                 model_id=f"{entry.base_model} + LoRA {entry.adapter_dir} (vLLM)")
    # the dtype the threshold was fitted in: bf16 probabilities differ from fp32 ones near the threshold
    model, tok = load_model(entry.base_model, device=device, cache_dir=cache_dir, dtype=entry.dtype)
    model = PeftModel.from_pretrained(model, str(entry.adapter_dir)).eval()
    if entry.answer_tokens is not None and entry.answer_tokens != tuple(answer_token_ids(tok)):
        raise CheckpointError(f"judge.json records answer tokens {list(entry.answer_tokens)}, but the base tokenizer "
                              f"gives {list(answer_token_ids(tok))}: the adapter was trained with another tokenizer")
    return JudgeVerifier(model, tok, thr, name="judge", model_id=f"{entry.base_model} + LoRA {entry.adapter_dir}")


def load_verifier(path: str | Path, kind: str = "probe", **kw) -> Verifier:
    """A verifier stored in a probe-train checkpoint folder: kind = probe | embedding | judge.

    probe: keyword args target_engine / draft_engine check the probes' FeatureSpec against the models
    (a checkpoint for another model is a CheckpointError); eps guards q -> 0.
    """
    if kind == "probe":
        return load_probe_pair(path, **kw)
    if kind == "embedding":
        return load_embedding_threshold(path, **kw)
    if kind == "judge":
        return load_judge_lora(path, **kw)
    raise ValueError(f"load_verifier: kind must be one of {CHECKPOINT_KINDS}, got {kind!r}")


def check_checkpoint(kind: str, checkpoint: str | Path | None) -> None:
    """Before any model loads (its files read, no weights): a verifier of `kind` that reads a checkpoint has one,
    a checkpoint folder (not a data folder, nor the run folder above it) holding that verifier (CheckpointError
    saying what to pass)."""
    if kind not in CHECKPOINT_KINDS:
        return
    if checkpoint is None:
        raise CheckpointError(f"the {kind} verifier is loaded from a checkpoint: pass --checkpoint "
                              "(or runtime.checkpoint), or use exact / bernoulli / llm_judge")
    if kind == "judge":  # as load_judge_lora reads it (a checkpoint, or the adapter's own folder)
        ckpt.read_judge(ckpt.checkpoint_folder(checkpoint))
        return
    found = ckpt.Checkpoint(checkpoint, strict=False)  # as the probe and embedding loaders open it
    if kind == "probe":
        for role in ("target", "draft"):
            found.require_probe(ckpt.probe_name(role), missing=_NO_PROBES)
    else:
        found.embedding()


def build_verifier(kind: str, *, checkpoint: str | Path | None = None, target_engine=None, draft_engine=None,
                   alpha: float = 0.6, llm_judge_model: str | None = None, llm_judge_engine=None,
                   device: str | None = None, eps: float = DEFAULT_EPS, threshold: float | None = None,
                   allow_model_mismatch: bool = False, difficulty: LatentDifficulty | None = None,
                   judge_base: str | None = None, embedding_model: str | None = None) -> Verifier:
    """Any verifier by name (`VERIFIER_KINDS`); checkpoint kinds read `checkpoint` (`judge_base` /
    `embedding_model`: the model the judge / embedding verifier loads instead of the one its file names).

    llm_judge: `llm_judge_model` names any instruct causal LM (or pass a loaded engine whose model is
    reused, e.g. the target itself, as `llm_judge_engine`). bernoulli: `difficulty` makes α depend on the
    step's position (system-speed runs with heterogeneous acceptance).
    """
    if kind not in VERIFIER_KINDS:
        raise ValueError(f"unknown verifier {kind!r}; choose one of {', '.join(VERIFIER_KINDS)}")
    if kind in CHECKPOINT_KINDS:
        check_checkpoint(kind, checkpoint)
        if kind == "probe":
            return load_probe_pair(checkpoint, target_engine=target_engine, draft_engine=draft_engine, eps=eps,
                                   allow_model_mismatch=allow_model_mismatch)
        if kind == "embedding":
            verifier = load_embedding_threshold(checkpoint, device=device, model=embedding_model)
        else:
            # a vLLM target started with LoRA on serves the adapter itself (when it is the adapter's base)
            lora_engine = target_engine if _is_vllm(target_engine) and target_engine.capabilities.lora else None
            verifier = load_judge_lora(checkpoint, device=device, vllm_engine=lora_engine, base_model=judge_base)
        if threshold is not None:
            verifier.threshold = float(threshold)
        return verifier
    if kind == "accept_all":
        return AcceptAll()
    if kind == "reject_all":
        return RejectAll()
    if kind == "bernoulli":
        return BernoulliVerifier(alpha, difficulty)
    if kind == "exact":
        return ExactMatch()
    # llm_judge
    if _is_vllm(llm_judge_engine):
        from specprobe.infer.engines.vllm_engine import VLLMJudge

        return VLLMJudgeVerifier(VLLMJudge(llm_judge_engine), 0.5 if threshold is None else threshold,
                                 name="llm_judge", model_id=llm_judge_engine.model_name)
    if llm_judge_engine is not None:
        if not llm_judge_engine.capabilities.raw_model:
            raise ValueError(f"the llm_judge verifier runs the model itself; the {llm_judge_engine.capabilities.kind} "
                             "engine gives no model to run: name runtime.llm_judge_model instead")
        model, tok, name = llm_judge_engine.model, llm_judge_engine.tokenizer, llm_judge_engine.model_name
    else:
        if not llm_judge_model:
            raise ValueError("the llm_judge verifier needs runtime.llm_judge_model (an instruct model)")
        model, tok = load_model(llm_judge_model, device=device)
        name = llm_judge_model
    return JudgeVerifier(model, tok, 0.5 if threshold is None else threshold, name="llm_judge", model_id=name)
