"""Lookahead Decoding: exact, draft-free token-level parallel decoding.

Every forward pass of the target carries three parts after the cached context:
1. the committed tokens not yet in the KV cache (at least the last one, the "current" token);
2. the lookahead branch: a 2-D window of N−1 levels × W columns from past Jacobi iterations. Level 0
   (oldest) is a causal guess sequence at positions cur+1..cur+W; level l, column j sits at position
   cur+1+j+l and sees level 0 up to column j plus levels 1..l−1 of column j. The output of the top level
   at column j is a new guess; (level 0 [j], level 1 [j], ..., new [j]) is an N-gram for the pool. Then
   the oldest level is dropped and the new guesses become the top level (during the first N−2 steps the
   window only grows). The branch is always greedy (the paper's choice: its n-grams are deterministic
   proposals, so the sampling rule needs no draft distribution);
3. the verification branch: up to G pool (N−1)-grams that continue the current token, merged into a trie
   (`token_spec.DraftTree.trie`: candidates sharing a prefix share its tokens) and attended as a tree after
   the context.
Masks are 4-D additive float masks with explicit position ids (`sequence_kv.SequenceKV`), so the one pass
computes for every branch what a plain forward of that path computes (up to floating-point differences
between kernels).

Verification is the one rule of every token proposer (`token_spec.verify_tree`; their Alg. 3 / Alg. 4 on the
trie): greedy accepts the longest candidate prefix that equals the target's argmax, plus one token; sampling
tries the candidates that continue the accepted path in order, accepting s with probability P(s) and
removing it from P on rejection. Every output token is distributed as the target's (Theorem A of the paper),
because each proposal is deterministic.

`LookaheadDecoder.generate` is the whole API: token ids in, token ids and counters out.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER, EngineStats, Generation, SerialStream, sample_seed
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import DraftTree, verify_tree


@dataclass(frozen=True)
class LookaheadConfig:
    """Window W, n-gram size N, verification candidates G (the paper: W = 15, N = 5, G = W for a 7B model
    on an A100; smaller windows suit smaller accelerators, as its Table 1 shows)."""

    window: int = 15
    ngram: int = 5
    max_verify: int | None = None  # G; None means G = W
    seed: int = 0  # initial window guesses are drawn from the prompt with this seed

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"lookahead window W must be >= 1, got {self.window}")
        if self.ngram < 2:
            raise ValueError(f"lookahead n-gram size N must be >= 2, got {self.ngram}")
        if self.max_verify is not None and self.max_verify < 0:
            raise ValueError(f"lookahead max_verify G must be >= 0, got {self.max_verify}")

    @property
    def guesses(self) -> int:
        return self.window if self.max_verify is None else self.max_verify


# ----------------------------------------------------------------------------- n-gram pool
class NgramPool:
    """Lookahead Decoding's proposer: n-grams keyed by their first token; per key at most `per_key`
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


# ----------------------------------------------------------------------------- one forward's layout
def lookahead_layout(levels: int, window: int, tree: DraftTree, cur_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed (m, m) bool, position ids (m,)) of the speculative block of one forward: `levels` × `window`
    lookahead tokens (level-major), then the verification trie's nodes. The block sees the whole committed
    context besides (`sequence_kv.forward_layout`); cur_pos is the position of the current token."""
    n_look = levels * window
    m = n_look + len(tree)
    allowed = torch.zeros((m, m), dtype=torch.bool)
    pos = torch.empty(m, dtype=torch.long)

    def col(level: int, j: int) -> int:  # column of lookahead token (level, j)
        return level * window + j

    for level in range(levels):
        for j in range(window):
            r = col(level, j)
            pos[r] = cur_pos + 1 + j + level
            allowed[r, [col(0, c) for c in range(j + 1)]] = True  # level 0 up to column j
            allowed[r, [col(lv, j) for lv in range(1, level + 1)]] = True  # same column, levels 1..level
    if len(tree):
        allowed[n_look:, n_look:] = tree.ancestry()
        pos[n_look:] = torch.tensor([cur_pos + d for d in tree.depths()])
    return allowed, pos


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
        pool = NgramPool(max(cfg.guesses, 1), cfg.guesses)
        if prompt_pool:  # the paper's "prompt as reference" option
            for s in range(len(ids) - cfg.ngram + 1):
                pool.add(ids[s:s + cfg.ngram])
        pick = torch.randint(len(ids), (cfg.window,), generator=gen)
        levels: list[list[int]] = [[ids[int(i)] for i in pick]]
        stats = LookaheadStats()
        before = self.kv.prefill_passes
        self.kv.start(ids)
        stats.prefill_passes = self.kv.prefill_passes - before
        out: list[int] = []
        while len(out) < max_new_tokens:
            tree = pool.propose(ids, cfg.ngram - 1)
            allowed, pos = lookahead_layout(len(levels), cfg.window, tree, len(ids) - 1)
            cur, block = self.kv.forward(ids, [t for lv in levels for t in lv] + list(tree.tokens), allowed, pos)
            self.kv.drop_speculative()  # accepted tokens are re-fed as committed tokens next pass
            stats.forward_passes += 1
            n_look = len(levels) * cfg.window
            levels = self._advance_window(levels, block[:n_look], pool)
            rows = torch.cat([cur[None], block[n_look:]])  # row 0: after the current token; i + 1: after node i
            chunk, nodes = verify_tree(tree, rows, temperature, top_p, gen)
            if len(tree):
                stats.steps_with_candidates += 1
                stats.proposed += len(tree)
            prev = -1
            for i, (t, node) in enumerate(zip(chunk, nodes)):
                stats.logprob += float(torch.log_softmax(rows[prev + 1], -1)[t])
                prev = node
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

    def _advance_window(self, levels: list[list[int]], look_logits: torch.Tensor, pool: NgramPool) -> list[list[int]]:
        """New greedy guesses from the top level; full windows emit one N-gram per column and slide."""
        w = self.cfg.window
        top = look_logits[(len(levels) - 1) * w:].argmax(-1).tolist()
        if len(levels) < self.cfg.ngram - 1:
            return levels + [top]
        for j in range(w):
            pool.add([lv[j] for lv in levels] + [top[j]])
        return levels[1:] + [top]


# ----------------------------------------------------------------------------- step engine
class LookaheadStepEngine:
    """A StepEngine whose steps are written by Lookahead Decoding on another engine's transformers model.

    Generation goes through the interface (`generate`, `open_stream` via SerialStream); scoring, prefixes,
    the tokenizer and the step stop rule are the base engine's. One sequence at a time: lookahead
    decoding spends its parallelism inside one sequence (n samples of a request run one after another).
    """

    def __init__(self, base, cfg: LookaheadConfig | None = None):
        if not base.capabilities.tree_attention:
            raise ValueError(f"lookahead decoding needs tree attention (a transformers engine); "
                             f"{type(base).__name__} has none")
        self.base, self.cfg = base, cfg or LookaheadConfig()
        self.decoder = LookaheadDecoder(base.sequence_kv(), self.cfg)
        # the StepEngine protocol, spelled out: generation is ours, the rest is the base engine's
        self.info, self.model_name, self.model, self.tokenizer = base.info, base.model_name, base.model, base.tokenizer
        self.capabilities = replace(base.capabilities, token_spec_per_run=False)
        self.text = base.text  # the step stop rule and prefixes (SEED reads them too)

    def clear_prefix_cache(self) -> None:
        self.base.clear_prefix_cache()

    def sequence_kv(self) -> SequenceKV:
        return self.base.sequence_kv()

    def with_token_spec(self, spec, assistant=None):
        if spec is not None:
            raise ValueError("Lookahead Decoding is itself the token-level speculation inside steps; it does not "
                             "combine with +ngram / +assistant")
        return self

    def format_prefix(self, question, steps=(), delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
        return self.base.format_prefix(question, steps, delimiter)

    def prefix_ids(self, prefix) -> list[int]:
        return self.base.prefix_ids(prefix)

    def check_fits(self, prefix, extra_tokens: int = 0) -> None:
        self.base.check_fits(prefix, extra_tokens)

    def count_tokens(self, text: str) -> int:
        return self.base.count_tokens(text)

    def score(self, prefix, steps, *, hidden: bool = True, layers=None):
        return self.base.score(prefix, steps, hidden=hidden, layers=layers)

    def score_chain(self, prefix, steps, *, hidden: bool = True, layers=None):
        return self.base.score_chain(prefix, steps, hidden=hidden, layers=layers)

    def generate(self, requests, params):
        t0 = time.perf_counter()
        stats = EngineStats()
        steps = []
        for req in requests:
            ids = self.base.prefix_ids(req.prefix)
            cap = req.cap(params)
            seed = params.seed if req.seed is None else req.seed
            row = []
            for k in range(req.n):
                def stop(tokens, cap=cap):
                    return self.base.text.finished(tokens, cap, params.delimiter) is not None

                tokens, st = self.decoder.generate(ids, cap, temperature=params.temperature, top_p=params.top_p,
                                                   stop=stop, seed=sample_seed(seed, k) or 0)
                row.append(self.base.text.make_step(tokens, st.logprob, cap, params.delimiter))
                stats.forward_passes += st.forward_passes + st.prefill_passes
                stats.iterations += st.forward_passes
                stats.row_iterations += st.forward_passes
                stats.generated_tokens += st.tokens
                stats.spec_rounds += st.steps_with_candidates
                stats.spec_proposed += st.proposed
                stats.spec_accepted += st.accepted
            steps.append(row)
        stats.seconds = time.perf_counter() - t0
        return Generation(steps, stats)

    def open_stream(self, params):
        return SerialStream(self, params)
