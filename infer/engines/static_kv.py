"""The fast decode path of the transformers engine: preallocated KV, device-side sampling, one host sync
per plain iteration.

`StaticKV` owns the batch's key/value buffers (transformers' `StaticCache`: per layer one
(slots, kv heads, columns, head dim) tensor written in place), the attention mask (slots, columns) on the
device and the write column. `FastDecodeBatch` decodes rows on it with the interface of
`hf_kv.DecodeBatch` (add / step / remove / run), so the engine picks either.

Layout (the same idea as the eager batch, without any concatenation): every row owns a slot; all slots
write the same column at each forward (the cache's write offset), and each row's mask says which
columns are its tokens. A row joining copies the K/V columns of the prompt prefix it shares with the
base (the prefix common to the rows the batch began with: what the engine's prefix cache holds of it, or, when
several rows share many uncached tokens, all of it encoded once in a prefill forward) or with a running row into
its own slot at the same column indices (one indexed copy per layer), and only its own tail is forwarded, into
fresh columns: in one forward, or, for rows starting a batch with a few tokens each (a step continuing the last),
through the decode step one token at a time (on a GPU a few replays of the captured step cost less than one eager
forward's launches). Rows of a step batch (n samples, the gamma+1
nested prefixes of Lookahead Reasoning) thus share the prefix without re-encoding it. Nested prefixes go further:
the longest is the base, encoded once in a one-row forward that keeps the logits after every row's prompt
(`ModelRunner.prefill_ends`), so the rows copy its columns and forward nothing of their own (one forward of their
tails would encode the shared drafts once per row, in every slot). With a captured decode step (CUDA) the forwards
of joining rows are chunks (`DecodeStep.chunk`): padded to a few widths and captured per buffer and width, since an
eager forward of a large model costs tens of milliseconds of launches; nested rows then take the longest row's tail
after the cached base in one such chunk of its slot alone (`StaticKV.first_slot`), keeping every row's logits, and
the others copy its columns. Finished and
empty slots keep decoding a pad token into masked columns: the batch shape never changes between
joins, which is what lets the decode step run as one captured CUDA graph (`decode_step.DecodeStep`: captured once per
buffer; the engine's `StaticKVPool` hands the same buffers, and so the same capture, to its later batches).

Per plain iteration the host sees one device-to-host copy (the new token and its log-probability per slot).
Stop detection runs on the host from those ids: a cheap per-token test (EOS, cap, the delimiter in the
row's last decoded token pieces) and, only when it fires, the exact rule of every engine
(`StepTokenizer.finished`, one full decode), so steps end exactly where the eager path ends them.

Sampling (`device_sampling`) is counter-based, so a row's draws are the same per seed whatever the batch;
they are not the same numbers as the eager path's CPU generators (same distribution, other draws). Its logits
agree across batches up to floating-point rounding (a captured plain step and a verification forward, taken
when other rows propose, round differently), so a sampled token at a near-tie can still depend on the others.

Token speculation inside steps (a proposer: prompt lookup, an assistant, Lookahead Decoding) runs on the same
buffers: an iteration where any row proposes feeds every row's current token and block (tree, side branch:
`token_spec.block_layout`) into fresh columns under a 4-D mask, eagerly (its width varies with the proposals);
the accepted path's columns join the row's mask, and the write column moves back to just after the last column
any row kept (nothing is copied: the next forward writes over the rest; rejected columns before it stay unseen).
Greedy verification copies every row's argmax and its log-probability to the host at once; sampled paths walk
`token_spec.verify_tree` with the row's own CPU generator (each logits row it visits is copied: more host syncs
than a plain iteration's one), while rows without a proposal draw on the device as in a plain iteration, and
Lookahead's `observe` reads its window's argmax (one sync per row). Iterations where no row proposes take the
plain (captured) decode step.

`StaticKV` is also the KV of the one-sequence tree decoders (SEED, the reference Lookahead decoder:
`sequence_kv.SequenceKV`, one slot): one class owns in-place writes, the write column, prefix loading and growth.

What it does not do (the engine uses the eager `DecodeBatch` then, and tree decoders refuse): models whose cache
layers are not plain full-attention layers.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specprobe.infer.engines.base import EngineStats, SamplingParams, Step
from specprobe.infer.engines.decode_step import CHUNK_MAX_SLOTS, DecodeStep
from specprobe.infer.engines.device_sampling import sample_tokens, seed_key
from specprobe.infer.engines.hf_kv import (
    ModelRunner,
    RowBatch,
    RowSpec,
    additive_mask,
    block_inputs,
    check_row_specs,
    common_prefix_len,
)
from specprobe.infer.engines.token_spec import (
    DraftTree,
    block_layout,
    drawn_rows,
    greedy_path,
    path_logprobs,
    verify_tree,
)
from specprobe.infer.engines.tokens import StepTokenizer

_SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_COLUMN_BLOCK = 256
_COLUMN_MARGIN = 64  # free columns a new or grown buffer gets beyond what it holds
# uncached tokens shared by several new rows that each row forwards with its own tail rather than in a separate prefill
# forward of the shared prefix (one forward fewer; see FastDecodeBatch._new_base)
_JOIN_SHARED_MAX = 16


def _positions(start: int, n: int, width: int) -> torch.Tensor:
    """Position ids of a row's n tail tokens padded to `width`: the pads repeat the last one (they are masked; a model
    with a learned position table must not index past it)."""
    return torch.arange(start, start + width).clamp(max=start + n - 1)


def slot_bucket(rows: int) -> int:
    """Slots allocated for `rows` rows: the next bucket, so that few batch shapes (graphs) exist."""
    for b in _SLOT_BUCKETS:
        if rows <= b:
            return b
    return rows


def column_capacity(n: int) -> int:
    """Columns to allocate for n: a multiple of the column block (few buffer shapes, few graphs)."""
    return max(_COLUMN_BLOCK, -(-n // _COLUMN_BLOCK) * _COLUMN_BLOCK)


def grown_columns(need: int, current: int) -> int:
    """Columns of a buffer grown to hold `need`: at least double the current ones (few reallocations)."""
    return max(column_capacity(need + _COLUMN_MARGIN), 2 * current)


def static_cache_supported(model) -> str | None:
    """None when the fast path can run this model, else why not."""
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_cache_len=8)
    except Exception as err:  # noqa: BLE001 - any failure means: use the eager path
        return f"StaticCache cannot be built for this model ({err})"
    bad = [type(layer).__name__ for layer in cache.layers if getattr(layer, "is_sliding", False)
           or not hasattr(layer, "cumulative_length")]
    if bad:
        return f"cache layers {sorted(set(bad))} are not plain static full-attention layers"
    return None


class StaticKV:
    """Preallocated K/V of a batch (transformers' StaticCache), the device attention mask and the write
    column. Every write into the buffers outside a forward goes through here."""

    def __init__(self, model, slots: int, columns: int, device, dtype, pad_id: int = 0):
        from transformers import StaticCache

        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.slots, self.columns = slots, columns
        self.cache = StaticCache(config=model.config, max_cache_len=columns)
        self.cache.early_initialization(slots, heads, head_dim, dtype, device)
        # a free slot sees the columns written while it is free (its own pad tokens): a query that sees
        # nothing would give NaN, and NaN K/V would leak through the zero attention weights
        self.mask = torch.zeros((slots, columns), dtype=torch.long, device=device)
        self.col = 0  # next column a forward writes
        # the plain decode step's inputs (each slot's current token and its position), written in place: with the
        # buffers and the mask they are all a captured decode step reads (`DecodeStep`)
        self.ids = torch.full((slots, 1), pad_id, dtype=torch.long, device=device)
        self.pos = torch.zeros((slots, 1), dtype=torch.long, device=device)
        # the last position the model has (a learned table: GPT-2, OPT); 0: none known
        self.last_pos = int(getattr(cfg, "max_position_embeddings", 0) or 0) - 1
        self.graph: Any = None  # the decode step captured on these buffers (owned by `DecodeStep`)
        # a chunk forward's inputs per width (`chunk_inputs`) and its captures per width (owned by `DecodeStep`)
        self.chunks: dict[int, tuple[torch.Tensor, ...]] = {}
        self.chunk_graphs: dict[int, Any] = {}
        self.keeps = slots  # logits rows a chunk keeps (`chunk_inputs`)
        self._first: StaticKV | None = None  # slot 0 alone (`first_slot`)
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.cache.layers for t in (layer.keys, layer.values))

    def reset(self, pad_id: int) -> None:
        """Empty again (a pooled buffer handed to a new batch); the K/V contents stay, unseen."""
        self.mask.zero_()
        self.ids.fill_(pad_id)
        self.pos.zero_()
        self.set_column(0)

    @property
    def layers(self):
        return self.cache.layers

    def chunk_inputs(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs a chunk forward of `width` columns reads (`DecodeStep.chunk`), written in place: each slot's
        token ids and positions (slots, width), and the `keeps` logits it keeps: their slot (fixed: kept row k is
        slot k's, or on a one-slot view the one slot's) and their index in the chunk."""
        if width not in self.chunks:
            device = self.mask.device
            self.chunks[width] = (torch.zeros((self.slots, width), dtype=torch.long, device=device),
                                  torch.zeros((self.slots, width), dtype=torch.long, device=device),
                                  torch.arange(self.keeps, device=device).clamp(max=self.slots - 1),
                                  torch.zeros(self.keeps, dtype=torch.long, device=device))
        return self.chunks[width]

    def first_slot(self) -> StaticKV:
        """Slot 0 alone: a one-slot StaticKV over this one's memory (views of its K/V, its mask row and its decode
        inputs; the cache layers share this one's write offsets), keeping as many logits rows in a chunk as this one
        has slots. A chunk of one row (a Lookahead batch's longest: `FastDecodeBatch._join_nested`) forwards that
        slot alone, not every slot's padded width; its captures (per width) live and go with this buffer. Writes
        through it move this buffer's write offset, not `col`: the caller moves that."""
        if self._first is None:
            view = object.__new__(StaticKV)
            view.__dict__.update(self.__dict__)
            view.slots, view.keeps, view.graph, view.chunks, view.chunk_graphs = 1, self.slots, None, {}, {}
            view.mask, view.ids, view.pos, view.nbytes, view._first = self.mask[:1], self.ids[:1], self.pos[:1], 0, None
            view.cache = copy.copy(self.cache)
            view.cache.layers = [copy.copy(layer) for layer in self.cache.layers]  # (cumulative_length: the same)
            for layer in view.cache.layers:
                layer.keys, layer.values, layer.batch_size = layer.keys[:1], layer.values[:1], 1
            self._first = view
        return self._first

    def set_column(self, col: int) -> None:
        """Make the next forward write at column `col` (the cache's write offset)."""
        self.col = col
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(col)

    def load_prefix(self, slots: Sequence[int], prefix_cache, n: int) -> None:
        """Columns 0..n-1 of `slots` := the first n positions of a 1-row DynamicCache."""
        idx = torch.tensor(list(slots), device=self.mask.device)
        for layer, src in zip(self.cache.layers, prefix_cache.layers):
            layer.keys[idx, :, :n] = src.keys[0, :, :n].to(layer.keys.dtype)
            layer.values[idx, :, :n] = src.values[0, :, :n].to(layer.values.dtype)

    def copy_columns(self, src_slot: int, dst_slot: int, cols: Sequence[int]) -> None:
        """K/V of `cols` of one slot into the same columns of another (a shared token prefix)."""
        idx = torch.tensor(list(cols), dtype=torch.long, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys[dst_slot, :, idx] = layer.keys[src_slot, :, idx]
            layer.values[dst_slot, :, idx] = layer.values[src_slot, :, idx]

    def clear_slot(self, slot: int) -> None:
        """A slot left free: nothing visible, and its position back to 0 (see `advance`)."""
        self.mask[slot].zero_()
        self.pos[slot].zero_()

    def advance(self) -> None:
        """Every slot's position one on, after a decode step. Free slots advance too (one kernel, no host work),
        so a free slot's position is kept inside the model's position table: a finished row's slot, or a padding
        slot in a stream that never empties, would pass the table of a model with learned positions (GPT-2, OPT).
        A live row never gets there (the engine checks that its prompt and cap fit)."""
        self.pos += 1
        if self.last_pos > 0:
            self.pos.clamp_(max=self.last_pos)

    def export(self, slot: int, cols: Sequence[int]):
        """A 1-row DynamicCache of one slot's `cols` (the engine's prefix cache keeps those)."""
        from transformers import DynamicCache

        idx = torch.tensor(list(cols), dtype=torch.long, device=self.mask.device)
        out = DynamicCache()
        for li, layer in enumerate(self.cache.layers):
            out.update(layer.keys[slot:slot + 1].index_select(2, idx).clone(),
                       layer.values[slot:slot + 1].index_select(2, idx).clone(), li)
        return out

    def resized(self, model, slots: int, columns: int, keep: torch.Tensor | None = None) -> StaticKV:
        """A new StaticKV with `slots` slots and `columns` columns holding this one's contents (`copy_to`)."""
        layer0 = self.cache.layers[0]
        new = StaticKV(model, slots, columns, layer0.keys.device, layer0.keys.dtype)
        self.copy_to(new, keep)
        return new

    def copy_to(self, new: StaticKV, keep: torch.Tensor | None = None) -> None:
        """`new` (at least as many slots, enough columns) := this one's contents: all written columns, or only
        the `keep` columns (in order) when given, and every slot's decode inputs."""
        keep = torch.arange(self.col, device=self.mask.device) if keep is None else keep
        n, s = len(keep), self.slots
        for old, nl in zip(self.cache.layers, new.cache.layers):
            nl.keys[:s, :, :n] = old.keys.index_select(2, keep)
            nl.values[:s, :, :n] = old.values.index_select(2, keep)
        new.mask.zero_()
        new.mask[:s, :n] = self.mask.index_select(1, keep)
        new.ids[:s] = self.ids
        new.pos[:s] = self.pos
        new.set_column(n)


class StaticKVPool:
    """StaticKV buffers of one model that outlive a batch. A decode step is captured once per buffer
    (`DecodeStep`), so a batch that reuses a buffer of its shape replays that capture instead of capturing
    (or recompiling) again; without the pool every `generate` call would pay a capture. The free buffers are
    held up to `keep` of them and `keep_bytes` of K/V together (the least recently returned go first, with their
    captures): a Lookahead Reasoning run cycles through a few slot counts (1 to γ + 1 rows) at each buffer length
    its context grows through, and a capture evicted between two cycles is paid again inside the timing."""

    def __init__(self, model, pad_id: int, keep: int = 16, keep_bytes: int = 4 << 30):
        self.model, self.pad_id, self.keep, self.keep_bytes = model, pad_id, keep, keep_bytes
        self.free: list[StaticKV] = []
        self.created = 0  # buffers allocated (a benchmark reads how often a batch found none to reuse)
        self._lock = threading.Lock()  # one engine's batches may be driven from several threads

    def take(self, slots: int, columns: int) -> StaticKV:
        """An empty buffer of exactly this shape: a free one when there is one, else a new one."""
        with self._lock:
            kv = next((k for k in self.free if k.slots == slots and k.columns == columns), None)
            if kv is not None:
                self.free.remove(kv)
            else:
                self.created += 1
        if kv is None:
            param = next(self.model.parameters())
            return StaticKV(self.model, slots, columns, param.device, param.dtype, self.pad_id)
        kv.reset(self.pad_id)
        return kv

    def give(self, kv: StaticKV) -> None:
        with self._lock:
            self.free.append(kv)
            while self.free and (len(self.free) > self.keep or sum(k.nbytes for k in self.free) > self.keep_bytes):
                del self.free[0]


@dataclass(eq=False)
class _FastRow:
    key: Hashable
    ids: list[int]
    cap: int
    seed_key: int
    keep: bool = False
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    pos: int = 0  # position id of the next token fed
    cols: list[int] = field(default_factory=list)  # column of each prompt token
    gen_cols: list[int] = field(default_factory=list)  # column of each generated token fed so far
    tail_text: str = ""  # the last few decoded characters (delimiter test)
    proposer: Any = None  # its own token proposer (`token_spec.Proposer.fork`), None without speculation
    generator: torch.Generator | None = None  # draws of `verify_tree` when it samples a proposal's path


class FastDecodeBatch(RowBatch):
    """Decode one step for each of several rows on a StaticKV (interface of `hf_kv.DecodeBatch`)."""

    def __init__(self, runner: ModelRunner, text: StepTokenizer, params: SamplingParams, *,
                 max_length: int | None = None, pool: StaticKVPool | None = None,
                 decode_step: DecodeStep | None = None, proposer=None, spec_tokens: int = 0,
                 join_steps: int | None = None):
        """pool, decode_step: the engine's (buffers and captures shared by its batches); by default this
        batch's own, eager on static buffers. join_steps: rows that start a batch with tails of at most this many
        tokens (all of one length) are fed through the decode step, one token per step, instead of one eager
        forward; by default 8 when the decode step replays a graph (a replay costs a fraction of an eager
        forward's launches), else 1. A join of more than one token a row runs as the decode step's chunk instead
        where it takes one (`_chunk_width`): a captured chunk costs about one replay."""
        self.runner, self.text, self.params = runner, text, params
        self.max_length = max_length
        self.proposer, self.spec_tokens = proposer, spec_tokens if proposer is not None else 0
        self.stats = EngineStats()
        self.finished_kv: dict[tuple[int, ...], tuple[Any, torch.Tensor]] = {}
        self.rows: list[_FastRow] = []
        self.device = runner.device
        self.kv: StaticKV | None = None
        self.base_ids: list[int] = []
        self.base_cache = None
        self.base_logits: dict[int, torch.Tensor] = {}  # n -> logits after base_ids[:n], where the base's forward kept them
        self.base_cached = 0  # leading base tokens the prefix cache held (`_new_base`)
        self._nested = False  # the rows starting the batch are nested prefixes joined by one chunk (`_join_nested`)
        self.shared_tokens = 0
        self._delim = params.delimiter
        self._cheap_stop = text.cheap_test_holds(self._delim)  # see StepTokenizer.next_tail
        self.pool = pool or StaticKVPool(runner.model, runner.pad_id, keep=0)
        self._forward = decode_step or DecodeStep(runner.model, "none")
        self.join_steps = join_steps if join_steps is not None else (8 if self._forward.graphed else 1)
        # sampling state of every slot, on the device (the decode inputs live in the StaticKV)
        self._keys = self._counters = None

    # ------------------------------------------------------------------ public API
    def add(self, specs: Sequence[RowSpec]) -> list[tuple[Hashable, Step]]:
        specs = list(specs)
        if not specs:
            return []
        check_row_specs(specs, [r.key for r in self.rows], self.max_length)
        with torch.inference_mode():
            new = [_FastRow(s.key, list(s.ids), s.cap, self._seed_key(s.seed), s.keep, pos=len(s.ids),
                            proposer=None if self.proposer is None else self.proposer.fork(s.seed),
                            generator=None if s.seed is None or self.proposer is None
                            else torch.Generator(device="cpu").manual_seed(s.seed))
                   for s in specs]
            if not self.rows:
                if self.kv is not None:  # kept by an add that failed: start it afresh
                    self.kv.reset(self.runner.pad_id)
                self._new_base([r.ids for r in new])
            self._ensure_slots(len(self.rows) + len(new), max(len(r.ids) for r in new))
            logits = self._join(new)
            self.stats.iterations += 1
            self.stats.row_iterations += len(new)
            slots = [r.slot for r in new]
            first = torch.stack([logits[id(r)] for r in new])
            finished = self._sample_and_append(new, first, slots)
        return finished

    def remove(self, keys: Sequence[Hashable]) -> None:
        gone = set(keys)
        with torch.inference_mode():  # the buffers are inference tensors
            self._drop([r for r in self.rows if r.key in gone])

    def step(self) -> list[tuple[Hashable, Step]]:
        if not self.rows:
            return []
        trees = self._proposals()
        with torch.inference_mode():
            if any(len(t) or t.side is not None for t in trees):
                return self._speculative_step(trees)
            self._ensure_columns(1)
            kv, c = self.kv, self.kv.col
            logits = self._decode_forward()
            kv.advance()
            for r in self.rows:
                r.gen_cols.append(c)
                r.pos += 1
            self.stats.decode_tokens += len(self.rows)
            self.stats.iterations += 1
            self.stats.row_iterations += len(self.rows)
            return self._sample_and_append(list(self.rows), logits, None)

    # ------------------------------------------------------------------ token speculation
    def _speculative_step(self, trees: list[DraftTree]) -> list[tuple[Hashable, Step]]:
        """One forward of every row's current token and block (`token_spec.block_layout`) into fresh columns,
        under a 4-D mask; `verify_tree`'s rule picks each row's path. The write column then moves back to just
        after the last column any row kept (the static form of the eager path's crop: the next forward writes over
        the rest); rejected nodes before it stay in the buffers unseen. Runs eagerly (its width varies with the
        proposals)."""
        rows = self.rows
        blocks = [block_layout(t, r.pos) for r, t in zip(rows, trees)]
        self._ensure_columns(1 + max(len(b[0]) for b in blocks))
        kv, c = self.kv, self.kv.col
        inp, pos, block = block_inputs([(r.slot, r.tokens[-1], r.pos, b) for r, b in zip(rows, blocks)], kv.slots,
                                       self.runner.pad_id)
        width = inp.shape[1]
        seen = kv.mask.bool()[:, None, :].repeat(1, width, 1)
        seen[:, :, c:c + width] = block.to(self.device)
        out = self.runner.forward(self.stats, input_ids=inp.to(self.device), position_ids=pos.to(self.device),
                                  attention_mask=additive_mask(seen, kv.layers[0].keys.dtype),
                                  cache=kv.cache, use_cache=True)
        self.stats.decode_tokens += sum(1 + len(b[0]) for b in blocks)
        self.stats.iterations += 1
        self.stats.row_iterations += len(rows)
        paths = self._verify(rows, trees, out.logits)
        new_mask = torch.zeros((kv.slots, width), dtype=torch.long)
        new_mask[sorted(set(range(kv.slots)) - {r.slot for r in rows})] = 1  # free slots see their own pad tokens
        finished = []
        for r, tree, (chunk, nodes, lps) in zip(rows, trees, paths):
            new_mask[r.slot, self._take_path(r, tree, chunk, nodes, c)] = 1
            step = self._append_path(r, chunk, nodes, lps, out.logits[r.slot])
            if step is not None:
                finished.append((r, step))
        end = int(new_mask[[r.slot for r in rows]].nonzero()[:, 1].max()) + 1
        new_mask[:, end:] = 0
        kv.mask[:, c:c + width] = new_mask.to(self.device)
        kv.set_column(c + end)
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        self.kv.ids[slots, 0] = torch.tensor([r.tokens[-1] for r in rows], device=self.device)
        self.kv.pos[slots, 0] = torch.tensor([r.pos for r in rows], device=self.device)
        self._drop([r for r, _ in finished])
        return [(r.key, s) for r, s in finished]

    def _verify(self, rows: list[_FastRow], trees: list[DraftTree],
                logits: torch.Tensor) -> list[tuple[list[int], list[int], list[float]]]:
        """(tokens, nodes, log-probabilities) of each row's verified path from the forward's logits (slots,
        width, vocab). Greedy: one host copy of every row's argmax and its log-probability. Sampling: a row
        without a proposal draws on the device like a plain step (so its draws never depend on whether other
        rows proposed), one with a proposal walks `verify_tree` with its own generator."""
        if self.params.temperature <= 0:
            live = logits[torch.tensor([r.slot for r in rows], device=self.device)]  # not the free slots'
            best = live.argmax(-1)
            # row by row: a float copy of every row's block at once would be (rows, width, vocab)
            norm = torch.stack([torch.logsumexp(x.float(), -1) for x in live])
            best_lp = live.gather(-1, best[..., None]).squeeze(-1).float() - norm
            host = torch.stack([best.double(), best_lp.double()]).cpu()  # the one device-to-host copy
            out = []
            for j, tree in enumerate(trees):
                chunk, nodes = greedy_path(tree, host[0, j].long().tolist())
                out.append((chunk, nodes, host[1, j, drawn_rows(nodes)].tolist()))
            self._observe(rows, trees, logits)
            return out
        plain = [r for r, t in zip(rows, trees) if not len(t)]
        drawn: dict[int, tuple[int, float]] = {}
        if plain:
            idx = torch.tensor([r.slot for r in plain], device=self.device)
            tok, lp = self._device_draw(logits[idx, 0], idx)
            host = torch.stack([tok.double(), lp.double()]).cpu()
            drawn = {id(r): (int(host[0, j]), float(host[1, j])) for j, r in enumerate(plain)}
        out = []
        for r, tree in zip(rows, trees):
            if not len(tree):
                tok, lp = drawn[id(r)]
                out.append(([tok], [-2], [lp]))
                continue
            row_logits = logits[r.slot, :1 + len(tree)]
            chunk, nodes = verify_tree(tree, row_logits, self.params.temperature, self.params.top_p, r.generator)
            out.append((chunk, nodes, path_logprobs(chunk, nodes, row_logits)))
        self._observe(rows, trees, logits)
        return out

    @staticmethod
    def _observe(rows: list[_FastRow], trees: list[DraftTree], logits: torch.Tensor) -> None:
        """Hand each side branch's outputs to the proposer that fed it (Lookahead Decoding's window)."""
        for r, tree in zip(rows, trees):
            if tree.side is not None:
                t = len(tree)
                r.proposer.observe(tree, logits[r.slot, 1 + t:1 + t + len(tree.side.tokens)].float())

    # ------------------------------------------------------------------ sampling and the stop rule
    def _seed_key(self, seed: int | None) -> int:
        if seed is None:  # unseeded rows follow torch's global RNG, as on the eager path
            seed = int(torch.randint(0, 2**62, ()))
        return seed_key(seed)

    def _sample_and_append(self, rows: list[_FastRow], logits: torch.Tensor,
                           slots: list[int] | None) -> list[tuple[Hashable, Step]]:
        """Draw one token for `rows` from logits (one row per row of `rows`, or per slot when `slots` is
        None), copy the tokens to the host once, and apply the stop rule."""
        idx = None if slots is None else torch.tensor(slots, device=self.device)
        tok, lp = self._device_draw(logits, idx)
        if idx is None:
            self.kv.ids[:, 0] = tok
        else:
            self.kv.ids[idx, 0] = tok
        host = torch.stack([tok.double(), lp.double()]).cpu()  # the one device-to-host copy
        toks, lps = host[0].long().tolist(), host[1].tolist()
        finished = []
        for r in rows:
            j = r.slot if slots is None else slots.index(r.slot)
            step = self._append(r, toks[j], lps[j])
            if step is not None:
                finished.append((r, step))
        for r, _ in finished:  # a copy: a captured step's logits live in a buffer its next replay overwrites
            self._export(r, logits[r.slot if slots is None else slots.index(r.slot)].float().clone())
        self._drop([r for r, _ in finished])
        return [(r.key, s) for r, s in finished]

    def _device_draw(self, logits: torch.Tensor, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token (and its log-probability) per slot of `idx` (None: every slot) from logits with one row per
        slot, drawn with the slots' keys and counters, which advance; both stay on the device."""
        keys = self._keys if idx is None else self._keys[idx]
        counters = self._counters if idx is None else self._counters[idx]
        tok, lp = sample_tokens(logits, self.params.temperature, self.params.top_p, keys, counters)
        if idx is None:
            self._counters += 1
        else:
            self._counters[idx] += 1
        return tok, lp

    def _append(self, row: _FastRow, tok: int, logprob: float) -> Step | None:
        row.tokens.append(tok)
        row.logprob += logprob
        # the exact rule (a full decode) runs only where the cheap test on the row's last pieces says it may end
        row.tail_text, may_end = self.text.next_tail(row.tail_text, tok, self._delim)
        maybe = (not self._cheap_stop or len(row.tokens) >= row.cap or tok in self.text.eos_ids or may_end)
        if not maybe:
            return None
        step = self.text.make_step(row.tokens, row.logprob, row.cap, self._delim)
        if step is not None:
            self.stats.generated_tokens += step.num_tokens
        return step

    # ------------------------------------------------------------------ joining
    def _new_base(self, ids_list: list[list[int]]) -> None:
        """The base: the rows' common prefix, as far as the prefix cache holds it when the rows' own join forward can
        take the rest (one row, or few uncached shared tokens: `ModelRunner.start`), else encoded in a prefill
        forward (and cached); when the rows are nested prefixes, the longest of them. Each row counts the tokens it
        reuses and forwards when it joins."""
        lcp = common_prefix_len(ids_list)
        self.base_ids, self.base_cache, self.base_logits, self._nested = [], None, {}, False
        encoded = self.stats.prefill_tokens
        longest = max(ids_list, key=len)
        nested = len(longest) > lcp and all(common_prefix_len([ids, longest]) == len(ids) for ids in ids_list)
        if nested:
            # nested prefixes (a Lookahead batch): the longest in one one-row forward, keeping the logits after
            # every row's last token, so the rows copy its columns and forward nothing (one forward of all rows'
            # tails would encode the shared drafts once per row); or, where the decode step takes it, its tail
            # after the cached base in one chunk (`_nested_chunk`)
            if not self._nested_chunk(longest, min(map(len, ids_list)) - 1, len(ids_list)):
                self.base_cache, self.base_logits = self.runner.prefill_ends(longest, [len(i) for i in ids_list],
                                                                             self.stats)
                self.base_ids = list(longest)
        elif lcp:
            leave = lcp if len(ids_list) == 1 else _JOIN_SHARED_MAX
            self.base_cache, missing, _ = self.runner.start(ids_list[0][:lcp], self.stats, leave)
            self.base_ids = list(ids_list[0][:lcp - len(missing)])  # rows forward >= 1 own token
        # the base's leading tokens that came from the prefix cache (the rest this batch encoded): what a row
        # taking the base counts as reused
        self.base_cached = len(self.base_ids) - (self.stats.prefill_tokens - encoded)

    def _nested_chunk(self, longest: list[int], most: int, rows: int) -> bool:
        """For nested rows: the base := what the prefix cache holds of the longest (at most `most` tokens: before the
        shortest row's last token), when the rest fits a chunk the decode step takes (captured on CUDA, where an eager
        forward costs tens of milliseconds of launches). Whether it did."""
        if not self._forward.bucket_chunks:
            return False
        cache, shared = self.runner.cached(longest, most)
        if self._nested_width(len(longest) - shared, slot_bucket(rows)) is None:
            return False
        self.base_cache, self.base_ids, self._nested = cache, list(longest[:shared]), True
        self.stats.reused_prefix_tokens += shared
        return True

    def _donor(self, row: _FastRow) -> tuple[_FastRow | None, int]:
        """The running row (or None: the base) sharing the longest token prefix with `row`, and how
        many tokens it shares (at most len(row.ids) - 1: one own token gives the first logits, unless the base's
        forward kept the logits after row.ids: then all of them)."""
        donor, share = None, common_prefix_len([row.ids, self.base_ids]) if self.base_ids else 0
        for d in self.rows:
            n = common_prefix_len([row.ids, d.ids])
            if n > share:
                donor, share = d, n
        if donor is None and share == len(row.ids) and share in self.base_logits:
            return None, share
        return donor, min(share, len(row.ids) - 1)

    def _join(self, new: list[_FastRow]) -> dict[int, torch.Tensor]:
        """Place `new` rows in free slots, copy their shared prefixes, forward their tails (one forward);
        returns each new row's first logits."""
        if self._nested:
            self._nested = False
            width = self._nested_width(max(len(r.ids) for r in new) - len(self.base_ids), self.kv.slots)
            if width is not None:
                return self._join_nested(new, width)
            # (a buffer kept from a failed add has more slots: the rows take the base and forward their tails)
        plans = [(r, *self._donor(r)) for r in new]
        tails = [r.ids[share:] for r, _, share in plans]
        m = max(len(t) for t in tails)
        base_cols = max([share for _, d, share in plans if d is None] + [0])
        by_steps = not self.rows and m <= self.join_steps and all(len(t) == m for t in tails)
        width = None if m == 1 and by_steps else self._chunk_width(m)  # (one replay of the step does one token)
        self._ensure_columns(width or m, min_start=base_cols)
        kv = self.kv
        free = [s for s in range(kv.slots) if s not in {r.slot for r in self.rows}]
        base_slots = []
        for (r, donor, share), slot in zip(plans, free):
            r.slot = slot
            kv.clear_slot(slot)
            if donor is None:
                r.cols = list(range(share))
                if share:
                    base_slots.append(slot)
                self.stats.reused_prefix_tokens += min(share, self.base_cached)
            else:
                r.cols = list(donor.cols[:share])
                kv.copy_columns(donor.slot, slot, r.cols)
                self.shared_tokens += share
                self.stats.reused_prefix_tokens += share
        if base_slots:
            kv.load_prefix(base_slots, self.base_cache, base_cols)
        self.stats.prefill_tokens += sum(map(len, tails))
        # rows whose every token is the base's, the logits after them kept (nested prefixes): nothing to forward
        logits = {id(r): self.base_logits[len(r.ids)] for r, tail in zip(new, tails) if not tail}
        fed = [(plan, tail) for plan, tail in zip(plans, tails) if tail]
        if not fed:
            for r in new:
                kv.mask[r.slot, r.cols] = 1
        elif width is not None:
            logits |= self._join_chunk(new, fed, width)
        elif by_steps and not logits:
            logits = self._join_by_steps(new, plans, tails)
        else:  # (a row without a tail must not take the columns the decode steps write for every slot)
            logits |= self._join_forward(new, fed, m)
        self.rows.extend(new)
        self._init_state(new)
        return logits

    def _join_forward(self, new: list[_FastRow], fed: list, m: int) -> dict[int, torch.Tensor]:
        """`_join`'s forward for the `new` rows with tails (`fed`: ((row, donor, share), tail) pairs, at most m
        tokens each): one eager forward of every slot's m columns (other slots feed pads); their first logits."""
        kv, c0 = self.kv, self.kv.col
        inp = torch.full((kv.slots, m), self.runner.pad_id, dtype=torch.long)
        pos = torch.zeros((kv.slots, m), dtype=torch.long)
        last = []
        for (r, _, share), tail in fed:
            inp[r.slot, :len(tail)] = torch.tensor(tail)
            pos[r.slot] = _positions(share, len(tail), m)
            r.cols = r.cols + list(range(c0, c0 + len(tail)))
            last.append(len(tail) - 1)
        for r in new:
            kv.mask[r.slot, r.cols] = 1
        for slot in sorted(set(range(kv.slots)) - {r.slot for r in self.rows + new}):
            kv.mask[slot, c0:c0 + m] = 1  # free slots see their own pad tokens
        keep = sorted(set(last))
        out = self.runner.forward(self.stats, input_ids=inp.to(self.device), position_ids=pos.to(self.device),
                                  attention_mask=kv.mask, cache=kv.cache, use_cache=True,
                                  logits_to_keep=torch.tensor(keep, device=self.device))
        kv.col = c0 + m
        return {id(r): out.logits[r.slot, keep.index(j)].float() for ((r, _, _), _), j in zip(fed, last)}

    def _nested_width(self, m: int, slots: int) -> int | None:
        """The width of the one-slot chunk (`StaticKV.first_slot`) in which nested rows on a buffer of `slots` slots
        take the longest row's m tokens after the base, or None where the decode step takes none."""
        width = self._forward.chunk_width(m)
        return width if slots <= CHUNK_MAX_SLOTS and self._forward.chunks_for(1, width) else None

    def _chunk_width(self, m: int) -> int | None:
        """The width of the chunk a join of at most m tokens a row runs as (`DecodeStep.chunk`), or None where the
        decode step takes no chunk of this buffer's slots and that width (`DecodeStep.chunks_for`)."""
        width = self._forward.chunk_width(m)
        return width if self._forward.chunks_for(self.kv.slots, width) else None

    def _join_chunk(self, new: list[_FastRow], fed: list, width: int) -> dict[int, torch.Tensor]:
        """`_join_forward` as the decode step's chunk of `width` columns (captured per buffer and width on CUDA): the
        tails padded with pad tokens (at the last tail token's position) into columns no row's mask takes; one
        logits row kept per slot (a fed row's last tail token)."""
        kv, c0 = self.kv, self.kv.col
        inp = torch.full((kv.slots, width), self.runner.pad_id, dtype=torch.long)
        pos = torch.zeros((kv.slots, width), dtype=torch.long)
        keep = torch.zeros(kv.slots, dtype=torch.long)
        for (r, _, share), tail in fed:
            inp[r.slot, :len(tail)] = torch.tensor(tail)
            pos[r.slot] = _positions(share, len(tail), width)
            keep[r.slot] = len(tail) - 1
            r.cols = r.cols + list(range(c0, c0 + len(tail)))
        for r in new:
            kv.mask[r.slot, r.cols] = 1
        for slot in sorted(set(range(kv.slots)) - {r.slot for r in self.rows + new}):
            kv.mask[slot, c0:c0 + width] = 1  # free slots see their own pad tokens
        logits = self._run_chunk(inp, pos, keep)
        return {id(r): logits[r.slot].float() for (r, _, _), _ in fed}

    def _run_chunk(self, ids: torch.Tensor, pos: torch.Tensor, keep_index: torch.Tensor,
                   on: StaticKV | None = None) -> torch.Tensor:
        """The decode step's chunk of every slot's `ids` at `pos` (slots, width) into the write column on, keeping
        kept row k's logits at keep_index[k] (of slot k, or of a one-slot view's slot); the write column moves past
        it. on: the buffer forwarded (this batch's, or a view of its first slot)."""
        on, width = on or self.kv, ids.shape[1]
        ids_in, pos_in, _, keep_in = on.chunk_inputs(width)
        for buffer, value in ((ids_in, ids), (pos_in, pos), (keep_in, keep_index)):
            buffer.copy_(value)  # every input, every time: the buffers are shared by all chunks of this width
        self.stats.forward_passes += 1
        with self.runner.lock:
            logits = self._forward.chunk(on, width)
        self.kv.col += width
        return logits

    def _join_nested(self, new: list[_FastRow], width: int) -> dict[int, torch.Tensor]:
        """Rows starting the batch that are nested prefixes (a Lookahead batch), where the decode step takes a chunk
        of `width`: the longest row, in slot 0, forwards its tail after the base in one chunk of that slot alone
        (`StaticKV.first_slot`) that keeps the logits after every row's last token (all past the base:
        `_new_base`), then every other row copies the longest row's columns of its prompt into its own slot (one
        indexed copy per layer) and forwards nothing. The other slots' columns of the chunk stay unwritten and
        unseen (a free slot sees the next decode step's column)."""
        longest = max(new, key=lambda r: len(r.ids))
        share = len(self.base_ids)
        tail = longest.ids[share:]
        self._ensure_columns(width, min_start=share)
        kv, c0 = self.kv, self.kv.col
        for slot, r in enumerate([longest] + [r for r in new if r is not longest]):
            r.slot = slot
            kv.clear_slot(slot)
        if share:
            kv.load_prefix([0], self.base_cache, share)
        longest.cols = list(range(share)) + list(range(c0, c0 + len(tail)))
        inp = torch.full((1, width), self.runner.pad_id, dtype=torch.long)
        inp[0, :len(tail)] = torch.tensor(tail)
        keep = torch.zeros(kv.slots, dtype=torch.long)
        for k, r in enumerate(new):  # kept row k: the longest's chunk after r's last token
            keep[k] = len(r.ids) - 1 - share
        kv.mask[0, longest.cols] = 1
        self.stats.prefill_tokens += len(tail)
        logits = self._run_chunk(inp, _positions(share, len(tail), width)[None], keep, on=kv.first_slot())
        first = {id(r): logits[k].float() for k, r in enumerate(new)}
        for r in new:
            if r is not longest:
                r.cols = longest.cols[:len(r.ids)]
                kv.copy_columns(longest.slot, r.slot, r.cols)
                kv.mask[r.slot, r.cols] = 1
        self.stats.reused_prefix_tokens += share * (len(new) - 1)  # the others' copies of the cached base
        self.rows.extend(new)
        self._init_state(new)
        return first

    def _join_by_steps(self, new: list[_FastRow], plans, tails: list[list[int]]) -> dict[int, torch.Tensor]:
        """`_join`'s forward for rows starting an empty batch whose tails have one length m: m decode steps (a
        captured step replays), each feeding every row's next tail token; the other slots feed pads as in a plain
        step."""
        kv, m = self.kv, len(tails[0])
        slots = torch.tensor([r.slot for r in new], device=self.device)
        toks = torch.tensor(tails, device=self.device)
        pos = torch.tensor([share for _, _, share in plans], device=self.device)
        for r in new:
            kv.mask[r.slot, r.cols] = 1
        c0 = kv.col
        for j in range(m):
            kv.ids[slots, 0] = toks[:, j]
            kv.pos[slots, 0] = pos + j
            logits = self._decode_forward()
        for r in new:
            r.cols = r.cols + list(range(c0, c0 + m))
        return {id(r): logits[r.slot].float() for r in new}

    def _decode_forward(self) -> torch.Tensor:
        """The decode step on every slot's `kv.ids` at `kv.pos`, into the write column, which every slot's mask
        takes (a free slot sees its own pad token: see StaticKV); the logits per slot."""
        kv = self.kv
        kv.mask[:, kv.col] = 1
        self.stats.forward_passes += 1
        with self.runner.lock:
            logits = self._forward(kv)
        kv.col += 1
        return logits

    def _init_state(self, new: list[_FastRow]) -> None:
        slots = torch.tensor([r.slot for r in new], device=self.device)
        self.kv.pos[slots, 0] = torch.tensor([r.pos for r in new], device=self.device)
        self._keys[slots] = torch.tensor([r.seed_key for r in new], device=self.device)
        self._counters[slots] = 0

    # ------------------------------------------------------------------ capacity
    def _ensure_slots(self, rows: int, longest: int) -> None:
        """Slots for `rows` rows; a new buffer gets columns for the longest new row's tokens."""
        want = slot_bucket(rows)
        if self.kv is not None and self.kv.slots >= want:
            return
        if self.kv is None:
            self.kv = self.pool.take(want, column_capacity(longest + _COLUMN_MARGIN))
        else:
            self._move_to(self.pool.take(want, self.kv.columns))
        old = 0 if self._keys is None else self._keys.shape[0]
        pad = torch.zeros(want - old, dtype=torch.long, device=self.device)
        self._keys = pad if self._keys is None else torch.cat([self._keys, pad])
        self._counters = pad.clone() if self._counters is None else torch.cat([self._counters, pad])

    def _move_to(self, new: StaticKV, keep: torch.Tensor | None = None) -> None:
        """Continue on `new` (more slots, other columns) holding the current contents; the old buffer goes back
        to the pool (after the copy: `new` was taken while the old one was still held, so they differ)."""
        self.kv.copy_to(new, keep)
        self.pool.give(self.kv)
        self.kv = new

    def _ensure_columns(self, n: int, min_start: int = 0) -> None:
        """Room for n more columns after the write column (and the write column at >= min_start):
        drop columns no row uses when that is enough, else grow the buffers."""
        kv = self.kv
        start = max(kv.col, min_start)
        if start + n <= kv.columns:
            if start != kv.col:
                kv.set_column(start)
            return
        if self.rows:
            used = kv.mask[[r.slot for r in self.rows]].bool().any(0).cpu()
        else:
            used = torch.zeros(kv.columns, dtype=torch.bool)
        used[:max(len(self.base_ids), 1)] = True
        keep = used[:kv.col].nonzero().squeeze(1)
        start = max(len(keep), min_start)
        columns = kv.columns if start + n <= kv.columns else grown_columns(start + n, kv.columns)
        remap = torch.full((kv.columns,), -1, dtype=torch.long)
        remap[keep] = torch.arange(len(keep))
        self._move_to(self.pool.take(kv.slots, columns), keep.to(self.device))
        for r in self.rows:
            r.cols = remap[torch.tensor(r.cols, dtype=torch.long)].tolist()
            r.gen_cols = remap[torch.tensor(r.gen_cols, dtype=torch.long)].tolist()
        if start != self.kv.col:
            self.kv.set_column(start)

    # ------------------------------------------------------------------ leaving
    def _export(self, row: _FastRow, logits: torch.Tensor) -> None:
        if not row.keep:
            return
        fed = len(row.tokens) - 1
        cols = row.cols + row.gen_cols[:fed]
        self.finished_kv[tuple(row.ids + row.tokens[:fed])] = (self.kv.export(row.slot, cols), logits.float())

    def _drop(self, rows: Sequence[_FastRow]) -> None:
        if not rows:
            return
        gone = {id(r) for r in rows}
        for r in rows:
            self.kv.clear_slot(r.slot)
        self.rows = [r for r in self.rows if id(r) not in gone]
        if not self.rows:  # empty: the buffers (and their capture) go back for the next batch; a new row restarts
            self.pool.give(self.kv)
            self.kv, self.base_ids, self.base_cache, self.base_logits = None, [], None, {}
            self._keys = self._counters = None
