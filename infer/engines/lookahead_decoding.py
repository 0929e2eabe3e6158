"""Lookahead Decoding: exact, draft-free token-level parallel decoding.

Every forward pass of the target carries three parts after the cached context, in this order:
1. the committed tokens not yet in the KV cache (at least the last one, the "current" token);
2. the verification branch: up to G pool (N−1)-grams that continue the current token, merged into a trie
   (`token_spec.DraftTree.trie`: candidates sharing a prefix share its tokens) and attended as a tree after
   the context;
3. the lookahead branch (`JacobiProposer`'s side branch, last so that a batch crops it with the rejected
   candidates): a 2-D window of N−1 levels × W columns from past Jacobi iterations. Level 0
   (oldest) is a causal guess sequence at positions cur+1..cur+W; level l, column j sits at position
   cur+1+j+l and sees level 0 up to column j plus levels 1..l−1 of column j. The output of the top level
   at column j is a new guess; (level 0 [j], level 1 [j], ..., new [j]) is an N-gram for the pool. Then
   the oldest level is dropped and the new guesses become the top level (during the first N−2 steps the
   window only grows). The branch is always greedy (the paper's choice: its n-grams are deterministic
   proposals, so the sampling rule needs no draft distribution).
Masks are 4-D additive float masks with explicit position ids (`token_spec.block_layout`), so the one pass
computes for every branch what a plain forward of that path computes (up to floating-point differences
between kernels).

Verification is the one rule of every token proposer (`token_spec.verify_tree`; their Alg. 3 / Alg. 4 on the
trie): greedy accepts the longest candidate prefix that equals the target's argmax, plus one token; sampling
tries the candidates that continue the accepted path in order, accepting s with probability P(s) and
removing it from P on rejection. Every output token is distributed as the target's (Theorem A of the paper),
because each proposal is deterministic.

Two drivers of one proposer (`JacobiProposer`: the window, the pool, their trie and side branch):
- the transformers engine's batches (`HFStepEngine.with_token_spec(TokenSpecConfig("lookahead"))`, each row its
  own window and pool, rows verified side by side in one forward): what the runtime and probe-bench use;
- `LookaheadDecoder.generate`, one sequence on a `SequenceKV` with token ids in, token ids and the paper's
  counters (compression ratio S) out: the reference on raw models, with no tokenizer or step rule.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch

from specprobe.infer.engines.base import EngineStats
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import (
    DraftTree,
    LookaheadConfig,
    SideBranch,
    block_layout,
    path_logprobs,
    verify_tree,
)


# ----------------------------------------------------------------------------- n-gram pool
class NgramPool:
    """Lookahead Decoding's n-gram pool: n-grams keyed by their first token; per key at most `per_key`
    continuations, newest kept; `propose` offers up to `candidates` of them (G) as a trie."""

    def __init__(self, per_key: int, candidates: int | None = None):
        self.per_key = per_key
        self.candidates = per_key if candidates is None else candidates
        self._pool: dict[int, OrderedDict] = {}

    def add(self, ngram: Sequence[int]) -> None:
        key, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        bucket = self._pool.setdefault(key, OrderedDict())
        bucket.pop(rest, None)
        bucket[rest] = None
        while len(bucket) > self.per_key:
            bucket.popitem(last=False)

    def lookup(self, token: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations of `token`, newest first."""
        bucket = self._pool.get(int(token))
        if not bucket or limit < 1:
            return []
        return [list(c) for c in reversed(bucket)][:limit]

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> DraftTree:
        """The newest continuations of the context's last token, cut to k tokens, as a trie (no model work)."""
        return DraftTree.trie([c[:k] for c in self.lookup(context[-1], self.candidates)])

    def __len__(self) -> int:
        return sum(len(b) for b in self._pool.values())


# ----------------------------------------------------------------------------- the proposer
@lru_cache(maxsize=64)  # one pattern per window size, asked for by every row at every forward
def window_branch(levels: int, window: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(allowed (levels * window,) * 2, offsets) of the Jacobi window, level-major: level l, column j sits at
    offset 1 + j + l after the current token and sees level 0 up to column j and levels 1..l of column j.
    The tensor is shared: callers copy it, never modify it."""
    m = levels * window
    allowed = torch.zeros((m, m), dtype=torch.bool)
    offsets = []
    for level in range(levels):
        for j in range(window):
            r = level * window + j
            offsets.append(1 + j + level)
            allowed[r, :j + 1] = True  # level 0 up to column j
            allowed[r, [lv * window + j for lv in range(1, level + 1)]] = True  # same column, levels 1..level
    return allowed, tuple(offsets)


class JacobiProposer:
    """Lookahead Decoding as a token proposer, for one sequence: `propose` returns the pool's n-grams that
    continue the context's last token (a trie) with the Jacobi window beside it (`token_spec.SideBranch`);
    `observe` reads the target's greedy outputs on the window, emits the full columns' n-grams into the pool and
    slides the window. The window starts from random prompt tokens (`generator`); `fork(seed)` gives the next
    sequence its own window and pool."""

    def __init__(self, cfg: LookaheadConfig | None = None, generator: torch.Generator | None = None,
                 prompt_pool: bool = False):
        self.cfg = cfg or LookaheadConfig()
        self.generator = generator if generator is not None else torch.Generator().manual_seed(self.cfg.seed)
        self.prompt_pool = prompt_pool
        self.pool = NgramPool(max(self.cfg.guesses, 1), self.cfg.guesses)
        self.levels: list[list[int]] | None = None

    def fork(self, seed: int | None) -> JacobiProposer:
        """A fresh window and pool for one sequence. Its window's random start must not reuse the random numbers
        that accept or reject this sequence's candidates (the row's own generator, seeded with `seed`), so the
        seed is mixed first (one LCG step)."""
        mixed = (int(self.cfg.seed if seed is None else seed) * 6364136223846793005 + 1442695040888963407) % 2**63
        return JacobiProposer(self.cfg, torch.Generator().manual_seed(mixed), self.prompt_pool)

    def start(self, context: Sequence[int]) -> None:
        """Begin a sequence: the window's first level from random context tokens (and the prompt's n-grams in the
        pool with `prompt_pool`); `propose` calls it on a fresh proposer."""
        if self.prompt_pool:  # the paper's "prompt as reference" option
            for s in range(len(context) - self.cfg.ngram + 1):
                self.pool.add(context[s:s + self.cfg.ngram])
        pick = torch.randint(len(context), (self.cfg.window,), generator=self.generator)
        self.levels = [[int(context[int(i)]) for i in pick]]

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> DraftTree:
        """Pool candidates cut to k tokens, beside the window (no model work)."""
        if self.levels is None:
            self.start(context)
        trie = self.pool.propose(context, k)
        allowed, offsets = window_branch(len(self.levels), self.cfg.window)
        return replace(trie, side=SideBranch(tuple(t for lv in self.levels for t in lv), allowed, offsets))

    def observe(self, tree: DraftTree, side_logits: torch.Tensor) -> None:
        """New greedy guesses from the top level; full windows emit one N-gram per column and slide."""
        w, levels = self.cfg.window, self.levels
        top = side_logits[(len(levels) - 1) * w:].argmax(-1).tolist()
        if len(levels) < self.cfg.ngram - 1:
            self.levels = levels + [top]
            return
        for j in range(w):
            self.pool.add([lv[j] for lv in levels] + [top[j]])
        self.levels = levels[1:] + [top]


# ----------------------------------------------------------------------------- decoder
@dataclass
class LookaheadStats:
    forward_passes: int = 0  # decoding steps (the prompt's prefill not counted)
    prefill_passes: int = 0  # forwards that encoded the prompt (0 when a cached prefix held it)
    tokens: int = 0
    proposed: int = 0  # candidate tokens sent to verification
    accepted: int = 0  # candidate tokens accepted (the extra token per step not counted)
    steps_with_candidates: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    logprob: float = 0.0  # of the generated tokens under the model's unmodified distribution

    @property
    def compression(self) -> float | None:
        """The paper's step compression ratio S: generated tokens / decoding steps."""
        return self.tokens / self.forward_passes if self.forward_passes else None


class LookaheadDecoder:
    """Lookahead Decoding of one sequence at a time on a transformers model's `SequenceKV`; the cache of
    the previous call is reused for the prefix it shares with the next (consecutive steps of one answer)."""

    def __init__(self, kv: SequenceKV, cfg: LookaheadConfig | None = None):
        self.kv, self.cfg = kv, cfg or LookaheadConfig()

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Callable[[list[int]], bool] | None = None,
                 seed: int | None = None, prompt_pool: bool = False) -> tuple[list[int], LookaheadStats]:
        """Generate up to max_new_tokens after prompt_ids; `stop(tokens)` ends generation early once true
        (checked after every appended token, so the output is cut exactly where plain decoding stops).
        temperature 0 is greedy; otherwise tokens follow filtered_probs(temperature, top_p)."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("lookahead decoding needs a non-empty prompt")
        cfg = self.cfg
        gen = torch.Generator().manual_seed(int(seed if seed is not None else cfg.seed))
        proposer = JacobiProposer(cfg, gen, prompt_pool)  # one generator: the window's start, then the draws
        proposer.start(ids)  # draws the window's start before any verification draw
        stats = LookaheadStats()
        before = self.kv.prefill_passes
        self.kv.start(ids)
        stats.prefill_passes = self.kv.prefill_passes - before
        out: list[int] = []
        while len(out) < max_new_tokens:
            tree = proposer.propose(ids, cfg.ngram - 1)
            block, allowed, pos = block_layout(tree, len(ids) - 1)
            cur, logits = self.kv.forward(ids, block, allowed, pos)
            self.kv.drop_speculative()  # accepted tokens are re-fed as committed tokens next pass
            stats.forward_passes += 1
            proposer.observe(tree, logits[len(tree):])
            rows = torch.cat([cur[None], logits[:len(tree)]])  # row 0: after the current token; i + 1: after node i
            chunk, nodes = verify_tree(tree, rows, temperature, top_p, gen)
            if len(tree):
                stats.steps_with_candidates += 1
                stats.proposed += len(tree)
            for i, (t, lp) in enumerate(zip(chunk, path_logprobs(chunk, nodes, rows))):
                stats.logprob += lp
                out.append(t)
                ids.append(t)
                if len(out) >= max_new_tokens or (stop is not None and stop(out)):
                    self._count_accepted(stats, chunk, i + 1)
                    stats.tokens = len(out)
                    return out, stats
            self._count_accepted(stats, chunk, len(chunk))
        stats.tokens = len(out)
        return out, stats

    @staticmethod
    def _count_accepted(stats: LookaheadStats, chunk: list[int], used: int) -> None:
        """Proposal tokens among the `used` tokens of a chunk that were kept (a stop may cut a chunk)."""
        accepted = min(used, len(chunk) - 1)
        stats.accepted += accepted
        stats.accepted_per_step.append(accepted)
