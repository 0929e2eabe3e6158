"""group_split: no group on two sides, deterministic, stable when groups are added."""
from __future__ import annotations

import numpy as np
import pytest

from specprobe.probes.splits import group_position, group_split, stratified_subsample


def rows_for(n_groups: int, per_group: int = 3, prefix: str = "q") -> list[str]:
    return [f"{prefix}{i}" for i in range(n_groups) for _ in range(per_group)]


def sides_of(groups, split):
    g = np.asarray(groups)
    return [set(g[idx]) for idx in split]


@pytest.mark.parametrize("exact", [False, True])
def test_no_group_leaks_and_rows_partitioned(exact):
    groups = rows_for(200)
    train, val, test = group_split(groups, 0.15, 0.1, seed=3, exact_sizes=exact)
    all_rows = np.concatenate([train, val, test])
    assert sorted(all_rows.tolist()) == list(range(len(groups)))  # every row exactly once
    tr, va, te = sides_of(groups, (train, val, test))
    assert not (tr & va) and not (tr & te) and not (va & te)
    if exact:
        assert (len(va), len(te)) == (30, 20)
    else:
        assert 10 <= len(va) <= 50 and 5 <= len(te) <= 40  # fractions hold in expectation


def test_deterministic_and_seed_dependent():
    groups = rows_for(100)
    a = group_split(groups, 0.2, 0.1, seed=0)
    b = group_split(list(reversed(groups)), 0.2, 0.1, seed=0)  # order of rows does not matter
    g = np.asarray(groups)
    g_rev = np.asarray(list(reversed(groups)))
    assert [set(g[i]) for i in a] == [set(g_rev[i]) for i in b]
    assert all(np.array_equal(x, y) for x, y in zip(a, group_split(groups, 0.2, 0.1, seed=0)))
    c = group_split(groups, 0.2, 0.1, seed=1)
    assert set(g[a[1]]) != set(g[c[1]])


def test_adding_groups_keeps_existing_assignments():
    old = rows_for(300)
    new = old + rows_for(100, prefix="new")
    old_sides = sides_of(old, group_split(old, 0.2, 0.1))
    new_sides = sides_of(new, group_split(new, 0.2, 0.1))
    for before, after in zip(old_sides, new_sides):
        assert before <= after  # no existing question changed side


def test_hash_position_is_stable_and_uniform():
    assert group_position("q17", 0) == group_position("q17", 0)
    assert group_position("q17", 0) != group_position("q17", 1)
    u = np.array([group_position(f"g{i}") for i in range(4000)])
    counts, _ = np.histogram(u, bins=4, range=(0, 1))
    assert counts.min() > 850  # roughly uniform (expected 1000 each)


def test_small_sets_get_every_requested_side():
    for seed in range(20):
        train, val, test = group_split(["a", "b", "c"], 0.05, 0.05, seed=seed)
        assert len(train) == len(val) == len(test) == 1
    train, val, test = group_split(["a", "a", "b"], 0.5, seed=0)
    assert len(test) == 0 and {len(train), len(val)} == {1, 2}


def test_errors():
    with pytest.raises(ValueError, match="cannot fill 3 splits"):
        group_split(["a", "a", "b"], 0.2, 0.2)
    with pytest.raises(ValueError, match="< 1"):
        group_split(rows_for(10), 0.6, 0.4)
    with pytest.raises(ValueError, match="val_fraction"):
        group_split(rows_for(10), -0.1)
    with pytest.raises(ValueError, match="cannot fill 2 splits"):
        group_split(["only"], 0.3)


def test_stratified_subsample_keeps_the_class_share_and_both_classes():
    labels = np.r_[np.ones(30, bool), np.zeros(270, bool)]
    idx = stratified_subsample(labels, 50, seed=2)
    assert len(idx) == 50 and len(set(idx.tolist())) == 50 and labels[idx].sum() == 5  # 10% kept
    assert idx.tolist() == sorted(idx.tolist()) and stratified_subsample(labels, 50, seed=2).tolist() == idx.tolist()
    rare = np.r_[np.ones(2, bool), np.zeros(298, bool)]
    assert rare[stratified_subsample(rare, 12)].sum() == 1  # rounds to 0, kept at 1 so ROC is defined
    one = np.array([True] + [False] * 99)
    assert one[stratified_subsample(one, 4, seed=1)].sum() == 1
    assert stratified_subsample(np.zeros(40, bool), 10).size == 10  # one class only: still a subsample
    assert stratified_subsample(labels, 1000).tolist() == list(range(300))
    assert stratified_subsample(labels, None).tolist() == list(range(300))
    assert stratified_subsample(np.r_[True, False, False], 1).size == 1

