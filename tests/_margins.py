"""Comparing greedy outputs of a real model without depending on one CPU's float rounding.

Two computations of the same greedy continuation (batched vs alone, cached vs fresh KV) agree up to
rounding, so they can only part at a near-tie. `trusted_length` finds how many leading tokens of a
reference continuation have a clear winner (top-1 minus top-2 logit >= `tol`, far above float32
rounding), and `assert_same_greedy` compares two continuations over that stretch only.
"""
from __future__ import annotations

import torch

TIE_TOL = 1e-3


def margins(model, prompt_ids: list[int], continuation: list[int]) -> list[float]:
    """Top-1 minus top-2 logit before each continuation token (one teacher-forced pass)."""
    ids = list(prompt_ids) + list(continuation)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1:len(ids) - 1].float()
    top = logits.topk(2, -1).values
    return (top[:, 0] - top[:, 1]).tolist()


def trusted_length(model, prompt_ids, reference, tol: float = TIE_TOL) -> int:
    gaps = margins(model, prompt_ids, reference)
    return next((i for i, g in enumerate(gaps) if g < tol), len(reference))


def assert_same_greedy(model, prompt_ids, got, reference, tol: float = TIE_TOL, at_least: int = 1) -> int:
    """got == reference up to the first near-tie of the reference (and both at least that long)."""
    n = trusted_length(model, prompt_ids, reference, tol)
    assert n >= min(at_least, len(reference)), f"a near-tie after {n} tokens leaves too little to compare"
    assert list(got[:n]) == list(reference[:n]), (n, got[:n], reference[:n])
    return n
