"""SEED: scheduled speculative decoding for tree-of-thoughts search.

Token level (`SeedGenerator`). Several sequences (the n thoughts of every kept state) share one draft and
one target model. Each sequence drafts a token tree of shape k_config (k_config = (2, 2, 1): 2 candidates
after the last token, 2 after each of those, 1 after each of the 4: 8 nodes, depth 3; all ones is a plain
k-token chain) and puts it in a first-come-first-served queue (`RoundsQueue`). The target takes the
oldest proposal, verifies its whole tree in ONE forward with tree attention (each node sees the context,
its ancestors and itself), commits the accepted tokens plus one, and hands the sequence back to drafting
("rounds"); meanwhile a drafting thread keeps drafting the other sequences.

Verification is the standard rule, per tree node (`verify_tree_sample`): the children of a node were drawn
i.i.d. from the draft's distribution q there; try them in order, accepting child x with probability
min(1, p'(x)/q(x)); after a rejection p' ← norm(max(p' − q, 0)); with every child rejected, draw from p'; at
a leaf draw a bonus token from p. Every committed token is distributed as the target's p (lossless per
sequence; with one child per node this is min(1, p/q) with residual resampling). Greedy
(temperature 0): the children are the draft's top tokens and the child equal to the target's argmax is
followed (`verify_tree_greedy`): exactly the target's greedy output.

Search level (`tot_search`). Breadth-first tree of thoughts (the paper's Alg. 1): every kept state gets n
thoughts (one step each), every new state is scored by a step reward (a specprobe probe or verifier via
`infer.decoding.specs.reward_from_verifier`), the best b are kept, for at most T levels; the answer is the
best state's chain. `seed_tot` writes the thoughts with SeedGenerator, `tot_target` (the baseline) with
the target alone through the engine interface.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specprobe.infer.decoding.common import GenState, seed_for
from specprobe.infer.engines.base import Step, StepRequest
from specprobe.infer.engines.lookahead_decoding import additive_mask, crop_cache
from specprobe.infer.engines.token_spec import filtered_probs, sample_from
from specprobe.probes.speedup import token_sd_speedup


@dataclass(frozen=True)
class SeedConfig:
    """Tree search (n thoughts per state, best b kept, depth T) and the token tree of each draft round."""

    thoughts: int = 3  # n
    keep: int = 1  # b
    depth: int = 4  # T (the paper: 4 levels for GSM8K)
    k_config: tuple[int, ...] = (2, 2, 1)  # the paper's tree-attention setting; (1, 1, 1) is its base
    threaded: bool = True  # draft in a thread while the target verifies

    def __post_init__(self) -> None:
        for name in ("thoughts", "keep", "depth"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"seed {name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.k_config or any((not isinstance(k, int)) or k < 1 for k in self.k_config):
            raise ValueError(f"seed k_config must be a non-empty list of ints >= 1, got {self.k_config!r}")


# ----------------------------------------------------------------------------- token trees
def expand_tree(k_config: Sequence[int]) -> tuple[list[int], list[int]]:
    """(parent, depth) of every node, breadth first; parent -1 is the root (the last committed token)."""
    parents, depths, frontier = [], [], [-1]
    for d, k in enumerate(k_config):
        nxt = []
        for u in frontier:
            for _ in range(k):
                parents.append(u)
                depths.append(d + 1)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, depths


def tree_ancestry(parents: Sequence[int]) -> torch.Tensor:
    """(m, m) bool: entry [i, j] is True when node j is node i or one of its ancestors (tree attention)."""
    m = len(parents)
    allowed = torch.zeros((m, m), dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parents[j]
    return allowed


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def verify_tree_sample(tokens: Sequence[int], parents: Sequence[int], q: dict[int, torch.Tensor],
                       p: dict[int, torch.Tensor], generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """Lossless multi-candidate verification. q[u] / p[u]: draft / target distribution after node u (u = -1:
    the root). Returns (tokens, node of each token or -2 for a drawn one)."""
    kids = _children(parents)
    u, out, nodes = -1, [], []
    while True:
        if u not in kids:  # a leaf: bonus token
            out.append(sample_from(p[u].float(), generator))
            nodes.append(-2)
            return out, nodes
        residual = p[u].float().clone()
        qu = q[u].float()
        for c in kids[u]:
            x = int(tokens[c])
            ratio = float(residual[x]) / max(float(qu[x]), 1e-30)
            if float(torch.rand((), generator=generator)) < min(1.0, ratio):
                out.append(x)
                nodes.append(c)
                u = c
                break
            residual = torch.clamp(residual - qu, min=0.0)
            total = float(residual.sum())
            residual = residual / total if total > 0 else p[u].float().clone()
        else:
            out.append(sample_from(residual, generator))
            nodes.append(-2)
            return out, nodes


def verify_tree_greedy(tokens: Sequence[int], parents: Sequence[int],
                       argmax: dict[int, int]) -> tuple[list[int], list[int]]:
    """Follow the child equal to the target's argmax; at a mismatch or a leaf append the argmax."""
    kids = _children(parents)
    u, out, nodes = -1, [], []
    while True:
        best = int(argmax[u])
        nxt = next((c for c in kids.get(u, []) if int(tokens[c]) == best), None)
        out.append(best)
        nodes.append(-2 if nxt is None else nxt)
        if nxt is None:
            return out, nodes
        u = nxt


# ----------------------------------------------------------------------------- the queue
class RoundsQueue:
    """FCFS verification queue of draft proposals. A sequence has at most one proposal in flight (it waits
    for its verification before drafting again); every proposal is verified exactly once."""

    def __init__(self):
        self._q: deque = deque()
        self._lock = threading.Condition()
        self.in_flight: set = set()
        self.submitted = 0
        self.verified = 0
        self.log: list[tuple[str, object, int]] = []  # ("submit" | "verify", sequence, ticket)

    def submit(self, seq, proposal) -> int:
        with self._lock:
            if seq in self.in_flight:
                raise RuntimeError(f"sequence {seq!r} submitted a proposal while another is waiting")
            ticket = self.submitted
            self.submitted += 1
            self.in_flight.add(seq)
            self._q.append((ticket, seq, proposal))
            self.log.append(("submit", seq, ticket))
            self._lock.notify_all()
            return ticket

    def pop(self, timeout: float | None = None):
        """The oldest proposal (ticket, sequence, proposal), or None after `timeout` seconds."""
        with self._lock:
            if not self._q and not self._lock.wait_for(lambda: bool(self._q), timeout):
                return None
            return self._q.popleft()

    def done(self, seq, ticket: int) -> None:
        with self._lock:
            self.in_flight.discard(seq)
            self.verified += 1
            self.log.append(("verify", seq, ticket))

    def __len__(self) -> int:
        with self._lock:
            return len(self._q)


# ----------------------------------------------------------------------------- token-level generator
@dataclass
class SeedStats:
    rounds: int = 0  # verifications
    proposed: int = 0  # draft tree nodes
    accepted: int = 0  # draft tokens accepted
    draft_forward_passes: int = 0
    target_forward_passes: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    generated_tokens: int = 0

    @property
    def acceptance(self) -> float | None:
        """Accepted draft tokens per draft position on the accepted path's depth (the paper's α: share of
        drafted positions whose token was accepted)."""
        return self.accepted / self.positions if self.positions else None

    positions: int = 0  # tree depth per round, summed
    accepted_per_round: list[int] = field(default_factory=list)


@dataclass
class _Seq:
    key: object
    ids: list[int]
    cap: int
    draft_gen: torch.Generator
    verify_gen: torch.Generator
    out: list[int] = field(default_factory=list)
    logprob: float = 0.0
    d_cache: object = None
    d_cached: int = 0
    t_cache: object = None
    t_cached: int = 0
    finished: bool = False


@dataclass
class _Proposal:
    tokens: list[int]
    parents: list[int]
    q: dict


class SeedGenerator:
    """Scheduled speculative decoding of several sequences with one draft and one target model (transformers
    causal LMs sharing a vocabulary)."""

    def __init__(self, target_model, draft_model, k_config: Sequence[int] = (2, 2, 1), *, temperature: float = 0.0,
                 draft_temperature: float | None = None, top_p: float = 1.0, threaded: bool = True):
        self.target, self.draft = target_model, draft_model
        self.parents, self.depths = expand_tree(k_config)
        self.k_config = tuple(k_config)
        self.ancestry = tree_ancestry(self.parents)
        self.temperature, self.top_p = temperature, top_p
        self.draft_temperature = temperature if draft_temperature is None else draft_temperature
        if temperature > 0 and self.draft_temperature <= 0:
            raise ValueError("sampled SEED needs a sampling draft (draft temperature > 0): the rule min(1, p/q) "
                             "needs the draft's distribution q")
        self.threaded = threaded
        self.stats = SeedStats()
        self.queue: RoundsQueue | None = None

    # ------------------------------------------------------------------ forwards
    @staticmethod
    def _forward(model, cache, cached: int, fresh: list[int], nodes: list[int], node_anc: torch.Tensor,
                 node_pos: list[int], node_cols_before: int):
        """One pass: `fresh` committed tokens (causal) then tree `nodes`, which see the whole context, the
        tree columns [node_cols_before, ...) allowed by node_anc (rows: nodes; cols: earlier tree columns +
        these nodes) and themselves."""
        nf, m = len(fresh), len(nodes)
        kv = cache.get_seq_length() + nf + m
        allowed = torch.zeros((nf + m, kv), dtype=torch.bool)
        allowed[:, :cached] = True
        for r in range(nf):
            allowed[r, cached:cached + r + 1] = True
        ctx = cached + nf
        if m:
            allowed[nf:, cached:ctx] = True
            allowed[nf:, node_cols_before:] = node_anc
        pos = list(range(ctx - nf, ctx)) + list(node_pos)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        res = model(input_ids=torch.tensor([fresh + nodes], device=device),
                    attention_mask=additive_mask(allowed, dtype).to(device),
                    position_ids=torch.tensor([pos], device=device), past_key_values=cache, use_cache=True)
        return res.logits[0].float(), res.past_key_values

    def _dist(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        return filtered_probs(logits, temperature, self.top_p)

    def _draft(self, s: _Seq) -> _Proposal:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        if s.d_cache is None:
            s.d_cache = DynamicCache(config=self.draft.config)
        ctx = len(s.ids)
        fresh = s.ids[s.d_cached:]
        tokens: list[int] = []
        q: dict[int, torch.Tensor] = {}
        logits, s.d_cache = self._forward(self.draft, s.d_cache, s.d_cached, fresh, [], torch.zeros(0, 0, dtype=torch.bool), [], 0)
        self.stats.draft_forward_passes += 1
        frontier = {-1: logits[-1]}
        for depth, k in enumerate(self.k_config):
            level = []
            for u, lg in frontier.items():
                if self.draft_temperature > 0:
                    q[u] = self._dist(lg, self.draft_temperature)
                    picks = [sample_from(q[u], s.draft_gen) for _ in range(k)]
                else:
                    picks = lg.topk(k).indices.tolist()
                for x in picks:
                    tokens.append(int(x))
                    level.append(len(tokens) - 1)
            if depth == len(self.k_config) - 1:
                break
            anc = self.ancestry[level[0]:level[-1] + 1, :level[-1] + 1]
            logits, s.d_cache = self._forward(self.draft, s.d_cache, ctx, [], [tokens[i] for i in level], anc,
                                              [ctx + depth] * len(level), ctx)
            self.stats.draft_forward_passes += 1
            frontier = {i: logits[j] for j, i in enumerate(level)}
        crop_cache(s.d_cache, ctx)
        s.d_cached = ctx
        self.stats.draft_s += time.perf_counter() - t0
        return _Proposal(tokens, list(self.parents[:len(tokens)]), q)

    def _verify(self, s: _Seq, prop: _Proposal, stop: Callable | None) -> None:
        from transformers import DynamicCache

        t0 = time.perf_counter()
        if s.t_cache is None:
            s.t_cache = DynamicCache(config=self.target.config)
        ctx = len(s.ids)
        fresh = s.ids[s.t_cached:]
        anc = self.ancestry[:len(prop.tokens), :len(prop.tokens)]
        logits, s.t_cache = self._forward(self.target, s.t_cache, s.t_cached, fresh, prop.tokens, anc,
                                          [ctx - 1 + d for d in self.depths[:len(prop.tokens)]], ctx)
        self.stats.target_forward_passes += 1
        crop_cache(s.t_cache, ctx)
        s.t_cached = ctx
        rows = {-1: logits[len(fresh) - 1]}
        rows.update({i: logits[len(fresh) + i] for i in range(len(prop.tokens))})
        if self.temperature <= 0:
            chunk, nodes = verify_tree_greedy(prop.tokens, prop.parents, {u: int(r.argmax()) for u, r in rows.items()})
        else:
            p = {u: self._dist(r, self.temperature) for u, r in rows.items()}
            chunk, nodes = verify_tree_sample(prop.tokens, prop.parents, prop.q, p, s.verify_gen)
        self.stats.rounds += 1
        self.stats.proposed += len(prop.tokens)
        self.stats.positions += len(self.k_config)
        prev, accepted = -1, 0
        for tok, node in zip(chunk, nodes):
            s.logprob += float(torch.log_softmax(rows[prev], -1)[tok])
            s.out.append(tok)
            s.ids.append(tok)
            accepted += int(node >= 0)  # only draft tokens that were kept count (a stop may cut the chunk)
            prev = node
            if len(s.out) >= s.cap or (stop is not None and stop(s.out)):
                s.finished = True
                break
        self.stats.accepted += accepted
        self.stats.accepted_per_round.append(accepted)
        self.stats.target_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ scheduling
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], caps: Sequence[int], seeds: Sequence[int],
                 stop: Callable[[list[int]], bool] | None = None) -> list[tuple[list[int], float]]:
        """(tokens, log-probability under the target's unmodified distribution) for every prompt."""
        seqs = [_Seq(i, [int(t) for t in p], int(c), torch.Generator().manual_seed(int(sd)),
                     torch.Generator().manual_seed(int(sd) ^ 0x5EED)) for i, (p, c, sd) in enumerate(zip(prompts, caps, seeds))]
        if any(not s.ids for s in seqs):
            raise ValueError("SEED needs non-empty prompts")
        self.queue = rq = RoundsQueue()
        live = [s for s in seqs if s.cap > 0]
        if not live:
            return [([], 0.0) for _ in seqs]
        if self.threaded:
            self._run_threaded(live, rq, stop)
        else:
            self._run_rounds(live, rq, stop)
        self.stats.generated_tokens += sum(len(s.out) for s in seqs)
        return [(s.out, s.logprob) for s in seqs]

    def _run_rounds(self, live: list[_Seq], rq: RoundsQueue, stop) -> None:
        """Single-thread schedule: every ready sequence drafts (in order), then the target verifies the
        oldest proposal; the verified sequence drafts again before the next verification."""
        ready = deque(live)
        while ready or len(rq):
            while ready:
                s = ready.popleft()
                rq.submit(s.key, (s, self._draft(s)))
            ticket, key, (s, prop) = rq.pop()
            self._verify(s, prop, stop)
            rq.done(key, ticket)
            if not s.finished:
                ready.append(s)

    def _run_threaded(self, live: list[_Seq], rq: RoundsQueue, stop) -> None:
        ready: queue.Queue = queue.Queue()
        for s in live:
            ready.put(s)
        errors: list[BaseException] = []

        def drafter():
            try:
                with torch.no_grad():
                    while True:
                        s = ready.get()
                        if s is None:
                            return
                        rq.submit(s.key, (s, self._draft(s)))
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller
                errors.append(err)

        worker = threading.Thread(target=drafter, name="seed-drafter", daemon=True)
        worker.start()
        remaining = len(live)
        try:
            while remaining:
                item = rq.pop(timeout=0.5)
                if errors:
                    raise errors[0]
                if item is None:
                    continue
                ticket, key, (s, prop) = item
                self._verify(s, prop, stop)
                rq.done(key, ticket)
                if s.finished:
                    remaining -= 1
                else:
                    ready.put(s)
        finally:
            ready.put(None)
            worker.join()
        if errors:
            raise errors[0]


# ----------------------------------------------------------------------------- tree-of-thoughts search
def _seed_thoughts(target, draft, cfg: SeedConfig, opts, generator_box: dict):
    """Thought writer backed by SeedGenerator on the engines' models (shared vocabulary needed)."""

    if draft.info.tokenizer_id != target.info.tokenizer_id:
        raise ValueError(f"SEED verifies draft tokens with the target: {draft.info.model_id!r} and "
                         f"{target.info.model_id!r} must share a tokenizer. Use tot_target instead")
    tp, dp = opts.target_params, opts.draft_params
    gen = SeedGenerator(target.model, draft.model, cfg.k_config, temperature=tp.temperature,
                        draft_temperature=dp.temperature, top_p=tp.top_p, threaded=cfg.threaded)
    generator_box["seed"] = gen

    def write(prefixes, n, caps, seeds):
        prompts, row_caps, row_seeds = [], [], []
        for pre, cap, sd in zip(prefixes, caps, seeds):
            ids = target.prefix_ids(pre)
            for k in range(n):
                prompts.append(ids)
                row_caps.append(cap)
                row_seeds.append(sd + k)

        def stop(tokens):  # the engines' one step rule; the cap is enforced by the generator
            return target.text.finished(tokens, 10**9, tp.delimiter) is not None

        outs = gen.generate(prompts, row_caps, row_seeds, stop)
        steps = []
        for (tokens, lp), cap in zip(outs, row_caps):
            text, reason = target.text.finished(tokens, cap, tp.delimiter) or (target.text.tokenizer.decode(tokens), "length")
            steps.append(Step(text, list(tokens), reason, lp, target.info.tokenizer_id))
        return [steps[i * n:(i + 1) * n] for i in range(len(prefixes))]

    return write


def _target_thoughts(target, opts):

    def write(prefixes, n, caps, seeds):
        out = target.generate([StepRequest(p, n, sd, c) for p, sd, c in zip(prefixes, seeds, caps)],
                              opts.target_params)
        write.stats = out.stats
        return out.steps

    return write


def tot_search(question: str, target, draft, reward, opts, cfg: SeedConfig | None = None,
               method: str = "seed_tot"):
    """Breadth-first tree of thoughts; thoughts by SEED (method seed_tot) or the target (tot_target)."""

    cfg = cfg or SeedConfig()
    use_seed = method == "seed_tot"
    if use_seed and draft is None:
        raise ValueError("seed_tot needs a draft engine (or run tot_target)")
    state = GenState(question, target, draft, opts, method)
    box: dict = {}
    write = _seed_thoughts(target, draft, cfg, opts, box) if use_seed else _target_thoughts(target, opts)
    beams: list[tuple[list, int, float]] = [([], 0, 0.0)]  # (steps, tokens, value)
    depth = min(cfg.depth, opts.max_steps)
    for level in range(depth):
        open_beams = [b for b in beams if not (b[0] and b[0][-1].stop_reason == "eos")
                      and opts.max_new_tokens - b[1] > 0]
        if not open_beams:
            break
        prefixes = [state.prefix(b[0]) for b in open_beams]
        caps = [min(opts.target_params.max_step_tokens, opts.max_new_tokens - b[1]) for b in open_beams]
        seeds = [seed_for(opts.seed, "thought", state.key(p)) for p in prefixes]
        thoughts = write(prefixes, cfg.thoughts, caps, seeds)
        if not use_seed:
            state.book("target", write.stats, len(prefixes) * cfg.thoughts, calls=1)
        children = []
        for b, pre, group in zip(open_beams, prefixes, thoughts):
            values = _evaluate(state, target, reward, pre, group, seed_for(opts.seed, "value", state.key(pre)))
            children += [(b[0] + [t], b[1] + t.num_tokens, v) for t, v in zip(group, values)]
        closed = [b for b in beams if b not in open_beams]
        pool = closed + children
        order = sorted(range(len(pool)), key=lambda i: -pool[i][2])  # stable: ties keep generation order
        beams = [pool[i] for i in order[:cfg.keep]]
        state.stats.cycles += 1
        state.add_trace({"cycle": level, "values": [c[2] for c in children],
                         "kept": [[s.text for s in b[0]] for b in beams]})
    best = beams[0]
    for step in best[0]:
        if state.done:
            break
        state.commit(step, "target", step.num_tokens)  # SEED is lossless: every token is the target's
    if state.stop_reason is None:
        state.stop_reason = "max_steps"
    if use_seed:
        _book_seed(state, box["seed"].stats)
    return state.finish(method)


def _evaluate(state, target, reward, prefix, steps, seed: int) -> list[float]:
    texts = [s.text for s in steps]
    full = [i for i, t in enumerate(texts) if t]
    scored: list = [None] * len(steps)
    if reward.layers is not None and full:
        got = state.score(target, "target", prefix, [texts[i] for i in full], hidden=True, layers=reward.layers)
        for i, s in zip(full, got):
            scored[i] = s
    t0 = time.perf_counter()
    values = reward.rewards(prefix, steps, scored, seed)
    state.stats.verify_time_s += time.perf_counter() - t0
    return values


def _book_seed(state, st: SeedStats) -> None:
    """SEED's token-level work in RunStats: draft/target forward passes and the token acceptance."""
    rs = state.stats
    rs.draft_time_s += st.draft_s
    rs.target_time_s += st.target_s  # verification passes (drafting overlaps them when threaded)
    rs.draft_calls += st.rounds
    rs.target_calls += st.rounds
    rs.target_rows += st.rounds
    rs.target_forward_passes += st.target_forward_passes
    rs.draft_forward_passes += st.draft_forward_passes
    rs.target_iterations += st.target_forward_passes
    rs.spec_rounds += st.rounds
    rs.spec_proposed += st.positions
    rs.spec_accepted += st.accepted
    depth = st.positions // st.rounds if st.rounds else 0
    for a in st.accepted_per_round:  # α by tree depth: position i judged when the first i were accepted
        for i in range(min(a + 1, depth)):
            rs.record_position(i, i < a)


def seed_predicted_speedup(stats, k_config: Sequence[int]) -> dict:
    """Token SD's g(k) = (1 − α^{k+1}) / ((1 − α)(1 + c·k)) at SEED's measured per-position acceptance α
    (accepted / judged tree positions, a position being judged when all before it were accepted) and c = one draft forward / one target verification pass,
    k = tree depth: the speedup of one sequence's thoughts over target decoding, before the overlap of
    drafting and verification that the scheduler adds (the SEED paper gives no formula; its Table 2 pairs
    α = 0.37 / 0.41 with 1.32x / 1.51x)."""

    out = {"ideal": None, "adjusted": None, "k": len(k_config), "formula": "g(k) token SD vs tot_target"}
    if stats.acceptance_rate is None or not stats.draft_forward_passes or not stats.target_forward_passes:
        return out
    alpha = min(stats.acceptance_rate, 1.0)
    k = len(k_config)
    c = (stats.draft_time_s / stats.draft_forward_passes) / (stats.target_time_s / stats.target_forward_passes) \
        if stats.target_time_s > 0 else None
    if c is not None:
        out["ideal"] = float(token_sd_speedup(alpha, c, k))
    return out
