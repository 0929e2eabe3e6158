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
3. the verification branch: up to G pool (N−1)-grams that continue the current token, each a causal
   chain after the context.
Masks are 4-D additive float masks with explicit position ids, so the one pass computes for every branch
what a plain forward of that path computes (up to floating-point differences between kernels).

Verification (their Alg. 3 / Alg. 4): walk the candidate positions; at position i the candidates still
alive share a prefix, hence a distribution P. Greedy: accept the first candidate whose token is argmax P
and keep only candidates with that token; with none, append argmax P and stop; when a candidate is
accepted in full, append the argmax after it (the longest matching prefix plus one token). Sampling:
try the candidates in order, accepting s_j with probability P_j(s_j); on rejection set P_j(s_j) = 0 and
renormalise; with none accepted draw from the last P_j; a full accept draws a bonus token. Every output
token is distributed as the target's (Theorem A of the paper), because each proposal is deterministic.

The transformers internals (DynamicCache, 4-D masks) stay in this module; `LookaheadDecoder.generate`
is the whole API: token ids in, token ids and counters out.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER, EngineStats, Generation, SerialStream, sample_seed
from specprobe.infer.engines.token_spec import filtered_probs, sample_from


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
    """n-grams keyed by their first token; per key at most `per_key` continuations, newest kept."""

    def __init__(self, per_key: int):
        self.per_key = per_key
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

    def __len__(self) -> int:
        return sum(len(b) for b in self._pool.values())


# ----------------------------------------------------------------------------- verification
def _check_candidates(cands: Sequence[Sequence[int]], rows: int, what: str) -> int:
    if not cands:
        raise ValueError("verification needs at least one candidate")
    k = len(cands[0])
    if any(len(c) != k for c in cands):
        raise ValueError("lookahead candidates must all have the same length")
    if rows != k + 1:
        raise ValueError(f"{what} needs len(candidate) + 1 = {k + 1} rows per candidate, got {rows}")
    return k


def greedy_verify(cands: Sequence[Sequence[int]], argmax: Sequence[Sequence[int]]) -> list[int]:
    """Alg. 3. argmax[j][i] = the target's argmax after the context plus cands[j][:i]."""
    k = _check_candidates(cands, len(argmax[0]) if argmax else 0, "greedy_verify")
    alive = list(range(len(cands)))
    out: list[int] = []
    for i in range(k):
        best = int(argmax[alive[0]][i])
        hit = [j for j in alive if int(cands[j][i]) == best]
        out.append(best)
        if not hit:
            return out
        alive = hit
    out.append(int(argmax[alive[0]][k]))
    return out


def sample_verify(cands: Sequence[Sequence[int]], probs: Sequence[torch.Tensor],
                  generator: torch.Generator | None) -> list[int]:
    """Alg. 4. probs[j]: (len(cand) + 1, vocab), row i = the target's distribution after the context plus
    cands[j][:i]. Lossless for deterministic (greedy-made) candidates."""
    k = _check_candidates(cands, int(probs[0].shape[0]), "sample_verify")
    alive = list(range(len(cands)))
    out: list[int] = []
    for i in range(k):
        p = probs[alive[0]][i].detach().float().cpu().clone()
        accepted = None
        for j in alive:
            s = int(cands[j][i])
            if float(torch.rand((), generator=generator)) < float(p[s]):
                accepted = s
                break
            p[s] = 0.0  # rejected: remove it and renormalise
            total = float(p.sum())
            if total <= 0.0:  # numerically everything was on rejected tokens: cannot happen exactly
                p = probs[alive[0]][i].detach().float().cpu().clone()
                break
            p = p / total
        if accepted is None:
            out.append(sample_from(p, generator))
            return out
        out.append(accepted)
        alive = [j for j in alive if int(cands[j][i]) == accepted]
    out.append(sample_from(probs[alive[0]][k].detach().float().cpu(), generator))
    return out


# ----------------------------------------------------------------------------- one forward's layout
def lookahead_layout(n_fresh: int, levels: int, window: int, n_cands: int, cand_len: int, cur_pos: int,
                     cached: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed (q, cached + q) bool, position ids (q,)) for one forward: n_fresh committed tokens (the
    last is the current token at position cur_pos), `levels` × `window` lookahead tokens (level-major),
    n_cands × cand_len verification tokens (candidate-major)."""
    q = n_fresh + levels * window + n_cands * cand_len
    allowed = torch.zeros((q, cached + q), dtype=torch.bool)
    pos = torch.empty(q, dtype=torch.long)
    allowed[:, :cached] = True
    fresh_cols = torch.arange(cached, cached + n_fresh)
    for r in range(n_fresh):  # committed tail: causal
        allowed[r, cached:cached + r + 1] = True
        pos[r] = cur_pos - (n_fresh - 1 - r)
    allowed[n_fresh:, fresh_cols] = True  # every speculative token sees the whole committed context
    base = cached + n_fresh

    def col(level: int, j: int) -> int:  # key column of lookahead token (level, j)
        return base + level * window + j

    for level in range(levels):
        for j in range(window):
            r = n_fresh + level * window + j
            pos[r] = cur_pos + 1 + j + level
            allowed[r, [col(0, c) for c in range(j + 1)]] = True  # level 0 up to column j
            allowed[r, [col(lv, j) for lv in range(1, level + 1)]] = True  # same column, levels 1..level
    vbase = n_fresh + levels * window
    for c in range(n_cands):
        for i in range(cand_len):
            r = vbase + c * cand_len + i
            pos[r] = cur_pos + 1 + i
            allowed[r, cached + vbase + c * cand_len: cached + r + 1] = True
    return allowed, pos


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, q, kv) additive mask: 0 where attention is allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


# ----------------------------------------------------------------------------- decoder
def _chunk_logprob(cur: torch.Tensor, verify_logits, cands, chunk: list[int], i: int) -> float:
    """log p of chunk[i]: row 0 is the current token's output; later rows come from a candidate that
    matches chunk[:i] (all such candidates share that prefix, hence that distribution)."""
    row = cur
    if i > 0:
        c = next(j for j, cand in enumerate(cands) if list(cand[:i]) == chunk[:i])
        row = verify_logits[c, i - 1]
    return float(torch.log_softmax(row.float(), -1)[chunk[i]])


def crop_cache(cache, length: int) -> None:
    """Drop cached positions beyond `length` (a negative count: the form every transformers 5 accepts)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@dataclass
class LookaheadStats:
    forward_passes: int = 0
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
    """Lookahead Decoding on a transformers causal LM (one sequence at a time)."""

    def __init__(self, model, cfg: LookaheadConfig | None = None):
        self.model, self.cfg = model, cfg or LookaheadConfig()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._last = None  # (token ids, cache holding exactly them) of the previous call

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, stop: Callable[[list[int]], bool] | None = None,
                 seed: int | None = None, prompt_pool: bool = False) -> tuple[list[int], LookaheadStats]:
        """Generate up to max_new_tokens after prompt_ids; `stop(tokens)` ends generation early once true
        (checked after every appended token, so the output is cut exactly where plain decoding stops).
        temperature 0 is greedy; otherwise tokens follow filtered_probs(temperature, top_p)."""
        from transformers import DynamicCache

        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("lookahead decoding needs a non-empty prompt")
        cfg = self.cfg
        gen = torch.Generator().manual_seed(int(seed if seed is not None else cfg.seed))
        n_cand = cfg.ngram - 1
        pool = NgramPool(max(cfg.guesses, 1))
        if prompt_pool:  # the paper's "prompt as reference" option
            for s in range(len(ids) - cfg.ngram + 1):
                pool.add(ids[s:s + cfg.ngram])
        pick = torch.randint(len(ids), (cfg.window,), generator=gen)
        levels: list[list[int]] = [[ids[int(i)] for i in pick]]
        cache, cached = self._reuse(ids)
        if cache is None:
            cache, cached = DynamicCache(config=self.model.config), 0
        out: list[int] = []
        stats = LookaheadStats()
        while len(out) < max_new_tokens:
            fresh = ids[cached:]
            cands = pool.lookup(ids[-1], cfg.guesses)
            allowed, pos = lookahead_layout(len(fresh), len(levels), cfg.window, len(cands), n_cand,
                                            len(ids) - 1, cached)
            flat = fresh + [t for lv in levels for t in lv] + [t for c in cands for t in c]
            res = self.model(input_ids=torch.tensor([flat], device=self.device),
                             attention_mask=additive_mask(allowed, self.dtype).to(self.device),
                             position_ids=pos[None].to(self.device), past_key_values=cache, use_cache=True)
            stats.forward_passes += 1
            logits = res.logits[0].float()
            cache = res.past_key_values
            crop_cache(cache, len(ids))  # keep only the committed context; accepted tokens are re-fed next pass
            cached = len(ids)
            n_look = len(levels) * cfg.window
            levels = self._advance_window(levels, logits[len(fresh):len(fresh) + n_look], pool)
            verify_logits = logits[len(fresh) + n_look:].view(len(cands), n_cand, -1) if cands else None
            chunk = self._verify(logits[len(fresh) - 1], verify_logits, cands, temperature, top_p, gen)
            if cands:
                stats.steps_with_candidates += 1
                stats.proposed += len(cands) * n_cand
            for i, t in enumerate(chunk):
                stats.logprob += _chunk_logprob(logits[len(fresh) - 1], verify_logits, cands, chunk, i)
                out.append(t)
                ids.append(t)
                if len(out) >= max_new_tokens or (stop is not None and stop(out)):
                    self._count_accepted(stats, chunk, i + 1)
                    return self._finish(out, stats, ids, cache, cached)
            self._count_accepted(stats, chunk, len(chunk))
        return self._finish(out, stats, ids, cache, cached)

    @staticmethod
    def _count_accepted(stats: LookaheadStats, chunk: list[int], used: int) -> None:
        """Proposal tokens among the `used` tokens of a chunk that were kept (a stop may cut a chunk)."""
        accepted = min(used, len(chunk) - 1)
        stats.accepted += accepted
        stats.accepted_per_step.append(accepted)

    def _reuse(self, ids: list[int]):
        """The cache of the previous call, cropped to the longest prefix it shares with `ids` (one token
        at least is left to feed): consecutive steps of one answer are not encoded again."""
        if self._last is None:
            return None, 0
        prev, cache = self._last
        self._last = None
        common = 0
        for a, b in zip(prev, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        if common < 1:
            return None, 0
        crop_cache(cache, common)
        return cache, common

    def _finish(self, out, stats, ids, cache, cached):
        stats.tokens = len(out)
        self._last = (ids[:cached], cache)
        return out, stats

    def _advance_window(self, levels: list[list[int]], look_logits: torch.Tensor, pool: NgramPool) -> list[list[int]]:
        """New greedy guesses from the top level; full windows emit one N-gram per column and slide."""
        w = self.cfg.window
        top = look_logits[(len(levels) - 1) * w:].argmax(-1).tolist()
        if len(levels) < self.cfg.ngram - 1:
            return levels + [top]
        for j in range(w):
            pool.add([lv[j] for lv in levels] + [top[j]])
        return levels[1:] + [top]

    @staticmethod
    def _verify(cur_logits: torch.Tensor, verify_logits: torch.Tensor | None, cands: list[list[int]],
                temperature: float, top_p: float, gen: torch.Generator) -> list[int]:
        """Accepted tokens of one step (1..N): rows are [current token's output, candidate outputs]."""
        if not cands:
            if temperature <= 0:
                return [int(cur_logits.argmax())]
            return [sample_from(filtered_probs(cur_logits, temperature, top_p), gen)]
        rows = torch.cat([cur_logits[None, None].expand(len(cands), 1, -1), verify_logits], 1)  # (G, N, V)
        if temperature <= 0:
            return greedy_verify(cands, rows.argmax(-1).tolist())
        probs = filtered_probs(rows, temperature, top_p)
        return sample_verify(cands, list(probs), gen)


# ----------------------------------------------------------------------------- step engine
class LookaheadStepEngine:
    """A StepEngine whose steps are written by Lookahead Decoding on another engine's transformers model.

    Generation goes through the interface (`generate`, `open_stream` via SerialStream); scoring, prefixes,
    the tokenizer and the step stop rule are the base engine's. One sequence at a time: lookahead
    decoding spends its parallelism inside one sequence (n samples of a request run one after another).
    """

    def __init__(self, base, cfg: LookaheadConfig | None = None):
        if not base.capabilities.raw_model or getattr(base, "text", None) is None:
            raise ValueError(f"lookahead decoding needs a transformers engine; {type(base).__name__} has no model")
        self.base, self.cfg = base, cfg or LookaheadConfig()
        self.decoder = LookaheadDecoder(base.model, self.cfg)
        # the StepEngine protocol, spelled out: generation is ours, the rest is the base engine's
        self.info, self.model_name, self.model, self.tokenizer = base.info, base.model_name, base.model, base.tokenizer
        self.capabilities = replace(base.capabilities, token_spec_per_run=False)
        self.text = base.text  # the step stop rule and prefixes (SEED's raw-model path reads them too)

    def clear_prefix_cache(self) -> None:
        self.base.clear_prefix_cache()

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
                stats.forward_passes += st.forward_passes
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
