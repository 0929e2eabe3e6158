"""Lookahead Reasoning speedup formulas: paper check values, α = 1 limits, Monte-Carlo agreement."""
from __future__ import annotations

import math

import numpy as np
import pytest

from specprobe.probes.speedup import (
    async_saturation_depth,
    async_speedup,
    geometric_sum,
    sync_speedup,
    token_sd_speedup,
)

ALPHA, C, K = 0.63, 0.1, 6


def test_paper_check_values():
    # digest: f_sync = 1.689, S2 = 2.258, S1 = 2.310 at α = 0.63, c = 0.1, k = 6
    assert round(sync_speedup(ALPHA, C, K), 3) == 1.689
    assert K < async_saturation_depth(C) == 10  # so S2 is the case that applies at k = 6
    assert round(async_speedup(ALPHA, C, K), 3) == 2.258
    s1 = async_speedup(ALPHA, C, 10)  # k >= ceil(1/c): S1
    assert s1 == pytest.approx(1 / (C + (1 - C) * (1 - ALPHA)))
    assert s1 == pytest.approx(2.3095, abs=1e-4)  # the digest's 2.310 is this rounded up


def test_closed_forms_match_written_formulas():
    a, c = 0.7, 0.2
    assert token_sd_speedup(a, c, 4) == pytest.approx((1 - a ** 5) / ((1 - a) * (1 + c * 4)))
    assert sync_speedup(a, c, 3) == pytest.approx((1 - a ** 3) / ((1 - a) * (1 - c + 3 * c)))
    k = 3  # < ceil(1/0.2) = 5
    s2 = (1 - a ** k) / ((1 - a) + c * (a - a ** (k + 1) - k * (1 - a) * a ** k))
    assert async_speedup(a, c, k) == pytest.approx(s2)
    assert token_sd_speedup(a, c, 4) == pytest.approx(sync_speedup(a, c, 5))  # same formula, k = γ + 1
    assert token_sd_speedup(a, c, 50) < 1 / (1 - a)  # bounded by 1/(1 - α)


def test_alpha_one_limits_are_finite():
    assert token_sd_speedup(1.0, 0.1, 5) == pytest.approx(6 / 1.5)
    assert sync_speedup(1.0, 0.1, 6) == pytest.approx(6 / 1.5)
    assert async_speedup(1.0, 0.1, 6) == pytest.approx(6.0)
    assert async_speedup(1.0, 0.1, 10) == pytest.approx(10.0)  # S1 = 1/c
    near = async_speedup(1 - 1e-9, 0.1, 6)
    assert near == pytest.approx(6.0, rel=1e-6)
    np.testing.assert_allclose(sync_speedup(np.array([0.5, 1.0]), 0.1, 6), [sync_speedup(0.5, 0.1, 6), 4.0])
    assert sync_speedup(0.0, 0.1, 6) == pytest.approx(1 / 1.5)  # nothing accepted: pure overhead


def test_async_cases():
    assert async_saturation_depth(0.3) == 4 and async_saturation_depth(0.25) == 4
    assert async_saturation_depth(0.0) == math.inf
    assert async_speedup(0.6, 0.3, 4) == async_speedup(0.6, 0.3, 9)  # S1 for every k >= 4
    values = [async_speedup(0.6, 0.1, k) for k in range(1, 10)]
    assert all(b > a for a, b in zip(values, values[1:]))  # Lemma 2: increasing below ceil(1/c)


def test_input_validation():
    with pytest.raises(ValueError, match="alpha"):
        sync_speedup(1.2, 0.1, 3)
    with pytest.raises(ValueError, match="k must be"):
        sync_speedup(0.5, 0.1, 0)
    with pytest.raises(ValueError, match="gamma"):
        token_sd_speedup(0.5, 0.1, 1.5)
    with pytest.raises(ValueError, match="c "):
        async_speedup(0.5, -0.1, 3)


def test_sync_monte_carlo_cycles():
    """Simulate Algorithm 1: k-1 drafts (cost c each) + one parallel target pass (cost 1) per cycle."""
    rng = np.random.default_rng(0)
    cycles = 200_000
    accepts = rng.random((cycles, K - 1)) < ALPHA
    first_fail = np.where(accepts.all(axis=1), K - 1, np.argmin(accepts, axis=1))
    steps = (first_fail + 1).sum()  # accepted drafts + the target's step at the failure (or bonus)
    time = cycles * (C * (K - 1) + 1.0)
    assert steps / time == pytest.approx(sync_speedup(ALPHA, C, K), rel=0.01)
    assert np.mean(first_fail + 1) == pytest.approx(geometric_sum(ALPHA, K), rel=0.01)


@pytest.mark.parametrize("k", [6, 12])
def test_async_monte_carlo_stages(k):
    """Appendix B's stage model: X accepted drafts, then either depth-limited or cost-limited timing."""
    rng = np.random.default_rng(1)
    x = rng.geometric(1 - ALPHA, size=400_000) - 1  # accepted drafts before the first rejection
    if k < async_saturation_depth(C):
        time = np.ceil((x + 1) / k) + C * (x % k)
    else:
        time = 1 + C * x
    assert (x + 1).sum() / time.sum() == pytest.approx(async_speedup(ALPHA, C, k), rel=0.01)
