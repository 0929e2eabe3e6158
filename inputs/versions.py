"""Package versions recorded in manifests and checkpoints, so a result says what produced it."""
from __future__ import annotations

import importlib.metadata

CORE_PACKAGES = ("specprobe", "torch", "transformers", "datasets", "peft", "safetensors", "pyarrow", "scikit-learn")


def package_versions(names=CORE_PACKAGES) -> dict[str, str]:
    out = {}
    for package in names:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out
