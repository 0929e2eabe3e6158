"""SemanticSpec's probe: a 3-layer MLP from pooled hidden states to the semantic probability of a step.

The paper fixes the optimiser (AdamW, lr 1e-3, betas (0.9, 0.95)) and "3-layer feed-forward regressor";
widths, loss, squashing, layer combination and early stopping are our choices, all in `ProbeMLPConfig` and
`FeatureSpec`. Inputs are standardised per (layer, dim) with statistics from the training set, because
hidden-state scales differ by orders of magnitude across layers and a few "massive activation" dims.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .base import PROB_EPS, HiddenStateProbe  # noqa: F401  (PROB_EPS: re-exported)
from .features import FeatureSpec

FORMAT_NAME = "specprobe.semantic_probe"
FORMAT_VERSION = 1


@dataclass
class ProbeMLPConfig:
    """Architecture and training hyper-parameters of a SemanticProbe."""

    hidden_dim: int = field(default=256, metadata={"help": "width of both hidden layers of the MLP"})
    dropout: float = field(default=0.1, metadata={"help": "dropout after each hidden layer, in [0, 1)"})
    loss: Literal["bce", "mse"] = field(default="bce", metadata={
        "help": "bce: BCE-with-logits on the soft label; mse: squared error of sigmoid(logit) vs the label"})
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate (SemanticSpec: 1e-3)"})
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata={
        "help": "AdamW betas (SemanticSpec: (0.9, 0.95))"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    epochs: int = field(default=60, metadata={"help": "maximum number of passes over the training set"})
    batch_size: int = field(default=256, metadata={"help": "training mini-batch size"})
    patience: int = field(default=8, metadata={
        "help": "stop after this many epochs without a lower validation loss; best weights are restored"})
    seed: int = field(default=0, metadata={"help": "seed for initialisation, shuffling and dropout"})
    std_floor: float = field(default=1e-3, metadata={
        "help": "lower bound on per-feature std in standardisation (constant features must not explode)"})

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)  # JSON gives a list back
        _require(isinstance(self.hidden_dim, int) and self.hidden_dim >= 1, "hidden_dim", "a positive int",
                 self.hidden_dim)
        _require(0.0 <= self.dropout < 1.0, "dropout", "in [0, 1)", self.dropout)
        _require(self.loss in ("bce", "mse"), "loss", "'bce' or 'mse'", self.loss)
        _require(math.isfinite(self.lr) and self.lr > 0, "lr", "a positive finite float", self.lr)
        _require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "betas",
                 "two floats in [0, 1)", self.betas)
        _require(self.weight_decay >= 0, "weight_decay", ">= 0", self.weight_decay)
        _require(isinstance(self.epochs, int) and self.epochs >= 1, "epochs", "a positive int", self.epochs)
        _require(isinstance(self.batch_size, int) and self.batch_size >= 1, "batch_size", "a positive int",
                 self.batch_size)
        _require(isinstance(self.patience, int) and self.patience >= 1, "patience", "a positive int",
                 self.patience)
        _require(isinstance(self.seed, int), "seed", "an int", self.seed)
        _require(self.std_floor > 0, "std_floor", "> 0", self.std_floor)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["betas"] = list(self.betas)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeMLPConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ProbeMLPConfig.from_dict: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)


def _require(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"ProbeMLPConfig.{name} must be {what}, got {value!r}")


class SemanticProbe(HiddenStateProbe):
    """Selected hidden states [B, len(layers), H] -> one logit per row.

    Pipeline: standardise per (layer, dim) -> combine layers (concat | mean | learned softmax weights)
    -> Linear-GELU-Dropout-Linear-GELU-Dropout-Linear.
    """

    FORMAT_NAME = FORMAT_NAME
    FORMAT_VERSION = FORMAT_VERSION
    KIND = "mlp"

    def __init__(self, spec: FeatureSpec, cfg: ProbeMLPConfig | None = None) -> None:
        self_cfg = cfg or ProbeMLPConfig()
        super().__init__(spec, self_cfg.std_floor)
        self.cfg = self_cfg
        n_sel = spec.num_selected
        if spec.combine == "weighted":
            self.layer_logits = nn.Parameter(torch.zeros(n_sel))  # uniform weights at start
        width = self.cfg.hidden_dim
        self.mlp = nn.Sequential(
            nn.Linear(spec.input_dim, width), nn.GELU(), nn.Dropout(self.cfg.dropout),
            nn.Linear(width, width), nn.GELU(), nn.Dropout(self.cfg.dropout),
            nn.Linear(width, 1),
        )

    def layer_weights(self) -> torch.Tensor:
        """Per-layer weights used to combine layers (softmax for 'weighted', uniform for 'mean')."""
        n_sel = self.spec.num_selected
        if self.spec.combine == "weighted":
            return torch.softmax(self.layer_logits, dim=0)
        return torch.full((n_sel,), 1.0 / n_sel, device=self.feature_mean.device)

    def combine(self, selected: torch.Tensor) -> torch.Tensor:
        x = self.standardize(selected)
        if self.spec.combine == "concat":
            return x.flatten(1)
        if self.spec.combine == "mean":
            return x.mean(dim=1)
        return torch.einsum("blh,l->bh", x, torch.softmax(self.layer_logits, dim=0))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self._check_selected(features)
        return self.mlp(self.combine(features)).squeeze(-1)

    # ---- persistence ----------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {"probe_config": self.cfg.to_dict()}

    @classmethod
    def _from_config(cls, spec: FeatureSpec, config: dict[str, Any]) -> SemanticProbe:
        return cls(spec, ProbeMLPConfig.from_dict(config["probe_config"]))


# ---- training ---------------------------------------------------------------------------------------
@dataclass
class FitHistory:
    """Per-epoch losses and where early stopping landed."""

    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    best_epoch: int = -1  # 0-based index into val_loss
    best_val_loss: float = math.inf
    stopped_early: bool = False

    @property
    def epochs_run(self) -> int:
        return len(self.train_loss)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "epochs_run": self.epochs_run}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FitHistory:
        """The inverse of to_dict (epochs_run is derived)."""
        kwargs = {f.name: data[f.name] for f in fields(cls) if data.get(f.name) is not None}
        return cls(**kwargs)  # (a saved inf best_val_loss reads back as None: the default)


def validate_training_data(x: torch.Tensor, y: torch.Tensor, spec: FeatureSpec, split: str) -> None:
    """Checks that must pass before any training step; messages say what is wrong and how much."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError(f"{split} features and labels must be torch tensors")
    if x.shape[0] == 0:
        raise ValueError(f"empty {split} set: no rows to train/validate on")
    full = (spec.num_layers + 1, spec.hidden_size)
    selected = (spec.num_selected, spec.hidden_size)
    if x.ndim != 3 or tuple(x.shape[1:]) not in (full, selected):
        raise ValueError(
            f"{split} features have shape {list(x.shape)}; the spec ({spec.model_id!r}, layers {spec.layers}) "
            f"needs [N, {full[0]}, {full[1]}] hidden states or [N, {selected[0]}, {selected[1]}] selected rows"
        )
    if y.ndim != 1 or y.shape[0] != x.shape[0]:
        raise ValueError(f"{split} labels must be a vector of length {x.shape[0]} (one per row), "
                         f"got shape {list(y.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{split} features must be floating point, got {x.dtype}")
    bad_rows = int((~torch.isfinite(x)).flatten(1).any(dim=1).sum())
    if bad_rows:
        raise ValueError(f"{split} features contain NaN/inf in {bad_rows} of {x.shape[0]} rows; "
                         "drop or fix those rows before training")
    y = y.double()
    if not torch.isfinite(y).all():
        raise ValueError(f"{split} labels contain {int((~torch.isfinite(y)).sum())} NaN/inf values")
    outside = int(((y < 0) | (y > 1)).sum())
    if outside:
        raise ValueError(f"{split} labels must lie in [0, 1] (probabilities); {outside} values are outside, "
                         f"range seen [{float(y.min()):.4g}, {float(y.max()):.4g}]")


def _loss(logits: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "bce":  # BCE against a soft target is minimised at sigmoid(logit) = label
        return F.binary_cross_entropy_with_logits(logits, y)
    return F.mse_loss(torch.sigmoid(logits), y)


@torch.no_grad()
def eval_loss(probe: SemanticProbe, x: torch.Tensor, y: torch.Tensor, kind: str, batch_size: int) -> float:
    probe.eval()
    total = 0.0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
        total += _loss(probe(xb), yb, kind).item() * xb.shape[0]
    return total / x.shape[0]


def fit_probe(train_x: torch.Tensor, train_y: torch.Tensor, val_x: torch.Tensor, val_y: torch.Tensor,
              spec: FeatureSpec, cfg: ProbeMLPConfig | None = None,
              log_fn: Callable[[dict[str, Any]], None] | None = None,
              device: str | torch.device = "cpu") -> tuple[SemanticProbe, FitHistory]:
    """Train a SemanticProbe; returns it (best validation weights, eval mode) and the loss history.

    Features may be full hidden states [N, num_layers+1, H] or the spec's selected rows. Labels are
    soft semantic probabilities in [0, 1]. Deterministic for a given seed (on the same device and
    thread count); the global torch RNG state is left untouched.
    """
    cfg = cfg or ProbeMLPConfig()
    validate_training_data(train_x, train_y, spec, "training")
    validate_training_data(val_x, val_y, spec, "validation")
    if float(train_y.max()) == float(train_y.min()):
        raise ValueError(
            f"single-class training set: all {train_y.shape[0]} labels equal {float(train_y[0]):.4g}, so there "
            "is nothing to learn; check the labelling step or the split"
        )
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        probe = SemanticProbe(spec, cfg)
        train_sel = probe.prepare(train_x).float().to(device)
        val_sel = probe.prepare(val_x).float().to(device)
        ytr, yva = train_y.float().to(device), val_y.float().to(device)
        probe.fit_standardizer(train_sel.cpu())
        probe.to(device)
        history = _train_loop(probe, train_sel, ytr, val_sel, yva, cfg, log_fn)
    return probe.eval(), history


def _train_loop(probe: SemanticProbe, x: torch.Tensor, y: torch.Tensor, vx: torch.Tensor, vy: torch.Tensor,
                cfg: ProbeMLPConfig, log_fn: Callable[[dict[str, Any]], None] | None) -> FitHistory:
    opt = torch.optim.AdamW(probe.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    shuffler = torch.Generator().manual_seed(cfg.seed)
    history = FitHistory()
    best_state = copy.deepcopy(probe.state_dict())
    stale = 0
    n = x.shape[0]
    for epoch in range(cfg.epochs):
        probe.train()
        order = torch.randperm(n, generator=shuffler).to(x.device)
        running = 0.0
        for start in range(0, n, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            loss = _loss(probe(x[idx]), y[idx], cfg.loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += loss.item() * idx.shape[0]
        train_loss = running / n
        val_loss = eval_loss(probe, vx, vy, cfg.loss, max(cfg.batch_size, 1024))
        history.train_loss.append(train_loss)
        history.val_loss.append(val_loss)
        improved = val_loss < history.best_val_loss - 1e-9
        if improved:
            history.best_val_loss, history.best_epoch, stale = val_loss, epoch, 0
            best_state = copy.deepcopy(probe.state_dict())
        else:
            stale += 1
        if log_fn is not None:
            log_fn({"epoch": epoch, "train_loss": train_loss, "val_loss": val_loss, "best_epoch": history.best_epoch})
        if stale >= cfg.patience:
            history.stopped_early = True
            break
    if history.best_epoch < 0:  # no finite validation loss: returning the untrained weights would pass as a probe
        raise ValueError(f"the probe's validation loss was never finite in {len(history.val_loss)} epochs (last: "
                         f"{history.val_loss[-1] if history.val_loss else 'none'}): training diverged; lower "
                         "probe.lr or check the features for extreme values")
    probe.load_state_dict(best_state)
    return history
