"""Each piece of state has one owner (an AST scan of the library): no module reaches into a `_private` attribute of
another module's objects or imports another module's private names, and no module but the checkpoint format's
owner (`infer/checkpoint_format.py`) spells a checkpoint file's name; and the packages' imports point one way."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from specprobe.infer import checkpoint_format as fmt

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["inputs", "probes", "infer", "data_gen", "train"]
CHECKPOINT_FILES = {fmt.CHECKPOINT_JSON, fmt.METRICS_JSON, fmt.BASELINES_JSON, fmt.EMBEDDING_JSON, fmt.JUDGE_JSON,
                    fmt.ADAPTER_CONFIG, fmt.ADAPTER_WEIGHTS, fmt.JUDGE_DIR}
# transformers' config fields (PretrainedConfig._name_or_path: the model's id or folder; ._commit_hash: its revision),
# and torch's
THIRD_PARTY = {"_name_or_path", "_commit_hash",
               "_version"}  # torch tensors' count of in-place writes (merged_linear: a kept product's input unchanged)
# module-level constants that name a file of the same name in another format (the report folder's numbers)
OTHER_FORMATS = {("train/report/runner.py", "REPORT_METRICS")}


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions, classes, variables and the attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def foreign_private_uses(source: str) -> list[tuple[int, str]]:
    """`obj._name` where obj is not self / cls and this module defines no `_name` (so the attribute is another
    module's), `getattr(obj, "_name")`, and `from module import _name`. transformers' configs keep their source
    and revision in underscored fields, which are read as its own code reads them (THIRD_PARTY)."""
    tree = ast.parse(source)
    own = _own_names(tree) | THIRD_PARTY
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and node.args[1].value.startswith("_")
              and not node.args[1].value.startswith("__") and node.args[1].value not in own
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def checkpoint_names(source: str, rel: str) -> list[tuple[int, str]]:
    """String constants equal to a checkpoint file's name (or ending in /name), outside docstrings and the allowed
    constants of other formats."""
    tree = ast.parse(source)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and (rel, t.id) in OTHER_FORMATS
                                                for t in node.targets):
            skip.add(id(node.value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and node.value.rsplit("/", 1)[-1] in CHECKPOINT_FILES]


# what each package may import (the design's one-way dependencies): inputs is the shared reading and config layer
MAY_IMPORT = {"inputs": set(), "probes": {"inputs"}, "infer": {"inputs", "probes"},
              "data_gen": {"inputs", "probes", "infer"}, "train": {"inputs", "probes", "infer", "data_gen"}}


def foreign_imports(source: str, package: str) -> list[tuple[int, str]]:
    """Imports (at module level or inside a function) of a specprobe package `package` may not import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "specprobe" and len(parts) > 1 and parts[1] != package \
                    and parts[1] not in MAY_IMPORT[package]:
                found.append((node.lineno, name))
    return found


def test_dependencies_point_one_way():
    found = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        found += [f"{rel.as_posix()}:{line} imports {name}"
                  for line, name in foreign_imports(path.read_text(encoding="utf-8"), rel.parts[0])]
    assert not found, ("imports against the packages' direction (probes imports none of the others; infer imports "
                       "probes; data_gen infer and probes; train all):\n" + "\n".join(found))


def test_the_import_scan_sees_what_it_forbids():
    src = ("from specprobe.probes.metrics import brier\n\ndef f():\n    import specprobe.train.config\n"
           "    from specprobe.data_gen import store\n")
    assert foreign_imports(src, "infer") == [(4, "specprobe.train.config"), (5, "specprobe.data_gen")]
    assert foreign_imports(src, "train") == []
    assert foreign_imports("from specprobe.infer import bench\n", "probes") == [(1, "specprobe.infer")]


def test_no_module_reaches_into_another_modules_private_state():
    assert len(_modules()) > 50  # the scan reads the library (not an empty folder)
    found = []
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line} {what}" for line, what in foreign_private_uses(path.read_text(encoding="utf-8"))]
    assert not found, "private attributes or names of another module:\n" + "\n".join(found)


def test_only_the_checkpoint_format_names_checkpoint_files():
    found = []
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "infer/checkpoint_format.py":
            continue
        found += [f"{rel}:{line} {name!r}" for line, name in checkpoint_names(path.read_text(encoding="utf-8"), rel)]
    assert not found, ("checkpoint file names outside infer/checkpoint_format.py (use its constants or its "
                       "Checkpoint class):\n" + "\n".join(found))


@pytest.mark.parametrize("source,want", [
    ("def f(engine):\n    return engine.runner._prefix_cache\n", [(2, "engine.runner._prefix_cache")]),
    ("from specprobe.infer.bench import _fmt\n", [(1, "from specprobe.infer.bench import _fmt")]),
    ("class A:\n    def f(self, other):\n        self._x = 1\n        return other._x\n", []),  # its own class's
    ("def f(engine):\n    return getattr(engine, '_lock', None)\n", [(2, "getattr(engine, '_lock', None)")]),
])
def test_the_private_scan_sees_what_it_forbids(source, want):
    assert foreign_private_uses(source) == want


def test_the_file_name_scan_sees_what_it_forbids():
    src = '"""Reads metrics.json."""\nimport json\n\ndef f(p):\n    return json.load(open(p / "metrics.json"))\n'
    assert checkpoint_names(src, "x.py") == [(5, "metrics.json")]
    assert checkpoint_names('REPORT_METRICS = "metrics.json"\n', "train/report/runner.py") == []
    assert checkpoint_names('path = "ckpt/judge.json"\n', "x.py") == [(1, "ckpt/judge.json")]
