"""How far to draft: choose the lookahead depth of one cycle from predicted per-step acceptance.

A sync cycle of Lookahead Reasoning (or SemanticSpec) that drafts k steps commits the accepted prefix of the
chain plus one target step: with a_i the probability that draft step i is accepted given steps 1..i-1 were,

    E[committed](k) = 1 + sum_{j=1..k} prod_{i<=j} a_i,

and costs k draft steps (c each, in target-step units) plus one batched target pass over k + 1 rows, b(k + 1)
(b(1) = 1; on a GPU far from saturation b ~ 1, on a CPU it is not). Target-only commits one step per unit, so

    speedup(k) = E[committed](k) / (k c + b(k + 1)),      k = 0 meaning: do not draft, the target writes.

With a_i constant and b = 1 this is Lookahead Reasoning's sync formula at k + 1 parallel steps
(`probes.speedup.sync_speedup`). The policy: after each drafted step the runtime knows that step's
predicted a_i (an acceptance probe on the draft's own hidden states, or a system-speed estimate); later
steps are forecast at the last known value; drafting goes on while the best depth over the known and
forecast estimates lies beyond the steps drafted so far, and never past gamma_max. When even the first
step does not pay (best depth 0), the cycle's draft is dropped and the target writes the step.

Pure functions of (a, c, b): no model code; tested against brute-force enumeration of the accept/reject
outcomes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

BatchCost = Callable[[int], float] | Sequence[float]


def _check(a: Sequence[float], c: float) -> list[float]:
    a = [float(x) for x in a]
    if any(not 0.0 <= x <= 1.0 for x in a):
        raise ValueError(f"acceptance estimates must be in [0, 1], got {a}")
    if not (c >= 0 and math.isfinite(c)):
        raise ValueError(f"c (draft/target cost per step) must be a finite number >= 0, got {c}")
    return a


def batch_cost(b: BatchCost | None, rows: int) -> float:
    """b(rows): the target pass over `rows` rows in single-row units. None: free batching (b = 1); a sequence
    gives b(k) at index k - 1 and is extended linearly past its end."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if b is None:
        return 1.0
    if callable(b):
        return float(b(rows))
    seq = [float(x) for x in b]
    if not seq:
        return 1.0
    if rows <= len(seq):
        return seq[rows - 1]
    step = seq[-1] - seq[-2] if len(seq) > 1 else 0.0
    return seq[-1] + step * (rows - len(seq))


def expected_committed(a: Sequence[float], k: int) -> float:
    """1 + sum_{j<=k} prod_{i<=j} a_i: the accepted prefix of k drafts plus the target's own step."""
    total, run = 1.0, 1.0
    for x in list(a)[:k]:
        run *= x
        total += run
    return total


def expected_speedup(a: Sequence[float], k: int, c: float, b: BatchCost | None = None) -> float:
    """speedup(k) of a cycle drafting k steps with acceptance estimates `a` (see the module doc)."""
    a = _check(a, c)
    if not 0 <= k <= len(a):
        raise ValueError(f"k must be in [0, {len(a)}] (one estimate per drafted step), got {k}")
    return expected_committed(a, k) / (k * c + batch_cost(b, k + 1))


def best_depth(a: Sequence[float], c: float, b: BatchCost | None = None, gamma_max: int | None = None) -> int:
    """The depth k in [0, min(len(a), gamma_max)] with the largest expected speedup (the smaller on ties)."""
    a = _check(a, c)
    top = len(a) if gamma_max is None else min(len(a), gamma_max)
    best, value = 0, expected_speedup(a, 0, c, b)
    for k in range(1, top + 1):
        v = expected_speedup(a, k, c, b)
        if v > value + 1e-12:
            best, value = k, v
    return best


def keep_drafting(known: Sequence[float], c: float, b: BatchCost | None, gamma_max: int) -> bool:
    """After drafting len(known) steps with these estimates: draft one more? Later steps are forecast at the
    last known estimate; yes while the best depth over known + forecast lies beyond the steps drafted."""
    if gamma_max < 1:
        raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
    known = list(known)
    if len(known) >= gamma_max:
        return False
    if not known:
        return True  # the first step is drafted to learn a_1
    forecast = known + [known[-1]] * (gamma_max - len(known))
    return best_depth(forecast, c, b, gamma_max) > len(known)


def drafting_plan(estimates: Sequence[float], c: float, b: BatchCost | None, gamma_max: int) -> tuple[int, int]:
    """(steps drafted, steps kept) of the sequential policy when the i-th drafted step's estimate is
    estimates[i]: it drafts while `keep_drafting` says so, then keeps the best depth over what it drafted
    (kept 0: drop the drafts, the target writes the step)."""
    drafted: list[float] = []
    while len(drafted) < min(gamma_max, len(estimates)) and keep_drafting(drafted, c, b, gamma_max):
        drafted.append(float(estimates[len(drafted)]))
    return len(drafted), best_depth(drafted, c, b, gamma_max)


def chosen_depth(estimates: Sequence[float], c: float, b: BatchCost | None, gamma_max: int) -> int:
    """The depth a cycle ends with under the sequential policy (`drafting_plan`'s steps kept)."""
    return drafting_plan(estimates, c, b, gamma_max)[1]
