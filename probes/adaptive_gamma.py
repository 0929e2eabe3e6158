"""How far to draft: choose the lookahead depth of one cycle from predicted per-step acceptance.

a_i is the probability that draft step i is accepted given steps 1..i-1 were; P_j = a_1 ... a_j. Two cycle
shapes, both measured in target-step units (speedup = expected committed steps / expected cost, the long-run
rate of a renewal process, against target-only's one step per unit):

Lookahead Reasoning, sync (kind "lookahead"): draft k steps (c each, one draft batch per level), then ONE target
pass over every prefix (rows(k) = 1 + W + ... + W^k rows for W branches; b(rows) in single-row units, b(1) = 1,
~1 on a GPU far from saturation, not on a CPU). The accepted prefix and one target step are committed:

    E[committed](k) = 1 + sum_{j<=k} P_j,    cost(k) = k c + b(rows(k)).

SemanticSpec (kind "semanticspec"): draft k steps, ONE teacher-forced target pass over them (v(k)), and at the
first rejection the target writes that step itself (cost 1); when all k pass nothing more is written:

    E[committed](k) = sum_{j<=k} P_j + (1 - P_k),    E[cost](k) = k c + v(k) + (1 - P_k).

k = 0 means: do not draft, the target writes the step (committed 1, cost 1). With a_i constant and b = 1 the
first is Lookahead Reasoning's sync formula at k + 1 parallel steps (`probes.speedup.sync_speedup`).

The policy: after each drafted step the runtime knows that step's predicted a_i (an acceptance probe on the
draft's own hidden states, or a system-speed estimate); later steps are forecast at the last known value;
drafting goes on while the best depth over the known and forecast estimates lies beyond the steps drafted so
far, and never past gamma_max. The cycle then keeps the best depth over what it drafted, with the drafted steps'
cost sunk (paid whichever depth is kept: charging it again would drop drafts whose verification alone pays);
when even the first step does not pay (best depth 0), the draft is dropped and the target writes the step. With the forecast skip
(`forecast_pays`), a cycle whose every step is forecast at the last estimate known does not draft at all.

Pure functions of (a, costs): no model code; tested against brute-force enumeration of the accept/reject
outcomes.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

BatchCost = Callable[[int], float] | Sequence[float]
CYCLE_KINDS = ("lookahead", "semanticspec")


def _lookup(table: BatchCost | None, n: int, name: str) -> float:
    """table(n): a callable, or a sequence with the value for n at index n - 1, extended linearly past its end."""
    if n < 1:
        raise ValueError(f"{name} is defined for n >= 1, got {n}")
    if table is None:
        return 1.0
    if callable(table):
        return float(table(n))
    seq = [float(x) for x in table]
    if not seq:
        return 1.0
    if n <= len(seq):
        return seq[n - 1]
    step = seq[-1] - seq[-2] if len(seq) > 1 else 0.0
    return seq[-1] + step * (n - len(seq))


def batch_cost(b: BatchCost | None, rows: int) -> float:
    """b(rows): the target pass over `rows` rows in single-row units. None: free batching (b = 1); a sequence
    gives b(k) at index k - 1 and is extended linearly past its end."""
    return _lookup(b, rows, "the batch cost b(rows)")


@dataclass(frozen=True)
class CycleCosts:
    """What a cycle costs, in units of one target step: c per drafted level; b(rows) for Lookahead Reasoning's
    target pass; v(k) for SemanticSpec's teacher-forced pass over k drafts (None: b = 1 / v = 0)."""

    c: float
    b: BatchCost | None = None
    v: BatchCost | None = None
    kind: Literal["lookahead", "semanticspec"] = "lookahead"
    width: int = 1  # draft branches per position (lookahead only): rows(k) = 1 + W + ... + W^k

    def __post_init__(self) -> None:
        if not (self.c >= 0 and math.isfinite(self.c)):
            raise ValueError(f"c (draft/target cost per step) must be a finite number >= 0, got {self.c}")
        if self.kind not in CYCLE_KINDS:
            raise ValueError(f"cycle kind must be one of {CYCLE_KINDS}, got {self.kind!r}")
        if not isinstance(self.width, int) or self.width < 1:
            raise ValueError(f"width must be an int >= 1, got {self.width!r}")

    def rows(self, k: int) -> int:
        return tree_rows(self.width, k)

    def score_cost(self, k: int) -> float:
        return 0.0 if self.v is None or k == 0 else _lookup(self.v, k, "the scoring cost v(k)")


def tree_rows(width: int, k: int) -> int:
    """Target rows verifying a draft tree of `width` branches per position, `k` deep: one per node, the root's
    prefix included (k + 1 nested prefixes for one branch)."""
    return sum(width ** d for d in range(k + 1))


def _check(a: Sequence[float]) -> list[float]:
    a = [float(x) for x in a]
    if any(not 0.0 <= x <= 1.0 for x in a):
        raise ValueError(f"acceptance estimates must be in [0, 1], got {a}")
    return a


def _chain(a: Sequence[float], k: int) -> tuple[float, float]:
    """(sum_{j<=k} P_j, P_k)."""
    total, run = 0.0, 1.0
    for x in list(a)[:k]:
        run *= x
        total += run
    return total, run


def expected_committed(a: Sequence[float], k: int, kind: str = "lookahead") -> float:
    """Expected steps one cycle commits when it drafts k steps (see the module doc)."""
    if k == 0:
        return 1.0
    total, last = _chain(a, k)
    return 1.0 + total if kind == "lookahead" else total + (1.0 - last)


def expected_cost(a: Sequence[float], k: int, costs: CycleCosts, drafted: int = 0) -> float:
    """Expected cost still to pay for one cycle keeping k steps, in target steps, when `drafted` steps are
    drafted already (their draft cost is sunk: 0 before drafting)."""
    if k == 0:
        return 1.0
    draft = max(k - drafted, 0) * costs.c
    if costs.kind == "lookahead":
        return draft + batch_cost(costs.b, costs.rows(k))
    return draft + costs.score_cost(k) + (1.0 - _chain(a, k)[1])


def expected_speedup(a: Sequence[float], k: int, costs: CycleCosts, drafted: int = 0) -> float:
    """speedup(k) of a cycle keeping k steps with acceptance estimates `a` (see the module doc), counting only
    the cost still to pay when `drafted` steps are drafted already."""
    a = _check(a)
    if not 0 <= k <= len(a):
        raise ValueError(f"k must be in [0, {len(a)}] (one estimate per drafted step), got {k}")
    return expected_committed(a, k, costs.kind) / expected_cost(a, k, costs, drafted)


def best_depth(a: Sequence[float], costs: CycleCosts, gamma_max: int | None = None, drafted: int = 0) -> int:
    """The depth k in [0, min(len(a), gamma_max)] with the largest expected speedup (the smaller on ties), the
    first `drafted` steps' draft cost sunk (`kept_depth`)."""
    a = _check(a)
    top = len(a) if gamma_max is None else min(len(a), gamma_max)
    best, value = 0, expected_speedup(a, 0, costs, drafted)
    for k in range(1, top + 1):
        v = expected_speedup(a, k, costs, drafted)
        if v > value + 1e-12:
            best, value = k, v
    return best


def keep_drafting(known: Sequence[float], costs: CycleCosts, gamma_max: int) -> bool:
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
    return best_depth(forecast, costs, gamma_max) > len(known)


def forecast_pays(estimate: float, costs: CycleCosts, gamma_max: int, drafted: int = 0) -> bool:
    """Before drafting anything: does a cycle pay when each of its gamma_max steps is forecast at `estimate` (the
    last estimate known, e.g. of the step before)? False: skip drafting, the target writes the step. drafted: how
    many of those steps exist already (their draft cost is sunk; async LR judges a draft the draft thread wrote)."""
    if gamma_max < 1:
        raise ValueError(f"gamma_max must be >= 1, got {gamma_max}")
    return best_depth([estimate] * gamma_max, costs, gamma_max, drafted) > 0


def kept_depth(drafted: Sequence[float], costs: CycleCosts, gamma_max: int) -> int:
    """How many of the drafted steps (their estimates) to keep: the best depth with their draft cost sunk. 0:
    drop them, the target writes the step."""
    return best_depth(drafted, costs, gamma_max, drafted=len(drafted))


def drafting_plan(estimates: Sequence[float], costs: CycleCosts, gamma_max: int) -> tuple[int, int]:
    """(steps drafted, steps kept) of the sequential policy when the i-th drafted step's estimate is
    estimates[i]: it drafts while `keep_drafting` says so, then keeps the best depth over what it drafted
    (kept 0: drop the drafts, the target writes the step)."""
    drafted: list[float] = []
    while len(drafted) < min(gamma_max, len(estimates)) and keep_drafting(drafted, costs, gamma_max):
        drafted.append(float(estimates[len(drafted)]))
    return len(drafted), kept_depth(drafted, costs, gamma_max)


def level_acceptance(estimates: Sequence[float], width: int) -> float:
    """A multi-branch level's acceptance (some branch accepted) from its branches' mean estimate ā:
    1 - (1 - ā)^W, treating the W branches as independent draws."""
    if not estimates:
        raise ValueError("no estimates for this level")
    mean = sum(_check(estimates)) / len(estimates)
    return 1.0 - (1.0 - mean) ** width
