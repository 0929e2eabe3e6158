"""A proper test statistic for sampling tests (instead of per-cell tolerances)."""
from __future__ import annotations


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """p-value of Pearson's chi-square test of `counts` against `probs` (cells with expected < 5 pooled)."""
    from scipy.stats import chi2

    n = sum(counts)
    cells, pool_c, pool_p = [], 0, 0.0
    for c, p in zip(counts, probs):
        if n * p >= 5:
            cells.append((c, p))
        else:
            pool_c, pool_p = pool_c + c, pool_p + p
    if pool_p > 0:
        cells.append((pool_c, pool_p))
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in cells)
    return float(chi2.sf(stat, len(cells) - 1))
