"""The transformers engine's model calls and batch KV caches (the eager reference path).

`ModelRunner` owns the model, its lock and the prefix cache: the engine's batch decoding, scoring and
prefills go through `ModelRunner.forward`, and the batch-cache details (DynamicCache batch ops, holes,
hidden-state outputs) live in this module, token trees included (Lookahead Decoding verifies its tries in
these batches, as it does in the fast path's). The fast path's preallocated buffers are `static_kv.StaticKV`, which
also holds the one-sequence KV of SEED and the reference Lookahead decoder (`sequence_kv.SequenceKV`: the same lock,
the same prefix cache).

Prefix reuse. A prompt's KV cache is computed once and shared by every row decoded after it; the
last few prefixes are kept (LRU), and so is the KV of every one-sample step of the latest decoding
call on this runner (`DecodeBatch(keep_finished=True)`), so a growing chain (the decoding runtime) only
encodes its new tokens. Prefixes are token ids built from the steps' own ids
(`infer.engines.tokens.StepTokenizer.prefix_ids`), so a committed step is found again exactly.

`DecodeBatch` is the unit of decoding: rows with their own prefix, seed and token cap decode in one
batch, one forward per iteration, and rows can join a running batch (continuous batching).

Layout. The batch KV cache has one slot per row and a common set of columns. Every row knows which
column holds each of its prompt tokens (`cols`); columns a row does not use are *holes* (attention mask
0), and every row carries its own position ids, so rows of different lengths decode side by side with
no re-padding. A new row is not re-encoded from scratch:
- the *base* (the longest token prefix common to the rows the batch started with) is encoded once,
  through the prefix cache, and sits in columns 0..len(base)-1;
- a joining row copies the K/V columns of the row (or base) it shares the longest token prefix with
  (the KV of a token depends only on the tokens before it), and only its own tail is forwarded, into
  new columns (holes for every other row). The γ+1 prefixes of an LR batch are nested, so the longest
  is encoded once and the others add a token or two; an async row reuses the row before it.
Token speculation adds a few proposed tokens per row to each forward; the columns of rejected proposals
become holes. Chains (prompt lookup, an assistant) ride the causal mask; a forward where some row proposes a
tree or a side branch (Lookahead Decoding's trie and Jacobi window) gets a 4-D mask instead: each row's block
is laid out by `token_spec.block_layout` after its current token, the accepted path's columns stay and every
other block column becomes a hole. Each row has its own proposer (`Proposer.fork`). Columns no row uses any
more are dropped from time to time (`_compact`).

Sampling. Each row draws from its own generator, one uniform per token by inverting the CDF of its own
distribution (`token_spec.draw_tokens`), so which random numbers a row uses never depends on the other
rows. The logits themselves come from batched kernels: rows of different batches agree up to
floating-point rounding, not bit for bit.
"""
from __future__ import annotations

import copy
import inspect
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specprobe.infer.engines.base import EngineStats, PromptTooLongError, SamplingParams, ScoredStep, Step
from specprobe.infer.engines.token_spec import (
    DraftTree,
    block_layout,
    bounded_proposal,
    draw_tokens,
    drawn_rows,
    path_logprobs,
    verify_tree,
)
from specprobe.infer.engines.tokens import StepTokenizer


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


def packing_pays(prefix_len: int, lengths: Sequence[int]) -> bool:
    """Whether `ModelRunner.score_packed` (the steps end to end in one row) does no more attention work than
    `score_rows` (one right-padded row per step): T (P + T) against R w (P + w) query-key pairs for T packed tokens,
    R rows of width w and a prefix of P. Packing never encodes more tokens (no padding) and reads the prefix's KV
    once, so it wins with a long prefix or uneven steps; many equal steps after a short prefix attend to each other
    in vain, and keep the padded rows."""
    total, rows, width = sum(lengths), len(lengths), max(lengths)
    return total * (prefix_len + total) <= rows * width * (prefix_len + width)


def _not_plain(cache) -> str | None:
    """The first cache layer that is not a plain full-attention DynamicCache layer, by type name, or None."""
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            return type(layer).__name__
    return None


def check_plain_cache(cache, what: str) -> None:
    """Cropping and custom column layouts need plain full-attention DynamicCache layers."""
    layer = _not_plain(cache)
    if layer is not None:
        raise NotImplementedError(f"{what}: only plain DynamicCache layers are supported; this model uses "
                                  f"{layer} layers (sliding-window or compressed caches)")


def check_plain_attention(config, name: str) -> None:
    """ValueError, when the engine is built (from the model's config, before its weights load), for a model whose KV
    cache is not plain full attention (Mistral's or Gemma-2's sliding window): the engine crops, joins and keeps
    rows' caches, which such layers do not allow, so its first step would fail."""
    from transformers import DynamicCache

    try:
        layer = _not_plain(DynamicCache(config=config))
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read: left to the first forward
        return
    if layer is not None:
        raise ValueError(f"{name}: its attention keeps {layer} caches (a sliding window); the transformers engine "
                         "runs only models with plain full-attention layers. Use models.engine: vllm for it (with a "
                         "verifier that reads no hidden states: those come from a transformers engine), or a model "
                         "without a sliding window")


def clone_cache(cache):
    """Cheap copy of a DynamicCache: layers are copied, tensors shared. DynamicLayer.update and
    batch ops rebind (never write into) their tensors, so the original stays valid."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    return new


def cache_keyword(model) -> str:
    """The keyword a model's forward takes its KV cache by, read from its signature: transformers 5.24 takes
    `cache` and warns at `past_key_values` (to go in 5.40); 5.19 and the GPU box's 5.17 take `past_key_values`.
    Wrappers whose forward passes `**kwargs` on (PEFT's `get_base_model()`, DataParallel's `module`) are looked
    through; a torch.compile'd module is not (its model is private), so pass the model itself. Where no signature
    says, `past_key_values`: every release before 5.40 takes it (one that does not know `cache` would drop it
    silently into `**kwargs`)."""
    for _ in range(8):
        try:
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError, AttributeError):
            break
        if "cache" in params:
            return "cache"
        if "past_key_values" in params:
            return "past_key_values"
        base = getattr(model, "get_base_model", None)
        model = base() if callable(base) else getattr(model, "module", None)
        if model is None:
            break
    return "past_key_values"


def output_cache(out):
    """The KV cache a forward returned, by the output class's own field name (reading the other name of a 5.24
    output logs a deprecation)."""
    fields = getattr(out, "__dataclass_fields__", None) or out
    return out.get("cache") if "cache" in fields else out.get("past_key_values")


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


_MERGED_PREFIX_MAX = 64  # uncached prefix tokens score_chain encodes in the steps' forward


def _croppable(cache) -> bool:
    return all(getattr(layer, "is_croppable", False) for layer in getattr(cache, "layers", [None]))


class ModelRunner:
    """The model, a lock around its calls, and the prefix cache (see the module doc)."""

    def __init__(self, model, pad_id: int, prefix_cache_size: int = 4):
        self.model = model
        self.device = next(model.parameters()).device
        self.pad_id = pad_id
        self.cache_keyword = cache_keyword(model)
        self.lock = threading.RLock()
        self._prefix_cache: OrderedDict[tuple[int, ...], tuple[object, torch.Tensor]] = OrderedDict()
        self._prefix_cache_size = prefix_cache_size
        self._recent: dict[tuple[int, ...], tuple[object, torch.Tensor]] = {}  # finished rows of the last batch

    # ---------------------------------------------------------------- forward and prefix cache
    def forward(self, stats: EngineStats, cache=None, **kw):
        """One model call; `cache` goes in under the keyword this model's transformers takes (`cache_keyword`)."""
        if cache is not None:
            kw[self.cache_keyword] = cache
        with self.lock, torch.inference_mode():
            stats.forward_passes += 1
            return self.model(**kw)

    def clear(self) -> None:
        with self.lock:
            self._prefix_cache.clear()
            self._recent = {}

    def prefill(self, ids: list[int], stats: EngineStats):
        """KV cache (a private copy) and final logits of one prefix, reusing the longest cached prefix."""
        cache, _, logits = self.start(ids, stats, 0)
        return cache, logits

    def _entries(self):
        yield from self._recent.items()
        yield from self._prefix_cache.items()

    def _cached_prefix(self, key: tuple[int, ...], most: int | None = None):
        """(a private copy of the cached prefix sharing the most leading tokens with `key`, cut back to what they share
        and to at most `most` tokens; that count): at most len(key) - 1, as >= 1 new token gives the logits."""
        best, shared = None, 0
        most = len(key) - 1 if most is None else min(most, len(key) - 1)
        for cached, (cache, _) in self._entries():
            n = min(common_prefix_len([cached, key]), most)
            if n > shared and (n == len(cached) or _croppable(cache)):
                best, shared = cache, n
        if best is None:
            return None, 0
        cache = clone_cache(best)
        crop_cache(cache, shared)
        return cache, shared

    def _exact(self, key: tuple[int, ...], stats: EngineStats):
        """(a private copy of the cache, final logits) of `key` when it is cached whole, else None."""
        hit = self._prefix_cache.get(key) or self._recent.get(key)
        if hit is None:
            return None
        if key in self._prefix_cache:
            self._prefix_cache.move_to_end(key)
        stats.reused_prefix_tokens += len(key)
        return clone_cache(hit[0]), hit[1]

    def _remember(self, key: tuple[int, ...], cache, logits: torch.Tensor) -> None:
        self._prefix_cache[key] = (cache, logits)
        while len(self._prefix_cache) > self._prefix_cache_size:
            self._prefix_cache.popitem(last=False)

    def start(self, ids: Sequence[int], stats: EngineStats, leave: int):
        """(a private copy of a cache, the tokens of `ids` it lacks, final logits or None) for a forward that
        continues `ids`: the cache holds all of `ids` (encoded now in a prefill forward, and cached) unless at most
        `leave` tokens are missing; those the caller's own forward encodes (and counts), and the logits are None.
        A prefill forward costs a whole eager forward: on a GPU as much as tens of captured decode steps."""
        with self.lock:
            return self._start(tuple(ids), stats, leave)

    def _start(self, key: tuple[int, ...], stats: EngineStats, leave: int):
        hit = self._exact(key, stats)
        if hit is not None:
            return hit[0], [], hit[1]
        # the cached prefix sharing the most leading tokens, cut back to what they share
        cache, shared = self._cached_prefix(key)
        new = list(key[shared:])
        if len(new) <= leave:
            return cache, new, None
        cache, logits = self._encode(key, cache, shared, [len(key)], stats)
        return cache, [], logits[len(key)]

    def cached(self, ids: Sequence[int], most: int):
        """(a private copy of the cached prefix sharing the most leading tokens with `ids`, at most `most` of them, or
        None; that count): no forward (the caller encodes the rest, and counts what it reuses)."""
        with self.lock:
            return self._cached_prefix(tuple(ids), most)

    def prefill_ends(self, ids: Sequence[int], ends: Sequence[int], stats: EngineStats):
        """(a private copy of the cache of `ids`, {n: logits after ids[:n]}) for each n of `ends` that the forward
        reaches: one forward of what the prefix cache lacks (at least the last token), keeping the logits at those
        n only (the cached part it reuses ends before the first of them). Nested prefixes (a Lookahead batch's rows)
        thus cost one one-row forward of the longest."""
        with self.lock:
            key = tuple(ids)
            cache, shared = self._cached_prefix(key, min(ends) - 1)
            return self._encode(key, cache, shared, ends, stats)

    def _encode(self, key: tuple[int, ...], cache, shared: int, ends: Sequence[int], stats: EngineStats):
        """One forward of key[shared:] after `cache` (which holds key[:shared]), keeping the logits after key[:n]
        for each n of `ends` past `shared`; `key` is cached. (a private copy of its cache, {n: logits})."""
        wanted = sorted(n for n in set(ends) if shared < n <= len(key))
        stats.reused_prefix_tokens += shared
        stats.prefill_tokens += len(key) - shared
        # an int keeps the last position without an index kernel
        keep = 1 if wanted == [len(key)] else torch.tensor([n - shared - 1 for n in wanted], device=self.device)
        out = self.forward(stats, input_ids=torch.tensor([key[shared:]], device=self.device), cache=cache,
                           position_ids=torch.arange(shared, len(key), device=self.device)[None], use_cache=True,
                           logits_to_keep=keep)
        logits = {n: out.logits[0, i].float() for i, n in enumerate(wanted)}
        cache = output_cache(out)
        self._remember(key, cache, logits[len(key)])
        return clone_cache(cache), logits

    def keep_recent(self, rows: dict[tuple[int, ...], tuple[object, torch.Tensor]]) -> None:
        """Replace the finished rows kept from the last decoding call."""
        with self.lock:
            self._recent = rows

    # ---------------------------------------------------------------- greedy proposals (assistant)
    def greedy_continue(self, ids: list[int], k: int, eos_ids: set[int], stats: EngineStats) -> list[int]:
        """k greedy tokens after `ids`; stops early at EOS."""
        out: list[int] = []
        if k < 1:
            return out
        with self.lock:
            cache, logits = self.prefill(list(ids), stats)
            position = len(ids)
            while True:
                tok = int(logits.argmax(-1))
                out.append(tok)
                if len(out) >= k or tok in eos_ids:
                    return out
                inp = torch.tensor([[tok]], device=self.device)
                pos = torch.tensor([[position]], device=self.device)
                res = self.forward(stats, input_ids=inp, cache=cache, position_ids=pos, use_cache=True)
                stats.decode_tokens += 1
                cache, logits = output_cache(res), res.logits[0, -1]
                position += 1

    # ---------------------------------------------------------------- teacher forcing
    def score_rows(self, ids: list[int], chunk: list[list[int]], hidden: bool, chosen: list[int],
                   stats: EngineStats) -> list[ScoredStep]:
        """Each step of `chunk` teacher-forced after `ids`; the prefix cache is repeated across the rows
        (right-padded)."""
        cache, last_logits = self.prefill(ids, stats)
        rows, width = len(chunk), max(map(len, chunk))
        cache.batch_repeat_interleave(rows)
        inp = torch.full((rows, width), self.pad_id, device=self.device)
        mask = torch.zeros((rows, len(ids) + width), dtype=torch.long, device=self.device)
        mask[:, : len(ids)] = 1
        for r, s in enumerate(chunk):
            inp[r, : len(s)] = torch.tensor(s)
            mask[r, len(ids): len(ids) + len(s)] = 1
        pos = torch.arange(len(ids), len(ids) + width, device=self.device)[None].expand(rows, -1)
        out = self.forward(stats, input_ids=inp, cache=cache, attention_mask=mask, position_ids=pos,
                           use_cache=False, output_hidden_states=hidden)
        stats.prefill_tokens += int(sum(map(len, chunk)))
        # token t of a step is predicted by the position before it: the prefix's last logits for t = 0
        pred = torch.cat([last_logits[None, None].expand(rows, 1, -1), out.logits[:, :-1].float()], 1)
        lp = torch.log_softmax(pred, -1).gather(-1, inp[..., None]).squeeze(-1)
        hs = torch.stack([out.hidden_states[i] for i in chosen], 1).float() if hidden else None  # (rows, L, T, H)
        results = []
        for r, s in enumerate(chunk):
            n = len(s)
            mean = hs[r, :, :n].mean(1).cpu() if hidden else None
            last = hs[r, :, n - 1].cpu() if hidden else None
            results.append(ScoredStep(list(s), lp[r, :n].cpu(), mean, last))
        return results

    def score_packed(self, ids: list[int], chunk: list[list[int]], hidden: bool, chosen: list[int],
                     stats: EngineStats) -> list[ScoredStep]:
        """Each step of `chunk` teacher-forced after `ids`, all of them in ONE row: the steps are laid end to end,
        each at the positions it would have after the prefix and seeing the prefix and its own earlier tokens only
        (a 4-D mask). The prefix's KV is read once, not copied per step as `score_rows` does, nothing is padded,
        and the pooled hidden states and log-probabilities of every step are reduced on the device and copied to
        the host once (`score_rows` copies three tensors per step). The steps attend to each other's columns in
        vain, which `packing_pays` weighs. Needs plain full-attention cache layers (`check_plain_cache`)."""
        cache, last_logits = self.prefill(ids, stats)
        check_plain_cache(cache, "packed scoring")
        dev = self.device
        lengths = torch.tensor([len(s) for s in chunk], device=dev)
        total = int(sum(len(s) for s in chunk))
        starts = torch.cumsum(lengths, 0) - lengths
        owner = torch.repeat_interleave(torch.arange(len(chunk), device=dev), lengths, output_size=total)  # its step
        offset = torch.arange(total, device=dev) - starts[owner]  # its index inside its step
        inp = torch.tensor([[t for s in chunk for t in s]], device=dev)
        seen = torch.ones((total, len(ids) + total), dtype=torch.bool, device=dev)
        seen[:, len(ids):] = (owner[:, None] == owner[None, :]) & (offset[None, :] <= offset[:, None])
        dtype = next(self.model.parameters()).dtype
        out = self.forward(stats, input_ids=inp, cache=cache, use_cache=False,
                           attention_mask=additive_mask(seen, dtype), position_ids=(len(ids) + offset)[None],
                           output_hidden_states=hidden)
        stats.prefill_tokens += total
        # token t of a step is predicted by the position before it: the prefix's last logits for t = 0
        logits = out.logits[0].float()
        pred = torch.cat([last_logits[None].float(), logits[:-1]], 0)  # row i: the logits before packed token i
        pred = torch.where((offset == 0)[:, None], last_logits[None].float(), pred)
        lp = torch.log_softmax(pred, -1).gather(-1, inp[0, :, None]).squeeze(-1).cpu()
        means = lasts = None
        if hidden:
            hs = torch.stack([out.hidden_states[i][0] for i in chosen], 0).float()  # (L, T, H)
            # a step's mean as a product with its (steps, T) membership: deterministic on a GPU (index_add is not)
            member = (owner[None, :] == torch.arange(len(chunk), device=dev)[:, None]).float()
            means = (torch.matmul(member, hs) / lengths.float()[None, :, None]).transpose(0, 1).contiguous().cpu()
            lasts = hs[:, starts + lengths - 1].transpose(0, 1).contiguous().cpu()
        starts = starts.tolist()
        return [ScoredStep(list(s), lp[starts[r]:starts[r] + len(s)],
                           means[r] if hidden else None, lasts[r] if hidden else None)
                for r, s in enumerate(chunk)]

    def score_chain(self, ids: list[int], step_ids: list[list[int]], hidden: bool, chosen: list[int],
                    stats: EngineStats) -> list[ScoredStep]:
        """steps[0] ⊕ steps[1] ⊕ ... teacher-forced after `ids` in one pass. The prefix's uncached tokens go in
        the same forward as the steps (no separate prefill forward: on a GPU each eager forward costs its launches).
        A prefix with more than `_MERGED_PREFIX_MAX` uncached tokens gets its own prefill forward (the merged one
        would hold logits and hidden states for all of them). The whole chain's KV is cached (an entry of the
        prefix cache's few, holding the prefix's KV too): a later prefix through some of the steps (SemanticSpec's
        target writing the step after its accepted drafts, the next cycle's context) reuses it instead of encoding
        those steps again, in an eager join forward on the fast path. The prefix itself is cached as a prefill
        would cache it, with its logits, when this call encoded part of it."""
        flat = [t for s in step_ids for t in s]
        with self.lock:
            key = tuple(ids)
            cache, new, last_logits = self._start(key, stats, _MERGED_PREFIX_MAX)
            if new:  # encoded in this forward
                stats.reused_prefix_tokens += len(ids) - len(new)
                stats.prefill_tokens += len(new)
            inp = torch.tensor([new + flat], device=self.device)
            pos = torch.arange(len(ids) - len(new), len(ids) + len(flat), device=self.device)[None]
            out = self.forward(stats, input_ids=inp, cache=cache, position_ids=pos, use_cache=True,
                               output_hidden_states=hidden)
            k = len(new)  # the steps' columns start here
            if new:
                last_logits = out.logits[0, k - 1].float().clone()  # not a view keeping all the logits alive
            chain = output_cache(out)
            if _croppable(chain):  # (a shorter prefix crops it; a sliding window's cache cannot)
                if new:  # the prefix itself, exactly, with its logits (a view of the chain's tensors: no copy)
                    prefix_cache = clone_cache(chain)
                    crop_cache(prefix_cache, len(ids))
                    self._remember(key, prefix_cache, last_logits)
                self._remember(key + tuple(flat), chain, out.logits[0, -1].float().clone())
        stats.prefill_tokens += len(flat)
        pred = torch.cat([last_logits[None], out.logits[0, k:-1].float()], 0)
        lp = torch.log_softmax(pred, -1).gather(-1, inp[0, k:, None]).squeeze(-1)
        hs = torch.stack([out.hidden_states[i][0, k:] for i in chosen], 0).float() if hidden else None  # (L, T, H)
        results, offset = [], 0
        for s in step_ids:
            sl = slice(offset, offset + len(s))
            mean = hs[:, sl].mean(1).cpu() if hidden and s else None
            last = hs[:, offset + len(s) - 1].cpu() if hidden and s else None
            results.append(ScoredStep(list(s), lp[sl].cpu(), mean, last))
            offset += len(s)
        return results


def block_inputs(rows: Sequence[tuple[int, int, int, tuple[list[int], torch.Tensor, torch.Tensor]]], n: int,
                 pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new columns of a verification forward (either decode path), for `rows` of (batch row or slot, current
    token, its position, its `token_spec.block_layout`) among n: input ids and position ids (n, width), and the
    block's attention (n, width, width) bool: every query sees its row's current token (padding queries and
    unlisted slots too: no query sees nothing), block tokens see the block columns `allowed` gives them. width:
    1 + the longest block."""
    width = 1 + max((len(b[0]) for *_, b in rows), default=0)
    inp = torch.full((n, width), pad, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    block = torch.zeros((n, width, width), dtype=torch.bool)
    block[:, :, 0] = True
    for i, current, cur_pos, (tokens, allowed, positions) in rows:
        b = len(tokens)
        inp[i, 0], pos[i] = current, cur_pos
        if b:
            inp[i, 1:1 + b], pos[i, 1:1 + b] = torch.tensor(tokens), positions
            block[i, 1:1 + b, 1:1 + b] = allowed
    return inp, pos, block


def check_row_specs(specs: Sequence[RowSpec], running_keys: Sequence[Hashable], max_length: int | None) -> None:
    """Rows about to join a batch (either decode path): unique keys, a prompt, a cap, room in the context window."""
    keys = [s.key for s in specs] + list(running_keys)
    if len(set(keys)) != len(keys):
        raise ValueError("row keys must be unique within a batch")
    for s in specs:
        if s.cap < 1:
            raise ValueError(f"row {s.key!r}: token cap must be >= 1, got {s.cap}")
        if not s.ids:
            raise ValueError(f"row {s.key!r}: empty prompt (no tokens)")
        if max_length and len(s.ids) + s.cap > max_length:
            raise PromptTooLongError(
                f"row {s.key!r}: prompt plus one step has {len(s.ids) + s.cap} tokens, more than the "
                f"context window ({max_length}); shorten the prompt or lower the number of steps kept in it")


@dataclass
class RowSpec:
    """One row to decode: `key` identifies it in the results."""

    key: Hashable
    ids: list[int]
    cap: int
    seed: int | None = None
    keep: bool = False  # keep its KV when it finishes (a step the caller may continue)


@dataclass(eq=False)  # rows are compared by identity
class _Row:
    key: Hashable
    ids: list[int]
    cap: int
    generator: torch.Generator | None
    keep: bool = False
    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0
    pos: int = 0  # position id of the next token fed to the model (= pending token)
    cols: list[int] = field(default_factory=list)  # cache column of each prompt token
    gen_cols: list[int] = field(default_factory=list)  # cache column of each generated token fed so far
    donor: _Row | None = None  # row whose columns it copies at join time (None: the base)
    share: int = 0  # prompt tokens taken from the donor / base instead of being forwarded
    proposer: Any = None  # its own token proposer (`token_spec.Proposer.fork`), None without speculation


class RowBatch:
    """What both decode paths' batches share: `rows` (each with a `key`, its tokens and its proposer), `step()`,
    and these."""

    rows: list
    stats: EngineStats
    spec_tokens: int = 0
    max_length: int | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def keys(self) -> list[Hashable]:
        return [r.key for r in self.rows]

    def run(self) -> dict[Hashable, Step]:
        """Step until every row is done."""
        results: dict[Hashable, Step] = {}
        while self.rows:
            results.update(self.step())
        return results

    def step(self) -> list[tuple[Hashable, Step]]:
        raise NotImplementedError

    def _take_path(self, row, tree: DraftTree, chunk: list[int], nodes: list[int], col0: int) -> list[int]:
        """Book a verified path (`verify_tree`'s tokens and nodes) of a row whose block started at column `col0`:
        its position, the columns of the tokens it fed (the current token, then the accepted nodes) and the
        speculation counts. Returns those columns' offsets in the block (0: the current token)."""
        kept = [0] + [1 + u for u in nodes[:-1]]
        row.gen_cols.extend(col0 + k for k in kept)
        row.pos += len(chunk)
        if len(tree):
            self.stats.spec_rounds += 1
            self.stats.spec_proposed += len(tree)
            self.stats.spec_accepted += len(chunk) - 1
        return kept

    def _append_path(self, row, chunk: list[int], nodes: list[int], logprobs: Sequence[float],
                     logits: torch.Tensor) -> Step | None:
        """Append a verified path's tokens (with their log-probabilities; logits: the row's block, row 0 after
        the current token, u + 1 after node u); returns the row's Step when it finishes on the way, keeping the
        logits its last token was drawn from (a copy: a view would keep every row's logits alive)."""
        for tok, lp, drawn in zip(chunk, logprobs, drawn_rows(nodes)):
            done = self._append(row, tok, lp)
            if done is not None:
                self._export(row, logits[drawn].float().clone())
                return done
        return None

    def _proposals(self) -> list[DraftTree]:
        """Each row's token proposal for this iteration (an empty tree without a proposer): at most as deep as
        the spec budget and the row's remaining cap allow (`token_spec.bounded_proposal`)."""
        return [bounded_proposal(r.proposer, r.ids + r.tokens, min(self.spec_tokens, r.cap - len(r.tokens) - 1),
                                 r.pos, self.max_length, self.stats) if r.proposer is not None else DraftTree()
                for r in self.rows]


class DecodeBatch(RowBatch):
    """Decode one step for each of several rows, one forward per iteration.

    Use `add` (any time), `step` (one iteration; returns the rows that finished in it), `remove`
    (cancel rows) or `run` (until every row is done). Not thread-safe: one thread drives a batch.
    """

    def __init__(self, runner: ModelRunner, text: StepTokenizer, params: SamplingParams, *,
                 max_length: int | None = None, proposer=None, spec_tokens: int = 0):
        self.runner, self.text, self.params = runner, text, params
        self.max_length = max_length
        self.proposer, self.spec_tokens = proposer, spec_tokens if proposer is not None else 0
        self.stats = EngineStats()
        # KV (prompt + step) of finished rows with `keep`: the runner keeps them so that the next prefix
        # that continues one of these steps is not encoded again
        self.finished_kv: dict[tuple[int, ...], tuple[Any, torch.Tensor]] = {}
        self.rows: list[_Row] = []
        self.cache = None
        self.mask: torch.Tensor | None = None  # (rows, cache columns) long
        self.base_ids: list[int] = []
        self.base_cache = None  # 1-row cache of base_ids, the prefix shared by the rows the batch began with
        self.base_logits: torch.Tensor | None = None
        self.ncols = 0  # columns of the batch cache
        self.device = runner.device
        self.shared_tokens = 0  # prompt tokens copied from another row instead of being encoded

    # ------------------------------------------------------------------ public API
    def add(self, specs: Sequence[RowSpec]) -> list[tuple[Hashable, Step]]:
        """Add rows; returns rows that finished at once (e.g. their first token is EOS or cap == 1)."""
        specs = list(specs)
        if not specs:
            return []
        check_row_specs(specs, [r.key for r in self.rows], self.max_length)
        with torch.inference_mode():
            creating = not self.rows
            if creating:
                self._new_base([s.ids for s in specs])
            new_rows = []
            for s in specs:
                gen = torch.Generator(device="cpu").manual_seed(s.seed) if s.seed is not None else None
                proposer = self.proposer.fork(s.seed) if self.proposer is not None else None
                new_rows.append(_Row(s.key, list(s.ids), s.cap, gen, s.keep, pos=len(s.ids), proposer=proposer))
            first_logits: dict[int, torch.Tensor] = {}
            for wave in self._plan(new_rows, creating):
                first_logits.update(self._join_wave(wave))
            self.stats.iterations += 1
            self.stats.row_iterations += len(new_rows)
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
        trees = self._proposals()
        chains = all(t.is_chain for t in trees)
        with torch.inference_mode():
            logits, width = (self._forward_chains if chains else self._forward_trees)(trees)
            new_mask = torch.zeros((len(self.rows), width), dtype=torch.long)
            finished = []
            for i, (r, tree) in enumerate(zip(self.rows, trees)):
                t = len(tree)
                if tree.side is not None:
                    r.proposer.observe(tree, logits[i, 1 + t:1 + t + len(tree.side.tokens)])
                row_logits = logits[i, :1 + t]  # row 0: after the current token, u + 1: after node u
                chunk, nodes = verify_tree(tree, row_logits, self.params.temperature, self.params.top_p, r.generator)
                # rejected proposals and side branches become holes
                new_mask[i, self._take_path(r, tree, chunk, nodes, self.ncols)] = 1
                done = self._append_path(r, chunk, nodes, path_logprobs(chunk, nodes, row_logits), row_logits)
                if done is not None:
                    finished.append((r, done))
            if not chains:  # columns after the last one any row kept are holes for all (side branches too): crop
                width = int(new_mask.nonzero()[:, 1].max()) + 1
                crop_cache(self.cache, self.ncols + width)
                new_mask = new_mask[:, :width]
            self.mask = torch.cat([self.mask, new_mask], 1)
            self.ncols += width
            self.stats.iterations += 1
            self.stats.row_iterations += len(self.rows)
            self._drop([r for r, _ in finished])
            self._compact()
        return [(r.key, s) for r, s in finished]

    # ------------------------------------------------------------------ internals
    def _forward_chains(self, trees: list[DraftTree]) -> tuple[torch.Tensor, int]:
        """Every row's current token and chain proposal in one causal run of new columns (a 2-D mask)."""
        width = 1 + max(len(t) for t in trees)
        rows = len(self.rows)
        inp = torch.full((rows, width), self.runner.pad_id, dtype=torch.long)
        fed = torch.zeros((rows, width), dtype=torch.long)
        pos = torch.zeros((rows, width), dtype=torch.long)
        for i, (r, tree) in enumerate(zip(self.rows, trees)):
            inp[i, 0] = r.tokens[-1]
            if len(tree):
                inp[i, 1:1 + len(tree)] = torch.tensor(tree.tokens)
            fed[i, :1 + len(tree)] = 1
            pos[i] = torch.arange(r.pos, r.pos + width)
        attn = torch.cat([self.mask, fed], 1)
        out = self.runner.forward(self.stats, input_ids=inp.to(self.device), cache=self.cache,
                                  attention_mask=attn.to(self.device), position_ids=pos.to(self.device), use_cache=True)
        self.cache = output_cache(out)
        self.stats.decode_tokens += int(fed.sum())
        return out.logits.float(), width

    def _forward_trees(self, trees: list[DraftTree]) -> tuple[torch.Tensor, int]:
        """Every row's current token, then its block (`block_layout`: tree, side branch), under a 4-D mask over
        the batch columns (a row whose proposal is a chain gets a chain-shaped tree)."""
        check_plain_cache(self.cache, "tree attention in a batch (Lookahead Decoding)")
        blocks = [block_layout(t, r.pos) for r, t in zip(self.rows, trees)]
        inp, pos, block = block_inputs([(i, r.tokens[-1], r.pos, b) for i, (r, b) in enumerate(zip(self.rows, blocks))],
                                       len(self.rows), self.runner.pad_id)
        width = inp.shape[1]
        seen = torch.cat([self.mask.bool()[:, None, :].expand(-1, width, -1), block], 2)  # its columns, its block
        dtype = next(self.runner.model.parameters()).dtype
        out = self.runner.forward(self.stats, input_ids=inp.to(self.device), cache=self.cache,
                                  attention_mask=additive_mask(seen, dtype).to(self.device),
                                  position_ids=pos.to(self.device), use_cache=True)
        self.cache = output_cache(out)
        self.stats.decode_tokens += sum(1 + len(b[0]) for b in blocks)
        return out.logits.float(), width

    def _new_base(self, ids_list: list[list[int]]) -> None:
        """A fresh batch: encode the prefix common to its first rows once (engine prefix cache)."""
        lcp = common_prefix_len(ids_list)
        self.base_ids = list(ids_list[0][:lcp])
        if lcp:
            cache, logits = self.runner.prefill(self.base_ids, self.stats)
            self.base_cache, self.base_logits = cache, logits
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
        old_cols = self.ncols
        tails = [r.ids[r.share:] for r in rows]
        m = max(len(t) for t in tails)
        cache = self._shared_columns(rows) if old_cols else None
        mask = torch.zeros((len(rows), old_cols + m), dtype=torch.long)
        for i, r in enumerate(rows):
            shared = list(range(r.share)) if r.donor is None else list(r.donor.cols[:r.share])
            mask[i, shared] = 1
            r.cols = shared
            if r.donor is not None:
                self.shared_tokens += r.share
                self.stats.reused_prefix_tokens += r.share
        logits: dict[int, torch.Tensor] = {}
        if m:
            cache = self._forward_tails(rows, tails, m, cache, mask, logits)
        for r, t in zip(rows, tails):
            if not t:
                logits[id(r)] = self.base_logits
            r.donor = None  # do not keep other rows alive
        self._merge_wave(cache, mask, m)
        self.rows.extend(rows)
        self.ncols = old_cols + m
        return logits

    def _shared_columns(self, rows: list[_Row]):
        """The wave's own cache: the shared columns of every row (the base's, or its donor row's), copied into
        fresh slots."""
        n, old_cols = len(rows), self.ncols
        template = self.cache if self.cache is not None else self.base_cache
        if n == 1 and self.cache is None and rows[0].donor is None and rows[0].share == len(self.base_ids):
            return clone_cache(self.base_cache)  # the common single-row case: no copying at all
        check_plain_cache(template, "rows joining a running batch")
        cache = clone_cache(template)
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
        return cache

    def _forward_tails(self, rows: list[_Row], tails: list[list[int]], m: int, cache, mask: torch.Tensor,
                       logits: dict[int, torch.Tensor]):
        """Forward the rows' own tails (at most m tokens) into the m new columns after the batch's (marked in
        `mask`, appended to each row's `cols`); the first logits of each row with a tail go into `logits`; returns
        the cache."""
        n, old_cols = len(rows), self.ncols
        right = all(r.share > 0 for r in rows)  # a left hole needs something visible to its query
        inp = torch.full((n, m), self.runner.pad_id, dtype=torch.long)
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
        out = self.runner.forward(self.stats, input_ids=inp.to(self.device), cache=cache,
                                  attention_mask=mask.to(self.device), position_ids=pos.to(self.device),
                                  use_cache=True, **({"logits_to_keep": 1} if right else {}))
        self.stats.prefill_tokens += sum(len(t) for t in tails)
        for i, (r, t) in enumerate(zip(rows, tails)):
            if t:
                logits[id(r)] = out.logits[i, -1 if right else len(t) - 1].float()
        return output_cache(out)

    def _merge_wave(self, cache, mask: torch.Tensor, m: int) -> None:
        """Append the wave's slots to the batch: the old rows get holes where the wave's tails went."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                old, new = getattr(old_layer, name), getattr(new_layer, name)
                if m:
                    old = torch.cat([old, old.new_zeros(old.shape[:2] + (m,) + old.shape[3:])], 2)
                setattr(old_layer, name, torch.cat([old, new], 0))
        self.mask = torch.cat([torch.cat([self.mask, torch.zeros((len(self.rows), m), dtype=torch.long)], 1),
                               mask], 0)

    def _export(self, row: _Row, logits: torch.Tensor) -> None:
        """Keep a finished row's KV of prompt + step (all but the last token, which was never fed) as a
        1-row cache, with the logits its last token was drawn from."""
        if not row.keep or self.cache is None:
            return
        check_plain_cache(self.cache, "keeping a finished row's KV")
        slot = next(i for i, r in enumerate(self.rows) if r is row)
        fed = len(row.tokens) - 1
        idx = torch.tensor(row.cols + row.gen_cols[:fed], dtype=torch.long, device=self.device)
        cache = clone_cache(self.cache)
        for layer in cache.layers:
            layer.keys = layer.keys[slot:slot + 1].index_select(2, idx)
            layer.values = layer.values[slot:slot + 1].index_select(2, idx)
        self.finished_kv[tuple(row.ids + row.tokens[:fed])] = (cache, logits.float())

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
        check_plain_cache(self.cache, "dropping unused batch columns")
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
        return draw_tokens(proposal, logits, self.params.temperature, self.params.top_p, row.generator)

    def _append(self, row: _Row, tok: int, logprob: float) -> Step | None:
        """Add one token to a row; returns its Step when the row is finished."""
        row.tokens.append(int(tok))
        row.logprob += logprob
        step = self.text.make_step(row.tokens, row.logprob, row.cap, self.params.delimiter)
        if step is not None:
            self.stats.generated_tokens += step.num_tokens
        return step

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


