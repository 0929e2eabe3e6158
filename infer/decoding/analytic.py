"""Analytic speedups at the α and c a run measured, next to the speedup it measured.

Units. T = target time per step in the target-only baseline of the same benchmark run.
- c = draft time per drafted position / T (one position = one draft call: a step, or W branches in one batch)
- b = target time per decode iteration in the method's run / the same in the baseline: what one forward
  of the method's target batch (k rows, or k rows with speculated tokens) costs relative to one row.
  The papers' formulas assume b = 1 ("k parallel target steps cost one target step", true on a GPU far
  from saturation); on a CPU b grows with k.
- τ = SemanticSpec's teacher-forced scoring per cycle / T (probe-bench measures all of it: the target's pass,
  and the draft's own pass where the verifier reads draft features too).

Two predictions per method: *ideal* (the paper's formula at the measured α, c) and *batch-adjusted*
(the same formula with the target step costing b·T: f(α, c/b, k) / b for LR; τ included for SemanticSpec).

SemanticSpec's formula is ours (the paper gives none): per cycle the draft writes γ steps (γc), the
target reads them in one pass (τ) and, with probability 1 − α^γ, writes the rejected step (1). Steps
emitted: Σ_{i≤γ} α^i + (1 − α^γ) = (1 − α^γ)/(1 − α), so
    S_ss = (1 − α^γ) / ((1 − α)(γc + τ + 1 − α^γ)).
"""
from __future__ import annotations

from specprobe.probes.speedup import async_speedup, geometric_sum, sync_speedup


def semanticspec_speedup(alpha: float, c: float, gamma: int, tau: float = 0.0) -> float:
    """S_ss above; at α = 1 it is γ / (γc + τ)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if c < 0 or tau < 0:
        raise ValueError(f"c and tau must be >= 0, got {c}, {tau}")
    g = float(geometric_sum(alpha, gamma))  # (1 - α^γ)/(1 - α)
    fail = (1.0 - alpha) * g  # 1 - α^γ
    return g / (gamma * c + tau + fail)


def predict(kind: str, alpha: float | None, c: float | None, gamma: int, b: float | None = None,
            tau: float | None = None) -> dict:
    """{"ideal": ..., "adjusted": ..., "k": ...} for kind in lr_sync | lr_async | semanticspec | draft."""
    out: dict = {"ideal": None, "adjusted": None, "k": None, "formula": None}
    if c is None:
        return out
    if kind == "draft":
        out.update(ideal=1.0 / c if c > 0 else None, formula="1/c")
        return out
    if alpha is None:
        return out
    alpha = min(max(alpha, 0.0), 1.0)
    if kind in ("lr_sync", "lr_async"):
        k = gamma + 1
        fn = sync_speedup if kind == "lr_sync" else async_speedup
        out.update(k=k, ideal=float(fn(alpha, c, k)),
                   formula="f_sync(k)" if kind == "lr_sync" else "S1/S2 (async)")
        if b is not None and b > 0:
            out["adjusted"] = float(fn(alpha, c / b, k)) / b
    elif kind == "semanticspec":
        out.update(ideal=semanticspec_speedup(alpha, c, gamma, 0.0), formula="S_ss")
        if tau is not None:
            out["adjusted"] = semanticspec_speedup(alpha, c, gamma, tau)
    return out


def token_level_factor(spec_accepted: int, rounds: int) -> float | None:
    """g(γ₂) of token SD at c₂ = 0 (prompt lookup): the tokens one verifying forward yields, 1 + accepted / rounds,
    the factor by which token speculation should multiply a step-level speedup.

    Not g at α = accepted / proposed: proposals go on past a round's first rejection and are counted, so that
    ratio understates the per-token acceptance the formula means (every formula g(α) at the α that matches the
    measured accepted tokens per round gives exactly 1 + accepted / rounds). Forwards without a proposal
    (no match to look up) yield one token and are not rounds, so where they are many this overstates g."""
    if not rounds:
        return None
    return 1.0 + spec_accepted / rounds
