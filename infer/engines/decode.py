"""Batched step decoding where every row has its own prefix, seed and token cap.

`DecodeBatch` is the unit of work of the decoding runtime: Lookahead Reasoning's γ+1 target steps
(each after a different prefix x ⊕ ŝ₀..ŝ_{j-1}) run as one batch, and the async runtime adds rows to a
running batch as soon as their prefixes exist (continuous batching).

Layout. All rows share the KV cache columns of one common token prefix (computed once, through the
engine's prefix cache). After it, each row owns its columns; columns a row does not own are *holes*
(attention mask 0) and every row carries its own position ids, so rows of different lengths decode
side by side with no re-padding:

    columns:   [ shared prefix | row suffixes, right-aligned | decoded tokens ... | joined rows ... ]
    row mask:  [ 1 1 1 1 1 1 1 | 0 0 1 1 1 / 1 1 1 1 1 / ... | 1 1 1 0 1 1 ...  | 0 0 0 / 1 1 1 ]

A row that joins later gets the shared prefix columns it has in common with the batch, holes for
everything else that is already there, and its own suffix appended as new columns (holes for the old
rows). Token speculation adds a few proposed tokens per row to each forward; the columns of proposals
that were rejected become holes too. The result is exactly what decoding each row alone computes, up to
floating-point differences of batched kernels.
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


@dataclass
class _Row:
    key: Hashable
    ids: list[int]
    cap: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    pos: int = 0  # position id of the next token fed to the model (= pending token)


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

    def __init__(self, engine, params: SamplingParams):
        self.engine = engine
        self.params = params
        self.rows: list[_Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (rows, cache columns) long
        self.base_ids: list[int] = []
        self.base_cache = None  # 1-row cache of base_ids (shared prefix) for rows that join later
        self.device = engine.device
        self.iterations = 0

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
            if self.cache is None:
                first_logits = self._start(specs)
            else:
                first_logits = self._join(specs)
            new_rows = []
            for s, logits in zip(specs, first_logits):
                gen = torch.Generator(device="cpu").manual_seed(s.seed) if s.seed is not None else None
                new_rows.append(_Row(s.key, list(s.ids), s.cap, gen, pos=len(s.ids)))
            self.rows.extend(new_rows)
            finished = []
            for row, logits in zip(new_rows, first_logits):
                tok = self._draw([], logits[None], row)[0]
                done = self._append(row, tok, float(torch.log_softmax(logits.float(), -1)[tok]))
                if done is not None:
                    finished.append((row, done))
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
                lsm = torch.log_softmax(row_logits[:accepted + 1], -1)
                for j, tok in enumerate(new):
                    done = self._append(r, tok, float(lsm[j, tok]))
                    if done is not None:
                        finished.append((r, done))
                        break
            self.mask = torch.cat([self.mask, new_mask], 1)
            self.iterations += 1
            self._drop([r for r, _ in finished])
        return [(r.key, s) for r, s in finished]

    def run(self) -> dict[Hashable, Step]:
        results: dict[Hashable, Step] = {}
        while self.rows:
            results.update(self.step())
        return results

    # ------------------------------------------------------------------ internals
    def _suffix_forward(self, cache, ids_list: list[list[int]], start: int):
        """Forward each row's ids[start:] on top of `cache` (rows already repeated; None = no shared
        prefix). Returns (cache, suffix mask (rows, m), last logits per row or None where empty).

        With a shared prefix the suffixes are right-aligned (holes first), so every row's last token is
        in the last column and only that column's logits are computed. Without one they are
        left-aligned, so that no query row is entirely masked (which would produce NaNs)."""
        suffixes = [ids[start:] for ids in ids_list]
        m = max(len(s) for s in suffixes)
        rows = len(suffixes)
        if m == 0:
            return cache, torch.zeros((rows, 0), dtype=torch.long), [None] * rows
        right = start > 0
        pad = self.engine.tokenizer.pad_token_id or 0
        inp = torch.full((rows, m), pad, dtype=torch.long)
        sfx_mask = torch.zeros((rows, m), dtype=torch.long)
        pos = torch.full((rows, m), start, dtype=torch.long) if right else torch.arange(start, start + m).repeat(rows, 1)
        for i, s in enumerate(suffixes):
            if not s:
                continue
            cols = slice(m - len(s), m) if right else slice(0, len(s))
            inp[i, cols] = torch.tensor(s)
            sfx_mask[i, cols] = 1
            pos[i, cols] = torch.arange(start, start + len(s))
        attn = torch.cat([torch.ones((rows, start), dtype=torch.long), sfx_mask], 1)
        out = self.engine._forward(input_ids=inp.to(self.device), past_key_values=cache,
                                   attention_mask=attn.to(self.device), position_ids=pos.to(self.device),
                                   use_cache=True, **({"logits_to_keep": 1} if right else {}))
        self.engine.stats["prefill_tokens"] += sum(len(s) for s in suffixes)
        if right:
            last = [out.logits[i, -1].float() if s else None for i, s in enumerate(suffixes)]
        else:
            last = [out.logits[i, len(s) - 1].float() if s else None for i, s in enumerate(suffixes)]
        return out.past_key_values, sfx_mask, last

    def _start(self, specs: Sequence[RowSpec]) -> list[torch.Tensor]:
        from infer.engines.hf import _clone_cache

        ids_list = [s.ids for s in specs]
        lcp = common_prefix_len(ids_list)
        self.base_ids = list(ids_list[0][:lcp])
        if lcp:
            base_cache, base_logits = self.engine._prefill(self.base_ids)
            self.base_cache = _clone_cache(base_cache)
            cache = base_cache
            if len(specs) > 1:
                cache.batch_repeat_interleave(len(specs))
        else:  # nothing in common (different questions): every row is all suffix
            cache, base_logits, self.base_cache = None, None, None
        cache, sfx_mask, last = self._suffix_forward(cache, ids_list, lcp)
        self.cache = cache
        self.mask = torch.cat([torch.ones((len(specs), lcp), dtype=torch.long), sfx_mask], 1)
        return [base_logits if lg is None else lg for lg in last]

    def _join(self, specs: Sequence[RowSpec]) -> list[torch.Tensor]:
        from infer.engines.hf import _clone_cache

        _check_plain_cache(self.cache)
        ids_list = [s.ids for s in specs]
        # shared columns: common with the batch's prefix, leaving every new row >= 1 own token
        start = min(min(common_prefix_len([self.base_ids, ids]), len(ids) - 1) for ids in ids_list)
        cache = _clone_cache(self.base_cache) if self.base_cache is not None and start > 0 else None
        cut = len(self.base_ids) - start
        if cache is not None and cut > 0:
            cache.crop(-cut)
        if cache is not None and len(specs) > 1:
            cache.batch_repeat_interleave(len(specs))
        cache, sfx_mask, last = self._suffix_forward(cache, ids_list, start)
        m = sfx_mask.shape[1]
        old_cols = self.mask.shape[1]
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                old, new = getattr(old_layer, name), getattr(new_layer, name)
                b_old, heads, _, dim = old.shape
                merged = old.new_zeros((b_old + new.shape[0], heads, old_cols + m, dim))
                merged[:b_old, :, :old_cols] = old
                merged[b_old:, :, :start] = new[:, :, :start]
                merged[b_old:, :, old_cols:] = new[:, :, start:]
                setattr(old_layer, name, merged)
        new_mask = torch.zeros((len(specs), old_cols + m), dtype=torch.long)
        new_mask[:, :start] = 1
        new_mask[:, old_cols:] = sfx_mask
        self.mask = torch.cat([torch.cat([self.mask, torch.zeros((len(self.rows), m), dtype=torch.long)], 1),
                               new_mask], 0)
        return last  # every new row has at least one suffix token

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
            self.cache, self.mask, self.base_cache, self.base_ids = None, None, None, []
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
