"""Acceptance rules: SemanticSpec's min(1, p/q), first-failure cut, branch choice."""
from __future__ import annotations

import numpy as np
import pytest

from probes.acceptance import (
    accept_all,
    bernoulli,
    choose_branch,
    first_failure,
    first_passing_branch,
    make_rng,
    reject_all,
    semantic_accept,
    semantic_accept_prob,
    semantic_accept_run,
    sync_cycle_output,
)


def test_accept_prob_values_and_vectorised():
    assert semantic_accept_prob(0.3, 0.6) == pytest.approx(0.5)
    assert semantic_accept_prob(0.9, 0.6) == 1.0  # target likes the meaning more than the draft: always accept
    assert semantic_accept_prob(0.0, 0.5) == 0.0
    out = semantic_accept_prob(np.array([0.1, 0.4, 1.0]), np.array([0.2, 0.2, 0.5]))
    np.testing.assert_allclose(out, [0.5, 1.0, 1.0])
    assert isinstance(semantic_accept_prob(0.1, 0.2), float)


def test_accept_prob_guards_small_q():
    assert semantic_accept_prob(0.0, 0.0) == 0.0  # 0 / eps, no NaN
    assert semantic_accept_prob(1e-7, 0.0, eps=1e-6) == pytest.approx(0.1)
    assert semantic_accept_prob(0.5, 0.0) == 1.0
    with pytest.raises(ValueError, match="eps"):
        semantic_accept_prob(0.5, 0.5, eps=0)


@pytest.mark.parametrize("p,q", [(-0.1, 0.5), (0.5, 1.2), (float("nan"), 0.5)])
def test_accept_prob_rejects_non_probabilities(p, q):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        semantic_accept_prob(p, q)


def test_semantic_accept_frequency_and_seeding():
    rng = make_rng(0)
    draws = [semantic_accept(0.3, 0.6, rng) for _ in range(20000)]
    assert np.mean(draws) == pytest.approx(0.5, abs=0.015)
    a = [semantic_accept(0.2, 0.5, make_rng(42)) for _ in range(3)]
    seq1 = [semantic_accept(0.2, 0.5, r) for r in [make_rng(7)] for _ in range(50)]
    seq2 = [semantic_accept(0.2, 0.5, r) for r in [make_rng(7)] for _ in range(50)]
    assert seq1 == seq2 and len(set(a)) == 1
    certain = make_rng(1)
    assert all(semantic_accept(0.8, 0.4, certain) for _ in range(1000))
    assert not any(semantic_accept(0.0, 0.4, certain) for _ in range(1000))


def test_bernoulli_bounds():
    rng = make_rng(3)
    assert all(bernoulli(1.0, rng) for _ in range(500)) and not any(bernoulli(0.0, rng) for _ in range(500))
    with pytest.raises(ValueError):
        bernoulli(1.5, rng)


def test_semantic_accept_run_stops_at_first_rejection():
    assert semantic_accept_run([0.5, 0.5, 0.5], [0.1, 0.1, 0.1], make_rng(0)) == 3
    assert semantic_accept_run([0.5, 0.0, 0.5], [0.1, 0.1, 0.1], make_rng(0)) == 1
    # expected accepted length with per-step prob 0.5 and 3 drafts: 0.5 + 0.25 + 0.125
    rng = make_rng(5)
    lengths = [semantic_accept_run([0.2] * 3, [0.4] * 3, rng) for _ in range(20000)]
    assert np.mean(lengths) == pytest.approx(0.875, abs=0.03)
    with pytest.raises(ValueError, match="same length"):
        semantic_accept_run([0.1], [0.1, 0.2], rng)


def test_first_failure_and_sync_cycle():
    assert first_failure([]) == 0
    assert first_failure([True, True, False, True]) == 2
    assert first_failure([False]) == 0
    assert first_failure(accept_all(4)) == 4 and first_failure(reject_all(4)) == 0
    assert sync_cycle_output([True, False, True]) == (1, 1)  # ŝ_0 ⊕ s_1
    assert sync_cycle_output([True, True]) == (2, 2)  # all pass: bonus target step s_γ


def test_branch_choice():
    assert first_passing_branch([False, True, True]) == 1
    assert first_passing_branch([False, False]) is None
    assert choose_branch([[False, True], [True, False], [True, True, False]]) == 2  # longest accepted prefix
    assert choose_branch([[True, False], [True, False]]) == 0  # tie: first branch
    assert choose_branch([[False], [False, True]]) is None
    assert choose_branch([[False], [True], [True]]) == first_passing_branch([False, True, True]) == 1
    assert choose_branch([]) is None
