"""Package versions and times recorded in manifests and checkpoints, so a result says what produced it, and when."""
from __future__ import annotations

import importlib.metadata
from datetime import datetime, timezone

CORE_PACKAGES = ("specprobe", "torch", "transformers", "datasets", "peft", "safetensors", "pyarrow", "scikit-learn")


def package_versions(names=CORE_PACKAGES) -> dict[str, str]:
    out = {}
    for package in names:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def utc_now() -> str:
    """The time now as manifests, checkpoints and reports record it: UTC, ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
