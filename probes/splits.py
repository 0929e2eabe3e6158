"""Train/validation/test splits by group (question id), so no question's contexts land on two sides.

Each group gets a position u in [0, 1) from a hash of (seed, group id); u < test_fraction goes to
test, the next val_fraction to validation, the rest to train. A group's side depends only on its own
id and the seed, so adding questions later never moves existing ones (with `exact_sizes=False`, the
default). Fractions then hold in expectation; small sets are repaired so every requested side gets at
least one group. `exact_sizes=True` instead ranks groups by u and cuts at exact counts.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np


def group_position(group: str, seed: int = 0) -> float:
    """Deterministic pseudo-uniform position in [0, 1) of one group (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}\x1f{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _validate(n_groups: int, val_fraction: float, test_fraction: float) -> int:
    for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not (0.0 <= frac < 1.0) or math.isnan(frac):
            raise ValueError(f"{name} must be in [0, 1), got {frac}")
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(f"val_fraction + test_fraction must be < 1 to leave a training set, "
                         f"got {val_fraction} + {test_fraction}")
    needed = 1 + (val_fraction > 0) + (test_fraction > 0)
    if n_groups < needed:
        raise ValueError(f"{n_groups} distinct group(s) cannot fill {needed} splits (train"
                         f"{', val' if val_fraction > 0 else ''}{', test' if test_fraction > 0 else ''}); "
                         "every split needs at least one whole group")
    return needed


def _sides_by_threshold(u: np.ndarray, val_fraction: float, test_fraction: float) -> np.ndarray:
    """0 = train, 1 = val, 2 = test."""
    side = np.zeros(u.size, dtype=np.int64)
    side[u < test_fraction + val_fraction] = 1
    side[u < test_fraction] = 2
    return side


def _sides_by_rank(u: np.ndarray, val_fraction: float, test_fraction: float) -> np.ndarray:
    n = u.size
    n_test = max(1, round(n * test_fraction)) if test_fraction > 0 else 0
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    while n_test + n_val > n - 1:  # rounding up both can eat the training set on tiny inputs
        if n_val >= n_test and n_val > 1:
            n_val -= 1
        else:
            n_test -= 1
    order = np.argsort(u, kind="mergesort")
    side = np.zeros(n, dtype=np.int64)
    side[order[:n_test]] = 2
    side[order[n_test:n_test + n_val]] = 1
    return side


def _repair_empty(side: np.ndarray, u: np.ndarray, val_fraction: float, test_fraction: float) -> np.ndarray:
    """Give each requested but empty side the group whose position is nearest to its interval.

    Only taken from a side that keeps at least one group, so no split is emptied by the repair.
    """
    side = side.copy()
    intervals = {0: (test_fraction + val_fraction, 1.0), 1: (test_fraction, test_fraction + val_fraction),
                 2: (0.0, test_fraction)}
    wanted = [0] + ([1] if val_fraction > 0 else []) + ([2] if test_fraction > 0 else [])
    for target in wanted:
        if np.any(side == target):
            continue
        lo, hi = intervals[target]
        counts = np.bincount(side, minlength=3)
        donor = counts[side] > 1
        distance = np.where(u < lo, lo - u, np.where(u >= hi, u - hi, 0.0))
        distance[~donor] = np.inf
        side[int(np.argmin(distance))] = target
    return side


def group_split(groups: Sequence[str], val_fraction: float, test_fraction: float = 0.0, seed: int = 0,
                *, exact_sizes: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices (train, val, test), each sorted, such that every group lies on exactly one side."""
    keys = [str(g) for g in groups]
    unique = sorted(set(keys))
    _validate(len(unique), val_fraction, test_fraction)
    u = np.array([group_position(g, seed) for g in unique])
    if exact_sizes:
        side = _sides_by_rank(u, val_fraction, test_fraction)
    else:
        side = _repair_empty(_sides_by_threshold(u, val_fraction, test_fraction), u, val_fraction, test_fraction)
    side_of = dict(zip(unique, side.tolist()))
    row_side = np.array([side_of[k] for k in keys], dtype=np.int64)
    return tuple(np.nonzero(row_side == s)[0] for s in (0, 1, 2))  # type: ignore[return-value]


def stratified_subsample(labels: Sequence[bool] | np.ndarray, limit: int | None, seed: int = 0) -> np.ndarray:
    """Sorted indices of at most `limit` rows keeping the share of True labels (rounded), with at least one row of
    each class present when `limit` allows two (so precision, recall, AUROC and ROC/PR curves stay defined on
    small subsets); all rows when they fit or `limit` is None. Seeded: the same rows on every run."""
    y = np.asarray(labels, dtype=bool).reshape(-1)
    if limit is None or y.size <= limit:
        return np.arange(y.size)
    pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
    n_pos = int(round(limit * pos.size / y.size))
    n_pos = min(max(n_pos, 1 if pos.size else 0), pos.size, limit - (1 if neg.size and limit > 1 else 0))
    n_neg = min(limit - n_pos, neg.size)
    rng = np.random.default_rng(seed)
    return np.sort(np.concatenate([rng.choice(pos, n_pos, replace=False), rng.choice(neg, n_neg, replace=False)]))
