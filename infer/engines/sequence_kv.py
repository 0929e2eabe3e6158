"""One sequence's KV for tree-shaped speculation, on the fast path's buffers: committed tokens, then blocks of
speculative tokens with their own attention pattern, dropped after verification.

SEED (draft trees on the draft model, their verification on the target) and the sequence-level
`lookahead_decoding.LookaheadDecoder` decode one sequence at a time with custom attention. Their KV is a one-slot
`static_kv.StaticKV`, the class that holds the fast decode path's batches (preallocated buffers written in place at
a write column, a 4-D mask per forward): one KV class serves the fast batches, in-step token speculation and these
decoders. What this module adds is the sequence's layout, explicit position ids and prefix reuse (the sequence it
continues, else the engine's prefix cache). The eager batch path (`hf_kv.DecodeBatch`) keeps its growing
DynamicCache: it is the reference, and the faster path on a CPU.

Columns, in order: the committed tokens (`committed`), then speculative columns of earlier blocks
(`speculative`), then the tokens of this forward. A forward feeds the committed tokens not yet cached (causal;
only when no speculative columns are left) and then one block: every block token sees all committed tokens, and
`allowed` says which speculative columns (earlier blocks, then this block) it sees. `drop_speculative` moves
the write column back to the committed tokens (nothing is copied: the next forward writes over the block), so the
accepted tokens are fed again as committed tokens by the next forward (their KV is recomputed once, in the causal
part).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from specprobe.infer.engines.base import EngineStats
from specprobe.infer.engines.hf_kv import additive_mask, cache_keyword
from specprobe.infer.engines.static_kv import StaticKV, column_capacity, grown_columns, static_cache_supported


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
    """The KV of one sequence on one transformers model, a one-slot `StaticKV` (see the module doc). `lock`: the
    engine's model lock, so that a sequence decoder and the engine's own batches never run the model at once.
    `prefill`: the engine's prompt-prefix cache (`hf_kv.ModelRunner.prefill`); a sequence that does not continue
    this cache's previous one starts from it, so sequences with one prompt (SEED's n thoughts of a state, on
    both models) encode it once."""

    def __init__(self, model, lock=None, prefill: Callable | None = None):
        why = static_cache_supported(model)
        if why is not None:
            raise NotImplementedError(f"tree attention (Lookahead Decoding, SEED) needs plain full-attention KV "
                                      f"layers: {why}")
        self.model = model
        self.cache_keyword = cache_keyword(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._prefill = prefill
        self._kv: StaticKV | None = None
        self._ids: list[int] = []  # the committed tokens whose KV is cached, in columns 0..committed-1
        self.speculative = 0
        self.forward_passes = 0  # forwards of this cache's own sequences
        self.prefill_passes = 0  # forwards the engine's prefix cache ran for it (0 on a hit)

    @property
    def committed(self) -> int:
        return len(self._ids)

    @torch.inference_mode()  # the buffers are inference tensors, as in the fast batches
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
        if self._kv is not None and common >= 1 and (continues or self._prefill is None):
            self._ids, self.speculative = self._ids[:common], 0
            self._kv.set_column(common)
            return
        self._reset()
        if self._prefill is not None and len(ids) > 1:
            stats = EngineStats()
            cache, _ = self._prefill(ids[:-1], stats)
            n = len(ids) - 1
            with self._lock:  # device writes stay out of the way of the engine's own (captured) forwards
                self._room(n)
                self._kv.load_prefix([0], cache, n)
                self._kv.set_column(n)
            self._ids = ids[:-1]
            self.prefill_passes += stats.forward_passes

    def _reset(self) -> None:
        self._ids, self.speculative = [], 0
        if self._kv is not None:
            self._kv.set_column(0)

    def _room(self, columns: int) -> None:
        """Buffers with at least `columns` columns, keeping the written ones (a longer sequence grows them)."""
        if self._kv is None:
            self._kv = StaticKV(self.model, 1, column_capacity(columns), self.device, self.dtype)
        elif columns > self._kv.columns:
            self._kv = self._kv.resized(self.model, 1, grown_columns(columns, self._kv.columns))

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], block: Sequence[int] = (), allowed: torch.Tensor | None = None,
                positions: Sequence[int] | torch.Tensor = ()) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Feed the tokens of `ids` not yet cached, then `block` (absolute `positions`, attention `allowed`
        over the speculative columns). Returns (the float logits after the last fed committed token, or None
        when none was fed; the block's logits (m, vocab)). Afterwards all of `ids` are committed and the
        block's columns are speculative."""
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
        layout = forward_layout(self.committed, len(fresh), self.speculative, allowed)
        pos = list(range(self.committed, len(ids))) + [int(p) for p in positions]
        try:
            with self._lock:
                self._room(layout.shape[1])
                kv = self._kv
                seen = torch.zeros((layout.shape[0], kv.columns), dtype=torch.bool)
                seen[:, :layout.shape[1]] = layout  # the buffer's unwritten columns stay unseen
                res = self.model(input_ids=torch.tensor([fresh + [int(t) for t in block]], device=self.device),
                                 attention_mask=additive_mask(seen.to(self.device), kv.layers[0].keys.dtype),
                                 position_ids=torch.tensor([pos], device=self.device), use_cache=True,
                                 **{self.cache_keyword: kv.cache}, logits_to_keep=m + (1 if fresh else 0))
        except BaseException:
            self._reset()  # the buffers may hold part of this forward's columns
            raise
        self.forward_passes += 1
        self._ids = ids
        self.speculative += m
        kv.col = self.committed + self.speculative  # the forward moved the cache's write offset; keep the mirror
        logits = res.logits[0].float()  # the last fed committed token, then the block
        return (logits[0] if fresh else None), logits[1 if fresh else 0:]

    @torch.inference_mode()
    def drop_speculative(self) -> None:
        """Forget the speculative columns: the next forward writes after the committed tokens again."""
        if self.speculative:
            self._kv.set_column(self.committed)
            self.speculative = 0
