"""The adaptive lookahead depth (probes.adaptive_gamma): pure rules on scripted estimates, checked against
brute-force enumeration of the accept/reject outcomes and against Lookahead Reasoning's sync formula."""
from __future__ import annotations

import itertools
import random

import pytest

from specprobe.probes.adaptive_gamma import (
    CycleCosts,
    batch_cost,
    best_depth,
    drafting_plan,
    expected_committed,
    expected_speedup,
    forecast_pays,
    keep_drafting,
    kept_depth,
    level_acceptance,
)
from specprobe.probes.speedup import sync_speedup


def brute_committed(a, k):
    """E[committed] by enumerating every accept/reject outcome of k independent drafts."""
    total = 0.0
    for outcome in itertools.product((0, 1), repeat=k):
        prob = 1.0
        for x, ok in zip(a, outcome):
            prob *= x if ok else 1 - x
        lead = next((i for i, ok in enumerate(outcome) if not ok), k)
        total += prob * (lead + 1)  # the accepted prefix, then the target's step
    return total


def brute_semanticspec(a, k, c, v, drafted=0):
    """(E[committed], E[cost still to pay]) of a SemanticSpec cycle keeping k steps with `drafted` drafted
    already, by enumeration: accepted drafts are committed up to the first rejection, where the target writes
    that step (cost 1)."""
    if k == 0:
        return 1.0, 1.0
    committed = cost = 0.0
    for outcome in itertools.product((0, 1), repeat=k):
        prob = 1.0
        for x, ok in zip(a, outcome):
            prob *= x if ok else 1 - x
        lead = next((i for i, ok in enumerate(outcome) if not ok), k)
        rejected = lead < k
        committed += prob * (lead + rejected)
        cost += prob * (max(k - drafted, 0) * c + v[k - 1] + rejected)
    return committed, cost


def brute_best(a, c, b, drafted=0):
    """The best depth by enumeration; the first `drafted` steps' draft cost is sunk (not charged)."""
    speed = [1.0] + [brute_committed(a, k) / (max(k - drafted, 0) * c + batch_cost(b, k + 1))
                     for k in range(1, len(a) + 1)]
    best = max(speed)
    return min(k for k, s in enumerate(speed) if s >= best - 1e-12)


def lr(c, b=None, width=1):
    return CycleCosts(c, b=b, width=width)


def test_expected_length_and_best_depth_match_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        a = [rng.random() for _ in range(n)]
        c = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0])
        b = rng.choice([None, [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45], [1.0, 1.8, 2.6, 3.4, 4.2, 5.0, 5.8]])
        for k in range(n + 1):
            assert expected_committed(a, k) == pytest.approx(brute_committed(a, k))
        assert best_depth(a, lr(c, b)) == brute_best(a, c, b)
        for drafted in range(1, n + 1):
            assert best_depth(a, lr(c, b), drafted=drafted) == brute_best(a, c, b, drafted)
        assert kept_depth(a, lr(c, b), n) == brute_best(a, c, b, n)


def test_constant_acceptance_and_free_batching_is_the_sync_formula():
    for alpha in (0.3, 0.6, 0.9):
        for k in range(0, 6):
            assert expected_speedup([alpha] * 6, k, lr(0.1)) == pytest.approx(float(sync_speedup(alpha, 0.1, k + 1)))


def test_always_draft_to_gamma_max_when_every_step_is_accepted_and_the_batch_is_free():
    assert best_depth([1.0] * 8, lr(0.1), gamma_max=5) == 5
    assert all(keep_drafting([1.0] * i, lr(0.1), 5) for i in range(5)) and not keep_drafting([1.0] * 5, lr(0.1), 5)
    assert drafting_plan([1.0] * 8, lr(0.1), 5) == (5, 5)
    # SemanticSpec with a fixed cost per target pass: one pass over more sure steps is cheaper per step
    assert drafting_plan([1.0] * 8, CycleCosts(0.1, v=lambda k: 0.05, kind="semanticspec"), 5) == (5, 5)


def test_never_draft_when_the_first_step_is_hopeless_or_the_batch_is_dear():
    dear = [1.0, 1.05, 1.1, 1.15]
    assert drafting_plan([0.01, 0.9, 0.9], lr(0.1, dear), 3) == (1, 0)  # drafts step 1, learns a_1, drops it
    assert not keep_drafting([0.01], lr(0.1, dear), 3)
    # with a free batch the drafted step's verification costs nothing: kept, however unlikely
    assert drafting_plan([0.01, 0.9, 0.9], lr(0.1), 3) == (1, 1)
    assert drafting_plan([0.01, 0.9, 0.9], CycleCosts(0.1, v=[0.1, 0.1, 0.1], kind="semanticspec"), 3) == (1, 0)
    # CPU-like batch cost b(k) = k with c = 1: every drafted step costs more than it can return
    assert best_depth([0.99] * 4, lr(1.0, lambda rows: float(rows))) == 0


def test_the_sequential_policy_stops_where_the_gain_changes_sign():
    """With exact forecasts (constant estimates) the policy's depth is the brute-force best depth; an easy
    stretch then a hard step stops before the hard step when the batch costs something."""
    b = [1.0, 1.05, 1.12, 1.2, 1.3, 1.42, 1.56]
    for alpha in (0.2, 0.5, 0.7, 0.9, 0.97):
        for c in (0.05, 0.2, 0.5):
            best = brute_best([alpha] * 6, c, b)
            drafted = max(best, 1)
            # no step is drafted past the best depth (wasted draft work), none short of it; what was drafted is
            # kept when its verification alone pays (its draft cost is sunk)
            assert drafting_plan([alpha] * 6, lr(c, b), 6) == (drafted, brute_best([alpha] * drafted, c, b, drafted))
            if best > 0:
                assert brute_best([alpha] * drafted, c, b, drafted) == best, (alpha, c)
    assert drafting_plan([0.95, 0.95, 0.95, 0.05, 0.95, 0.95], lr(0.1, b), 6) == (4, 3)


def test_the_kept_depth_does_not_charge_the_drafted_steps_again():
    """On the H100's 1.5B -> 7B costs (c ~ 0.5, b(2) ~ 1.09), a drafted step at a = 0.55 does not pay before it
    is drafted, but once drafted its verification alone does: it is kept, not thrown away (the target would
    then write the step and the draft work was spent for nothing)."""
    costs = lr(0.515, [1.0, 1.089, 1.145])
    assert best_depth([0.55], costs) == 0 and not forecast_pays(0.55, costs, 1)
    assert kept_depth([0.55], costs, 1) == 1 and drafting_plan([0.55], costs, 1) == (1, 1)
    assert kept_depth([0.05], costs, 1) == 0  # (1 + 0.05) / 1.089 < 1: still dropped when hopeless
    assert forecast_pays(0.55, costs, 1, drafted=1) and not forecast_pays(0.05, costs, 1, drafted=1)
    ss = CycleCosts(0.515, v=[0.1, 0.1], kind="semanticspec")  # kept: 1 / (0.1 + 0.45) > 1; drafted: 1 / 1.065 < 1
    assert best_depth([0.55], ss) == 0 and kept_depth([0.55], ss, 1) == 1


def test_the_forecast_skip_drafts_when_a_cycle_at_that_estimate_pays():
    """forecast_pays(e) is: some depth k >= 1 beats the target alone when every step is accepted with e, by
    enumeration; it says yes at e = 1 with a free batch, no at e = 0, and flips once as e grows."""
    b = [1.0, 1.3, 1.6, 1.9, 2.2]
    for costs in (lr(0.2, b), CycleCosts(0.2, v=[0.2, 0.22, 0.24, 0.26], kind="semanticspec")):
        answers = []
        for e in [i / 40 for i in range(41)]:
            if costs.kind == "lookahead":
                speeds = [brute_committed([e] * k, k) / (k * 0.2 + batch_cost(b, k + 1)) for k in range(1, 5)]
            else:
                speeds = [x / y for x, y in (brute_semanticspec([e] * k, k, 0.2, costs.v) for k in range(1, 5))]
            answers.append(forecast_pays(e, costs, 4))
            assert answers[-1] == (max(speeds) > 1.0 + 1e-12), (costs.kind, e)
        assert answers[0] is False and answers[-1] is True
        assert answers == sorted(answers)  # one flip: no at low estimates, yes at high ones
    assert forecast_pays(1.0, lr(0.0), 3) and not forecast_pays(0.0, lr(0.0), 3)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        best_depth([1.2], lr(0.1))
    with pytest.raises(ValueError, match="c "):
        lr(-1.0)
    with pytest.raises(ValueError, match="cycle kind"):
        CycleCosts(0.1, kind="token")
    with pytest.raises(ValueError, match="gamma_max"):
        keep_drafting([0.5], lr(0.1), 0)
    with pytest.raises(ValueError, match="gamma_max"):
        forecast_pays(0.5, lr(0.1), 0)
    assert batch_cost([1.0, 1.5], 4) == pytest.approx(2.5)  # extended linearly past the measured rows


def test_semanticspec_cycle_matches_brute_force():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(1, 6)
        a = [rng.random() for _ in range(n)]
        c = rng.choice([0.0, 0.05, 0.2, 0.5])
        v = [rng.choice([0.0, 0.05, 0.3]) * (1 + 0.2 * i) for i in range(n)]
        costs = CycleCosts(c, v=v, kind="semanticspec")
        speeds = []
        for k in range(n + 1):
            committed, cost = brute_semanticspec(a, k, c, v)
            assert expected_committed(a, k, "semanticspec") == pytest.approx(committed)
            assert expected_speedup(a, k, costs) == pytest.approx(committed / cost)
            speeds.append(committed / cost)
            if k:
                sunk = brute_semanticspec(a, k, c, v, drafted=n)
                assert expected_speedup(a, k, costs, drafted=n) == pytest.approx(sunk[0] / sunk[1])
        best = max(speeds)
        assert best_depth(a, costs) == min(k for k, s in enumerate(speeds) if s >= best - 1e-12)


def test_semanticspec_drafts_deeper_than_lookahead_when_the_batch_is_dear():
    """SemanticSpec pays no batch: with CPU-like b(k) = k Lookahead Reasoning should not draft, SemanticSpec
    at cheap scoring should draft to gamma_max on easy steps."""
    a = [0.9] * 6
    assert best_depth(a, lr(0.05, lambda rows: float(rows))) == 0
    assert best_depth(a, CycleCosts(0.05, v=[0.05] * 6, kind="semanticspec")) >= 4


def test_multi_branch_rows_and_level_acceptance():
    costs = lr(0.1, lambda rows: float(rows), width=2)
    assert [costs.rows(k) for k in range(4)] == [1, 3, 7, 15]
    assert expected_speedup([0.5, 0.5], 2, costs) == pytest.approx((1 + 0.5 + 0.25) / (0.2 + 7.0))
    assert level_acceptance([0.5, 0.7], 2) == pytest.approx(1 - 0.4 ** 2)
    assert level_acceptance([0.3], 1) == pytest.approx(0.3)
