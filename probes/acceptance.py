"""The runtime's acceptance rules as small pure functions.

- SemanticSpec: accept draft step i with probability min(1, p_i / q_i), where p_i / q_i are the target /
  draft probes' semantic probabilities; stop at the first rejection (the target regenerates that step).
- Lookahead Reasoning: verdicts V(s_j, ŝ_j) per position; the cycle keeps drafts up to the first failure,
  then the target's own step there (or a bonus target step when all pass).
- Multi-branch: W candidate steps per position; a position passes if any branch passes.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

DEFAULT_EPS = 1e-6  # guard for q -> 0: a draft probe that is sure the draft is impossible


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator every stochastic decision takes, so a run is reproducible from one seed."""
    return np.random.default_rng(seed)


def semantic_accept_prob(p: Any, q: Any, eps: float = DEFAULT_EPS) -> Any:
    """min(1, p / max(q, eps)), elementwise; floats in -> float out.

    p and q must be probabilities in [0, 1]; anything else (including NaN) is a bug upstream and raises.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    p_arr = np.asarray(p, dtype=np.float64)
    q_arr = np.asarray(q, dtype=np.float64)
    for name, arr in (("p", p_arr), ("q", q_arr)):
        if not np.all((arr >= 0) & (arr <= 1)):  # also catches NaN
            raise ValueError(f"{name} must be probabilities in [0, 1], got {arr if arr.ndim == 0 else arr.tolist()}")
    ratio = np.minimum(1.0, p_arr / np.maximum(q_arr, eps))
    return float(ratio) if ratio.ndim == 0 else ratio


def bernoulli(prob: float, rng: np.random.Generator) -> bool:
    """True with probability `prob`: u ~ U[0, 1) and u < prob, so prob 1 always and prob 0 never accepts."""
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"prob must be in [0, 1], got {prob}")
    return bool(rng.random() < prob)


def semantic_accept(p: float, q: float, rng: np.random.Generator, eps: float = DEFAULT_EPS) -> bool:
    """One SemanticSpec decision for one draft step."""
    return bernoulli(semantic_accept_prob(float(p), float(q), eps), rng)


def semantic_accept_run(p: Sequence[float], q: Sequence[float], rng: np.random.Generator,
                        eps: float = DEFAULT_EPS) -> int:
    """Number of leading draft steps accepted; draws stop at the first rejection, as at run time."""
    if len(p) != len(q):
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    for i, (pi, qi) in enumerate(zip(p, q)):
        if not semantic_accept(pi, qi, rng, eps):
            return i
    return len(p)


def accept_all(n: int) -> list[bool]:
    """Decisions of a verifier that accepts everything (an upper bound on speed)."""
    return [True] * n


def reject_all(n: int) -> list[bool]:
    """Decisions of a verifier that accepts nothing (the target-only baseline's output)."""
    return [False] * n


def first_failure(accepts: Sequence[bool]) -> int:
    """Index of the first False, or len(accepts) when every step passes."""
    for i, ok in enumerate(accepts):
        if not ok:
            return i
    return len(accepts)


def first_passing_branch(verdicts: Sequence[bool]) -> int | None:
    """At one position: the first of the W branches the verifier accepts (the paper keeps that one)."""
    for w, ok in enumerate(verdicts):
        if ok:
            return w
    return None


def choose_branch(branch_accepts: Sequence[Sequence[bool]]) -> int | None:
    """Pick a candidate path among several; branch_accepts[w] holds path w's verdicts, step by step.

    The path with the longest accepted prefix wins, ties going to the lowest index (so with one
    position this is `first_passing_branch`). None when no path gets its first step accepted.
    """
    best, best_len = None, 0
    for w, verdicts in enumerate(branch_accepts):
        length = first_failure(verdicts)
        if length > best_len:
            best, best_len = w, length
    return best


def sync_cycle_output(accepts: Sequence[bool]) -> tuple[int, int]:
    """Lookahead Reasoning's sync cycle: (drafts kept, index of the target step appended).

    With γ drafts and γ+1 target steps s_0..s_γ, the output is ŝ_0..ŝ_{j*-1} ⊕ s_{j*}, j* = first failure
    (j* = γ: all drafts accepted plus a bonus target step).
    """
    j = first_failure(accepts)
    return j, j
