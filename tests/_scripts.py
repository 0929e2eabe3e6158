"""Loading a script of benchmarks/ (not a package) as a module, for tests of its functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (its `if __name__ == "__main__"` block does not run)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
