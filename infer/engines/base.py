"""The step-engine interface: what every backend (transformers now, vLLM later) provides.

Callers only ever see these types. Steps travel between models as text, so draft and target may
use different tokenizers; token ids in a result belong to the engine that produced it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence, runtime_checkable

import torch

StopReason = Literal["delimiter", "eos", "length"]
DEFAULT_STEP_DELIMITER = "\n\n"


@dataclass(frozen=True)
class SamplingParams:
    """How one step is sampled. Defaults follow Lookahead Reasoning (temperature 0.6, top-p 0.95,
    100 tokens per step). temperature == 0 means greedy."""

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
    """One generated step. `text` includes the delimiter when stop_reason == "delimiter"."""

    text: str
    token_ids: list[int]
    stop_reason: StopReason
    logprob: float  # sum of the sampled tokens' log-probabilities (under the unmodified distribution)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class ScoredStep:
    """Teacher-forced view of one given step after a prefix.

    mean_hidden / last_hidden: (num_layers + 1, hidden) float32 on CPU; index 0 is the embedding
    output, index L the final layer (after the final norm, as transformers reports it).
    """

    token_ids: list[int]
    token_logprobs: torch.Tensor  # (num_tokens,)
    mean_hidden: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None

    @property
    def logprob(self) -> float:
        return float(self.token_logprobs.sum())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class EngineInfo:
    """What a checkpoint records about the model whose hidden states it was trained on."""

    model_id: str
    revision: str | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    extra: dict = field(default_factory=dict)


@runtime_checkable
class StepEngine(Protocol):
    """One model behind a step-level API.

    `prompt` arguments are raw user questions; the engine applies its own chat template.
    `prefix` = chat-formatted prompt + the steps so far (as text), built by `format_prefix`.
    """

    info: EngineInfo

    def format_prefix(self, question: str, steps: Sequence[str] = ()) -> str:
        """The text the model conditions on: chat template applied to `question`, then the steps."""
        ...

    def sample(
        self, prefixes: Sequence[str], n: int, params: SamplingParams
    ) -> list[list[Step]]:
        """n one-step continuations for each prefix; result[i][k] is sample k of prefix i."""
        ...

    def score(
        self,
        prefix: str,
        steps: Sequence[str],
        *,
        hidden: bool = True,
        layers: Sequence[int] | None = None,
    ) -> list[ScoredStep]:
        """Teacher-force each step after `prefix` (independently, sharing the prefix's encoding)."""
        ...

    def score_chain(
        self, prefix: str, steps: Sequence[str], *, hidden: bool = True, layers: Sequence[int] | None = None
    ) -> list[ScoredStep]:
        """Teacher-force steps[0] ⊕ steps[1] ⊕ ... after `prefix` in one pass (SemanticSpec step 2)."""
        ...
