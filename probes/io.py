"""Save/load helpers: tensors go to safetensors, configuration goes to JSON. Never pickle.

A saved model is two files in one folder: ``{name}.safetensors`` (tensors only) and ``{name}.json``
(everything needed to rebuild the module, plus a format tag and version). Both are written to a
temporary file first and renamed, so a crash mid-save never leaves a half-written file behind; that
rule lives here (`stage_file`, `write_atomically`, `write_text`) for every package.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

PathLike = str | os.PathLike
REDO = "the file is damaged or was edited; run the step that wrote it again (probe-train --stage data or --stage train)"


class FileFormatError(ValueError):
    """A file that exists but cannot be read as what it should be (truncated, damaged, edited by hand)."""


def stage_file(path: PathLike, write: Callable[[str], Any]) -> Path:
    """Call write(tmp) on a temporary file beside `path` and make it durable (fsync, mode 0644); return the
    temporary path. Rename it over `path` to publish it: several staged files can be published together.
    Temporary names look like `.{name}.*.tmp`, which `clean_temporaries`-style sweeps can find."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp and safetensors create private files; outputs are meant to be shared
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return Path(tmp)


def write_atomically(path: PathLike, write: Callable[[str], Any]) -> Path:
    """Call write(tmp_path) on a temp file beside `path`, then rename it over `path` (never half-written)."""
    path = Path(path)
    tmp = stage_file(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: PathLike, text: str) -> Path:
    """Write UTF-8 text atomically."""
    return write_atomically(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def clean_json(obj: Any) -> Any:
    """JSON-ready, recursively: NaN / inf -> None; numpy and torch arrays and scalars -> Python values; tuples ->
    lists; keys -> strings."""
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if isinstance(obj, (np.ndarray, np.generic, torch.Tensor)):
        return clean_json(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON, atomically. Non-finite floats are refused (they are not JSON)."""
    path = Path(path)
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"
    return write_text(path, text)


def read_json(path: PathLike, what_to_do: str = REDO) -> Any:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSON file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise FileFormatError(f"{path} is not valid JSON ({err}); {what_to_do}") from None


def save_tensors(path: PathLike, tensors: Mapping[str, torch.Tensor],
                 metadata: Mapping[str, str] | None = None) -> Path:
    """Write named tensors to a safetensors file, atomically.

    Tensors are moved to CPU and made contiguous copies: safetensors refuses views that share
    storage, which state dicts can contain (tied weights, slices).
    """
    path = Path(path)
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_tensors: entry {key!r} is {type(value).__name__}, not a torch.Tensor")
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return write_atomically(path, lambda tmp: save_file(plain, tmp, metadata=dict(metadata) if metadata else None))


def load_tensors(path: PathLike, what_to_do: str = REDO) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    try:
        return load_file(str(path), device="cpu")
    except Exception as err:  # noqa: BLE001 - SafetensorError and friends: the bytes are not a safetensors file
        raise FileFormatError(f"{path} cannot be read as safetensors ({type(err).__name__}: {err}); {what_to_do}") from None


@contextlib.contextmanager
def open_tensors(path: PathLike, what_to_do: str = REDO):
    """safetensors' lazy reader (`safe_open`) on `path`, with the same named errors as `load_tensors` (for the
    file's own format errors, on opening or on reading a slice; the caller's errors pass through)."""
    from safetensors import SafetensorError, safe_open

    def named(err: Exception) -> FileFormatError:
        return FileFormatError(f"{path} cannot be read as safetensors ({type(err).__name__}: {err}); {what_to_do}")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - anything that stops the header from being read
        raise named(err) from None
    with handle as f:
        try:
            yield f
        except SafetensorError as err:
            raise named(err) from None


def model_paths(directory: PathLike, name: str) -> tuple[Path, Path]:
    """(`{name}.safetensors`, `{name}.json`) inside `directory`."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(f"model name must be a plain file stem (no slashes, not hidden), got {name!r}")
    directory = Path(directory)
    return directory / f"{name}.safetensors", directory / f"{name}.json"


def save_model_files(directory: PathLike, name: str, tensors: Mapping[str, torch.Tensor],
                     config: Mapping[str, Any], *, format_name: str, format_version: int) -> tuple[Path, Path]:
    """Write the tensor file and the JSON config (with `format` and `format_version` keys added).

    The JSON is written last, so its presence means the pair is complete.
    """
    weights_path, json_path = model_paths(directory, name)
    save_tensors(weights_path, tensors, metadata={"format": format_name, "format_version": str(format_version)})
    payload = {"format": format_name, "format_version": format_version, **config}
    write_json(json_path, payload)
    return weights_path, json_path


def load_model_files(directory: PathLike, name: str, *, format_name: str,
                     supported_versions: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read back what `save_model_files` wrote, checking the format tag and version."""
    weights_path, json_path = model_paths(directory, name)
    if not json_path.is_file() or not weights_path.is_file():
        present = sorted(p.name for p in Path(directory).glob("*")) if Path(directory).is_dir() else []
        raise FileNotFoundError(
            f"expected {weights_path.name} and {json_path.name} in {directory}; found {present or 'nothing'}"
        )
    config = read_json(json_path)
    if config.get("format") != format_name:
        raise ValueError(f"{json_path} holds format {config.get('format')!r}, expected {format_name!r}")
    version = config.get("format_version")
    if version not in supported_versions:
        raise ValueError(
            f"{json_path} has format_version {version!r}; this specprobe reads {list(supported_versions)}. "
            "Upgrade specprobe or re-save the model with this version."
        )
    return load_tensors(weights_path), config


def json_float(x: float) -> float | None:
    """A float that JSON can hold: NaN/inf become None."""
    x = float(x)
    return x if math.isfinite(x) else None


def front_matter(meta: Mapping[str, Any]) -> str:
    """A YAML block between '---' lines, as the Hub reads it at the top of a README.md (model and data cards)."""
    return "---\n" + yaml.safe_dump(dict(meta), sort_keys=False, allow_unicode=True) + "---\n"
