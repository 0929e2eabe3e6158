"""The step-engine interface: everything a caller may use of an engine, and all an engine author needs.

Every caller (the decoding runtime in `infer.decoding`, the data pipeline, the verifiers, the benchmarks)
uses only what this module defines. An engine is one model behind four calls:

    generate(requests, params) -> Generation   n one-step continuations per request (batched)
    open_stream(params)        -> StepStream   the same, with requests added while it runs (async LR)
    score(prefix, steps)       -> Scoring      teacher-forced log-probabilities / pooled hidden states
    score_chain(prefix, steps) -> Scoring      the same for steps[0] ⊕ steps[1] ⊕ ... in one pass

plus `info`, `format_prefix` (text view), `check_fits` (capacity) and `count_tokens`.

Prefixes. A `Prefix` is the question plus the steps written so far. A step is either a `str` (a given
reference step, e.g. from a dataset: the engine follows it by the delimiter unless it ends with one) or
a generated `Step`, used exactly as it was generated: when the step carries token ids of this engine's
tokenizer (`Step.tokenizer_id == engine.info.tokenizer_id`) the engine conditions on those ids, so a
committed step is never re-tokenised and prefix/KV reuse is exact; otherwise it encodes the step's text
as is (no delimiter added: a step cut by the token cap is continued mid-sentence, as it was written).
The token ids an engine builds for a prefix are: the chat-formatted question (`format_prefix(question)`
encoded) followed by each step's ids in order.

Results carry their own counters (`EngineStats`): callers add them up; nothing is read from a shared
dict. Seeds: a request's `seed` makes its n samples reproducible whatever else is in the batch (an
engine derives one generator per sample from it). Threads: async Lookahead Reasoning drives the draft and
the target engine from two threads at once, and scores probe features on either from a third; an engine
must therefore serialise its own model calls (a lock around them is enough). A `StepStream` is driven by
one thread.

A new engine (e.g. vLLM) implements `StepEngine`; `infer.engines.tokens.StepTokenizer` gives it the
chat template, prefix ids and the step stop rule for any Hugging Face tokenizer, and `SerialStream`
gives it a `StepStream` on top of `generate` when it has no continuous batching of its own.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol, runtime_checkable

import torch

StopReason = Literal["delimiter", "eos", "length"]
DEFAULT_STEP_DELIMITER = "\n\n"


class PromptTooLongError(ValueError):
    """A prompt (plus the tokens asked for after it) does not fit the model's context window."""


@dataclass(frozen=True)
class SamplingParams:
    """How steps are sampled. Defaults follow Lookahead Reasoning (temperature 0.6, top-p 0.95, 100 tokens
    per step). temperature == 0 means greedy. `seed` is the default seed of requests that give none."""

    temperature: float = 0.6
    top_p: float = 0.95
    max_step_tokens: int = 100
    delimiter: str = DEFAULT_STEP_DELIMITER
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_step_tokens < 1:
            raise ValueError(f"SamplingParams.max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if not self.delimiter:
            raise ValueError("SamplingParams.delimiter must be a non-empty string")


@dataclass
class Step:
    """One generated step.

    text: the decoded `token_ids` (without a final EOS token). A step that stopped on the delimiter
      contains it after some non-whitespace text and ends with it (a final token may add whitespace
      after it, e.g. one "\\n\\n\\n" token); a "length" step is cut wherever the cap fell.
    token_ids: every token sampled, in the tokenizer named by `tokenizer_id` (EOS included when
      stop_reason == "eos").
    stop_reason: "delimiter" | "eos" | "length" (hit the request's token cap).
    logprob: sum of the sampled tokens' log-probabilities under the model's unmodified distribution.
    """

    text: str
    token_ids: list[int]
    stop_reason: StopReason
    logprob: float
    tokenizer_id: str = ""  # `EngineInfo.tokenizer_id` of the engine that wrote token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


PrefixStep = str | Step


@dataclass(frozen=True)
class Prefix:
    """What a model conditions on: a question (the engine applies its chat template) and the steps so far.

    A `str` step is a given reference step (followed by the delimiter unless it ends with one); a `Step`
    is used as generated (its token ids when they are in this engine's tokenizer). See the module doc.
    """

    question: str
    steps: tuple[PrefixStep, ...] = ()
    delimiter: str = DEFAULT_STEP_DELIMITER

    def __post_init__(self) -> None:
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError("empty prompt: the question text is empty")
        object.__setattr__(self, "steps", tuple(self.steps))
        bad = [i for i, s in enumerate(self.steps) if not isinstance(s, (str, Step))]
        if bad:
            raise TypeError(f"Prefix steps {bad} are neither str nor Step")

    def extend(self, *steps: PrefixStep) -> Prefix:
        """This prefix followed by more steps."""
        return Prefix(self.question, self.steps + tuple(steps), self.delimiter)

    def step_texts(self) -> list[str]:
        """The steps as text, each as it appears in the prefix (given steps with their delimiter)."""
        return [s.text if isinstance(s, Step) else with_delimiter(s, self.delimiter) for s in self.steps]


def with_delimiter(text: str, delimiter: str) -> str:
    """A given (reference) step as it appears in a prefix: followed by the delimiter."""
    return text if text.endswith(delimiter) else text + delimiter


def context_text(question: str, steps: Sequence[str], delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
    """The plain (template-free) context equivalence judges read: the question, then the steps, each stripped and
    joined by the delimiter (blank parts dropped). The data stage's judges read the same text."""
    parts = [question.strip(), *(s.strip() for s in steps)]
    return delimiter.join(p for p in parts if p)


def seed_for(seed: int, *parts) -> int:
    """A 63-bit seed derived from a base seed and any parts (strings, ints): stable across runs."""
    digest = hashlib.blake2b(repr((int(seed),) + tuple(parts)).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sample_seed(seed: int | None, k: int) -> int | None:
    """Seed of sample k of a request with `seed`, for every engine: the seed itself for k = 0, a hash of
    (seed, k) else (so requests seeded 1 and 2 never share samples, as seed + k would make them)."""
    if seed is None or k == 0:
        return seed
    return seed_for(seed, int(k))


@dataclass(frozen=True)
class StepRequest:
    """n one-step continuations of one prefix.

    seed: makes the n samples reproducible whatever else shares the batch (None: params.seed; when that
      is None too, unseeded). max_tokens: this request's token cap (None: params.max_step_tokens; larger
      values are clipped to it).
    """

    prefix: Prefix
    n: int = 1
    seed: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, Prefix):
            raise TypeError(f"StepRequest.prefix must be a Prefix, got {type(self.prefix).__name__}")
        if self.n < 1:
            raise ValueError(f"StepRequest.n must be >= 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"StepRequest.max_tokens must be >= 1, got {self.max_tokens}")

    def cap(self, params: SamplingParams) -> int:
        return params.max_step_tokens if self.max_tokens is None else min(self.max_tokens, params.max_step_tokens)


@dataclass
class EngineStats:
    """Work done by one engine call, returned with its result. Add them with `+` / `+=`.

    forward_passes: model calls; iterations: decoding iterations (one forward of a batch, however many
    rows); row_iterations: sum over those of the rows in them; prefill_tokens: prompt / teacher-forced
    tokens run through the model; reused_prefix_tokens: prompt tokens served from a cache instead;
    decode_tokens: tokens fed during decoding; generated_tokens: tokens in the returned steps;
    spec_*: token-level speculation inside steps (rounds with a proposal, tokens proposed / accepted);
    proposer_forward_passes: forward passes of an assistant model proposing those tokens; seconds: wall time of the call.
    """

    forward_passes: int = 0
    iterations: int = 0
    row_iterations: int = 0
    prefill_tokens: int = 0
    reused_prefix_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    spec_rounds: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    proposer_forward_passes: int = 0
    seconds: float = 0.0

    def __add__(self, other: EngineStats) -> EngineStats:
        return EngineStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Generation:
    """Result of `generate`: steps[i][k] is sample k of request i."""

    steps: list[list[Step]]
    stats: EngineStats


@dataclass
class ScoredStep:
    """Teacher-forced view of one given step after a prefix.

    token_ids: the step's tokens (the engine's tokenizer); token_logprobs: (num_tokens,) log p of each.
    mean_hidden / last_hidden: (len(layers), hidden) float32 on CPU, mean over the step's tokens and at
    its last token; layer index 0 is the embedding output, num_layers the final layer (after the final
    norm, as transformers reports it). None when hidden states were not asked for.
    """

    token_ids: list[int]
    token_logprobs: torch.Tensor
    mean_hidden: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None

    @property
    def logprob(self) -> float:
        return float(self.token_logprobs.sum())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Scoring:
    """Result of `score` / `score_chain`: one ScoredStep per given step."""

    steps: list[ScoredStep]
    stats: EngineStats


@dataclass
class EngineInfo:
    """What a checkpoint records about a model, and what callers may rely on.

    tokenizer_id: equal for two engines exactly when their token ids are interchangeable (same
    vocabulary), so a Step of one can be fed to the other as ids. max_length: the context window in
    tokens (None: unknown / unlimited).
    """

    model_id: str
    revision: str | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    tokenizer_id: str = ""
    max_length: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the step API. Callers branch on this, never on an engine's type.

    kind: the backend ("transformers", "vllm", ...). raw_model: `model` is a transformers model callers may
    run themselves (reusing the weights as an LLM judge). tree_attention: custom attention masks, for token trees
    (`sequence_kv()` gives one sequence's KV cache for SEED; the batches verify Lookahead Decoding's tries). lora:
    it serves LoRA adapters per request (the judge-LoRA on vLLM). prefix_cache: it keeps prompt-prefix KV between
    calls (`clear_prefix_cache` empties it). token_spec_per_run: `with_token_spec` may choose token-level
    speculation per call (vLLM fixes it when the engine starts)."""

    kind: str
    raw_model: bool = False
    tree_attention: bool = False
    lora: bool = False
    prefix_cache: bool = True
    token_spec_per_run: bool = True


@runtime_checkable
class StepStream(Protocol):
    """Continuous batching: requests join while others decode (async Lookahead Reasoning).

    Each request yields exactly one Step (n == 1). Driven by one thread; `take_stats` returns the
    work done since its last call (and resets it).
    """

    def add(self, requests: Sequence[tuple[Hashable, StepRequest]]) -> list[tuple[Hashable, Step]]:
        """Add keyed requests (n must be 1; keys unique among live ones); returns any finished at once."""
        ...

    def step(self) -> list[tuple[Hashable, Step]]:
        """Advance every live request by one decoding iteration; returns those that finished."""
        ...

    def cancel(self, keys: Sequence[Hashable]) -> None:
        """Drop live requests; their results are never produced."""
        ...

    def __len__(self) -> int:
        """Number of live requests."""
        ...

    def take_stats(self) -> EngineStats:
        ...


@runtime_checkable
class StepEngine(Protocol):
    """One model behind the step-level API (see the module doc for prefixes, seeds and stats). Everything a
    caller outside `infer/engines/` may touch is declared here (tests/test_engine_protocol.py checks it)."""

    info: EngineInfo
    model_name: str  # the name it was loaded by (config name; info.model_id is the resolved id)
    capabilities: EngineCapabilities
    tokenizer: Any  # the transformers tokenizer of its model
    model: Any  # the transformers model when capabilities.raw_model, else None
    text: Any  # its `tokens.StepTokenizer`: prefixes as token ids and the one step stop rule (`finished`)

    def clear_prefix_cache(self) -> None:
        """Forget cached prompt prefixes, so the next call pays its own prefill (fair benchmarks)."""
        ...

    def with_token_spec(self, spec: Any, assistant: Any = None) -> StepEngine:
        """This engine with token-level speculation inside steps (`engines.token_spec.TokenSpecConfig`, None:
        off) for the calls made through the returned view; the engine itself is not changed. `assistant`: the
        draft engine for spec mode "assistant". Engines whose capabilities say token_spec_per_run=False accept
        only what they were started with (and return themselves)."""
        ...

    def sequence_kv(self) -> Any:
        """A fresh `sequence_kv.SequenceKV` on this engine's model (capabilities.tree_attention; other engines
        raise NotImplementedError): the KV of one sequence with tree-attention blocks."""
        ...

    def format_prefix(self, question: str, steps: Sequence[PrefixStep] = (),
                      delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
        """The prefix as text (chat template applied to the question, then the steps as in
        `Prefix.step_texts`). For display and datasets; engines condition on token ids (see Prefix)."""
        ...

    def prefix_ids(self, prefix: Prefix) -> list[int]:
        """The token ids the engine conditions on for `prefix` (committed steps as their own ids)."""
        ...

    def check_fits(self, prefix: Prefix, extra_tokens: int = 0) -> None:
        """Raise PromptTooLongError when the prefix plus `extra_tokens` exceeds `info.max_length`."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` as a step (no special tokens) in this engine's tokenizer."""
        ...

    def generate(self, requests: Sequence[StepRequest], params: SamplingParams) -> Generation:
        """One step per sample for every request, decoded together. A step ends after the first
        `params.delimiter` that follows non-whitespace text, at EOS, or at the request's token cap.
        Greedy (temperature 0) samples of one request are identical. Raises PromptTooLongError."""
        ...

    def open_stream(self, params: SamplingParams) -> StepStream:
        """An empty StepStream on this engine."""
        ...

    def score(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True,
              layers: Sequence[int] | None = None) -> Scoring:
        """Teacher-force each step (text, encoded as is) after `prefix`, independently. layers: which
        hidden-state layers to pool (negative counts from the end; None: all num_layers + 1)."""
        ...

    def score_chain(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True,
                    layers: Sequence[int] | None = None) -> Scoring:
        """Teacher-force steps[0] ⊕ steps[1] ⊕ ... after `prefix` in one pass; result i is step i
        conditioned on the steps before it (SemanticSpec's single target pass)."""
        ...


class SerialStream:
    """A StepStream for engines without continuous batching: `step` runs the pending requests to the
    end with one `generate` call. Results are the same as from `generate`; only the overlap is lost."""

    def __init__(self, engine: StepEngine, params: SamplingParams):
        self.engine, self.params = engine, params
        self._pending: dict[Hashable, StepRequest] = {}
        self._stats = EngineStats()

    def add(self, requests: Sequence[tuple[Hashable, StepRequest]]) -> list[tuple[Hashable, Step]]:
        for key, req in requests:
            if req.n != 1:
                raise ValueError(f"stream request {key!r}: n must be 1, got {req.n}")
            if key in self._pending:
                raise ValueError(f"stream request key {key!r} is already live")
            self._pending[key] = req
        return []

    def step(self) -> list[tuple[Hashable, Step]]:
        if not self._pending:
            return []
        keys, reqs = list(self._pending), list(self._pending.values())
        self._pending.clear()
        t0 = time.perf_counter()
        out = self.engine.generate(reqs, self.params)
        out.stats.seconds = time.perf_counter() - t0
        self._stats += out.stats
        return [(k, s[0]) for k, s in zip(keys, out.steps)]

    def cancel(self, keys: Sequence[Hashable]) -> None:
        for k in keys:
            self._pending.pop(k, None)

    def __len__(self) -> int:
        return len(self._pending)

    def take_stats(self) -> EngineStats:
        stats, self._stats = self._stats, EngineStats()
        return stats
