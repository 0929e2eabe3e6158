"""Sampling on the device with no host synchronisation, reproducible per seed (the fast decode path).

The eager path (`token_spec.draw_tokens`) draws with one CPU generator per row and reads each row's
distribution back to the host. The fast path keeps everything on the device instead:

- randomness is *counter-based*: the uniform for (row, draw number, token id) is a hash of the row's seed
  key, its draw counter and the token id. No generator state, so a row's draws never depend on the
  other rows, the batch size or the slot the row sits in, and the function can be captured in a CUDA
  graph (seed keys and counters are device tensors updated in place);
- a token is drawn by the exponential-race (Gumbel-max) trick: argmax_v p_v / E_v with E_v = -log U_v
  i.i.d. Exponential(1) picks v with probability exactly p_v (gpt-fast uses the same trick);
- temperature and top-p give the same distribution as `token_spec.filtered_probs`; greedy is argmax.

The hash is 32-bit integer mixing (the "lowbias32" finaliser) computed in int64 and masked, so it runs
on any device torch supports and gives the same numbers on CPU and CUDA.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit mixer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit key of a row seed (any Python int): both halves of the seed go through the mixer."""
    s = int(seed) & ((1 << 64) - 1)
    lo = torch.tensor(s & _MASK32, dtype=torch.int64)
    hi = torch.tensor((s >> 32) & _MASK32, dtype=torch.int64)
    return int(_mix32((_mix32(hi ^ 0x5BD1E995) + lo) & _MASK32))


def uniforms(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) of shape (rows, vocab) for draw number `counters[r]` of the row keyed `keys[r]`; strictly
    inside (0, 1), so -log U is finite and positive."""
    # (key, counter) -> one 32-bit row state; the counter enters through a multiply-add, so keys and
    # counters that happen to be equal do not cancel
    row = _mix32((_mix32(keys) + (counters * 0x85EBCA6B + 0x27D4EB2F)) & _MASK32)  # (rows,)
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _mix32((row[:, None] ^ ((ids[None] * _GOLDEN) & _MASK32)) & _MASK32)
    bits = _mix32(bits ^ row[:, None])  # second round: neighbouring ids decorrelate fully
    # 23 bits: (k + 0.5) / 2**23 is exact in float32 and never rounds to 0 or 1 (24 bits would reach 1.0)
    return ((bits >> 9).to(torch.float32) + 0.5) / 8388608.0


def outside_nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p rule, on probabilities sorted descending along the last axis: True where a token falls
    outside the nucleus, i.e. the tokens before it already hold top_p of the mass. The first token always
    stays, so the nucleus is never empty."""
    return (sorted_probs.cumsum(-1) - sorted_probs) >= top_p


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """log of the sampling distribution (softmax(logits / T) restricted to the top-p nucleus and
    renormalised), -inf outside the nucleus; the same distribution as `token_spec.filtered_probs`."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_lp, order = logp.sort(-1, descending=True)
    sorted_lp = sorted_lp.masked_fill(outside_nucleus(sorted_lp.exp(), top_p), float("-inf"))
    kept = torch.empty_like(logp).scatter_(-1, order, sorted_lp)
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, keys: torch.Tensor,
                  counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits (rows, vocab), and its log-probability under the model's own
    (unmodified) distribution, both on the device. temperature == 0: argmax."""
    full = torch.log_softmax(logits.float(), dim=-1)
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        logp = nucleus_logprobs(logits, temperature, top_p)
        race = logp - torch.log(-torch.log(uniforms(keys, counters, logits.shape[-1])))
        race = race.masked_fill(logp == float("-inf"), float("-inf"))  # never a NaN outside the nucleus
        tokens = race.argmax(-1)
    return tokens, full.gather(-1, tokens[:, None]).squeeze(-1)
