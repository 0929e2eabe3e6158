"""How the config travels: the whole experiment config stays in train/ (its CLIs and pipeline), library code below
takes the sections it reads (`DataJob`, `BenchSetup`, single sections), and packages import one way.
Static scans of every module, so a new violation fails here before anyone trips over it."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from specprobe.data_gen.config import DataJob
from specprobe.infer.config import TRAINING_SECTIONS, BenchSetup, InferenceConfig, load_inference_config
from specprobe.inputs.config import ConfigError
from specprobe.train.config import ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
# package -> the project packages it may import; `inputs` is the floor every package stands on
MAY_IMPORT = {"inputs": set(), "probes": {"inputs"}, "infer": {"inputs", "probes"},
              "data_gen": {"inputs", "probes", "infer"}, "train": {"inputs", "probes", "infer", "data_gen"}}
BELOW_TRAIN = ("inputs", "probes", "infer", "data_gen")
# names a whole experiment config goes by; below train/, none of them may read a section or a run folder
CONFIG_NAMES = {"cfg", "config", "experiment", "exp_cfg", "experiment_config"}


def _modules(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def _imported_packages(tree: ast.AST, depth: int = 1) -> set[str]:
    """Project packages a module imports: `specprobe.X...`, `from specprobe import X`. A relative import stays in
    the module's own top-level package when its level is at most `depth` (the module's folder depth); one that
    climbs out is reported as "relative" (it would hide a crossing)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("specprobe.")}
        elif isinstance(node, ast.ImportFrom) and node.level > depth:
            found.add("relative")
        elif isinstance(node, ast.ImportFrom) and node.module == "specprobe":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specprobe."):
            found.add(node.module.split(".")[1])
    return found


def _experiment_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(ExperimentConfig)} | {"data_dir", "checkpoint_dir"}


def _root_name(node: ast.AST) -> str | None:
    """`cfg` of cfg.x, `cfg` of self.cfg.x (the last name before the attribute read)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def experiment_reads(source: str) -> list[tuple[int, str]]:
    """(line, text) of every read of an ExperimentConfig field through a config-named object."""
    fields = _experiment_fields()
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in fields and _root_name(node.value) in CONFIG_NAMES:
            hits.append((node.lineno, ast.unparse(node)))
    return sorted(hits)


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_packages_import_one_way(package):
    for path in _modules(package):
        depth = len(path.relative_to(ROOT).parts) - 1
        bad = _imported_packages(ast.parse(path.read_text()), depth) - MAY_IMPORT[package] - {package}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}; {package} may import {sorted(MAY_IMPORT[package])}"


def test_no_experiment_config_below_train():
    """infer/, data_gen/, probes/, inputs/ never see ExperimentConfig: no section or run folder read through it."""
    found = []
    for package in BELOW_TRAIN:
        for path in _modules(package):
            if path.name.endswith("_cli.py"):
                continue  # a CLI holds the config it loads (probe-bench: infer.config.InferenceConfig)
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}:{line}: {expr}" for line, expr in experiment_reads(text)]
            if "ExperimentConfig" in text.replace("ExperimentConfig.", ""):
                # naming it in prose is fine ("ExperimentConfig.data_job()"); taking or building one is not
                tree = ast.parse(text)
                found += [f"{path.relative_to(ROOT)}:{n.lineno}: uses ExperimentConfig" for n in ast.walk(tree)
                          if isinstance(n, ast.Name) and n.id == "ExperimentConfig"]
    assert not found, "the experiment config leaks below train/:\n" + "\n".join(found)


def test_the_scan_sees_the_leaks_it_forbids():
    """The rule above on planted code: each way of reading the whole config is caught, section bundles are not."""
    leaks = ("def f(cfg):\n    return cfg.runtime.gamma\n"
             "class A:\n    def g(self):\n        return self.cfg.data_dir\n"
             "def h(config):\n    return config.models\n")
    assert [expr for _, expr in experiment_reads(leaks)] == ["cfg.runtime", "self.cfg.data_dir", "config.models"]
    fine = "def f(setup, job):\n    return setup.runtime.gamma, job.data.num_samples, job.folder\n"
    assert experiment_reads(fine) == []
    crossings = "from specprobe import train\nimport specprobe.data_gen.store\nfrom ..infer import bench\nfrom .x import y\n"
    assert _imported_packages(ast.parse(crossings), depth=1) == {"train", "data_gen", "relative"}


def test_the_sections_handed_down_are_the_experiments_own():
    """data_job() / bench_setup() carry the very section objects (no copies that could drift), the run's
    folders, and the whole config for the records (manifest, bench results)."""
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["data.num_samples=3", "runtime.gamma=2"])
    job = cfg.data_job()
    assert isinstance(job, DataJob)
    for name in ("data", "source", "models", "sampling", "ray"):
        assert getattr(job, name) is getattr(cfg, name), name
    assert job.data.num_samples == 3 and job.folder == cfg.data_dir
    assert job.config_record()["output_dir"] == cfg.output_dir
    setup = cfg.bench_setup()
    assert isinstance(setup, BenchSetup)
    for name in ("models", "sampling", "runtime", "bench", "ray"):
        assert getattr(setup, name) is getattr(cfg, name), name
    assert setup.runtime.gamma == 2 and setup.delimiter == cfg.source.delimiter
    assert setup.checkpoint_dir == cfg.checkpoint_dir and setup.config_record()["data"]["num_samples"] == 3


def test_a_notebook_builds_the_sections_without_the_experiment_config(tmp_path):
    """The typed bundles stand alone: their records hold what decides the data / the benchmark, so a data
    folder made from a DataJob fingerprints the same as one made through the experiment config."""
    from specprobe.data_gen.config import DataConfig
    from specprobe.data_gen.store import fingerprint
    from specprobe.infer.config import BenchConfig, ModelsConfig, RuntimeConfig, SamplingConfig
    from specprobe.inputs.records import SourceConfig

    job = DataJob(DataConfig(num_samples=3), SourceConfig(), ModelsConfig(), SamplingConfig(), tmp_path / "data")
    cfg = load_config(None, ["data.num_samples=3", f"output_dir={tmp_path}"])
    assert fingerprint(job.config_record()) == fingerprint(cfg.data_job().config_record())
    setup = BenchSetup(ModelsConfig(), SamplingConfig(), RuntimeConfig(), BenchConfig())
    assert set(setup.config_record()) == {"models", "sampling", "runtime", "bench", "ray"}
    assert setup.checkpoint_dir is None


def test_probe_bench_loads_the_inference_sections_of_the_shared_yaml(tmp_path):
    """probe-bench (infer/) reads the experiment YAML without train/: it skips the data and training sections,
    rejects an override it would ignore, still rejects an unknown top-level key, and hands down the same
    sections as the whole experiment config does."""
    tiny, ov = ROOT / "configs" / "tiny.yaml", ["runtime.gamma=3", "bench.num_problems=2"]
    inference, whole = load_inference_config(tiny, ov), load_config(tiny, ov)
    assert type(inference) is InferenceConfig and isinstance(whole, InferenceConfig)
    a, b = inference.bench_setup(), whole.bench_setup()
    assert (a.models, a.sampling, a.runtime, a.bench, a.ray, a.delimiter, a.checkpoint_dir) == \
        (b.models, b.sampling, b.runtime, b.bench, b.ray, b.delimiter, b.checkpoint_dir)
    assert a.runtime.gamma == 3 and "data" not in a.config_record() and "data" in b.config_record()
    with pytest.raises(ConfigError, match="data is not one of them"):
        load_inference_config(tiny, ["data.num_samples=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("nmae: x\nprobe: {hidden_dim: 8}\n")
    with pytest.raises(ConfigError, match="unknown key nmae"):
        load_inference_config(bad)
    bad.write_text("runtme: {gamma: 3}\n")  # a misspelt section is not mistaken for another stage's
    with pytest.raises(ConfigError, match="unknown key runtme"):
        load_inference_config(bad)
    bad.write_text("probe: {hidden_dim: 8}\nruntime: {gamma: 2}\n")
    assert load_inference_config(bad).runtime.gamma == 2  # probe-train's sections are not read here


def test_the_sections_probe_bench_skips_are_exactly_probe_trains_own():
    """TRAINING_SECTIONS (infer/) names what ExperimentConfig (train/) adds to InferenceConfig: a new training
    section would otherwise make probe-bench reject every experiment YAML that sets it."""
    extra = {f.name for f in dataclasses.fields(ExperimentConfig)} - {f.name for f in dataclasses.fields(InferenceConfig)}
    assert extra == set(TRAINING_SECTIONS)
