"""Token-level speculation inside one step: proposers and the acceptance rules.

Both proposers are *deterministic* functions of the context (prompt lookup; greedy drafting by an
assistant model that shares the target's tokenizer), which gives a simple exact rule:

- greedy (temperature 0): accept the longest prefix of the proposal that equals the target's argmax at
  each position, then append the target's own argmax at the first mismatch (or after the last proposed
  token). The output is token-for-token what plain greedy decoding writes.
- sampling: a deterministic proposal x has q(x) = 1, so the speculative-sampling rule min(1, p/q) becomes
  "accept x with probability p(x)"; on rejection the next token is drawn from p with x removed and the
  rest renormalised. Marginally every token is still distributed as p (lossless):
  P(x) = p(x), and P(y) = (1 − p(x)) · p(y) / (1 − p(x)) = p(y) for y ≠ x.

`p` is the distribution the engine samples from (temperature, then top-p), so speculation and plain
sampling target the same distribution: `draw_tokens` is the one sampling rule of the transformers engine,
with or without a proposal (no proposal: one draw from p, or the argmax under greedy). The functions here
are pure (tensors in, token lists out) and are unit-tested on tiny arrays;
`infer.engines.hf_kv.DecodeBatch` calls them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from specprobe.infer.engines.base import EngineStats

TokenSpecMethod = Literal["ngram", "assistant"]


@dataclass(frozen=True)
class TokenSpecConfig:
    """How a step engine speculates tokens inside a step."""

    method: TokenSpecMethod = "ngram"
    num_tokens: int = 8  # proposed tokens per round (LR's n-gram setting: 8)
    ngram_size: int = 3  # longest n-gram matched by prompt lookup; shorter ones are tried down to min_ngram
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "assistant"):
            raise ValueError(f"token speculation method must be 'ngram' or 'assistant', got {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.ngram_size:
            raise ValueError(f"need 1 <= min_ngram <= ngram_size, got {self.min_ngram} and {self.ngram_size}")


# ----------------------------------------------------------------------------- proposals
def ngram_propose(context: Sequence[int], max_ngram: int, k: int, min_ngram: int = 1) -> list[int]:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens and return
    (up to) k tokens that followed it. n goes from max_ngram down to min_ngram; [] when nothing matches."""
    if k < 1:
        return []
    ctx = list(context)
    size = len(ctx)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = ctx[size - n:]
        first = tail[0]
        # candidate starts i < size - n (the tail itself excluded), newest first
        for i in range(size - n - 1, -1, -1):
            if ctx[i] == first and ctx[i:i + n] == tail:
                return ctx[i + n:i + n + k]
    return []


class Proposer(Protocol):
    def propose(self, context: Sequence[int], k: int, stats: EngineStats) -> list[int]:
        """Up to k tokens that might follow `context` (token ids of the target's tokenizer); model work
        is added to `stats.proposer_forward_passes`."""
        ...


class NgramProposer:
    """Prompt-lookup proposals (no model)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> list[int]:
        return ngram_propose(context, self.max_ngram, k, self.min_ngram)


class AssistantProposer:
    """Greedy proposals from a smaller model with the same tokenizer (an HFStepEngine).

    The assistant's prefix cache makes each round incremental: only the tokens added since the last
    round are encoded before the k greedy tokens are decoded.
    """

    def __init__(self, assistant, target_tokenizer_id: str):
        if assistant.info.tokenizer_id != target_tokenizer_id:
            raise ValueError(
                f"assistant speculation needs the draft and target to share a tokenizer; "
                f"{assistant.info.model_id!r} has a different vocabulary. Use token_spec=ngram instead.")
        self.assistant = assistant

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> list[int]:
        own = EngineStats()
        out = self.assistant.greedy_continue(list(context), k, own)
        if stats is not None:
            stats.proposer_forward_passes += own.forward_passes
        return out


# ----------------------------------------------------------------------------- distributions
def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: softmax(logits / T), restricted to the top-p nucleus and
    renormalised. Works on (..., vocab); temperature must be > 0 (greedy has no distribution)."""
    if temperature <= 0:
        raise ValueError("filtered_probs needs temperature > 0; greedy decoding uses argmax")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    # The nucleus is usually a few tokens: sort only the top 64 when they hold top_p of the mass
    # (a full vocabulary sort costs milliseconds per token on a CPU).
    top_p_vals, order = probs.topk(min(64, probs.shape[-1]), dim=-1)
    if not bool((top_p_vals.sum(-1) >= top_p).all()):  # a flat distribution: sort everything
        top_p_vals, order = probs.sort(-1, descending=True)
    drop = (top_p_vals.cumsum(-1) - top_p_vals) >= top_p  # the first token always survives
    kept = top_p_vals.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, kept)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution by inverting its CDF with one uniform (much cheaper on a CPU
    than torch.multinomial for a large vocabulary). Tokens of probability 0 are never drawn."""
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u[None], right=True)[0]), probs.shape[0] - 1)


# ----------------------------------------------------------------------------- acceptance rules
def greedy_accept(proposal: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Greedy verification. target_argmax[i] is the target's argmax after the context plus proposal[:i]
    (len(proposal) + 1 entries). Returns the accepted proposal prefix plus one target token."""
    if len(target_argmax) != len(proposal) + 1:
        raise ValueError(f"need len(proposal) + 1 = {len(proposal) + 1} target tokens, got {len(target_argmax)}")
    out: list[int] = []
    for x, t in zip(proposal, target_argmax):
        if int(x) != int(t):
            break
        out.append(int(x))
    out.append(int(target_argmax[len(out)]))
    return out


def sample_accept(proposal: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """Lossless verification of a deterministic proposal under sampling.

    probs: (len(proposal) + 1, vocab), row i = the target's distribution after context + proposal[:i].
    Accept proposal[i] with probability probs[i, x]; at the first rejection draw from probs[i] without x
    (renormalised); when everything is accepted draw a bonus token from the last row.
    """
    if probs.ndim != 2 or probs.shape[0] != len(proposal) + 1:
        raise ValueError(f"probs must be (len(proposal) + 1, vocab) = ({len(proposal) + 1}, V), "
                         f"got {tuple(probs.shape)}")
    probs = probs.detach().float().cpu()
    out: list[int] = []
    for i, x in enumerate(proposal):
        x = int(x)
        px = float(probs[i, x])
        u = float(torch.rand((), generator=generator))
        if u < px:
            out.append(x)
            continue
        residual = probs[i].clone()
        residual[x] = 0.0
        total = float(residual.sum())
        if total <= 0.0:  # p(x) == 1 up to rounding: x is the only possible token
            out.append(x)
            continue
        out.append(sample_from(residual, generator))
        return out
    out.append(sample_from(probs[len(proposal)], generator))
    return out


def draw_tokens(proposal: Sequence[int], logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> list[int]:
    """The accepted proposal prefix plus one new token, from one row's logits (len(proposal) + 1, vocab):
    argmax at temperature 0, else the nucleus distribution with one uniform draw per token from the
    row's own generator (so a row's draws never depend on the other rows of a batch)."""
    if temperature == 0:
        return greedy_accept(proposal, logits.argmax(-1).tolist())
    return sample_accept(proposal, filtered_probs(logits, temperature, top_p), generator)
