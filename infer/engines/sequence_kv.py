"""One sequence's KV cache for tree-shaped speculation: committed tokens, then blocks of speculative tokens
with their own attention pattern, cropped away after verification.

SEED (draft trees on the draft model, their verification on the target) and the sequence-level
`lookahead_decoding.LookaheadDecoder` decode one sequence at a time with custom attention; every transformers
detail they need lives here: the DynamicCache, cropping, the 4-D additive masks with explicit position ids,
and prefix reuse (the sequence it continues, else the engine's prefix cache). The engine's batch paths keep
their own layouts: `hf_kv.DecodeBatch` and `static_kv.FastDecodeBatch` verify every in-step proposer's chains
and trees (prompt lookup, an assistant, Lookahead Decoding) row by row in one forward.

Columns of the cache, in order: the committed tokens (`committed`), then speculative columns of earlier
blocks (`speculative`), then the tokens of this forward. A forward feeds the committed tokens not yet
cached (causal; only when no speculative columns are left) and then one block: every block token sees
all committed tokens, and `allowed` says which speculative columns (earlier blocks, then this block) it
sees. `drop_speculative` crops the cache back to the committed tokens, so the accepted tokens are fed
again as committed tokens by the next forward (their KV is recomputed once, in the causal part).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from specprobe.infer.engines.base import EngineStats


def crop_cache(cache, length: int) -> None:
    """Drop cached positions beyond `length` (a negative count: the form every transformers 5 accepts)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(batch, 1, q, kv) additive mask from a bool (q, kv) or (batch, q, kv) pattern (on its device): 0 where
    attention is allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None] if allowed.ndim == 2 else mask[:, None]


def check_plain_cache(cache, what: str) -> None:
    """Cropping and custom column layouts need plain full-attention DynamicCache layers."""
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(f"{what}: only plain DynamicCache layers are supported; this model uses "
                                      f"{type(layer).__name__} layers (sliding-window or compressed caches)")


def forward_layout(committed: int, n_fresh: int, speculative: int, allowed: torch.Tensor) -> torch.Tensor:
    """(n_fresh + m, kv) bool attention of one forward: `n_fresh` causal tokens after `committed` cached ones,
    then m block tokens that see every committed token and, per `allowed` (m, speculative + m), the
    speculative columns. Fresh tokens and earlier speculative columns never meet (see the module doc)."""
    m = allowed.shape[0]
    if allowed.shape[1] != speculative + m:
        raise ValueError(f"a block of {m} tokens after {speculative} speculative columns needs allowed of shape "
                         f"({m}, {speculative + m}), got {tuple(allowed.shape)}")
    if n_fresh and speculative:
        raise ValueError("committed tokens cannot follow speculative columns: drop_speculative() first")
    ctx = committed + n_fresh
    out = torch.zeros((n_fresh + m, ctx + speculative + m), dtype=torch.bool)
    out[:, :committed] = True
    for r in range(n_fresh):
        out[r, committed:committed + r + 1] = True
    out[n_fresh:, committed:ctx] = True
    out[n_fresh:, ctx:] = allowed
    return out


class SequenceKV:
    """The KV cache of one sequence on one transformers model (see the module doc). `lock`: the engine's
    model lock, so that a sequence decoder and the engine's own batches never run the model at once.
    `prefill`: the engine's prompt-prefix cache (`hf_kv.ModelRunner.prefill`); a sequence that does not continue
    this cache's previous one starts from it, so sequences with one prompt (SEED's n thoughts of a state, on
    both models) encode it once."""

    def __init__(self, model, lock=None, prefill: Callable | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._prefill = prefill
        self._cache = None
        self._ids: list[int] = []  # the committed tokens whose KV is cached
        self.speculative = 0
        self.forward_passes = 0  # forwards of this cache's own sequences
        self.prefill_passes = 0  # forwards the engine's prefix cache ran for it (0 on a hit)

    @property
    def committed(self) -> int:
        return len(self._ids)

    def start(self, ids: Sequence[int]) -> None:
        """Begin (or go on with) a sequence. One that continues the cached tokens keeps them (consecutive
        steps of one answer); any other starts from the engine's prefix cache, or without one from what it
        shares with the cached tokens. At least one token is left to feed: the first forward returns its
        output."""
        ids = [int(t) for t in ids]
        common = 0
        for a, b in zip(self._ids, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        continues = common == min(len(self._ids), len(ids) - 1)
        if self._cache is not None and common >= 1 and (continues or self._prefill is None):
            crop_cache(self._cache, common)
            self._ids, self.speculative = self._ids[:common], 0
            return
        self._reset()
        if self._prefill is not None and len(ids) > 1:
            stats = EngineStats()
            self._cache, _ = self._prefill(ids[:-1], stats)
            self._ids = ids[:-1]
            self.prefill_passes += stats.forward_passes

    def _reset(self) -> None:
        self._cache, self._ids, self.speculative = None, [], 0

    @torch.no_grad()
    def forward(self, ids: Sequence[int], block: Sequence[int] = (), allowed: torch.Tensor | None = None,
                positions: Sequence[int] | torch.Tensor = ()) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed the tokens of `ids` not yet cached, then `block` (absolute `positions`, attention `allowed`
        over the speculative columns). Returns (the float logits after the last fed committed token, or None
        when none was fed; the block's logits (m, vocab)). Afterwards all of `ids` are committed and the
        block's columns are speculative."""
        from transformers import DynamicCache

        ids = [int(t) for t in ids]
        if ids[:self.committed] != self._ids:
            raise ValueError("SequenceKV.forward: ids must extend the committed tokens (call start() for another "
                             "sequence)")
        fresh = ids[self.committed:]
        m = len(block)
        if allowed is None:
            allowed = torch.zeros((0, self.speculative), dtype=torch.bool)
        if not fresh and not m:
            raise ValueError("SequenceKV.forward needs at least one new committed or block token")
        if len(positions) != m:
            raise ValueError(f"{m} block tokens need {m} positions, got {len(positions)}")
        mask = forward_layout(self.committed, len(fresh), self.speculative, allowed)
        pos = list(range(self.committed, len(ids))) + [int(p) for p in positions]
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        check_plain_cache(self._cache, "tree attention (Lookahead Decoding, SEED)")
        try:
            with self._lock:
                res = self.model(input_ids=torch.tensor([fresh + [int(t) for t in block]], device=self.device),
                                 attention_mask=additive_mask(mask, self.dtype).to(self.device),
                                 position_ids=torch.tensor([pos], device=self.device), past_key_values=self._cache,
                                 use_cache=True, logits_to_keep=m + (1 if fresh else 0))
        except BaseException:
            self._reset()  # the cache may hold part of this forward's columns
            raise
        self.forward_passes += 1
        self._cache = res.past_key_values
        self._ids = ids
        self.speculative += m
        logits = res.logits[0].float()  # the last fed committed token, then the block
        return (logits[0] if fresh else None), logits[1 if fresh else 0:]

    def drop_speculative(self) -> None:
        """Crop the speculative columns: the cache holds exactly the committed tokens again."""
        if self.speculative:
            crop_cache(self._cache, self.committed)
            self.speculative = 0
