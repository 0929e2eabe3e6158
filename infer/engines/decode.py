"""Batched step decoding where every row has its own prefix, seed and token cap.

`DecodeBatch` is the unit of work of the decoding runtime: Lookahead Reasoning's γ+1 target steps
(each after a different prefix x ⊕ ŝ₀..ŝ_{j-1}) run as one batch, and the async runtime adds rows to a
running batch as soon as their prefixes exist (continuous batching).

Layout. The batch KV cache has one slot per row and a common set of columns. Every row knows which
column holds each of its prompt tokens (`cols`); columns a row does not use are *holes* (attention mask
0), and every row carries its own position ids, so rows of different lengths decode side by side with
no re-padding. A new row is not re-encoded from scratch:
- the *base* (the longest token prefix common to the rows the batch started with) is encoded once,
  through the engine's prefix cache, and sits in columns 0..len(base)-1;
- a joining row copies the K/V columns of the row (or base) it shares the longest token prefix with
  (the KV of a token depends only on the tokens before it), and only its own tail is forwarded, into
  new columns (holes for every other row). The γ+1 prefixes of an LR batch are nested, so the longest
  is encoded once and the others add a token or two; an async row reuses the row before it.
Token speculation adds a few proposed tokens per row to each forward; the columns of rejected proposals
become holes. Columns no row uses any more are dropped from time to time (`_compact`). The result is
what decoding each row alone computes, up to floating-point differences of batched kernels.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from infer.engines.base import SamplingParams, Step
from infer.engines.token_spec import filtered_probs, greedy_accept, sample_accept


@dataclass
class RowSpec:
    """One row to decode: `key` identifies it in the results."""

    key: Hashable
    ids: list[int]
    cap: int
    seed: int | None = None


@dataclass(eq=False)  # rows are compared by identity
class _Row:
    key: Hashable
    ids: list[int]
    cap: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    pos: int = 0  # position id of the next token fed to the model (= pending token)
    cols: list[int] = field(default_factory=list)  # cache column of each prompt token
    gen_cols: list[int] = field(default_factory=list)  # cache column of each generated token fed so far
    donor: "_Row | None" = None  # row whose columns it copies at join time (None: the base)
    share: int = 0  # prompt tokens taken from the donor / base instead of being forwarded


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of all sequences."""
    if not seqs:
        return 0
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def _check_plain_cache(cache) -> None:
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(
                f"rows can only join a running batch with a plain DynamicCache; this model uses "
                f"{type(layer).__name__} layers")


class DecodeBatch:
    """Decode one step for each of several rows, one forward per iteration.

    Use `add` (any time), `step` (one iteration; returns the rows that finished in it), `remove`
    (cancel rows) or `run` (until every row is done). Not thread-safe: one thread drives a batch.
    """

    def __init__(self, engine, params: SamplingParams, export: bool = False):
        self.engine = engine
        self.params = params
        # export: keep each finished row's KV (prompt + step) so the caller can hand the committed one to
        # the engine's prefix cache (`HFStepEngine.remember_prefix`) and the next step need not re-encode it
        self.export = export
        self.exports: dict[Hashable, tuple[list[int], Any, torch.Tensor]] = {}
        self.rows: list[_Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (rows, cache columns) long
        self.base_ids: list[int] = []
        self.base_cache = None  # 1-row cache of base_ids, the prefix shared by the rows the batch began with
        self.base_logits: torch.Tensor | None = None
        self.ncols = 0  # columns of the batch cache
        self.device = engine.device
        self.iterations = 0
        self.row_iterations = 0  # sum over iterations of the rows in the batch
        self.shared_tokens = 0  # prompt tokens copied from another row instead of being encoded

    # ------------------------------------------------------------------ public API
    def __len__(self) -> int:
        return len(self.rows)

    @property
    def keys(self) -> list[Hashable]:
        return [r.key for r in self.rows]

    def add(self, specs: Sequence[RowSpec]) -> list[tuple[Hashable, Step]]:
        """Add rows; returns rows that finished at once (e.g. their first token is EOS or cap == 1)."""
        specs = list(specs)
        if not specs:
            return []
        keys = [s.key for s in specs] + [r.key for r in self.rows]
        if len(set(keys)) != len(keys):
            raise ValueError("row keys must be unique within a batch")
        for s in specs:
            if s.cap < 1:
                raise ValueError(f"row {s.key!r}: token cap must be >= 1, got {s.cap}")
            if not s.ids:
                raise ValueError(f"row {s.key!r}: empty prompt (no tokens)")
            self.engine._check_fits(len(s.ids) + s.cap, "prompt plus one step")
        with torch.inference_mode():
            creating = not self.rows
            if creating:
                self._new_base([s.ids for s in specs])
            new_rows = []
            for s in specs:
                gen = torch.Generator(device="cpu").manual_seed(s.seed) if s.seed is not None else None
                new_rows.append(_Row(s.key, list(s.ids), s.cap, gen, pos=len(s.ids)))
            first_logits: dict[int, torch.Tensor] = {}
            for wave in self._plan(new_rows, creating):
                first_logits.update(self._join_wave(wave))
            finished = []
            for row in new_rows:
                logits = first_logits[id(row)]
                tok = self._draw([], logits[None], row)[0]
                done = self._append(row, tok, float(torch.log_softmax(logits.float(), -1)[tok]))
                if done is not None:
                    finished.append((row, done))
                    self._export(row, logits)
            self._drop([r for r, _ in finished])
        return [(r.key, s) for r, s in finished]

    def remove(self, keys: Sequence[Hashable]) -> None:
        """Cancel rows (their results are never produced)."""
        gone = set(keys)
        self._drop([r for r in self.rows if r.key in gone])

    def step(self) -> list[tuple[Hashable, Step]]:
        """One forward for all rows (with token speculation when the engine has it on)."""
        if not self.rows:
            return []
        eng = self.engine
        proposer, k_cfg = eng.token_proposer(), (eng.token_spec.num_tokens if eng.token_spec else 0)
        proposals: list[list[int]] = []
        for r in self.rows:
            k = min(k_cfg, r.cap - len(r.tokens) - 1)
            prop = proposer.propose(r.ids + r.tokens, k) if proposer is not None and k > 0 else []
            proposals.append(list(prop)[:max(k, 0)])
        width = 1 + max(len(p) for p in proposals)
        rows = len(self.rows)
        pad = eng.tokenizer.pad_token_id or 0
        with torch.inference_mode():
            inp = torch.full((rows, width), pad, dtype=torch.long)
            new_mask = torch.zeros((rows, width), dtype=torch.long)
            pos = torch.zeros((rows, width), dtype=torch.long)
            for i, (r, prop) in enumerate(zip(self.rows, proposals)):
                inp[i, 0] = r.tokens[-1]
                if prop:
                    inp[i, 1:1 + len(prop)] = torch.tensor(prop)
                new_mask[i, :1 + len(prop)] = 1
                pos[i] = torch.arange(r.pos, r.pos + width)
            attn = torch.cat([self.mask, new_mask], 1)
            out = eng._forward(input_ids=inp.to(self.device), past_key_values=self.cache,
                               attention_mask=attn.to(self.device), position_ids=pos.to(self.device), use_cache=True)
            self.cache = out.past_key_values
            logits = out.logits.float()
            eng.stats["decode_tokens"] += rows
            finished = []
            for i, (r, prop) in enumerate(zip(self.rows, proposals)):
                row_logits = logits[i, :1 + len(prop)]
                new = self._draw(prop, row_logits, r)
                accepted = len(new) - 1
                if prop:
                    eng.stats["spec_rounds"] += 1
                    eng.stats["spec_proposed"] += len(prop)
                    eng.stats["spec_accepted"] += accepted
                    new_mask[i, 1 + accepted:] = 0  # rejected proposals become holes
                r.pos += 1 + accepted
                r.gen_cols.extend(range(self.ncols, self.ncols + 1 + accepted))
                lsm = torch.log_softmax(row_logits[:accepted + 1], -1)
                for j, tok in enumerate(new):
                    done = self._append(r, tok, float(lsm[j, tok]))
                    if done is not None:
                        finished.append((r, done))
                        self._export(r, row_logits[j])
                        break
            self.mask = torch.cat([self.mask, new_mask], 1)
            self.ncols += width
            self.iterations += 1
            self.row_iterations += rows
            self._drop([r for r, _ in finished])
            self._compact()
        return [(r.key, s) for r, s in finished]

    def run(self) -> dict[Hashable, Step]:
        results: dict[Hashable, Step] = {}
        while self.rows:
            results.update(self.step())
        return results

    # ------------------------------------------------------------------ internals
    def _new_base(self, ids_list: list[list[int]]) -> None:
        """A fresh batch: encode the prefix common to its first rows once (engine prefix cache)."""
        from infer.engines.hf import _clone_cache

        lcp = common_prefix_len(ids_list)
        self.base_ids = list(ids_list[0][:lcp])
        if lcp:
            cache, logits = self.engine._prefill(self.base_ids)
            self.base_cache, self.base_logits = _clone_cache(cache), logits
        else:  # nothing in common (different questions)
            self.base_cache, self.base_logits = None, None
        self.cache, self.mask, self.ncols = None, None, lcp

    def _plan(self, new_rows: list[_Row], creating: bool) -> list[list[_Row]]:
        """Choose each new row's donor (the batch row or base sharing its longest token prefix) and split
        the rows into waves: rows whose donor is another new row wait for it (second wave)."""
        min_gain = 8  # a second forward is worth it when it saves at least this many tokens per row
        first, second = [], []
        for r in sorted(new_rows, key=lambda r: -len(r.ids)):
            base_share = common_prefix_len([r.ids, self.base_ids]) if self.base_ids else 0
            donor, share = None, base_share
            for d in self.rows:
                n = common_prefix_len([r.ids, d.ids])
                if n > share:
                    donor, share = d, n
            new_donor, new_share = None, 0
            for d in first:
                n = common_prefix_len([r.ids, d.ids])
                if n > new_share:
                    new_donor, new_share = d, n
            if new_donor is not None and new_share >= share + min_gain:
                donor, share = new_donor, new_share
            if creating and donor is None and r.ids == self.base_ids and self.base_logits is not None:
                r.donor, r.share = None, len(r.ids)  # exactly the base: its logits are known
            else:
                r.donor, r.share = donor, min(share, len(r.ids) - 1)  # >= 1 own token gives the logits
            tail = len(r.ids) - r.share
            waits = any(r.donor is d for d in first) or tail <= min_gain
            (second if waits else first).append(r)
        return [w for w in (first, second) if w]

    def _join_wave(self, rows: list[_Row]) -> dict[int, torch.Tensor]:
        """Give `rows` their cache slots (copied shared columns + forwarded tails); returns first logits."""
        from infer.engines.hf import _clone_cache

        n, old_cols = len(rows), self.ncols
        tails = [r.ids[r.share:] for r in rows]
        m = max(len(t) for t in tails)
        # the wave's own cache: the shared columns of every row, copied into fresh slots
        cache = None
        if old_cols:
            template = self.cache if self.cache is not None else self.base_cache
            if n == 1 and self.cache is None and rows[0].donor is None and rows[0].share == len(self.base_ids):
                cache = _clone_cache(self.base_cache)  # the common single-row case: no copying at all
            else:
                _check_plain_cache(template)
                cache = _clone_cache(template)
                index = {id(r): i for i, r in enumerate(self.rows)}
                nb = len(self.base_ids)
                for li, layer in enumerate(cache.layers):
                    for name in ("keys", "values"):
                        src = getattr(template.layers[li], name)
                        new = src.new_zeros((n,) + tuple(src.shape[1:2]) + (old_cols,) + tuple(src.shape[3:]))
                        if nb:
                            new[:, :, :nb] = getattr(self.base_cache.layers[li], name)[:, :, :nb]
                        batch_src = getattr(self.cache.layers[li], name) if self.cache is not None else None
                        for i, r in enumerate(rows):
                            if r.donor is not None:
                                idx = torch.tensor(r.donor.cols[:r.share], device=src.device)
                                new[i, :, idx] = batch_src[index[id(r.donor)], :, idx]
                        setattr(layer, name, new)
        mask = torch.zeros((n, old_cols + m), dtype=torch.long)
        for i, r in enumerate(rows):
            shared = list(range(r.share)) if r.donor is None else list(r.donor.cols[:r.share])
            mask[i, shared] = 1
            r.cols = shared
            if r.donor is not None:
                self.shared_tokens += r.share
                self.engine.stats["shared_prefix_tokens"] = self.engine.stats.get("shared_prefix_tokens", 0) + r.share
        logits: dict[int, torch.Tensor] = {}
        if m:
            right = all(r.share > 0 for r in rows)  # a left hole needs something visible to its query
            pad = self.engine.tokenizer.pad_token_id or 0
            inp = torch.full((n, m), pad, dtype=torch.long)
            pos = torch.zeros((n, m), dtype=torch.long)
            for i, (r, t) in enumerate(zip(rows, tails)):
                start = m - len(t) if right else 0
                if t:
                    inp[i, start:start + len(t)] = torch.tensor(t)
                    mask[i, old_cols + start:old_cols + start + len(t)] = 1
                    pos[i, start:start + len(t)] = torch.arange(r.share, r.share + len(t))
                    r.cols = r.cols + list(range(old_cols + start, old_cols + start + len(t)))
                pos[i, :start] = r.share
                pos[i, start + len(t):] = r.share + len(t)
            out = self.engine._forward(input_ids=inp.to(self.device), past_key_values=cache,
                                       attention_mask=mask.to(self.device), position_ids=pos.to(self.device),
                                       use_cache=True, **({"logits_to_keep": 1} if right else {}))
            self.engine.stats["prefill_tokens"] += sum(len(t) for t in tails)
            cache = out.past_key_values
            for i, (r, t) in enumerate(zip(rows, tails)):
                if t:
                    logits[id(r)] = out.logits[i, -1 if right else len(t) - 1].float()
        for r, t in zip(rows, tails):
            if not t:
                logits[id(r)] = self.base_logits
            r.donor = None  # do not keep other rows alive
        # merge the wave into the batch: old rows get holes where the wave's tails went
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            for old_layer, new_layer in zip(self.cache.layers, cache.layers):
                for name in ("keys", "values"):
                    old, new = getattr(old_layer, name), getattr(new_layer, name)
                    if m:
                        old = torch.cat([old, old.new_zeros(old.shape[:2] + (m,) + old.shape[3:])], 2)
                    setattr(old_layer, name, torch.cat([old, new], 0))
            self.mask = torch.cat([torch.cat([self.mask, torch.zeros((len(self.rows), m), dtype=torch.long)], 1),
                                   mask], 0)
        self.rows.extend(rows)
        self.ncols = old_cols + m
        return logits

    def _export(self, row: _Row, logits: torch.Tensor) -> None:
        """Keep a finished row's KV of prompt + step (all but the last token, which was never fed) as a
        1-row cache, with the logits its last token was drawn from."""
        from infer.engines.hf import _clone_cache

        if not self.export or self.cache is None:
            return
        _check_plain_cache(self.cache)
        slot = next(i for i, r in enumerate(self.rows) if r is row)
        fed = len(row.tokens) - 1
        idx = torch.tensor(row.cols + row.gen_cols[:fed], dtype=torch.long, device=self.device)
        cache = _clone_cache(self.cache)
        for layer in cache.layers:
            layer.keys = layer.keys[slot:slot + 1].index_select(2, idx)
            layer.values = layer.values[slot:slot + 1].index_select(2, idx)
        self.exports[row.key] = (row.ids + row.tokens[:fed], cache, logits.float())

    def _compact(self, min_cols: int = 256, max_hole_share: float = 0.5) -> None:
        """Drop columns no row attends to (async batches live long and accumulate holes); the base
        columns stay, later rows copy them."""
        if self.cache is None or self.ncols < min_cols:
            return
        used = self.mask.bool().any(0)
        used[:len(self.base_ids)] = True
        keep = used.nonzero().squeeze(1)
        if len(keep) > (1 - max_hole_share) * self.ncols:
            return
        _check_plain_cache(self.cache)
        remap = torch.full((self.ncols,), -1, dtype=torch.long)
        remap[keep] = torch.arange(len(keep))
        idx = keep.to(self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)
        self.mask = self.mask[:, keep]
        for r in self.rows:
            r.cols = remap[torch.tensor(r.cols, dtype=torch.long)].tolist()
            r.gen_cols = remap[torch.tensor(r.gen_cols, dtype=torch.long)].tolist()
        self.ncols = len(keep)

    def _draw(self, proposal: list[int], logits: torch.Tensor, row: _Row) -> list[int]:
        """Accepted proposal tokens + one new token, from logits (len(proposal) + 1, vocab)."""
        p = self.params
        if p.temperature == 0:
            return greedy_accept(proposal, logits.argmax(-1).tolist())
        probs = filtered_probs(logits, p.temperature, p.top_p)
        return sample_accept(proposal, probs, row.generator)

    def _append(self, row: _Row, tok: int, logprob: float) -> Step | None:
        """Add one token to a row; returns its Step when the row is finished."""
        from infer.engines.hf import find_step_end

        row.tokens.append(int(tok))
        row.logprob += logprob
        eng = self.engine
        if eng.stop_at_eos and tok in eng.eos_ids:
            return Step(eng.tokenizer.decode(row.tokens[:-1]), list(row.tokens), "eos", row.logprob)
        text = eng.tokenizer.decode(row.tokens)
        end = find_step_end(text, self.params.delimiter)
        if end is not None:
            return Step(text[:end], list(row.tokens), "delimiter", row.logprob)
        if len(row.tokens) >= row.cap:
            return Step(text, list(row.tokens), "length", row.logprob)
        return None

    def _drop(self, rows: Sequence[_Row]) -> None:
        if not rows:
            return
        gone = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache, self.mask, self.base_cache, self.base_ids, self.base_logits = None, None, None, [], None
            self.ncols = 0
            return
        idx = torch.tensor(keep, dtype=torch.long)
        self.cache.batch_select_indices(idx.to(self.device))
        self.mask = self.mask[idx]


def make_row_specs(engine, prefixes: Sequence[str], params: SamplingParams, seeds: Sequence[int | None] | None,
                   caps: Sequence[int] | None) -> list[RowSpec]:
    """RowSpecs for `generate_steps`: key = index; seed per row (params.seed + i when none given)."""
    n = len(prefixes)
    if seeds is not None and len(seeds) != n or caps is not None and len(caps) != n:
        raise ValueError(f"seeds and caps must have one entry per prefix ({n})")
    specs = []
    for i, prefix in enumerate(prefixes):
        if seeds is not None:
            seed: Any = seeds[i]
        else:
            seed = None if params.seed is None else params.seed + i
        cap = params.max_step_tokens if caps is None else min(int(caps[i]), params.max_step_tokens)
        specs.append(RowSpec(i, engine.encode_prefix(prefix), cap, seed))
    return specs
