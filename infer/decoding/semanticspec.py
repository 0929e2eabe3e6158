"""SemanticSpec decoding (Alg. 1 of the SemanticSpec paper): probes decide, the target only regenerates on rejection.

One cycle:
1. The draft writes γ' = min(γ, steps left) steps s̃₁..s̃_γ' one after the other (it stops early at an
   EOS step or a step cut by the token cap).
2. ONE teacher-forced target pass over context ⊕ s̃₁..s̃_γ' (`score_chain`) gives the target's hidden
   states of every draft step; the draft's own hidden states of the same steps come from one
   teacher-forced draft pass (the draft wrote them, so this is what it saw).
3. Step by step: accept s̃_i with probability min(1, p_i / max(q_i, eps)) (p from the target probe, q
   from the draft probe; the draw is seeded by the prefix, see engines.base.seed_for). At the first rejection
   the target writes that step itself and the remaining drafts are dropped. When every draft passes the
   next cycle starts from the new prefix (no bonus step: the target pass wrote nothing).
A draft cut by the step-token cap, empty, ending the answer (EOS), or following a committed step that was cut
(`GenState.unacceptable`) is treated as rejected (the target rewrites it: the answer always ends on a target
step). Any
verifier that judges a draft without the target's own step also plugs in (bernoulli, accept_all,
reject_all); then no hidden states are read, but the target pass still runs, as in the algorithm.

gamma=adaptive (`DecodeOptions.depth`): step 1 stops early when the policy says one more draft does not pay
(`probes.adaptive_gamma`, SemanticSpec's cycle formula), and only the depth worth keeping goes to the target
pass; kept 0 drops the drafts and the target writes the step. With `forecast_skip`, a cycle whose steps,
forecast at the last estimate known, would not pay drafts nothing: the target writes the step, and the draft's
estimate of that step is the next forecast. The drop and the skip read only draft-side estimates; every draft
that is judged is judged by the same min(1, p/q) rule as with a fixed γ.

Drafts past the kept depth are not thrown away when every kept draft is accepted: the next cycle starts from
exactly the prefix they were drafted after (the same step objects, hence the same token ids), where the draft
would write them again (same prefix-keyed seed, same token cap), so they are reused with their estimates instead
of redrafted (`_Spare`). The output and every decision are those of redrafting; only the draft's work is saved.
The forecast skip decides first, as without reuse: a skipped cycle drops the spare drafts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specprobe.infer.decoding.common import (
    DecodeOptions,
    GenerationResult,
    GenState,
    check_verifier,
    refused,
    step_record,
)
from specprobe.infer.engines.base import Step, seed_for
from specprobe.infer.verifiers import StepContext, Verifier, VerifyItem


@dataclass
class _Spare:
    """Drafts written past the kept depth of a cycle whose kept drafts were all accepted, by where they were
    drafted: (the prefix's step objects, token cap) -> (step, estimate). Only the next cycle may use them. Keyed
    by identity, not text: a step that reads the same may hold other token ids."""

    drafts: dict[tuple[tuple[int, ...], int], tuple[Step, float]] = field(default_factory=dict)

    @staticmethod
    def key(prefix, cap: int) -> tuple[tuple[int, ...], int]:
        return tuple(map(id, prefix.steps)), cap


def semanticspec(question: str, target, draft, verifier: Verifier, opts: DecodeOptions) -> GenerationResult:
    check_verifier(verifier, draft)
    if verifier.needs_target_step:
        raise ValueError(f"SemanticSpec judges a draft step without the target's own step; the {verifier.name} "
                         "verifier needs one. Use probe (or bernoulli / accept_all / reject_all), or run "
                         "Lookahead Reasoning (lr_sync / lr_async) with this verifier")
    state = GenState(question, target, draft, opts, "semanticspec")
    spare = _Spare()
    while not state.done:
        spare = _cycle(state, target, draft, verifier, spare)
    return state.finish("semanticspec")


@dataclass
class _Drafted:
    """A cycle's drafts in order, with their token counts, their draft-side estimates (gamma=adaptive) and where
    each was drafted (its `_Spare` key)."""

    steps: list[Step] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    estimates: list[float] = field(default_factory=list)
    where: list[tuple[tuple[int, ...], int]] = field(default_factory=list)
    reused: int = 0  # drafts taken from the last cycle's spares


def _cycle(state: GenState, target, draft, verifier: Verifier, spare: _Spare) -> _Spare:
    """One cycle; returns the drafts the next cycle may reuse."""
    opts, stats = state.opts, state.stats
    cycle = stats.cycles
    g = min(opts.gamma, state.steps_left)  # >= 1 and cap() >= 1 while the generation runs
    costs = None if opts.depth is None else opts.depth.costs("semanticspec", 1, opts.gamma, target, draft,
                                                              opts.target_params)
    forecast = state.forecast  # what the skip decision reads (recorded with the cycle)
    if state.skip_drafting(costs, g):
        stats.record_depth(0, 0)
        _target_writes(state, target, cycle, {"drafted": 0, "kept": 0, "estimates": [], "skipped": True,
                                              "forecast": forecast})
        return _Spare()
    drafted = _draft(state, draft, g, costs, spare)
    stats.draft_steps_reused += drafted.reused
    depth_record, past_kept = None, _Spare()
    if costs is not None:  # keep the depth that pays; 0: the target writes the step (below, as on a rejection)
        depth_record, past_kept = _keep_what_pays(state, drafted, costs, g, forecast)
        if not drafted.steps:
            _target_writes(state, target, cycle, depth_record)
            return _Spare()
    drafts, tokens = drafted.steps, drafted.tokens
    committed, positions, verdicts = _judge(state, target, verifier, drafted,
                                            _features(state, target, draft, verifier, drafts))
    stats.cycles += 1
    state.add_trace({
        "cycle": cycle, "start_step": len(state.steps) - len(committed),
        "drafts": [step_record(d, t, depth=i, branch=0, verdict=v.to_dict() if i < len(verdicts) else None)
                   for i, (d, t, v) in enumerate(zip(drafts, tokens, verdicts + [None] * len(drafts)))],
        "targets": [], "positions": positions, "committed": committed,
        **({} if depth_record is None else {"depth": depth_record}),
    })
    # spares only after every kept draft passed: then the next prefix holds these very step objects (a rejected
    # draft's object is freed and its id may be taken by a new step)
    all_accepted = len(committed) == len(drafts) and all(c["source"] == "draft" for c in committed)
    return past_kept if all_accepted and not state.done else _Spare()


def _draft(state: GenState, draft, g: int, costs, spare: _Spare) -> _Drafted:
    """Step 1: up to g drafts one after the other, each taken from the spares where it was drafted before; stops
    at a draft that cannot be accepted, and (gamma=adaptive) where one more draft does not pay."""
    opts, out = state.opts, _Drafted()
    for _ in range(g):
        cap = state.cap(sum(out.tokens))
        if cap < 1:
            break
        prefix = state.prefix(out.steps)
        out.where.append(_Spare.key(prefix, cap))
        ready = spare.drafts.pop(out.where[-1], None)
        if ready is not None:
            step, estimate = ready
            out.reused += 1
        else:
            step = state.generate(draft, "draft", [prefix], [seed_for(opts.seed, "draft", state.key(prefix), 0)], [cap],
                                  opts.draft_params)[0]
            estimate = None if costs is None else state.estimate(prefix, step)
        out.steps.append(step)
        out.tokens.append(state.count_tokens(step, draft))
        if costs is not None:
            out.estimates.append(estimate)
        if not state.acceptable(step):
            break
        if costs is not None and not opts.depth.keep(out.estimates, costs, g):
            break
    return out


def _keep_what_pays(state: GenState, drafted: _Drafted, costs, g: int, forecast) -> tuple[dict, _Spare]:
    """gamma=adaptive: cut the drafts to the depth worth verifying (in place); the cycle's depth record, and the
    drafts past the kept depth for the next cycle."""
    drafts, estimates = drafted.steps, drafted.estimates
    usable = [e for d, e in zip(drafts, estimates) if state.acceptable(d)]
    state.forecast = usable[-1] if usable else state.forecast
    kept = state.opts.depth.kept(estimates, costs, g)
    state.stats.record_depth(len(drafts), kept)
    record = {"drafted": len(drafts), "kept": kept, "estimates": estimates, "forecast": forecast,
              "reused": drafted.reused}
    past_kept = _Spare({w: (d, e) for w, d, e in zip(drafted.where[kept:], drafts[kept:], estimates[kept:])})
    drafted.steps, drafted.tokens = drafts[:kept], drafted.tokens[:kept]
    return record, past_kept


def _features(state: GenState, target, draft, verifier: Verifier, drafts: list[Step]) -> dict:
    """Step 2: one teacher-forced target pass over all drafts (and the draft's own pass when the verifier reads
    probes); draft index -> (target's, draft's) pooled features, for the drafts with text."""
    texts = [d.text for d in drafts]
    scorable = [i for i, t in enumerate(texts) if t]
    need = verifier.needs_features
    chosen = [texts[i] for i in scorable]
    t_scored = state.score(target, "target", state.prefix(), chosen, chain=True, hidden=need,
                           layers=verifier.layers("target") if need else None) if scorable else []
    d_scored = state.score(draft, "draft", state.prefix(), chosen, chain=True,
                           layers=verifier.layers("draft")) if need and scorable else []
    if not need:
        return {}
    return {i: (verifier.pooled(ts, "target"), verifier.pooled(ds, "draft"))
            for i, ts, ds in zip(scorable, t_scored, d_scored)}


def _judge(state: GenState, target, verifier: Verifier, drafted: _Drafted, feats: dict) -> tuple[list, list, list]:
    """Step 3: decide in order (only the decisions the walk reaches are drawn); commit accepted drafts, and at the
    first rejection the target's own step. The committed records, the positions' verdicts, the verdicts."""
    stats, opts = state.stats, state.opts
    committed, positions, verdicts = [], [], []
    for i, step in enumerate(drafted.steps):
        prefix = state.prefix()
        reason = state.unacceptable(step) or (None if step.text else "empty")
        if reason is not None:
            verdict = refused(reason)
            stats.refused += 1
        else:
            tf, df = feats.get(i, (None, None))
            item = VerifyItem(StepContext(state.question, tuple(state.texts())), step.text, None, df, tf,
                              seed_for(opts.seed, "accept", state.accept_key(prefix), 0), {"position": i, "branch": 0})
            t0 = time.perf_counter()
            verdict = verifier.verify([item])[0]
            stats.verify_time_s += time.perf_counter() - t0
            stats.record_decisions([verdict])
        verdicts.append(verdict)
        stats.record_position(i, verdict.accepted)
        positions.append({"position": i, "accepted": verdict.accepted, "branch": 0})
        if verdict.accepted:
            committed.append(state.commit(step, "draft", drafted.tokens[i]).to_dict())
            if state.done:
                break
            continue
        committed.append(_target_step(state, target))
        break
    return committed, positions, verdicts


def _target_step(state: GenState, target) -> dict:
    """The target writes the next step itself (after a rejection, or when the policy drops the draft)."""
    prefix = state.prefix()
    step = state.generate(target, "target", [prefix], [seed_for(state.opts.seed, "target", state.key(prefix), 0)],
                          [state.cap()], state.opts.target_params)[0]
    return state.commit(step, "target", state.count_tokens(step, target)).to_dict()


def _target_writes(state: GenState, target, cycle: int, depth_record: dict) -> None:
    """A cycle whose drafts were all dropped by the depth policy, or that drafted none (forecast skip): one
    target step, no verification."""
    prefix = state.prefix()
    committed = [_target_step(state, target)]
    if depth_record.get("skipped") and not state.done:
        depth_record["target_estimate"] = state.forecast_written(prefix, state.committed[-1])
    state.stats.cycles += 1
    state.add_trace({"cycle": cycle, "start_step": len(state.steps) - 1, "drafts": [], "targets": [],
                     "positions": [], "committed": committed, "depth": depth_record})
