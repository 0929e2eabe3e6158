"""The checkpoint folder probe-train writes (layout: checkpoints/README.md) and a reader for it.

Everything is safetensors + JSON (+ PEFT's own safetensors adapter); no pickle anywhere. The folder is
assembled under a temporary name next to its destination and moved into place with renames, so an
interrupted run leaves either the previous checkpoint or the new one, never a mix.

``read_checkpoint(path)`` returns the parts as Python objects (probes as ``SemanticProbe``s, baselines,
the embedding threshold, the judge's metadata and adapter folder); ``infer.verifiers.load_verifier`` is
the runtime's loader of the same files.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from infer.versions import package_versions
from probes.io import read_json, write_json
from probes.mlp import SemanticProbe
from train.baselines import ConstantBaseline, LogprobBaseline

FORMAT = "specprobe-checkpoint"
FORMAT_VERSION = 1
BASELINES_FORMAT = "specprobe.baselines"
EMBEDDING_FORMAT = "specprobe.embedding_threshold"
JUDGE_DIR = "judge_lora"
JUDGE_JSON = "judge.json"
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".joblib", ".npy", ".npz")
LOGPROB_INPUTS = {"target_own": "mean_logprob", "draft_via_target": "target_logprob / target_num_tokens",
                  "draft_own": "mean_logprob"}


def clean_json(obj: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python, tuples -> lists (JSON-ready, recursively)."""
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


# ----------------------------------------------------------------------------- writing
def _write_probes(folder: Path, probes) -> list[str]:
    names = []
    for name, trained in probes.probes.items():
        trained.probe.save(folder, name)
        names.append(name)
    baselines = {"format": BASELINES_FORMAT, "format_version": 1}
    for role, base in probes.baselines.items():
        main = probes.probes[f"probe_{role}"].plan
        baselines[role] = {**base.to_dict(), "trained_on": main.train_sets,
                           "logprob_input": {s: LOGPROB_INPUTS[s] for s in main.train_sets}}
    write_json(folder / "baselines.json", clean_json(baselines))
    return names + ["baselines"]


def _write_embedding(folder: Path, embedding) -> str:
    from infer.models import describe_source

    payload = {"format": EMBEDDING_FORMAT, "format_version": 1, **embedding.to_json(describe_source(embedding.model)),
               "validation": embedding.metrics.get("val")}
    write_json(folder / "embedding_threshold.json", clean_json(payload))
    return "embedding_threshold"


def _components_meta(folder: Path) -> list[dict[str, Any]]:
    return [{"file": str(p.relative_to(folder)), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file()]


def write_checkpoint(folder: str | os.PathLike, cfg, result, manifest: dict,
                     data_folder: str | os.PathLike | None = None) -> Path:
    """Write every trained component of a `train.pipeline.TrainResult` to `folder` (replacing it)."""
    from infer.config import to_dict
    from train.tracking import format_metrics

    folder = Path(folder)
    data_folder = data_folder if data_folder is not None else cfg.data_dir
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        components: list[str] = []
        if result.probes is not None:
            components += _write_probes(tmp, result.probes)
        if result.embedding is not None:
            components.append(_write_embedding(tmp, result.embedding))
        if result.judge is not None:
            result.judge.save(tmp / JUDGE_DIR)
            components.append("judge")
        metrics = clean_json(result.metrics)
        write_json(tmp / "metrics.json", metrics)
        (tmp / "README.md").write_text(model_card(cfg, metrics, components, manifest, format_metrics(metrics)),
                                       encoding="utf-8")
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": cfg.name,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "components": components,
                "data": {"folder": str(Path(data_folder).resolve()), "engines": manifest["engines"],
                         "layers": manifest["layers"], "created": manifest.get("created"),
                         "fingerprint": manifest.get("fingerprint")},
                "config": to_dict(cfg), "versions": package_versions()}
        write_json(tmp / "checkpoint.json", clean_json(meta))
        meta["files"] = _components_meta(tmp)
        write_json(tmp / "checkpoint.json", clean_json(meta))
        bad = find_pickles(tmp)
        if bad:
            raise RuntimeError(f"refusing to write a checkpoint with pickle files: {bad}")
        _swap_in(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _make_readable(folder: Path) -> None:
    """Files 0644, folders 0755: checkpoints are meant to be shared (temporary files are created 0600)."""
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _swap_in(tmp: Path, folder: Path) -> None:
    _make_readable(tmp)
    old = folder.with_name(f".{folder.name}.old{os.getpid()}")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def find_pickles(folder: str | os.PathLike) -> list[str]:
    """Files that are or may be pickles: a pickle-ish suffix, a .safetensors file that safetensors cannot
    open, or any other file starting like a pickle (protocol 2-5 header) or a zip (torch.save)."""
    from safetensors import safe_open

    bad = []
    for path in Path(folder).rglob("*"):
        if not path.is_file():
            continue
        if path.suffix.lower() in PICKLE_SUFFIXES:
            bad.append(str(path))
        elif path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt") as f:
                    list(f.keys())
            except Exception:  # noqa: BLE001 - anything safetensors cannot read is suspect
                bad.append(str(path))
        else:
            with open(path, "rb") as f:
                head = f.read(2)
            if head == b"PK" or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5):
                bad.append(str(path))
    return sorted(bad)


# ----------------------------------------------------------------------------- model card
def model_card(cfg, metrics: dict, components: list[str], manifest: dict, table: str) -> str:
    eng = manifest["engines"]
    data = metrics.get("data", {})
    rows = data.get("rows", {})
    split = metrics.get("split", {})
    lines = [
        f"# specprobe checkpoint `{cfg.name}`", "",
        "Verifiers for step-level speculative reasoning (SemanticSpec probes, Lookahead-Reasoning pair verifiers),"
        " trained by `probe-train`.", "",
        "## Models", "",
        *(f"- {role}: `{e['model_id']}` (config name `{e.get('name')}`, revision {e.get('revision') or 'unknown'}, "
          f"{e['num_layers']} layers, hidden size {e['hidden_size']})" for role, e in eng.items()),
        "", "## Data", "",
        f"- folder: `{data.get('folder')}`; {data.get('num_samples_per_context')} samples per context and model, "
        f"meaning clusters by the `{data.get('judge')}` judge",
        f"- source: `{cfg.source.kind}` ({cfg.source.task if cfg.source.kind == 'reasoning_gym' else cfg.source.name or cfg.source.path})",
        f"- split by question (seed {split.get('seed')}): "
        + ", ".join(f"{s} {len(split.get(s, []))} questions ({', '.join(f'{m} {n}' for m, n in rows.get(s, {}).items())} samples)"
                    for s in ("train", "val", "test")),
        "", "## Components", "",
        *(f"- `{c}`" for c in components),
        "", "## Training", "",
        *_training_lines(cfg, components),
        "", "## Validation metrics", "", "```", table, "```", "",
        "Probe MAE, Spearman and ECE compare with the soft labels; AUROC scores 'this meaning is the majority' "
        "(label ≥ 0.5). Pair verifiers: AUROC of the score, precision / recall / acceptance at each threshold. "
        "All numbers are in `metrics.json`.", "",
        "## Limitations", "",
        "- Labels come from sampled meaning clusters: with N samples per context a probability is known only "
        "to about 1/N, and the equivalence judge's mistakes become label noise.",
        "- The probes read one specific model's hidden states: they refuse a model with another layer count "
        "or hidden size, and are meaningless for other weights of the same shape.",
        "- Trained on one data distribution (source, prompt format, sampling temperature); other domains may "
        "need new data.",
    ]
    if "offline:" in (cfg.models.target + cfg.models.draft):
        lines.append("- Offline tiny setting: one small LM plays both roles and an embedding judge replaces NLI; "
                     "numbers show the pipeline works, not what full-size models reach.")
    return "\n".join(lines) + "\n"


def _training_lines(cfg, components: list[str]) -> list[str]:
    p, v = cfg.probe, cfg.verifiers
    lines = []
    if "probe_target" in components or "probe_draft" in components:
        lines.append(f"- probes: 3-layer MLP, width {p.hidden_dim}, dropout {p.dropout}, loss {p.loss}, AdamW lr {p.lr} "
                     f"betas {tuple(p.betas)} weight decay {p.weight_decay}, ≤ {p.epochs} epochs, early stopping "
                     f"patience {p.patience}, seed {p.seed}; features `{p.features}`, combine `{p.combine}`, pooling "
                     f"`{p.pooling}`; target probe also on draft steps via the target: {p.target_with_draft}; "
                     f"log-prob baseline: {p.logprob_baseline}")
    if "embedding_threshold" in components:
        lines.append(f"- embedding threshold: `{v.embedding_model}`, target precision {v.target_precision}")
    if "judge" in components:
        lines.append(f"- judge LoRA: base `{v.judge_base}`, r {v.judge_lora_r}, alpha {v.judge_lora_alpha}, "
                     f"{'all' if v.judge_lora_layers is None else f'last {v.judge_lora_layers}'} layers, "
                     f"{v.judge_steps} steps, lr {v.judge_lr}, batch {v.judge_batch_size}, ≤ {v.judge_max_pairs} "
                     "balanced pairs")
    return lines


# ----------------------------------------------------------------------------- reading
@dataclass
class Checkpoint:
    folder: Path
    meta: dict[str, Any]
    probes: dict[str, SemanticProbe] = field(default_factory=dict)
    baselines: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> {constant, logprob, ...}
    embedding: dict[str, Any] | None = None
    judge: dict[str, Any] | None = None  # judge.json + "adapter_dir"
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def components(self) -> list[str]:
        return list(self.meta.get("components", []))


def read_checkpoint(path: str | os.PathLike, map_location: str = "cpu") -> Checkpoint:
    """Read a probe-train checkpoint folder (or its checkpoint.json) into Python objects."""
    folder = Path(path)
    if folder.name == "checkpoint.json":
        folder = folder.parent
    meta_path = folder / "checkpoint.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{folder} is not a probe-train checkpoint: no checkpoint.json "
                                "(train one with `probe-train --config <file>`)")
    meta = read_json(meta_path)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
                         f"this specprobe reads {FORMAT!r} version {FORMAT_VERSION}")
    ckpt = Checkpoint(folder, meta)
    for name in meta.get("components", []):
        if name.startswith(("probe_", "baseline_last_layer_")):
            ckpt.probes[name] = SemanticProbe.load(folder, name, map_location=map_location)
        elif name == "baselines":
            ckpt.baselines = _read_baselines(folder / "baselines.json")
        elif name == "embedding_threshold":
            ckpt.embedding = read_json(folder / "embedding_threshold.json")
        elif name == "judge":
            ckpt.judge = {**read_json(folder / JUDGE_DIR / JUDGE_JSON), "adapter_dir": str(folder / JUDGE_DIR)}
    if (folder / "metrics.json").is_file():
        ckpt.metrics = read_json(folder / "metrics.json")
    return ckpt


def _read_baselines(path: Path) -> dict[str, dict[str, Any]]:
    data = read_json(path)
    if data.get("format") != BASELINES_FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {BASELINES_FORMAT!r}")
    out = {}
    for role in ("target", "draft"):
        if role in data:
            entry = data[role]
            out[role] = {"constant": ConstantBaseline.from_dict(entry["constant"]),
                         "logprob": LogprobBaseline.from_dict(entry["logprob"]),
                         "logprob_input": entry.get("logprob_input"), "trained_on": entry.get("trained_on")}
    return out
