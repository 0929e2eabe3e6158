"""Lookahead Reasoning's analytic speedup model (its paper, §2, §3.2 and Appendix B).

Symbols: α = acceptance probability of one drafted unit (token or step), independent per unit;
c = draft cost / target cost per unit; k = number of units the target produces in parallel per cycle.

All functions accept α as a float or numpy array. The α -> 1 limits are exact because every
``(1 - α^k) / (1 - α)`` is evaluated as the geometric sum ``1 + α + ... + α^(k-1)`` (no division by 1 - α).

Reading notes on the paper:
- Sync LR and token SD are the same formula: the sync cycle drafts k-1 steps (cost c each) and the
  target checks them with k parallel steps (cost 1), so f_sync(k) = g(γ = k - 1). In Algorithm 1's
  notation (γ drafts, γ+1 target steps) that is k = γ + 1.
- The async case split is written with ⌊1/c⌋ in §3.2 and in Theorem 2's case 1, but with ⌈1/c⌉ in
  the proof, the f_async definition of B.1.2 and Lemma 2; we follow ⌈1/c⌉. The two agree whenever 1/c is
  an integer (e.g. c = 0.1 gives 10 either way).
- Check values (α = 0.63, c = 0.1, k = 6): f_sync = 1.689, S₂ = 2.258 (S₂ applies: 6 < ⌈1/0.1⌉ = 10),
  S₁ = 2.30947, i.e. 2.309 to 3 decimals (the digest's 2.310 rounds twice). These check values are the
  digest's own; the paper text does not print them, but they follow from its formulas.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def _alpha(alpha: Any) -> np.ndarray:
    a = np.asarray(alpha, dtype=np.float64)
    if not np.all((a >= 0) & (a <= 1)):
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return a


def _check_c(c: float) -> float:
    c = float(c)
    if not (c >= 0 and math.isfinite(c)):
        raise ValueError(f"c (draft/target cost ratio) must be a finite number >= 0, got {c}")
    return c


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _out(x: np.ndarray) -> Any:
    return float(x) if x.ndim == 0 else x


def geometric_sum(alpha: Any, k: int) -> Any:
    """1 + α + ... + α^(k-1) = E[min(X + 1, k)] for X ~ Geometric (accepted units before a failure)."""
    a = _alpha(alpha)
    k = _check_int(k, "k", 0)
    powers = a[..., None] ** np.arange(k)
    return _out(powers.sum(axis=-1))


def token_sd_speedup(alpha: Any, c: float, gamma: int) -> Any:
    """Token-level speculative decoding (Leviathan et al.): g(γ) = (1 − α^{γ+1}) / ((1 − α)(1 + cγ)).

    γ drafted tokens per cycle; bounded by 1/(1 − α). At α = 1 it is (γ + 1)/(1 + cγ).
    """
    gamma = _check_int(gamma, "gamma", 0)
    c = _check_c(c)
    return _out(np.asarray(geometric_sum(alpha, gamma + 1)) / (1.0 + c * gamma))


def sync_speedup(alpha: Any, c: float, k: int) -> Any:
    """Sync Lookahead Reasoning: f_sync(k) = (1 − α^k) / ((1 − α)(1 − c + c·k)).

    k = target steps generated in parallel per cycle (k - 1 drafted steps). At α = 1: k / (1 − c + ck).
    """
    k = _check_int(k, "k", 1)
    c = _check_c(c)
    return _out(np.asarray(geometric_sum(alpha, k)) / (1.0 - c + c * k))


def async_saturation_depth(c: float) -> float:
    """⌈1/c⌉: how many steps the draft can produce during one target step (inf when c = 0)."""
    c = _check_c(c)
    if c == 0:
        return math.inf
    return float(math.ceil(1.0 / c - 1e-12))  # tolerance: 1/c computed as 10.000000000000002 is still 10


def async_speedup(alpha: Any, c: float, k: int) -> Any:
    """Async Lookahead Reasoning (Appendix B, Theorem 2).

    - k ≥ ⌈1/c⌉ (draft-cost limited): S₁ = 1 / (c + (1 − c)(1 − α)).
    - k < ⌈1/c⌉ (depth limited):      S₂ = (1 − α^k) / ((1 − α) + c[α − α^{k+1} − k(1 − α)α^k]).
    S₂ is evaluated divided through by (1 − α): G / (1 + c(αG − kα^k)) with G = Σ_{i<k} α^i, whose
    α = 1 limit is k.
    """
    k = _check_int(k, "k", 1)
    c = _check_c(c)
    a = _alpha(alpha)
    if k >= async_saturation_depth(c):
        return _out(1.0 / (c + (1.0 - c) * (1.0 - a)))
    g = np.asarray(geometric_sum(a, k))
    return _out(g / (1.0 + c * (a * g - k * a ** k)))
