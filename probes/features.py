"""What a probe reads: which model's hidden states, which layers, and how they are combined.

Hidden-state tensors follow the Hugging Face ``output_hidden_states`` layout: one row per layer plus
row 0 for the embeddings, so a model with ``num_layers`` transformer layers gives
``[B, num_layers + 1, hidden_size]`` after pooling over a step's tokens.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePath
from typing import Any, Literal

import torch

CombineMode = Literal["concat", "mean", "weighted"]
PoolingMode = Literal["mean", "last"]
COMBINE_MODES: tuple[str, ...] = ("concat", "mean", "weighted")
POOLING_MODES: tuple[str, ...] = ("mean", "last")

_RANGE_RE = re.compile(r"^range:(\d+)-(\d+)$")


def parse_layer_option(option: str) -> str | list[int]:
    """The syntax of a layer option, checked without knowing the model: "all", "last", or explicit rows.

    - ``"all"``: every row, 0..num_layers (what SemanticSpec calls "all layers").
    - ``"last"``: the final layer only (their cheaper "last-hidden" ablation).
    - ``"range:a-b"``: rows a..b inclusive.
    - ``"a,b,c"``: an explicit list (a single ``"7"`` works too).
    Config validation calls this; `layers_from_option` resolves the result against a model.
    """
    if not isinstance(option, str) or not option.strip():
        raise ValueError(f"layer option must be a non-empty string, got {option!r}")
    text = option.strip().lower()
    if text in ("all", "last"):
        return text
    match = _RANGE_RE.match(text.replace(" ", ""))
    if match:
        lo, hi = int(match.group(1)), int(match.group(2))
        if lo > hi:
            raise ValueError(f"layer range {option!r} is empty: start {lo} > end {hi}")
        return list(range(lo, hi + 1))
    if text.startswith("range:"):
        raise ValueError(f"layer range {option!r} must look like 'range:a-b' with non-negative ints a <= b")
    try:
        rows = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"unknown layer option {option!r}: use 'all', 'last', 'range:a-b' or a comma list like '4,8,12' "
            "(0 = embeddings)"
        ) from None
    if not rows or min(rows) < 0:
        raise ValueError(f"layer option {option!r} must list row indices >= 0 (0 = embeddings)")
    return rows


def layers_from_option(option: str, num_layers: int) -> list[int]:
    """Turn a layer option (`parse_layer_option`) into hidden-state row indices of a model with
    `num_layers` layers (0 = embeddings, num_layers = last layer), sorted and duplicate-free."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    parsed = parse_layer_option(option)
    if parsed == "all":
        return list(range(num_layers + 1))
    if parsed == "last":
        return [num_layers]
    _check_rows(parsed, num_layers, source=f"layer option {option!r}")
    return sorted(set(parsed))


def _check_rows(rows: list[int], num_layers: int, source: str) -> None:
    bad = [r for r in rows if not 0 <= r <= num_layers]
    if bad:
        raise ValueError(
            f"{source}: rows {bad} are out of range; valid rows are 0..{num_layers} "
            f"(0 = embeddings, {num_layers} = last of the model's {num_layers} layers)"
        )


def same_model_name(a: str | None, b: str | None) -> bool:
    """Whether two names name the same model (the one rule probe-train, probe-eval and the runtime share): equal
    names (hub ids are case-insensitive; a trailing slash does not count), or a local folder and a name with the
    same last path component (/models/Qwen2-7B and ./models/Qwen2-7B are copies of Qwen/Qwen2-7B). A hub cache
    snapshot (.../models--Qwen--Qwen2-7B/snapshots/<revision>) names its organisation too. A name of one or two
    parts not written as a path (models/Qwen2-7B) reads as a hub id, whatever folders exist here: two ids of other
    organisations (org-a/X, org-b/X) are other weights."""
    if not a or not b:
        return False
    a, b = a.strip().rstrip("/"), b.strip().rstrip("/")
    if a.lower() == b.lower():
        return True
    if not (_is_local(a) or _is_local(b)):
        return False
    ha, hb = (_held_name(n).lower() if _is_local(n) else n.lower() for n in (a, b))
    if "/" in ha and "/" in hb:  # both say their organisation (a hub id, a hub cache snapshot)
        return ha == hb
    return ha.rsplit("/", 1)[-1] == hb.rsplit("/", 1)[-1]


def _is_local(name: str) -> bool:
    """A path, not a hub id: written as one (/, ./, ../, ~), a hub cache snapshot, or three parts or more (a hub id
    has at most two)."""
    return name.startswith(("/", "./", "../", "~")) or len(PurePath(name).parts) >= 3


def _held_name(folder: str) -> str:
    """The name of the model a local folder holds: a hub cache snapshot's org/name, else the folder's own name."""
    parts = PurePath(folder).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1)
    return parts[-1] if parts else folder


@dataclass
class FeatureSpec:
    """The contract between a probe and the engine that feeds it hidden states."""

    model_id: str = field(metadata={"help": "model whose hidden states the probe was trained on"})
    num_layers: int = field(metadata={"help": "transformer layers of that model (tensors have num_layers+1 rows)"})
    hidden_size: int = field(metadata={"help": "hidden size of that model"})
    layers: list[int] = field(metadata={"help": "hidden-state rows the probe reads, sorted (0 = embeddings)"})
    combine: CombineMode = field(default="concat", metadata={
        "help": "how the selected layers are combined: concat | mean | weighted (learned softmax weights)"})
    pooling: PoolingMode = field(default="mean", metadata={
        "help": "how a step's tokens were pooled into one vector: mean | last"})
    revision: str | None = field(default=None, metadata={"help": "model revision (commit/tag), if known"})

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise ValueError(f"FeatureSpec.model_id must be a non-empty string, got {self.model_id!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"FeatureSpec.num_layers must be a positive int, got {self.num_layers!r}")
        if not isinstance(self.hidden_size, int) or self.hidden_size < 1:
            raise ValueError(f"FeatureSpec.hidden_size must be a positive int, got {self.hidden_size!r}")
        if isinstance(self.layers, str):  # convenience: FeatureSpec(..., layers="all")
            self.layers = layers_from_option(self.layers, self.num_layers)
        self.layers = [int(r) for r in self.layers]
        if not self.layers:
            raise ValueError("FeatureSpec.layers is empty: a probe must read at least one layer")
        if len(set(self.layers)) != len(self.layers) or self.layers != sorted(self.layers):
            raise ValueError(f"FeatureSpec.layers must be sorted and without duplicates, got {self.layers}")
        _check_rows(self.layers, self.num_layers, source="FeatureSpec.layers")
        if self.combine not in COMBINE_MODES:
            raise ValueError(f"FeatureSpec.combine must be one of {COMBINE_MODES}, got {self.combine!r}")
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"FeatureSpec.pooling must be one of {POOLING_MODES}, got {self.pooling!r}")
        if self.revision is not None and not isinstance(self.revision, str):
            raise ValueError(f"FeatureSpec.revision must be a string or None, got {self.revision!r}")

    @property
    def num_selected(self) -> int:
        return len(self.layers)

    @property
    def input_dim(self) -> int:
        """Width of the combined feature vector fed to the MLP."""
        return self.hidden_size * (self.num_selected if self.combine == "concat" else 1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FeatureSpec:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"FeatureSpec.from_dict: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    def check_compatible(self, num_layers: int, hidden_size: int, model_id: str | None = None,
                         *, allow_model_mismatch: bool = False) -> None:
        """Raise ValueError if an engine's model cannot feed this probe.

        Shapes must match exactly. A different model name with matching shapes is refused too (same
        shapes do not mean the same representation) unless `allow_model_mismatch` is set, e.g. for a
        local copy saved under another name.
        """
        trained = (f"the probe was trained on {self.model_id!r}"
                   f"{'@' + self.revision if self.revision else ''} with {self.num_layers} layers / "
                   f"hidden size {self.hidden_size}")
        engine = f"the engine's model {model_id!r}" if model_id else "the engine's model"
        if num_layers != self.num_layers or hidden_size != self.hidden_size:
            raise ValueError(
                f"{trained}, but {engine} has {num_layers} layers / hidden size {hidden_size}. "
                f"Load {self.model_id!r} in the engine, or retrain the probe on features from the engine's model."
            )
        if model_id is not None and not allow_model_mismatch and not same_model_name(model_id, self.model_id):
            raise ValueError(
                f"{trained}, but {engine} is a different model (shapes match, representations need not). "
                f"Load {self.model_id!r}, retrain the probe on this model, or pass allow_model_mismatch=True "
                "(probe-bench: runtime.allow_model_mismatch=true) if it is the same weights under another name."
            )

    def select(self, features: torch.Tensor) -> torch.Tensor:
        """[B, num_layers+1, H] pooled hidden states -> [B, len(layers), H] rows this probe reads."""
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"select expects a torch.Tensor, got {type(features).__name__}")
        expected = (self.num_layers + 1, self.hidden_size)
        if features.ndim != 3 or tuple(features.shape[1:]) != expected:
            raise ValueError(
                f"select expects hidden states of shape [B, {expected[0]}, {expected[1]}] "
                f"(num_layers+1 rows for {self.model_id!r}), got {list(features.shape)}"
            )
        if self.num_selected == self.num_layers + 1:
            return features  # every row, in order: nothing to gather
        index = torch.tensor(self.layers, device=features.device)
        return features.index_select(1, index)
