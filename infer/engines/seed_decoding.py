"""SEED's token level: scheduled speculative decoding of several sequences with one draft and one target model.

Several sequences (the n thoughts of every kept state of `infer.decoding.seed.tot_search`) share one draft and
one target engine. Each sequence drafts a token tree of shape k_config (k_config = (2, 2, 1): 2 candidates
after the last token, 2 after each of those, 1 after each of the 4: 8 nodes, depth 3; all ones is a plain
k-token chain) with its `TreeDrafter` (the proposer) and puts it in a first-come-first-served queue
(`RoundsQueue`). The target takes the oldest proposal, verifies its whole tree in ONE forward with tree
attention (each node sees the context, its ancestors and itself), commits the accepted tokens plus one, and
hands the sequence back to drafting ("rounds"); meanwhile a drafting thread keeps drafting the other
sequences.

Verification is the one rule of every token proposer (`token_spec.verify_tree`): the children of a node were
drawn i.i.d. from the draft's distribution q there; try them in order, accepting child x with probability
min(1, p'(x)/q(x)); after a rejection p' ← norm(max(p' − q, 0)); with every child rejected, draw from p'; at
a leaf draw a bonus token from p. Every committed token is distributed as the target's p (lossless per
sequence). Greedy (temperature 0): the child equal to the target's argmax is followed, exactly the target's
greedy output; with a greedy draft (draft temperature 0) the children are the draft's top tokens.

Both models run through `sequence_kv.SequenceKV` (one per sequence and model), never directly.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specprobe.infer.engines.base import EngineStats, Prefix, Step, sample_seed
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import (
    DraftTree,
    NoSideBranch,
    filtered_probs,
    path_logprobs,
    sample_from,
    verify_tree,
)


def tree_shape(k_config: Sequence[int]) -> tuple[int, ...]:
    """Parents of a k_config tree's nodes, breadth first (-1: the root, the last committed token)."""
    parents, frontier = [], [-1]
    for k in k_config:
        nxt = []
        for u in frontier:
            for _ in range(k):
                parents.append(u)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return tuple(parents)


class TreeDrafter(NoSideBranch):
    """SEED's proposer for one sequence: a token tree of shape k_config from the draft model, one forward per
    tree level on the sequence's own draft KV. Children are drawn i.i.d. from the draft's filtered
    distribution q (kept in the tree for verification), or are its top tokens under greedy drafting."""

    def __init__(self, new_kv: Callable[[], SequenceKV], k_config: Sequence[int], temperature: float, top_p: float,
                 seed: int = 0):
        self.new_kv, self._kv, self.k_config = new_kv, None, tuple(k_config)
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator().manual_seed(int(seed))
        self.parents = tree_shape(self.k_config)
        self.ancestry = DraftTree((0,) * len(self.parents), self.parents).ancestry()  # any depth's tree: a prefix

    @property
    def kv(self) -> SequenceKV:
        """Its draft KV, made on first use (the generator's root drafter only forks and never drafts)."""
        if self._kv is None:
            self._kv = self.new_kv()
        return self._kv

    def fork(self, seed: int | None) -> TreeDrafter:
        """The drafter of another sequence: its own draft KV and generator."""
        return TreeDrafter(self.new_kv, self.k_config, self.temperature, self.top_p, 0 if seed is None else seed)

    def propose(self, context: Sequence[int], k: int, stats: EngineStats | None = None) -> DraftTree:
        levels = self.k_config[:k]
        ctx = len(context)
        before = self.kv.forward_passes + self.kv.prefill_passes
        self.kv.start(context)  # the sequence so far stays cached; a new one starts from the prefix cache
        cur, _ = self.kv.forward(context)
        tokens: list[int] = []
        q: dict[int, torch.Tensor] = {}
        frontier = {-1: cur}
        for depth, width in enumerate(levels):
            level = list(range(len(tokens), len(tokens) + width * len(frontier)))
            for u, logits in frontier.items():
                if self.temperature > 0:
                    q[u] = filtered_probs(logits, self.temperature, self.top_p)
                    tokens += [sample_from(q[u], self.generator) for _ in range(width)]
                else:
                    tokens += [int(x) for x in logits.topk(width).indices.tolist()]
            if depth == len(levels) - 1:
                break
            seen = self.ancestry[level[0]:level[-1] + 1, :level[-1] + 1]  # this level over all nodes so far
            _, out = self.kv.forward(context, [tokens[i] for i in level], seen, [ctx + depth] * len(level))
            frontier = {i: out[j] for j, i in enumerate(level)}
        self.kv.drop_speculative()
        if stats is not None:
            stats.proposer_forward_passes += self.kv.forward_passes + self.kv.prefill_passes - before
        return DraftTree(tuple(tokens), self.parents[:len(tokens)], q if self.temperature > 0 else None)


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


# ----------------------------------------------------------------------------- the generator
@dataclass
class SeedStats:
    rounds: int = 0  # verifications
    proposed: int = 0  # draft tree nodes
    accepted: int = 0  # draft tokens accepted
    draft_forward_passes: int = 0  # every model call, prompt prefills included (0 on a prefix-cache hit)
    target_forward_passes: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    generated_tokens: int = 0
    positions: int = 0  # tree depth per round, summed
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def acceptance(self) -> float | None:
        """Accepted draft tokens per draft position on the accepted path's depth (the paper's α: share of
        drafted positions whose token was accepted)."""
        return self.accepted / self.positions if self.positions else None


@dataclass
class _Seq:
    key: object
    ids: list[int]
    cap: int
    drafter: TreeDrafter
    target: SequenceKV
    verify_gen: torch.Generator
    out: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finished: bool = False


class SeedGenerator:
    """Scheduled speculative decoding of several sequences with one draft and one target model sharing a
    vocabulary. `target_kv` / `draft_kv` make a fresh `SequenceKV` on each model (an engine's
    `sequence_kv`; `from_engines` wires two engines)."""

    def __init__(self, target_kv: Callable[[], SequenceKV], draft_kv: Callable[[], SequenceKV],
                 k_config: Sequence[int] = (2, 2, 1), *, temperature: float = 0.0,
                 draft_temperature: float | None = None, top_p: float = 1.0, threaded: bool = True):
        self.target_kv = target_kv
        self.k_config = tuple(k_config)
        self.temperature, self.top_p = temperature, top_p
        self.draft_temperature = temperature if draft_temperature is None else draft_temperature
        if temperature > 0 and self.draft_temperature <= 0:
            raise ValueError("sampled SEED needs a sampling draft (draft temperature > 0): the rule min(1, p/q) "
                             "needs the draft's distribution q")
        self.threaded = threaded
        self.drafter = TreeDrafter(draft_kv, self.k_config, self.draft_temperature, top_p)  # forked per sequence
        self.stats = SeedStats()
        self.queue: RoundsQueue | None = None

    @classmethod
    def from_engines(cls, target, draft, k_config: Sequence[int], **kw) -> SeedGenerator:
        """SEED on two step engines (both need tree attention and one tokenizer)."""
        for role, engine in (("target", target), ("draft", draft)):
            if not engine.capabilities.tree_attention:
                raise ValueError(f"SEED verifies token trees with tree attention; the {role} engine "
                                 f"({engine.capabilities.kind}) has none. Use a transformers engine or tot_target")
        if draft.info.tokenizer_id != target.info.tokenizer_id:
            raise ValueError(f"SEED verifies draft tokens with the target: {draft.info.model_id!r} and "
                             f"{target.info.model_id!r} must share a tokenizer. Use tot_target instead")
        return cls(target.sequence_kv, draft.sequence_kv, k_config, **kw)

    # ------------------------------------------------------------------ one round
    def _draft(self, s: _Seq) -> DraftTree:
        t0 = time.perf_counter()
        own = EngineStats()
        tree = s.drafter.propose(s.ids, len(self.k_config), own)
        self.stats.draft_forward_passes += own.proposer_forward_passes
        self.stats.draft_s += time.perf_counter() - t0
        return tree

    def _verify(self, s: _Seq, tree: DraftTree, stop: Callable | None) -> None:
        t0 = time.perf_counter()
        ctx = len(s.ids)
        before = s.target.forward_passes + s.target.prefill_passes
        s.target.start(s.ids)
        cur, block = s.target.forward(s.ids, tree.tokens, tree.ancestry(), [ctx - 1 + d for d in tree.depths()])
        s.target.drop_speculative()
        self.stats.target_forward_passes += s.target.forward_passes + s.target.prefill_passes - before
        rows = torch.cat([cur[None], block])  # row 0: after the context; i + 1: after node i
        chunk, nodes = verify_tree(tree, rows, self.temperature, self.top_p, s.verify_gen)
        self.stats.rounds += 1
        self.stats.proposed += len(tree)
        self.stats.positions += len(self.k_config)
        accepted = 0
        for tok, node, lp in zip(chunk, nodes, path_logprobs(chunk, nodes, rows)):
            s.logprob += lp
            s.out.append(tok)
            s.ids.append(tok)
            accepted += int(node >= 0)  # only draft tokens that were kept count (a stop may cut the chunk)
            if len(s.out) >= s.cap or (stop is not None and stop(s.out)):
                s.finished = True
                break
        self.stats.accepted += accepted
        self.stats.accepted_per_round.append(accepted)
        self.stats.target_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ scheduling
    def generate_steps(self, engine, prefixes: Sequence[Prefix], n: int, caps: Sequence[int], seeds: Sequence[int],
                       delimiter: str) -> list[list[Step]]:
        """n steps after every prefix (sample k seeded as every engine seeds it), cut by the engines' one step rule."""
        prompts, row_caps, row_seeds = [], [], []
        for pre, cap, sd in zip(prefixes, caps, seeds):
            ids = engine.prefix_ids(pre)
            for k in range(n):
                prompts.append(ids)
                row_caps.append(cap)
                row_seeds.append(sample_seed(sd, k))

        def stop(tokens):  # the cap is enforced by the generator
            return engine.text.finished(tokens, 10**9, delimiter) is not None

        steps = []
        for (tokens, lp), cap in zip(self.generate(prompts, row_caps, row_seeds, stop), row_caps):
            text, reason = engine.text.finished(tokens, cap, delimiter) or (engine.text.tokenizer.decode(tokens), "length")
            steps.append(Step(text, list(tokens), reason, lp, engine.info.tokenizer_id))
        return [steps[i * n:(i + 1) * n] for i in range(len(prefixes))]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], caps: Sequence[int], seeds: Sequence[int],
                 stop: Callable[[list[int]], bool] | None = None) -> list[tuple[list[int], float]]:
        """(tokens, log-probability under the target's unmodified distribution) for every prompt."""
        if any(not p for p in prompts):
            raise ValueError("SEED needs non-empty prompts")
        seqs = [self._sequence(i, p, c, sd) for i, (p, c, sd) in enumerate(zip(prompts, caps, seeds))]
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

    def _sequence(self, key, prompt: Sequence[int], cap: int, seed: int) -> _Seq:
        return _Seq(key, [int(t) for t in prompt], int(cap), self.drafter.fork(seed), self.target_kv(),
                    torch.Generator().manual_seed(int(seed) ^ 0x5EED))

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
