"""The adaptive lookahead depth (probes.adaptive_gamma): pure rules on scripted estimates, checked against
brute-force enumeration of the accept/reject outcomes and against Lookahead Reasoning's sync formula."""
from __future__ import annotations

import itertools
import random

import pytest

from specprobe.probes.adaptive_gamma import (
    batch_cost,
    best_depth,
    chosen_depth,
    drafting_plan,
    expected_committed,
    expected_speedup,
    keep_drafting,
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


def brute_best(a, c, b):
    speed = [brute_committed(a, k) / (k * c + batch_cost(b, k + 1)) for k in range(len(a) + 1)]
    best = max(speed)
    return min(k for k, s in enumerate(speed) if s >= best - 1e-12)


def test_expected_length_and_best_depth_match_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        a = [rng.random() for _ in range(n)]
        c = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0])
        b = rng.choice([None, [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45], [1.0, 1.8, 2.6, 3.4, 4.2, 5.0, 5.8]])
        for k in range(n + 1):
            assert expected_committed(a, k) == pytest.approx(brute_committed(a, k))
        assert best_depth(a, c, b) == brute_best(a, c, b)


def test_constant_acceptance_and_free_batching_is_the_sync_formula():
    for alpha in (0.3, 0.6, 0.9):
        for k in range(0, 6):
            assert expected_speedup([alpha] * 6, k, 0.1) == pytest.approx(float(sync_speedup(alpha, 0.1, k + 1)))


def test_always_draft_to_gamma_max_when_every_step_is_accepted_and_the_batch_is_free():
    assert best_depth([1.0] * 8, 0.1, None, gamma_max=5) == 5
    assert all(keep_drafting([1.0] * i, 0.1, None, 5) for i in range(5)) and not keep_drafting([1.0] * 5, 0.1, None, 5)
    assert chosen_depth([1.0] * 8, 0.1, None, 5) == 5


def test_never_draft_when_the_first_step_is_hopeless_or_the_batch_is_dear():
    assert drafting_plan([0.01, 0.9, 0.9], 0.1, None, 3) == (1, 0)  # drafts step 1, learns a_1, drops it
    assert not keep_drafting([0.01], 0.1, None, 3)
    # CPU-like batch cost b(k) = k with c = 1: every drafted step costs more than it can return
    assert best_depth([0.99] * 4, 1.0, lambda rows: float(rows)) == 0


def test_the_sequential_policy_stops_where_the_gain_changes_sign():
    """With exact forecasts (constant estimates) the policy's depth is the brute-force best depth; an easy
    stretch then a hard step stops before the hard step when the batch costs something."""
    b = [1.0, 1.05, 1.12, 1.2, 1.3, 1.42, 1.56]
    for alpha in (0.2, 0.5, 0.7, 0.9, 0.97):
        for c in (0.05, 0.2, 0.5):
            best = brute_best([alpha] * 6, c, b)
            # no step is drafted past the best depth (wasted draft work), none short of it
            assert drafting_plan([alpha] * 6, c, b, 6) == (max(best, 1), best), (alpha, c)
    assert chosen_depth([0.95, 0.95, 0.95, 0.05, 0.95, 0.95], 0.1, b, 6) == 3


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        best_depth([1.2], 0.1)
    with pytest.raises(ValueError, match="c "):
        best_depth([0.5], -1.0)
    with pytest.raises(ValueError, match="gamma_max"):
        keep_drafting([0.5], 0.1, None, 0)
    assert batch_cost([1.0, 1.5], 4) == pytest.approx(2.5)  # extended linearly past the measured rows
