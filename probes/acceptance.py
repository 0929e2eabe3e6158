"""SemanticSpec's acceptance rule as pure functions; the runtime's verifiers call exactly these.

Accept draft step i with probability min(1, p_i / q_i), where p_i / q_i are the target / draft probes'
semantic probabilities (`semantic_accept_prob`, then one `bernoulli` draw from a `make_rng` generator);
the decoding loop stops at the first rejection (the target regenerates that step). Lookahead
Reasoning's walk over verdicts (first accepted branch per position, the target's step at the first
position with none, a bonus target step after a full accept) lives in infer.decoding.lookahead, its
only user.
"""
from __future__ import annotations

from typing import Any

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
