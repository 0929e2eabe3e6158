"""The classic probe: L2-regularised logistic regression on one layer's pooled hidden state (or a few layers,
concatenated), as the semantic-entropy-probe papers fit per layer. On a few hundred questions it has far
fewer weights to fit than the MLP (576 + 1 for SmolLM2 against ~150k), which is why it is trained beside it.

Soft labels (a share of N samples) are fitted exactly: the loss is the mean BCE against y plus l2 / 2 * ||w||^2
(the bias is not penalised), minimised by Newton's method in float64. That is scikit-learn's
LogisticRegression with C = 1 / (l2 * n) on rows entered twice (class 1 with weight y, class 0 with weight
1 - y); a test checks the two agree. The strength is per row, so one grid serves any data size, and Newton
takes a few seconds per layer where lbfgs on the weak penalties took minutes.
Which layer, which pooling and which strength are chosen on validation questions only (`select_logistic`).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .base import HiddenStateProbe
from .features import FeatureSpec
from .metrics import brier, log_loss

FORMAT_NAME = "specprobe.logistic_probe"
DEFAULT_L2 = (1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


class LogisticProbe(HiddenStateProbe):
    """Standardised selected rows, concatenated -> one linear logit."""

    FORMAT_NAME = FORMAT_NAME
    KIND = "logistic"

    def __init__(self, spec: FeatureSpec, l2: float = 1e-2, std_floor: float = 1e-3) -> None:
        super().__init__(spec, std_floor)
        if not l2 > 0:
            raise ValueError(f"LogisticProbe.l2 must be > 0, got {l2!r}")
        self.l2 = float(l2)
        self.linear = nn.Linear(spec.num_selected * spec.hidden_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self._check_selected(features)
        return self.linear(self.standardize(features).flatten(1)).squeeze(-1)

    def _config(self) -> dict[str, Any]:
        return {"l2": self.l2, "std_floor": self.std_floor}

    @classmethod
    def _from_config(cls, spec: FeatureSpec, config: dict[str, Any]) -> LogisticProbe:
        return cls(spec, float(config["l2"]), float(config.get("std_floor", 1e-3)))


def _check(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"{what}: features must be [N, layers, H] and labels [N] with N > 0, got "
                         f"{list(x.shape)} and {list(y.shape)}")
    if not bool(torch.isfinite(x).all()) or not bool(torch.isfinite(y).all()):
        raise ValueError(f"{what}: features or labels contain NaN/inf")
    if bool(((y < 0) | (y > 1)).any()):
        raise ValueError(f"{what}: labels must lie in [0, 1]")


def newton_logistic(z: torch.Tensor, y: torch.Tensor, l2: float, init: torch.Tensor | None = None,
                    max_iter: int = 50, tol: float = 1e-8) -> tuple[torch.Tensor, int]:
    """Minimise mean BCE(sigmoid(z @ w + b), y) + l2 / 2 * ||w||^2 (b not penalised) by damped Newton steps.

    z [N, D] float64 features, y [N] soft labels in [0, 1]; returns ([D + 1] weights with the bias last, the
    iterations used). Strictly convex for l2 > 0, so the optimum is unique; a step that raises the loss is
    halved until it does not. (D is one or a few layers' width, so the [D+1, D+1] Hessian is cheap to solve.)
    """
    n, d = z.shape
    design = torch.cat([z, torch.ones(n, 1, dtype=z.dtype)], dim=1)
    ridge = torch.full((d + 1,), float(l2), dtype=z.dtype)
    ridge[-1] = 0.0
    w = torch.zeros(d + 1, dtype=z.dtype) if init is None else init.clone()

    def loss_of(weights: torch.Tensor) -> torch.Tensor:
        logits = design @ weights
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="mean")
        return bce + 0.5 * (ridge * weights * weights).sum()

    loss = loss_of(w)
    for it in range(1, max_iter + 1):
        p = torch.sigmoid(design @ w)
        grad = design.T @ (p - y) / n + ridge * w
        hess = (design * (p * (1 - p)).unsqueeze(1)).T @ design / n
        hess.diagonal().add_(ridge + 1e-10)
        factor, info = torch.linalg.cholesky_ex(hess)  # positive definite: Cholesky is half the cost of LU
        step = (torch.cholesky_solve(grad.unsqueeze(1), factor).squeeze(1) if int(info) == 0
                else torch.linalg.lstsq(hess, grad.unsqueeze(1)).solution.squeeze(1))
        scale = 1.0
        while True:
            trial = w - scale * step
            trial_loss = loss_of(trial)
            if trial_loss <= loss:
                break
            if scale < 1e-6:  # no step lowers the loss (rounding at the optimum): keep the weights we have
                return w, it
            scale *= 0.5
        decrease = float(loss - trial_loss)
        w, loss = trial, trial_loss
        if float(grad.abs().max()) < tol or decrease < tol * 1e-2:
            return w, it
    return w, max_iter


def fit_logistic_path(x: torch.Tensor, y: torch.Tensor, spec: FeatureSpec, l2s: Sequence[float] = DEFAULT_L2,
                      max_iter: int = 50, std_floor: float = 1e-3) -> list[LogisticProbe]:
    """One LogisticProbe per L2 strength on selected rows x [N, len(spec.layers), H] and soft labels y [N]
    (the same order as `l2s`), fitted from the strongest penalty to the weakest, each Newton solve started
    from the previous solution."""
    _check(x, y, "logistic probe training rows")
    if float(y.max()) == float(y.min()):
        raise ValueError(f"single-class training set: all {y.shape[0]} labels equal {float(y[0]):.4g}")
    template = LogisticProbe(spec, max(l2s), std_floor)
    template.fit_standardizer(x)
    z = template.standardize(x).flatten(1).double()
    yy = y.double()
    probes: dict[float, LogisticProbe] = {}
    w = None
    for l2 in sorted(set(float(v) for v in l2s), reverse=True):
        w, iterations = newton_logistic(z, yy, l2, init=w, max_iter=max_iter)
        probe = LogisticProbe(spec, l2, std_floor)
        probe.load_state_dict(template.state_dict(), strict=False)
        with torch.no_grad():
            probe.linear.weight.copy_(w[:-1].float().unsqueeze(0))
            probe.linear.bias.copy_(w[-1:].float())
        probe.newton_iterations = iterations  # reported by the trainer, not saved
        probes[l2] = probe.eval()
    return [probes[float(v)] for v in l2s]


@dataclass
class Candidate:
    """One way to read the hidden states: its spec and its selected training / validation rows."""

    spec: FeatureSpec
    train_x: torch.Tensor
    val_x: torch.Tensor


@dataclass
class Selection:
    """What `select_logistic` chose and the validation scores of every option it tried."""

    key: Hashable
    probe: LogisticProbe
    table: list[dict[str, Any]] = field(default_factory=list)

    @property
    def best(self) -> dict[str, Any]:
        return min(self.table, key=lambda r: r["val_log_loss"])


def select_logistic(candidates: Mapping[Hashable, Candidate], train_y: torch.Tensor, val_y: torch.Tensor,
                    l2s: Sequence[float] = DEFAULT_L2, max_iter: int = 50,
                    on_candidate: Callable[[], None] | None = None) -> Selection:
    """Fit every candidate over the L2 path on the training rows; keep the one with the lowest validation
    log-loss (ties: the stronger penalty, then the earlier candidate). Test rows never enter. on_candidate: called
    after each candidate's path (a progress bar's update)."""
    if not candidates:
        raise ValueError("select_logistic needs at least one candidate")
    vy = val_y.double().numpy()
    table, best, best_key, best_score = [], None, None, np.inf
    for key, cand in candidates.items():
        _check(cand.val_x, val_y, f"validation rows of {key!r}")
        path = fit_logistic_path(cand.train_x, train_y, cand.spec, l2s, max_iter)
        for probe in sorted(path, key=lambda p: -p.l2):
            pred = probe.predict_proba(cand.val_x).double().numpy()
            score = log_loss(pred, vy)
            table.append({"candidate": key, "layers": list(cand.spec.layers), "pooling": cand.spec.pooling,
                          "l2": probe.l2, "val_log_loss": score, "val_brier": brier(pred, vy)})
            if score < best_score - 1e-12:
                best, best_key, best_score = probe, key, score
        if on_candidate is not None:
            on_candidate()
    return Selection(best_key, best, table)
