"""Lookahead Reasoning: step-level speculation checked against the target's own steps.

Sync cycle (their Alg. 1, with W >= 1 branches):
1. The draft writes a tree of depth g = min(γ, steps left − 1): W candidate steps after the committed
   output, W children after each candidate, ... (W = 1: one chain ŝ₀..ŝ_{g−1}, drafted sequentially;
   each level of a tree is one draft batch).
2. ONE target batch writes a step after every prefix in the tree: the committed output x (s₀), and
   x ⊕ path for every draft node that could be accepted (x ⊕ ŝ₀..ŝ_{j−1} for a chain: γ+1 rows).
3. The verifier judges every (draft child, target step at its parent) pair in one call. Walking from the
   root, the first accepted branch at each position is kept; at the first position with none, the
   target's step there is appended; when the walk reaches a leaf, that leaf's target step is a bonus.
   A draft cut by the step-token cap is never accepted (unless `accept_length_cut`, which system-speed
   runs set), nor one that ends the answer with EOS, nor, with `refuse_boxed`, one that writes a boxed
   final answer: the answer ends on the target's own step at that position. Where the target's step itself
   ends the answer (EOS), it is committed without judging the drafts there, as LR's public code stops on
   the target's EOS before it reads a verdict. Drafting stops one step short of max_steps, so a run cut
   there ends on the target's step too.
   Multi-branch drafting needs a sampling draft (W greedy branches would be identical).

Async (W = 1): a draft thread keeps up to γ drafts beyond the committed output; a target thread starts
the target step for a position the moment its prefix exists and adds it to its running batch
(continuous batching, `DecodeBatch.add`); the main thread verifies positions in order. A rejection
commits the target's step, drops every draft and cancels every target row (an epoch counter makes late
results harmless). As in sync, no draft covers the last step allowed (max_steps − 1). Because every
generation and draw is keyed by its prefix (see engines.base.seed_for), the output does not depend on thread
timing — only the wall time does — up to the floating-point differences between batch compositions (in
float32 these rarely change a token; in bfloat16 they can flip a near-tie, and with it the rest of the text).
The two threads use one engine each. Python's thread switch interval is left alone; `fast_thread_switching()`
is a context manager a benchmark or CLI may use around async runs (the draft thread's Python holds the GIL
between torch kernels).

Target-only and draft-only baselines run through the same sync loop with γ = 0 (one target row per
cycle, no drafts).

gamma=adaptive (`DecodeOptions.depth`, `infer.decoding.depth`): sync drafts level by level while the policy
says one more level pays (a level's acceptance: its branches' mean estimate, 1 − (1 − ā)^W), then drops the
levels past the depth worth keeping before the target batch (kept 0: the target writes the step alone). With
`forecast_skip`, a cycle whose levels, forecast at the last estimate known, would not pay drafts nothing: the
target writes the step, and the draft's estimate of that step is the next forecast.
Async drafts ahead only while the policy says so, starts target steps only for the prefixes it would keep, and
skips a first pending draft whose own estimate does not pay (the target's step is committed unjudged); that
decision reads only the first draft's estimate, so the output still does not depend on thread timing.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from specprobe.infer.decoding.common import (
    DecodeOptions,
    GenerationResult,
    GenState,
    check_verifier,
    refused,
    step_record,
)
from specprobe.infer.engines.base import Prefix, Step, StepRequest, seed_for
from specprobe.infer.verifiers import StepContext, Verdict, Verifier, VerifyItem


@dataclass
class _Node:
    depth: int
    branch: int
    parent: _Node | None
    draft: Step | None = None  # None at the root
    draft_tokens: int = 0  # in target tokens
    path: list[Step] = field(default_factory=list)  # draft steps from the root to this node
    path_tokens: int = 0
    branches: list[int] = field(default_factory=list)  # branch index at every depth from the root
    children: list[_Node] = field(default_factory=list)
    target: Step | None = None
    verdict: Verdict | None = None
    target_key: str = ""  # seed key of the target's step after this node
    accept_key: str = ""  # seed key of the acceptance draws of this node's children
    target_features: object = None  # pooled hidden states of this node's draft (probe verifier)
    draft_features: object = None


ASYNC_SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


@contextmanager
def fast_thread_switching(interval: float = ASYNC_SWITCH_INTERVAL):
    """Shorten Python's thread switch interval for the duration (restored afterwards). Opt-in for async
    runs: torch releases the GIL inside its kernels, but the Python between them (most of a small draft
    model's time) holds it, and the target thread would wait up to the default 5 ms for it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, interval))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


# ----------------------------------------------------------------------------- sync
def _draft_tree(state: GenState, draft, g: int, width: int, costs=None) -> tuple[_Node, list[_Node], dict | None]:
    """Draft up to g levels. With a depth policy (`costs` given), drafting stops when one more level is not
    expected to pay, and the levels past the depth worth keeping are dropped; the policy's record is returned."""
    root = _Node(0, 0, None)
    nodes: list[_Node] = []
    frontier = [root]
    opts = state.opts
    forecast = state.forecast  # what the skip decision reads (recorded with the cycle)
    if state.skip_drafting(costs, g):
        state.stats.record_depth(0, 0)
        return root, nodes, {"drafted": 0, "kept": 0, "estimates": [], "skipped": True, "forecast": forecast}
    estimates: list[float] = []
    usable: list[float] = []  # estimates of levels with a draft that could be accepted: the next forecast
    for depth in range(1, g + 1):
        expand = [n for n in frontier if (n is root or state.acceptable(n.draft)) and state.cap(n.path_tokens) >= 1]
        if not expand:
            break
        prefixes, seeds, caps, parents = [], [], [], []
        for n in expand:
            prefix = state.prefix(n.path)
            for w in range(width):
                prefixes.append(prefix)
                seeds.append(seed_for(opts.seed, "draft", state.key(prefix), w))
                caps.append(state.cap(n.path_tokens))
                parents.append((n, w))
        steps = state.generate(draft, "draft", prefixes, seeds, caps, opts.draft_params)
        frontier = []
        for (parent, w), step in zip(parents, steps):
            ntok = state.count_tokens(step, draft)
            child = _Node(depth, w, parent, step, ntok, parent.path + [step], parent.path_tokens + ntok,
                          parent.branches + [w])
            parent.children.append(child)
            frontier.append(child)
            nodes.append(child)
        if costs is not None:
            level = [state.estimate(state.prefix(n.parent.path), n.draft) for n in frontier]
            estimates.append(opts.depth.level(level, width))
            if any(state.acceptable(n.draft) for n in frontier):
                usable.append(estimates[-1])
            if not opts.depth.keep(estimates, costs, g):
                break
    if costs is None:
        return root, nodes, None
    state.forecast = usable[-1] if usable else state.forecast
    kept = opts.depth.kept(estimates, costs, g)
    state.stats.record_depth(len(estimates), kept)
    for n in [root] + nodes:  # drop the levels past the kept depth
        if n.depth >= kept:
            n.children = []
    return root, [n for n in nodes if n.depth <= kept], {"drafted": len(estimates), "kept": kept,
                                                         "estimates": estimates, "forecast": forecast}


def _probe_features(state: GenState, target, draft, verifier, root: _Node, nodes: list[_Node]) -> None:
    """Teacher-forced hidden states of every draft node under both models (probe verifier)."""
    parents = [root] + [n for n in nodes if n.children]
    for parent in parents:
        if state.ends_answer(parent.target):  # no draft is judged there
            continue
        kids = [c for c in parent.children if state.acceptable(c.draft) and c.draft.text]
        if not kids:
            continue
        texts = [c.draft.text for c in kids]
        for role, engine in (("target", target), ("draft", draft)):
            scored = state.score(engine, role, state.prefix(parent.path), texts, layers=verifier.layers(role))
            for c, sc in zip(kids, scored):
                if role == "target":
                    c.target_features = verifier.pooled(sc, role)
                else:
                    c.draft_features = verifier.pooled(sc, role)


def _verify_tree(state: GenState, verifier: Verifier, root: _Node, nodes: list[_Node]) -> None:
    items, owners = [], []
    for parent in [root] + nodes:
        if parent.target is None or state.ends_answer(parent.target):  # the target's EOS step is committed
            continue
        ctx = StepContext(state.question, tuple(state.texts(parent.path)))
        for child in parent.children:
            reason = state.unacceptable(child.draft)
            if reason is not None:
                child.verdict = refused(reason)
                state.stats.refused += 1
                continue
            if verifier.needs_features and not child.draft.text:
                child.verdict = Verdict(False, float("nan"), 0.0, {"reason": "empty"})
                state.stats.refused += 1
                continue
            items.append(VerifyItem(ctx, child.draft.text, parent.target.text, child.draft_features,
                                    child.target_features, seed_for(state.opts.seed, "accept", parent.accept_key,
                                                                    child.branch),
                                    {"position": parent.depth, "branch": child.branch}))
            owners.append(child)
    if not items:
        return
    t0 = time.perf_counter()
    verdicts = verifier.verify(items)
    state.stats.record_decisions(verdicts)
    for child, verdict in zip(owners, verdicts):
        child.verdict = verdict
    state.stats.verify_time_s += time.perf_counter() - t0


def _sync_cycle(state: GenState, target, draft, verifier: Verifier | None, gamma: int, width: int,
                target_role: str) -> None:
    opts = state.opts
    g = max(0, min(gamma, state.steps_left - 1))
    cycle = state.stats.cycles
    depth_record = None
    if g > 0:
        costs = None if opts.depth is None else opts.depth.costs("lookahead", width, opts.gamma, target, draft,
                                                                  opts.target_params)
        root, nodes, depth_record = _draft_tree(state, draft, g, width, costs)
    else:
        root, nodes = _Node(0, 0, None), []
    # one target batch: the root and every node whose draft could be accepted (and is not EOS)
    rows = [root] + [n for n in nodes if state.acceptable(n.draft) and state.cap(n.path_tokens) >= 1]
    params = opts.target_params if target_role == "target" else opts.draft_params
    prefixes = [state.prefix(n.path) for n in rows]
    for n, prefix in zip(rows, prefixes):
        n.target_key, n.accept_key = state.key(prefix), state.accept_key(prefix)
    steps = state.generate(target, "target" if target_role == "target" else "draft", prefixes,
                           [seed_for(opts.seed, target_role, n.target_key, 0) for n in rows],
                           [state.cap(n.path_tokens) for n in rows], params)
    for n, s in zip(rows, steps):
        n.target = s
    if nodes:
        if verifier.needs_features:
            _probe_features(state, target, draft, verifier, root, nodes)
        _verify_tree(state, verifier, root, nodes)
    # walk
    committed, positions = [], []
    node = root
    while True:
        if node.children and not state.ends_answer(node.target):
            chosen = next((c for c in node.children if c.verdict is not None and c.verdict.accepted), None)
            positions.append({"position": node.depth, "accepted": chosen is not None,
                              "branch": None if chosen is None else chosen.branch})
            state.stats.record_position(node.depth, chosen is not None)
        else:
            chosen = None
        if chosen is None:
            out = state.commit(node.target, target_role, state.count_tokens(node.target, target))
            committed.append(out.to_dict())
            break
        out = state.commit(chosen.draft, "draft", chosen.draft_tokens)
        committed.append(out.to_dict())
        node = chosen
        if state.done or node.target is None:
            break
    if depth_record is not None and depth_record.get("skipped") and not state.done:
        depth_record["target_estimate"] = state.forecast_written(prefixes[0], root.target, width)
    state.stats.cycles += 1
    state.add_trace({
        "cycle": cycle, "start_step": len(state.steps) - len(committed),
        "drafts": [step_record(n.draft, n.draft_tokens, depth=n.depth - 1, branch=n.branch, path=n.branches,
                               verdict=None if n.verdict is None else n.verdict.to_dict()) for n in nodes],
        "targets": [step_record(n.target, depth=n.depth, path=n.branches) for n in rows],
        "positions": positions, "committed": committed,
        **({} if depth_record is None else {"depth": depth_record}),
    })


def _sync_loop(question: str, target, draft, verifier: Verifier | None, opts: DecodeOptions, gamma: int,
               width: int, method: str, target_role: str = "target") -> GenerationResult:
    state = GenState(question, target, draft if gamma > 0 else None, opts, method)
    while not state.done:
        _sync_cycle(state, target, draft, verifier, gamma, width, target_role)
    return state.finish(method)


def target_only(question: str, target, opts: DecodeOptions) -> GenerationResult:
    """The baseline: the target writes every step (the sync loop with no drafts)."""
    return _sync_loop(question, target, None, None, opts, 0, 1, "target")


def draft_only(question: str, draft, opts: DecodeOptions) -> GenerationResult:
    """The draft writes every step (its own chat template and sampling parameters)."""
    return _sync_loop(question, draft, None, None, opts, 0, 1, "draft", target_role="draft")


def lookahead_sync(question: str, target, draft, verifier: Verifier, opts: DecodeOptions) -> GenerationResult:
    """Sync Lookahead Reasoning with γ = opts.gamma and W = opts.width branches per position."""
    check_verifier(verifier, draft)
    method = "lr_sync" if opts.width == 1 else f"lr_sync_w{opts.width}"
    return _sync_loop(question, target, draft, verifier, opts, opts.gamma, opts.width, method)


# ----------------------------------------------------------------------------- async
class _AsyncRun:
    """Shared state of one async generation; every field is guarded by `cond`."""

    def __init__(self, state: GenState, target, draft, verifier: Verifier):
        self.state, self.target, self.draft, self.verifier = state, target, draft, verifier
        self.cond = threading.Condition()
        self.epoch = 0
        self.drafts: list[tuple[Step, int]] = []  # speculative chain beyond the committed output
        self.results: dict[tuple[int, int], Step] = {}  # (epoch, absolute position) -> target step
        self.launched: set[tuple[int, int]] = set()
        self.keys: dict[tuple[int, int], str] = {}  # acceptance seed key of each launched target step's prefix
        self.stop = False
        self.error: BaseException | None = None
        self.stage_position = 0  # position within the current stage (since the last rejection)
        self.estimates: list[float] = []  # gamma=adaptive: predicted acceptance of each draft in self.drafts
        opts = state.opts
        self.costs = None if opts.depth is None else opts.depth.costs("lookahead", 1, opts.gamma, target, draft,
                                                                      opts.target_params)

    # ---------------------------------------------------------------- helpers (call with cond held)
    def _draft_tokens(self, upto: int | None = None) -> int:
        return sum(t for _, t in self.drafts[:upto])

    def _can_draft(self) -> bool:
        st, opts = self.state, self.state.opts
        if self.stop or st.done or len(self.drafts) >= opts.gamma:
            return False
        if self.drafts and not st.acceptable(self.drafts[-1][0]):
            return False
        if len(st.steps) + len(self.drafts) >= opts.max_steps - 1:
            return False  # the last step is the target's own, as in sync LR (its drafts stop one step short)
        if self.costs is not None and not opts.depth.keep(self.estimates, self.costs, opts.gamma):
            return False
        return st.cap(self._draft_tokens()) >= 1

    def _verified_depth(self) -> int:
        """Drafts whose prefixes get a target step now: all of them, or the depth the policy keeps."""
        if self.costs is None:
            return len(self.drafts)
        return self.state.opts.depth.kept(self.estimates, self.costs, self.state.opts.gamma)

    def _pending_target_jobs(self) -> list[tuple[tuple[int, int], StepRequest]]:
        st = self.state
        base = len(st.steps)
        jobs = []
        for j in range(self._verified_depth() + 1):
            n = base + j
            key = (self.epoch, n)
            if key in self.launched or n >= st.opts.max_steps:
                continue
            if j > 0 and not st.acceptable(self.drafts[j - 1][0]):
                break
            cap = st.cap(self._draft_tokens(j))
            if cap < 1:
                break
            prefix = st.prefix([d for d, _ in self.drafts[:j]])
            self.keys[key] = st.accept_key(prefix)
            jobs.append((key, StepRequest(prefix, 1, seed_for(st.opts.seed, "target", st.key(prefix), 0), cap)))
        return jobs

    def _fail(self, err: BaseException) -> None:
        with self.cond:
            self.error = self.error or err
            self.stop = True
            self.cond.notify_all()

    # ---------------------------------------------------------------- workers
    def draft_worker(self) -> None:
        st, opts = self.state, self.state.opts
        try:
            while True:
                with self.cond:
                    while not self.stop and not self._can_draft():
                        self.cond.wait()
                    if self.stop:
                        return
                    epoch, n = self.epoch, len(st.steps) + len(self.drafts)
                    prefix = st.prefix([d for d, _ in self.drafts])
                    cap = st.cap(self._draft_tokens())
                t0 = time.perf_counter()
                stream = self.draft.open_stream(opts.draft_params)
                result = dict(stream.add([(0, StepRequest(prefix, 1, seed_for(opts.seed, "draft", st.key(prefix), 0),
                                                          cap))]))
                while len(stream):
                    with self.cond:  # abandon a draft that a rejection made useless
                        stale = self.stop or epoch != self.epoch
                    if stale:
                        stream.cancel([0])
                        break
                    result.update(stream.step())
                dt = time.perf_counter() - t0
                work = stream.take_stats()
                estimate, est_s = self._estimate(prefix, result.get(0), epoch)
                with self.cond:
                    st.stats.estimate_time_s += est_s
                    step = result.get(0)
                    if step is None or self.stop or epoch != self.epoch or n != len(st.steps) + len(self.drafts):
                        st.stats.draft_abandoned += 1
                        st.stats.draft_abandoned_s += dt
                        st.stats.draft_forward_passes += work.forward_passes
                        continue
                    st.book("draft", work, 1, calls=1, seconds=dt)
                    self.drafts.append((step, st.count_tokens(step, self.draft)))
                    self.estimates.append(estimate)
                    self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            self._fail(err)

    def target_worker(self) -> None:
        st, opts = self.state, self.state.opts
        stream = self.target.open_stream(opts.target_params)
        live: set[tuple[int, int]] = set()
        try:
            while True:
                with self.cond:
                    while not self.stop and not live and not self._pending_target_jobs():
                        self.cond.wait()
                    if self.stop:
                        return
                    stale = [k for k in live if k[0] != self.epoch]
                    jobs = self._pending_target_jobs()
                    self.launched.update(key for key, _ in jobs)
                t0 = time.perf_counter()
                stream.cancel(stale)
                live.difference_update(stale)
                live.update(key for key, _ in jobs)
                finished = stream.add(jobs) if jobs else []
                if len(stream):
                    finished += stream.step()
                live.difference_update(key for key, _ in finished)
                dt = time.perf_counter() - t0
                work = stream.take_stats()
                with self.cond:
                    st.book("target", work, len(jobs), calls=1 if jobs else 0, seconds=dt)
                    for key, step in finished:
                        if key[0] == self.epoch:
                            self.results[key] = step
                    if finished:
                        self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001
            self._fail(err)

    # ---------------------------------------------------------------- commit loop (main thread)
    def run(self) -> None:
        st = self.state
        while not st.done:
            with self.cond:
                n = len(st.steps)
                key = (self.epoch, n)
                while not self.stop and not (key in self.results and (self.drafts or not self._draft_expected())):
                    self.cond.wait()
                if self.error is not None:
                    raise self.error
                s = self.results.pop(key)
                d = self.drafts[0] if self.drafts else None
                context = StepContext(st.question, tuple(st.texts()))
                seed_key = self.keys[key]
                position = self.stage_position
                judged = d is not None and not st.ends_answer(s)  # the target's EOS step is committed unjudged
                depth = self._depth_decision() if judged else None
            verdict = None
            if judged and not (depth is not None and depth["skipped"]):
                verdict = self._judge(d[0], s, context, seed_key, position)
            with self.cond:
                record = {"cycle": st.stats.cycles, "start_step": n, "positions": [], "targets": [step_record(s)],
                          "drafts": [] if d is None else [step_record(d[0], d[1], depth=position, branch=0,
                                                                         verdict=None if verdict is None
                                                                         else verdict.to_dict())]}
                if depth is not None:
                    record["depth"] = depth
                if verdict is not None:
                    st.stats.record_position(position, verdict.accepted)
                    record["positions"].append({"position": position, "accepted": verdict.accepted, "branch": 0})
                if verdict is not None and verdict.accepted:
                    out = st.commit(d[0], "draft", d[1])
                    self.drafts.pop(0)
                    if self.costs is not None:
                        self.estimates.pop(0)
                    self.stage_position += 1
                else:
                    out = st.commit(s, "target", st.count_tokens(s, self.target))
                    self.drafts.clear()
                    self.estimates.clear()
                    self.epoch += 1
                    self.stage_position = 0
                    st.stats.cycles += 1  # a stage ends at a rejection (or at the end)
                record["committed"] = [out.to_dict()]
                st.add_trace(record)
                if st.done:
                    if self.stage_position:
                        st.stats.cycles += 1
                    self.stop = True
                self.cond.notify_all()

    def _estimate(self, prefix: Prefix, step: Step | None, epoch: int) -> tuple[float, float]:
        """(predicted acceptance, seconds) of a new draft (draft thread, without the lock); 0 when unused."""
        st = self.state
        if self.costs is None or step is None or epoch != self.epoch or not st.acceptable(step):
            return 0.0, 0.0
        t0 = time.perf_counter()
        value = st.opts.depth.estimate(prefix, step)
        return value, time.perf_counter() - t0

    def _depth_decision(self) -> dict | None:
        """gamma=adaptive (call with cond held): skip the first pending draft when, on its own estimate, it does
        not pay (the target writes the step). Only that draft's estimate decides, so the output does not depend
        on how far the draft thread has run ahead; like `keep_drafting`, the drafts after it are forecast at its
        estimate (judged alone, one draft never pays where a batch row costs nearly a step, and every draft of
        an easy stretch was drafted and then thrown away). That draft exists: its cost is sunk, as in the kept
        depth (`_verified_depth`), so the two agree on whether it is worth a target row."""
        if self.costs is None:
            return None
        depth, gamma = self.state.opts.depth, self.state.opts.gamma
        first = self.estimates[0]
        skipped = not depth.pays(first, self.costs, gamma, drafted=1)
        self.state.stats.record_depth(len(self.drafts), 0 if skipped else self._verified_depth())
        return {"skipped": skipped, "estimate": first, "pending": len(self.drafts)}

    def _judge(self, dstep: Step, target_step: Step, context: StepContext, seed_key: str, position: int) -> Verdict:
        """The verdict on the first pending draft (main thread, without the lock)."""
        st, verifier = self.state, self.verifier
        reason = st.unacceptable(dstep) or ("empty" if verifier.needs_features and not dstep.text else None)
        if reason is not None:
            with self.cond:
                st.stats.refused += 1
            return refused(reason)
        item = VerifyItem(context, dstep.text, target_step.text, seed=seed_for(st.opts.seed, "accept", seed_key, 0),
                          meta={"position": position, "branch": 0})
        if verifier.needs_features:
            prefix = Prefix(st.question, tuple(st.committed), st.opts.delimiter)
            for role, engine in (("target", self.target), ("draft", self.draft)):
                # scoring runs beside the worker threads: its passes are booked as scoring time only
                sc = engine.score(prefix, [dstep.text], hidden=True, layers=verifier.layers(role))
                with self.cond:
                    st.stats.score_time_s += sc.stats.seconds
                if role == "target":
                    item.target_features = verifier.pooled(sc.steps[0], role)
                else:
                    item.draft_features = verifier.pooled(sc.steps[0], role)
        t0 = time.perf_counter()
        verdict = verifier.verify([item])[0]
        with self.cond:
            st.stats.verify_time_s += time.perf_counter() - t0
            st.stats.record_decisions([verdict])
        return verdict

    def _draft_expected(self) -> bool:
        """Will the draft thread produce the draft for the first uncommitted position?"""
        return self._can_draft()


def lookahead_async(question: str, target, draft, verifier: Verifier, opts: DecodeOptions) -> GenerationResult:
    """Async Lookahead Reasoning (W = 1): drafting, target steps and verification overlap."""
    check_verifier(verifier, draft)
    if opts.width != 1:
        raise ValueError("async Lookahead Reasoning runs one branch per position (width = 1); "
                         "use lr_sync for multi-branch drafting")
    if target is draft:
        raise ValueError("async Lookahead Reasoning drives the draft and target engines from two threads; "
                         "give it two engine objects (they may share the model weights)")
    state = GenState(question, target, draft, opts, "lr_async")
    run = _AsyncRun(state, target, draft, verifier)
    threads = [threading.Thread(target=run.draft_worker, name="lr-draft", daemon=True),
               threading.Thread(target=run.target_worker, name="lr-target", daemon=True)]
    for t in threads:
        t.start()
    try:
        run.run()
        result = state.finish("lr_async")
    finally:
        with run.cond:
            run.stop = True
            run.cond.notify_all()
        for t in threads:
            t.join()
    if run.error is not None:
        raise run.error
    return result
