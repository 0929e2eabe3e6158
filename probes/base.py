"""What every hidden-state probe shares: its FeatureSpec, per-(layer, dim) standardisation fitted on the
training rows, probabilities clamped away from 0 and 1, and the safetensors + JSON pair it is saved as.

Subclasses (`mlp.SemanticProbe`, `logistic.LogisticProbe`) define `forward` (selected rows -> one logit per
row), `FORMAT_NAME`, and how their config goes in and out of the JSON (`_config` / `_from_config`).
`load_probe` reads either kind back from its JSON's format tag, so callers never need to know which.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from .features import FeatureSpec
from .io import FileFormatError, load_model_files, model_paths, read_json, save_model_files

PROB_EPS = 1e-6  # predictions are clamped to [eps, 1 - eps] so p/q ratios stay finite


class HiddenStateProbe(nn.Module):
    """Selected hidden states [B, len(layers), H] -> P(label) per row."""

    FORMAT_NAME: ClassVar[str] = ""
    FORMAT_VERSION: ClassVar[int] = 1
    KIND: ClassVar[str] = ""

    def __init__(self, spec: FeatureSpec, std_floor: float) -> None:
        super().__init__()
        self.spec = spec
        self.std_floor = float(std_floor)
        self.extra: dict[str, Any] = {}  # free-form metadata saved in the JSON (e.g. training provenance)
        self.register_buffer("feature_mean", torch.zeros(spec.num_selected, spec.hidden_size))
        self.register_buffer("feature_std", torch.ones(spec.num_selected, spec.hidden_size))

    # ---- features -------------------------------------------------------------------------------
    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """Accept full hidden states [B, num_layers+1, H] or already-selected [B, len(layers), H]."""
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"features must be a torch.Tensor, got {type(features).__name__}")
        spec = self.spec
        if features.ndim == 3 and features.shape[1] == spec.num_layers + 1 and features.shape[2] == spec.hidden_size:
            return spec.select(features)
        self._check_selected(features)
        return features

    def _check_selected(self, features: torch.Tensor) -> None:
        spec = self.spec
        expected = (spec.num_selected, spec.hidden_size)
        if features.ndim != 3 or tuple(features.shape[1:]) != expected:
            raise ValueError(
                f"probe expects features [B, {expected[0]}, {expected[1]}] (layers {spec.layers} of "
                f"{spec.model_id!r}) or full hidden states [B, {spec.num_layers + 1}, {spec.hidden_size}], "
                f"got {list(features.shape)}"
            )

    @torch.no_grad()
    def fit_standardizer(self, selected: torch.Tensor) -> None:
        """Set per-(layer, dim) mean/std from training features [N, len(layers), H]."""
        self._check_selected(selected)
        x = selected.to(self.feature_mean.dtype)
        self.feature_mean.copy_(x.mean(dim=0))
        std = x.std(dim=0, unbiased=False) if x.shape[0] > 1 else torch.zeros_like(self.feature_std)
        self.feature_std.copy_(std.clamp_min(self.std_floor))

    def standardize(self, selected: torch.Tensor) -> torch.Tensor:
        return (selected.to(self.feature_mean.dtype) - self.feature_mean) / self.feature_std

    # ---- inference ------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_proba(self, features: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
        """Probabilities in [PROB_EPS, 1 - PROB_EPS] (never exactly 0 or 1), on CPU, float32."""
        was_training = self.training
        self.eval()
        try:
            x = self.prepare(features)
            device = self.feature_mean.device
            out = [torch.sigmoid(self(chunk.to(device)).double()) for chunk in x.split(batch_size)]
            probs = torch.cat(out) if out else torch.empty(0, dtype=torch.float64)
        finally:
            self.train(was_training)
        return probs.clamp(PROB_EPS, 1 - PROB_EPS).float().cpu()

    # ---- persistence ----------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _from_config(cls, spec: FeatureSpec, config: dict[str, Any]) -> HiddenStateProbe:
        raise NotImplementedError

    def save(self, directory, name: str, extra: dict[str, Any] | None = None):
        """Write `{name}.safetensors` (weights + standardisation buffers) and `{name}.json`."""
        meta = {**self.extra, **(extra or {})}
        config = {"probe_kind": self.KIND, "feature_spec": self.spec.to_dict(), **self._config(), "extra": meta}
        return save_model_files(directory, name, self.state_dict(), config,
                                format_name=self.FORMAT_NAME, format_version=self.FORMAT_VERSION)

    @classmethod
    def load(cls, directory, name: str, map_location: str | torch.device = "cpu") -> HiddenStateProbe:
        tensors, config = load_model_files(directory, name, format_name=cls.FORMAT_NAME,
                                           supported_versions=(cls.FORMAT_VERSION,))
        probe = cls._from_config(FeatureSpec.from_dict(config["feature_spec"]), config)
        try:
            missing, unexpected = probe.load_state_dict(tensors, strict=False)
        except RuntimeError as err:  # shape mismatch between the JSON config and the weights
            raise ValueError(f"{name}.safetensors does not match its JSON config in {directory}: {err}") from None
        if missing or unexpected:
            raise ValueError(f"{name}.safetensors does not match its JSON config: "
                             f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:
            raise FileFormatError(f"{name}.safetensors in {directory} has NaN/inf weights ({', '.join(sorted(bad))}); "
                                  "the probe cannot predict anything: train it again (probe-train --stage train)")
        probe.extra = config.get("extra", {})
        return probe.to(map_location).eval()


def probe_classes() -> dict[str, type[HiddenStateProbe]]:
    """Every probe kind by its JSON format tag."""
    from .logistic import LogisticProbe
    from .mlp import SemanticProbe

    return {cls.FORMAT_NAME: cls for cls in (SemanticProbe, LogisticProbe)}


def load_probe(directory, name: str, map_location: str | torch.device = "cpu") -> HiddenStateProbe:
    """A saved probe of any kind (MLP or logistic), told apart by the format tag in `{name}.json`."""
    json_path = model_paths(directory, name)[1]
    if not json_path.is_file():
        present = sorted(p.name for p in Path(directory).glob("*.json")) if Path(directory).is_dir() else []
        raise FileNotFoundError(f"expected {json_path.name} (and {name}.safetensors) in {directory}; "
                                f"JSON files there: {present or 'none'}")
    tag = read_json(json_path).get("format")
    classes = probe_classes()
    if tag not in classes:
        raise FileFormatError(f"{json_path} holds format {tag!r}, which is not a probe; probe formats: {sorted(classes)}")
    return classes[tag].load(directory, name, map_location=map_location)
