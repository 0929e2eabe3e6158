"""SemanticSpec's acceptance rule min(1, p/q) and the seeded Bernoulli draw the runtime takes."""
from __future__ import annotations

import numpy as np
import pytest

from specprobe.probes.acceptance import bernoulli, make_rng, semantic_accept_prob


def semantic_accept(p, q, rng):
    """One SemanticSpec decision, composed as the runtime's probe verifier composes it."""
    return bernoulli(semantic_accept_prob(p, q), rng)


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
