"""Lookahead Reasoning (paper 000): step-level speculation checked against the target's own steps.

Sync cycle (their Alg. 1, with W >= 1 branches):
1. The draft writes a tree of depth g = min(γ, steps left − 1): W candidate steps after the committed
   output, W children after each candidate, ... (W = 1: one chain ŝ₀..ŝ_{g−1}, drafted sequentially;
   each level of a tree is one draft batch).
2. ONE target batch writes a step after every prefix in the tree: the committed output x (s₀), and
   x ⊕ path for every draft node that could be accepted (x ⊕ ŝ₀..ŝ_{j−1} for a chain: γ+1 rows).
3. The verifier judges every (draft child, target step at its parent) pair in one call. Walking from the
   root, the first accepted branch at each position is kept; at the first position with none, the
   target's step there is appended; when the walk reaches a leaf, that leaf's target step is a bonus.
   A draft cut by the step-token cap is never accepted.

Async (W = 1): a draft thread keeps up to γ drafts beyond the committed output; a target thread starts
the target step for a position the moment its prefix exists and adds it to its running batch
(continuous batching, `DecodeBatch.add`); the main thread verifies positions in order. A rejection
commits the target's step, drops every draft and cancels every target row (an epoch counter makes late
results harmless). Because every generation and draw is keyed by its prefix (see common.seed_for), the
output does not depend on thread timing — only the wall time does — up to the floating-point
differences between batch compositions (in float32 these practically never change a token; in
bfloat16 they can flip a near-tie, and with it the rest of the text).

Target-only and draft-only baselines run through the same sync loop with γ = 0 (one target row per
cycle, no drafts).
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field

from infer.engines.base import Step
from infer.decoding.common import DecodeOptions, GenerationResult, GenState, seed_for, step_record
from infer.verifiers import StepContext, Verdict, Verifier, VerifyItem


@dataclass
class _Node:
    depth: int
    branch: int
    parent: "_Node | None"
    draft: Step | None = None  # None at the root
    draft_tokens: int = 0  # in target tokens
    path: list[str] = field(default_factory=list)  # draft texts from the root to this node
    path_tokens: int = 0
    branches: list[int] = field(default_factory=list)  # branch index at every depth from the root
    children: list["_Node"] = field(default_factory=list)
    target: Step | None = None
    verdict: Verdict | None = None
    target_prefix: str = ""


ASYNC_SWITCH_INTERVAL = 0.0005  # seconds; Python's default is 0.005


def _length_cut_verdict() -> Verdict:
    return Verdict(False, float("nan"), 0.0, {"reason": "length"})


# ----------------------------------------------------------------------------- sync
def _draft_tree(state: GenState, draft, g: int, width: int) -> tuple[_Node, list[_Node]]:
    root = _Node(0, 0, None)
    nodes: list[_Node] = []
    frontier = [root]
    opts = state.opts
    for depth in range(1, g + 1):
        expand = [n for n in frontier if n is root or (state.acceptable(n.draft) and n.draft.stop_reason != "eos")]
        expand = [n for n in expand if state.cap(n.path_tokens) >= 1]
        if not expand:
            break
        prefixes, seeds, caps, parents = [], [], [], []
        for n in expand:
            prefix = state.prefix(draft, n.path)
            for w in range(width):
                prefixes.append(prefix)
                seeds.append(seed_for(opts.seed, "draft", prefix, w))
                caps.append(state.cap(n.path_tokens))
                parents.append((n, w))
        steps = state.generate(draft, "draft", prefixes, seeds, caps, opts.draft_params)
        if len(steps) == 1:
            state.keep(0)  # a chain: the next draft step extends this one
        frontier = []
        for (parent, w), step in zip(parents, steps):
            ntok = state.count_tokens(step, draft)
            child = _Node(depth, w, parent, step, ntok, parent.path + [step.text], parent.path_tokens + ntok,
                          parent.branches + [w])
            parent.children.append(child)
            frontier.append(child)
            nodes.append(child)
    return root, nodes


def _probe_features(state: GenState, target, draft, verifier, root: _Node, nodes: list[_Node]) -> None:
    """Teacher-forced hidden states of every draft node under both models (probe verifier)."""
    t0 = time.perf_counter()
    parents = [root] + [n for n in nodes if n.children]
    for parent in parents:
        kids = [c for c in parent.children if state.acceptable(c.draft) and c.draft.text]
        if not kids:
            continue
        texts = [c.draft.text for c in kids]
        for role, engine in (("target", target), ("draft", draft)):
            scored = engine.score(state.prefix(engine, parent.path), texts, hidden=True, layers=verifier.layers(role))
            for c, sc in zip(kids, scored):
                setattr(c, f"_{role}_features", verifier.pooled(sc, role))
    state.stats.score_time_s += time.perf_counter() - t0


def _verify_tree(state: GenState, verifier: Verifier, root: _Node, nodes: list[_Node]) -> None:
    items, owners = [], []
    for parent in [root] + nodes:
        if parent.target is None:
            continue
        ctx = StepContext(state.question, tuple(state.texts(parent.path)))
        for child in parent.children:
            if not state.acceptable(child.draft):
                child.verdict = _length_cut_verdict()
                continue
            if verifier.needs_features and not child.draft.text:
                child.verdict = Verdict(False, float("nan"), 0.0, {"reason": "empty"})
                continue
            items.append(VerifyItem(ctx, child.draft.text, parent.target.text,
                                    getattr(child, "_draft_features", None), getattr(child, "_target_features", None),
                                    seed_for(state.opts.seed, "accept", parent.target_prefix, child.branch),
                                    {"position": parent.depth, "branch": child.branch}))
            owners.append(child)
    if not items:
        return
    t0 = time.perf_counter()
    for child, verdict in zip(owners, verifier.verify(items)):
        child.verdict = verdict
    state.stats.verify_time_s += time.perf_counter() - t0


def _sync_cycle(state: GenState, target, draft, verifier: Verifier | None, gamma: int, width: int,
                target_role: str) -> None:
    opts = state.opts
    g = max(0, min(gamma, state.steps_left - 1))
    cycle = state.stats.cycles
    if g > 0:
        root, nodes = _draft_tree(state, draft, g, width)
    else:
        root, nodes = _Node(0, 0, None), []
    # one target batch: the root and every node whose draft could be accepted (and is not EOS)
    rows = [root] + [n for n in nodes if state.acceptable(n.draft) and n.draft.stop_reason != "eos"
                     and state.cap(n.path_tokens) >= 1]
    params = opts.target_params if target_role == "target" else opts.draft_params
    for n in rows:
        n.target_prefix = state.prefix(target, n.path)
    steps = state.generate(target, "target" if target_role == "target" else "draft",
                           [n.target_prefix for n in rows],
                           [seed_for(opts.seed, target_role, n.target_prefix, 0) for n in rows],
                           [state.cap(n.path_tokens) for n in rows], params)
    for n, s in zip(rows, steps):
        n.target = s
    exports = state.exports
    if nodes:
        if verifier.needs_features:
            _probe_features(state, target, draft, verifier, root, nodes)
        _verify_tree(state, verifier, root, nodes)
    # walk
    committed, positions = [], []
    node = root
    while True:
        if node.children:
            chosen = next((c for c in node.children if c.verdict is not None and c.verdict.accepted), None)
            positions.append({"position": node.depth, "accepted": chosen is not None,
                              "branch": None if chosen is None else chosen.branch})
            state.stats.record_position(node.depth, chosen is not None)
        else:
            chosen = None
        if chosen is None:
            out = state.commit(node.target, target_role, state.count_tokens(node.target, target))
            committed.append(out.to_dict())
            state.exports = exports
            state.keep(next(i for i, n in enumerate(rows) if n is node))  # its KV is the new prefix
            break
        out = state.commit(chosen.draft, "draft", chosen.draft_tokens)
        committed.append(out.to_dict())
        node = chosen
        if state.done or node.target is None:
            break
    state.stats.cycles += 1
    state.add_trace({
        "cycle": cycle, "start_step": len(state.steps) - len(committed),
        "drafts": [step_record(n.draft, n.draft_tokens, depth=n.depth - 1, branch=n.branch, path=n.branches,
                               verdict=None if n.verdict is None else n.verdict.to_dict()) for n in nodes],
        "targets": [step_record(n.target, depth=n.depth) for n in rows],
        "positions": positions, "committed": committed,
    })


def _sync_loop(question: str, target, draft, verifier: Verifier | None, opts: DecodeOptions, gamma: int,
               width: int, method: str, target_role: str = "target") -> GenerationResult:
    state = GenState(question, target, draft if gamma > 0 else None, opts, method)
    while not state.done:
        _sync_cycle(state, target, draft, verifier, gamma, width, target_role)
    return state.finish(method)


def _check_verifier(verifier: Verifier | None, draft) -> None:
    if verifier is None:
        raise ValueError("speculative decoding needs a verifier (see infer.verifiers.build_verifier)")
    if draft is None:
        raise ValueError("speculative decoding needs a draft engine")


def target_only(question: str, target, opts: DecodeOptions) -> GenerationResult:
    """The baseline: the target writes every step (the sync loop with no drafts)."""
    return _sync_loop(question, target, None, None, opts, 0, 1, "target")


def draft_only(question: str, draft, opts: DecodeOptions) -> GenerationResult:
    """The draft writes every step (its own chat template and sampling parameters)."""
    return _sync_loop(question, draft, None, None, opts, 0, 1, "draft", target_role="draft")


def lookahead_sync(question: str, target, draft, verifier: Verifier, opts: DecodeOptions) -> GenerationResult:
    """Sync Lookahead Reasoning with γ = opts.gamma and W = opts.width branches per position."""
    _check_verifier(verifier, draft)
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
        self.prefixes: dict[tuple[int, int], str] = {}
        self.stop = False
        self.error: BaseException | None = None
        self.stage_position = 0  # position within the current stage (since the last rejection)

    # ---------------------------------------------------------------- helpers (call with cond held)
    def _draft_tokens(self, upto: int | None = None) -> int:
        return sum(t for _, t in self.drafts[:upto])

    def _can_draft(self) -> bool:
        st, opts = self.state, self.state.opts
        if self.stop or st.done or len(self.drafts) >= opts.gamma:
            return False
        if self.drafts and (not st.acceptable(self.drafts[-1][0]) or self.drafts[-1][0].stop_reason == "eos"):
            return False
        if len(st.steps) + len(self.drafts) >= opts.max_steps:
            return False
        return st.cap(self._draft_tokens()) >= 1

    def _pending_target_jobs(self) -> list[tuple[tuple[int, int], str, int]]:
        st = self.state
        base = len(st.steps)
        jobs = []
        for j in range(len(self.drafts) + 1):
            n = base + j
            key = (self.epoch, n)
            if key in self.launched or n >= st.opts.max_steps:
                continue
            if j > 0:
                d = self.drafts[j - 1][0]
                if not st.acceptable(d) or d.stop_reason == "eos":
                    break
            cap = st.cap(self._draft_tokens(j))
            if cap < 1:
                break
            prefix = st.prefix(self.target, [d.text for d, _ in self.drafts[:j]])
            jobs.append((key, prefix, cap))
        return jobs

    def _fail(self, err: BaseException) -> None:
        with self.cond:
            self.error = self.error or err
            self.stop = True
            self.cond.notify_all()

    # ---------------------------------------------------------------- workers
    def draft_worker(self) -> None:
        from infer.engines.decode import RowSpec

        st, opts = self.state, self.state.opts
        try:
            while True:
                with self.cond:
                    while not self.stop and not self._can_draft():
                        self.cond.wait()
                    if self.stop:
                        return
                    epoch, n = self.epoch, len(st.steps) + len(self.drafts)
                    prefix = st.prefix(self.draft, [d.text for d, _ in self.drafts])
                    cap = st.cap(self._draft_tokens())
                t0 = time.perf_counter()
                batch = self.draft.open_batch(opts.draft_params)
                result = dict(batch.add([RowSpec(0, self.draft.encode_prefix(prefix), cap,
                                                 seed_for(opts.seed, "draft", prefix, 0))]))
                iterations, stale = 1, False
                while len(batch):
                    with self.cond:  # abandon a draft that a rejection made useless
                        stale = self.stop or epoch != self.epoch
                    if stale:
                        break
                    result.update(batch.step())
                    iterations += 1
                dt = time.perf_counter() - t0
                with self.cond:
                    step = result.get(0)
                    if step is None or self.stop or epoch != self.epoch or n != len(st.steps) + len(self.drafts):
                        st.stats.draft_abandoned += 1
                        st.stats.draft_abandoned_s += dt
                        continue
                    st.book("draft", dt, 1, step.num_tokens, iterations)
                    self.drafts.append((step, st.count_tokens(step, self.draft)))
                    self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            self._fail(err)

    def target_worker(self) -> None:
        from infer.engines.decode import RowSpec

        st, opts = self.state, self.state.opts
        batch = self.target.open_batch(opts.target_params)
        try:
            while True:
                with self.cond:
                    while not self.stop and not len(batch) and not self._pending_target_jobs():
                        self.cond.wait()
                    if self.stop:
                        return
                    stale = [k for k in batch.keys if k[0] != self.epoch]
                    jobs = self._pending_target_jobs()
                    for key, prefix, _ in jobs:
                        self.launched.add(key)
                        self.prefixes[key] = prefix
                t0 = time.perf_counter()
                batch.remove(stale)
                specs = [RowSpec(key, self.target.encode_prefix(prefix), cap, seed_for(opts.seed, "target", prefix, 0))
                         for key, prefix, cap in jobs]
                finished = batch.add(specs) if specs else []
                rows = len(batch)
                if rows:
                    finished += batch.step()
                dt = time.perf_counter() - t0
                with self.cond:
                    stt = st.stats
                    stt.target_time_s += dt
                    stt.target_iterations += 1
                    stt.target_row_iterations += rows
                    stt.target_rows += len(specs)
                    stt.target_calls += 1 if specs else 0
                    for key, step in finished:
                        stt.target_generated_tokens += step.num_tokens
                        if key[0] == self.epoch:
                            self.results[key] = step
                    if finished:
                        self.cond.notify_all()
        except BaseException as err:  # noqa: BLE001
            self._fail(err)

    # ---------------------------------------------------------------- commit loop (main thread)
    def run(self) -> None:
        st, verifier = self.state, self.verifier
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
                prefix = self.prefixes[key]
                position = self.stage_position
            verdict = None
            if d is not None:
                dstep = d[0]
                if not st.acceptable(dstep):
                    verdict = _length_cut_verdict()
                elif verifier.needs_features and not dstep.text:
                    verdict = Verdict(False, float("nan"), 0.0, {"reason": "empty"})
                else:
                    item = VerifyItem(context, dstep.text, s.text, seed=seed_for(st.opts.seed, "accept", prefix, 0),
                                      meta={"position": position, "branch": 0})
                    if verifier.needs_features:
                        t0 = time.perf_counter()
                        for role, engine in (("target", self.target), ("draft", self.draft)):
                            pre = engine.format_prefix(st.question, context.steps, st.opts.delimiter)
                            sc = engine.score(pre, [dstep.text], hidden=True, layers=verifier.layers(role))[0]
                            setattr(item, f"{role}_features", verifier.pooled(sc, role))
                        st.stats.score_time_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    verdict = verifier.verify([item])[0]
                    st.stats.verify_time_s += time.perf_counter() - t0
            with self.cond:
                record = {"cycle": st.stats.cycles, "start_step": n, "positions": [], "targets": [step_record(s)],
                          "drafts": [] if d is None else [step_record(d[0], d[1], depth=position, branch=0,
                                                                         verdict=verdict.to_dict())]}
                if verdict is not None:
                    st.stats.record_position(position, verdict.accepted)
                    record["positions"].append({"position": position, "accepted": verdict.accepted, "branch": 0})
                if verdict is not None and verdict.accepted:
                    out = st.commit(d[0], "draft", d[1])
                    self.drafts.pop(0)
                    self.stage_position += 1
                else:
                    out = st.commit(s, "target", st.count_tokens(s, self.target))
                    self.drafts.clear()
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

    def _draft_expected(self) -> bool:
        """Will the draft thread produce the draft for the first uncommitted position?"""
        return self._can_draft()


def lookahead_async(question: str, target, draft, verifier: Verifier, opts: DecodeOptions) -> GenerationResult:
    """Async Lookahead Reasoning (W = 1): drafting, target steps and verification overlap."""
    _check_verifier(verifier, draft)
    if opts.width != 1:
        raise ValueError("async Lookahead Reasoning runs one branch per position (width = 1); "
                         "use lr_sync for multi-branch drafting")
    state = GenState(question, target, draft, opts, "lr_async")
    run = _AsyncRun(state, target, draft, verifier)
    threads = [threading.Thread(target=run.draft_worker, name="lr-draft", daemon=True),
               threading.Thread(target=run.target_worker, name="lr-target", daemon=True)]
    # torch releases the GIL inside its kernels, but the Python between them (most of a small draft
    # model's time) holds it; a short switch interval keeps the target thread from waiting 5 ms for it
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, ASYNC_SWITCH_INTERVAL))
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
        sys.setswitchinterval(interval)
    if run.error is not None:
        raise run.error
    return result
