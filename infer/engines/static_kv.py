"""The fast decode path of the transformers engine: preallocated KV, device-side sampling, one host sync
per plain iteration.

`StaticKV` owns the batch's key/value buffers (transformers' `StaticCache`: per layer one
(slots, kv heads, columns, head dim) tensor written in place), the attention mask (slots, columns) on the
device and the write column. `FastDecodeBatch` decodes rows on it with the interface of
`hf_kv.DecodeBatch` (add / step / remove / run), so the engine picks either.

Layout (the same idea as the eager batch, without any concatenation): every row owns a slot; all slots
write the same column at each forward (the cache's write offset), and each row's mask says which
columns are its tokens. A row joining copies the K/V columns of the prompt prefix it shares with the
base (the prefix common to the rows the batch began with, encoded once through the engine's prefix
cache) or with a running row into its own slot at the same column indices (one indexed copy per layer),
and only its own tail is forwarded, into fresh columns. Rows of a step batch (n samples, the gamma+1
nested prefixes of Lookahead Reasoning) thus share the prefix without re-encoding it. Finished and
empty slots keep decoding a pad token into masked columns: the batch shape never changes between
joins, which is what lets the decode step run as one captured CUDA graph (`torch.compile` with
mode="reduce-overhead" on CUDA; `compile=False` runs the same code eagerly).

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

import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specprobe.infer.engines.base import EngineStats, SamplingParams, Step
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

log = logging.getLogger(__name__)

_SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_COLUMN_BLOCK = 256
_COLUMN_MARGIN = 64  # free columns a new or grown buffer gets beyond what it holds


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

    def __init__(self, model, slots: int, columns: int, device, dtype):
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

    @property
    def layers(self):
        return self.cache.layers

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
        self.mask[slot].zero_()

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
        """A new StaticKV with `slots` slots and `columns` columns holding this one's contents: all
        columns, or only the `keep` columns (in order) when given."""
        layer0 = self.cache.layers[0]
        new = StaticKV(model, slots, columns, layer0.keys.device, layer0.keys.dtype)
        keep = torch.arange(self.col, device=self.mask.device) if keep is None else keep
        n, s = len(keep), self.slots
        for old, nl in zip(self.cache.layers, new.cache.layers):
            nl.keys[:s, :, :n] = old.keys.index_select(2, keep)
            nl.values[:s, :, :n] = old.values.index_select(2, keep)
        new.mask[:s, :n] = self.mask.index_select(1, keep)
        new.set_column(n)
        return new


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
                 max_length: int | None = None, compile: bool = False, proposer=None, spec_tokens: int = 0):
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
        self.shared_tokens = 0
        self._delim = params.delimiter
        self._cheap_stop = self._delim.isascii()  # see _append
        self._forward = _compiled_decode(runner.model) if compile else _eager_decode(runner.model)
        # device state of every slot, updated in place (graph inputs)
        self._ids = self._pos = self._keys = self._counters = None

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
                self._new_base([r.ids for r in new])
            self._ensure_slots(len(self.rows) + len(new))
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
            kv.mask[:, c] = 1  # every slot's new token (a free slot's too: see StaticKV)
            self.stats.forward_passes += 1
            with self.runner.lock:
                logits = self._forward(self._ids, self._pos, kv.mask, kv.cache)
            kv.col += 1
            self._pos += 1
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
                                  past_key_values=kv.cache, use_cache=True)
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
        self._ids[slots, 0] = torch.tensor([r.tokens[-1] for r in rows], device=self.device)
        self._pos[slots, 0] = torch.tensor([r.pos for r in rows], device=self.device)
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
            self._ids[:, 0] = tok
        else:
            self._ids[idx, 0] = tok
        host = torch.stack([tok.double(), lp.double()]).cpu()  # the one device-to-host copy
        toks, lps = host[0].long().tolist(), host[1].tolist()
        finished = []
        for r in rows:
            j = r.slot if slots is None else slots.index(r.slot)
            step = self._append(r, toks[j], lps[j])
            if step is not None:
                finished.append((r, step))
        for r, _ in finished:  # a copy: the compiled step's logits live in a buffer its next replay overwrites
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
        # An ASCII delimiter survives decoding token by token (its bytes never belong to a multi-byte
        # character), so it shows in the row's last pieces whenever it ends in this token; the exact
        # rule (a full decode) runs only then.
        piece = self.text.piece(tok)
        row.tail_text = (row.tail_text + piece)[-(len(self._delim) + len(piece)):]
        maybe = (not self._cheap_stop or len(row.tokens) >= row.cap or tok in self.text.eos_ids
                 or self._delim in row.tail_text)
        if not maybe:
            return None
        step = self.text.make_step(row.tokens, row.logprob, row.cap, self._delim)
        if step is not None:
            self.stats.generated_tokens += step.num_tokens
        return step

    # ------------------------------------------------------------------ joining
    def _new_base(self, ids_list: list[list[int]]) -> None:
        lcp = common_prefix_len(ids_list)
        self.base_ids = list(ids_list[0][:lcp])
        if lcp:
            self.base_cache, _ = self.runner.prefill(self.base_ids, self.stats)  # rows forward >= 1 own token
        else:
            self.base_cache = None

    def _donor(self, row: _FastRow) -> tuple[_FastRow | None, int]:
        """The running row (or None: the base) sharing the longest token prefix with `row`, and how
        many tokens it shares (at most len(row.ids) - 1: one own token gives the first logits)."""
        donor, share = None, common_prefix_len([row.ids, self.base_ids]) if self.base_ids else 0
        for d in self.rows:
            n = common_prefix_len([row.ids, d.ids])
            if n > share:
                donor, share = d, n
        return donor, min(share, len(row.ids) - 1)

    def _join(self, new: list[_FastRow]) -> dict[int, torch.Tensor]:
        """Place `new` rows in free slots, copy their shared prefixes, forward their tails (one forward);
        returns each new row's first logits."""
        plans = [(r, *self._donor(r)) for r in new]
        tails = [r.ids[share:] for r, _, share in plans]
        m = max(len(t) for t in tails)
        base_cols = max([share for _, d, share in plans if d is None] + [0])
        self._ensure_columns(m, min_start=base_cols)
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
            else:
                r.cols = list(donor.cols[:share])
                kv.copy_columns(donor.slot, slot, r.cols)
                self.shared_tokens += share
            self.stats.reused_prefix_tokens += share
        if base_slots:
            kv.load_prefix(base_slots, self.base_cache, base_cols)
        c0 = kv.col
        inp = torch.full((kv.slots, m), self.runner.pad_id, dtype=torch.long)
        pos = torch.zeros((kv.slots, m), dtype=torch.long)
        last = []
        for (r, _, share), tail in zip(plans, tails):
            inp[r.slot, :len(tail)] = torch.tensor(tail)
            pos[r.slot] = torch.arange(share, share + m)
            r.cols = r.cols + list(range(c0, c0 + len(tail)))
            last.append(len(tail) - 1)
        for r in new:
            kv.mask[r.slot, r.cols] = 1
        for slot in sorted(set(range(kv.slots)) - {r.slot for r in self.rows + new}):
            kv.mask[slot, c0:c0 + m] = 1  # free slots see their own pad tokens
        keep = sorted(set(last))
        out = self.runner.forward(self.stats, input_ids=inp.to(self.device), position_ids=pos.to(self.device),
                                  attention_mask=kv.mask, past_key_values=kv.cache, use_cache=True,
                                  logits_to_keep=torch.tensor(keep, device=self.device))
        kv.col = c0 + m
        self.stats.prefill_tokens += sum(map(len, tails))
        self.rows.extend(new)
        self._init_state(new)
        return {id(r): out.logits[r.slot, keep.index(j)].float() for r, j in zip(new, last)}

    def _init_state(self, new: list[_FastRow]) -> None:
        slots = torch.tensor([r.slot for r in new], device=self.device)
        self._pos[slots, 0] = torch.tensor([r.pos for r in new], device=self.device)
        self._keys[slots] = torch.tensor([r.seed_key for r in new], device=self.device)
        self._counters[slots] = 0

    # ------------------------------------------------------------------ capacity
    def _ensure_slots(self, rows: int) -> None:
        want = slot_bucket(rows)
        if self.kv is not None and self.kv.slots >= want:
            return
        cols = column_capacity(len(self.base_ids) + _COLUMN_MARGIN)
        if self.kv is None:
            layer_dtype = next(self.runner.model.parameters()).dtype
            self.kv = StaticKV(self.runner.model, want, cols, self.device, layer_dtype)
        else:
            self.kv = self.kv.resized(self.runner.model, want, self.kv.columns)
        old = 0 if self._ids is None else self._ids.shape[0]

        def extend(t, fill, width=None):
            shape = (want - old,) if width is None else (want - old, width)
            pad = torch.full(shape, fill, dtype=torch.long, device=self.device)
            return pad if t is None else torch.cat([t, pad])
        self._ids = extend(self._ids, self.runner.pad_id, 1)
        self._pos = extend(self._pos, 0, 1)
        self._keys = extend(self._keys, 0)
        self._counters = extend(self._counters, 0)

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
        self.kv = kv.resized(self.runner.model, kv.slots, columns, keep.to(self.device))
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


# ---------------------------------------------------------------------- the decode forward
def _eager_decode(model):
    def forward(ids, pos, mask, cache):
        return model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                     use_cache=True).logits[:, -1]
    return forward


def _compiled_decode(model):
    """The decode forward compiled once per batch shape; on CUDA "reduce-overhead" replays it as a
    CUDA graph (the launches of a whole forward in one call, no Python between kernels)."""
    eager = _eager_decode(model)
    compiled = torch.compile(eager, mode="reduce-overhead", fullgraph=False, dynamic=False)
    state = {"failed": False}

    def forward(ids, pos, mask, cache):
        if not state["failed"]:
            try:
                return compiled(ids, pos, mask, cache)
            except Exception as err:  # noqa: BLE001 - compilation problems must not stop decoding
                state["failed"] = True
                log.warning("compiling the decode step failed (%s); decoding eagerly on static buffers", err)
        return eager(ids, pos, mask, cache)
    return forward
