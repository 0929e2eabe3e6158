"""Typed configs: YAML + overrides, validation that names the key and the file."""
import re
from pathlib import Path

import pytest

from specprobe.inputs.config import ConfigError, dump_yaml
from specprobe.train.config import ExperimentConfig, field_help, load_config

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.models.target and cfg.models.draft
    assert load_config(path, ["output_dir=/tmp/elsewhere"]).output_dir == "/tmp/elsewhere"


def test_full_size_configs_name_the_real_pairs():
    targets = {load_config(p).models.target for p in CONFIGS}
    assert {"deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B",
            "Qwen/Qwen3-32B"} <= targets
    for p in CONFIGS:
        cfg = load_config(p)
        if not cfg.models.target.startswith("offline:"):  # tiny, tiny-vllm and small are the offline configs
            assert cfg.data.judge == "nli" and cfg.data.nli_model == "microsoft/deberta-large-mnli"


def test_tiny_config_is_offline():
    cfg = load_config(CONFIGS[0].with_name("tiny.yaml"))
    assert cfg.models.target.startswith("offline:") and cfg.data.judge == "embedding"
    assert cfg.source.kind == "reasoning_gym"


def test_tiny_vllm_config_is_the_tiny_config_on_vllm():
    tiny, on_vllm = (load_config(CONFIGS[0].with_name(n)) for n in ("tiny.yaml", "tiny-vllm.yaml"))
    assert on_vllm.models.engine_of("target") == on_vllm.models.engine_of("draft") == "vllm"
    assert tiny.models.engine_of("draft") == "hf"
    assert (on_vllm.data, on_vllm.sampling, on_vllm.source) == (tiny.data, tiny.sampling, tiny.source)


def test_vllm_settings_are_validated():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(None, ["models.vllm.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match="engine"):
        load_config(None, ["models.engine=tensorrt"])
    cfg = load_config(None, ["models.engine=vllm", "models.draft_engine=hf", "models.vllm.max_model_len=8192"])
    assert (cfg.models.engine_of("target"), cfg.models.engine_of("draft")) == ("vllm", "hf")
    assert cfg.models.vllm.max_model_len == 8192
    from specprobe.infer.engines import (
        vllm_settings,  # the engine-start settings (vLLM itself is imported only on start)
    )

    assert vllm_settings(cfg.models).max_model_len == 8192 and vllm_settings(cfg.models).hidden_states == "transformers"


def test_small_config_holds_out_at_least_40_test_questions():
    from specprobe.probes.splits import group_split

    cfg = load_config(CONFIGS[0].with_name("small.yaml"))
    assert cfg.models.target.startswith("offline:") and cfg.data.contexts_per_trace == 1
    questions = [str(i) for i in range(cfg.source.size)]
    _, val, test = group_split(questions, cfg.probe.val_fraction, cfg.probe.test_fraction, exact_sizes=True)
    assert len(test) >= 40 and len(val) >= 8


def test_test_split_is_the_default():
    assert ExperimentConfig().probe.test_fraction > 0


def test_overrides_are_typed():
    cfg = load_config(None, ["data.num_samples=8", "probe.betas=[0.9, 0.99]", "sampling.temperature=1",
                             "source.domains=[math]", "models.cache_dir=/tmp/c"])
    assert cfg.data.num_samples == 8 and cfg.probe.betas == [0.9, 0.99]
    assert isinstance(cfg.sampling.temperature, float) and cfg.source.domains == ["math"]


def test_unknown_key_names_key_and_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("data:\n  num_sample: 4\n")
    with pytest.raises(ConfigError, match=r"data\.num_sample.*exp\.yaml"):
        load_config(path)


def test_a_key_given_twice_or_an_empty_file_is_an_error(tmp_path):
    """YAML itself keeps the last of two equal keys (the first `data:` section would vanish) and reads an empty
    file as nothing (the built-in defaults would run); both are refused, naming the file and the lines."""
    path = tmp_path / "twice.yaml"
    path.write_text("data:\n  num_samples: 4\nprobe:\n  epochs: 2\ndata:\n  layers: last\n")
    with pytest.raises(ConfigError, match=r"twice\.yaml.*key 'data' appears twice.*lines 1 and 5"):
        load_config(path)
    path.write_text("data:\n  num_samples: 4\n  num_samples: 6\n")  # within a section too
    with pytest.raises(ConfigError, match=r"key 'num_samples' appears twice.*lines 2 and 3"):
        load_config(path)
    path.write_text("data:\n  num_samples: 4\nprobe:\n  epochs: 2\n")  # one each: fine
    assert load_config(path).data.num_samples == 4
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml holds no settings"):
        load_config(empty)


def test_a_home_folder_path_is_expanded_where_it_is_read(tmp_path, monkeypatch):
    """`output_dir=~/runs/x` after `key=` reaches the program unexpanded; the checks and the writers must read
    it as the same folder (it once became './~/runs/x')."""
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "exp.yaml"
    path.write_text("source:\n  kind: jsonl\n  path: ~/traces.jsonl\n")
    cfg = load_config(path, ["output_dir=~/runs/x"])
    assert cfg.output_dir == str(tmp_path / "runs" / "x") and cfg.source.path == str(tmp_path / "traces.jsonl")
    assert cfg.checkpoint_dir.parent == cfg.data_dir.parent == tmp_path / "runs" / "x"
    assert load_config(None, ["name=~x"]).name == "~x"  # not a home folder: as written


@pytest.mark.parametrize("override, pattern", [
    ("data.num_samples=abc", r"data\.num_samples: expected int"),
    ("probe.loss=l1", r"probe\.loss: 'l1' is not one of"),
    ("runtime.gamma=0", r"gamma must be >= 1"),
    ("models=3", r"models: expected a section"),
    ("nokey", r"key=value"),
    ("data.models=[target, oracle]", r"data\.models"),
    ("data.cluster_scheme=last", r"data\.cluster_scheme: 'last' is not one of"),
    # a union names each form it takes
    ("eval.umap_layer=[1]", r"eval\.umap_layer: \[1\] is not an int or a str"),
    ("models.fused_norm=maybe", r"models\.fused_norm: 'maybe' is not a bool or one of \['auto'\]"),
])
def test_bad_values_are_errors(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


def test_a_number_where_text_is_expected_says_how_to_quote_it(tmp_path):
    """`data.layers=7` reaches the loader as the number 7 (YAML; 010 would be 8): refused, saying how to quote it,
    and the quoted forms load."""
    with pytest.raises(ConfigError, match=r"data\.layers: expected str, got int 7 .*data\.layers=\"'7'\" on the "):
        load_config(None, ["data.layers=7"])
    assert load_config(None, ["data.layers='7'"]).data.layers == "7"
    path = tmp_path / "q.yaml"
    path.write_text("data: &base\n  num_samples: 3\n  layers: '7'\nprobe:\n  epochs: 2\n")
    assert load_config(path).data.layers == "7"


def test_yaml_merge_keys_still_merge(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("models: &m\n  device: cpu\nsampling:\n  temperature: 0.5\ndata:\n  <<: {num_samples: 3}\n"
                    "  layers: last\n")
    cfg = load_config(path)
    assert (cfg.data.num_samples, cfg.data.layers) == (3, "last")


def test_bool_is_not_an_int(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("data:\n  num_samples: true\n")
    with pytest.raises(ConfigError, match="expected int"):
        load_config(path)


def test_every_field_is_documented():
    rows = field_help(ExperimentConfig)
    assert len(rows) > 60
    undocumented = [key for key, help_text, _ in rows if not help_text.strip()]
    assert undocumented == []


def test_dump_round_trips(tmp_path):
    cfg = load_config(None, ["data.num_samples=5"])
    path = tmp_path / "dump.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg


def test_each_section_lives_beside_its_owner():
    cfg = ExperimentConfig()
    owners = {"models": "infer", "sampling": "infer", "source": "inputs", "runtime": "infer", "bench": "infer",
              "ray": "infer", "data": "data_gen", "probe": "train", "verifiers": "train", "eval": "train",
              "wandb": "train"}
    assert {name: type(getattr(cfg, name)).__module__.split(".")[1] for name in owners} == owners


def test_inputs_are_checked_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """Bad dtype, device, model names and paths, a jsonl source without a path, an output_dir that is a file:
    errors naming the key, raised by the config or the CLI before a model is loaded."""
    from specprobe.infer import models
    from specprobe.train import cli
    from specprobe.train.config import load_config

    for override, match in [("models.dtype=float33", "models.dtype: unknown dtype 'float33'"),
                            ("models.device=tpu", "models.device: 'tpu' is not a device"),
                            ("models.draft_device=gpu1", "models.draft_device: 'gpu1' is not a device"),
                            ("models.target=offline:nope", "models.target: unknown offline model 'offline:nope'"),
                            ("source.kind=jsonl", "source.kind is jsonl but neither source.path nor source.name is set"),
                            ("probe.device=cude", "probe.device: 'cude' is not a device"),
                            ("verifiers.judge_dtype=bf17", "verifiers.judge_dtype: unknown dtype 'bf17'")]:
        with pytest.raises(ConfigError, match=match):
            load_config("configs/tiny.yaml", [override])
    # model paths that one tool reads are checked by that tool before it loads anything, not when any tool loads
    # the config (a machine that only trains need not have the data stage's NLI model, nor the target and draft)
    moved_lms = load_config("configs/tiny.yaml", ["models.target=/no/target", f"output_dir={tmp_path}/m"])
    with pytest.raises(ConfigError, match="models.target: local model path /no/target does not"):
        moved_lms.check_before_loading(sources=True)
    moved_lms.check_before_loading(sources=False, training=True)  # the train stage alone
    from _train_fixtures import write_synthetic_data

    write_synthetic_data(tmp_path / "m", questions=2)  # a finished data folder: `all` only trains
    moved_lms.check_before_loading(sources=True, training=True)
    with pytest.raises(models.ModelUnavailableError, match="local model path /no/target does not exist"):
        models.resolve_model_folder("/no/target")  # a loader called without the config's check
    nli = load_config("configs/tiny.yaml", ["data.judge=nli", "data.nli_model=/no/nli", f"output_dir={tmp_path}/n"])
    with pytest.raises(ConfigError, match="data.nli_model: local model path /no/nli does not"):  # (a path, not an id)
        nli.check_before_loading(sources=True)
    nli.check_before_loading(sources=False)  # the train stage alone
    load_config("configs/tiny.yaml", ["data.nli_model=/no/nli", f"output_dir={tmp_path}/n"]).check_before_loading(
        sources=True)  # not the configured judge's model: not read
    moved = load_config("configs/tiny.yaml", ["runtime.checkpoint_judge_base=./no-base"])
    with pytest.raises(ConfigError, match="runtime.checkpoint_judge_base: local model path ./no-base"):
        moved.runtime.check_available()
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for overrides, match in [([f"output_dir={a_file}"], "output_dir: .*taken is a file"),
                             ([f"output_dir={a_file}/sub"], "output_dir: .*taken is a file"),
                             (["source.kind=jsonl", f"source.path={tmp_path}/none.jsonl", f"output_dir={tmp_path}/o"],
                              "source.path: .*none.jsonl does not exist")]:
        assert cli.main(["--config", "configs/tiny.yaml", "--stage", "data", *overrides]) == 1
        assert re.search(match, capsys.readouterr().err), match
    out = tmp_path / "o"
    assert not out.exists()
    # the verifiers' models are checked before the data stage when the run trains them (`all`, `train`), not
    # for the data stage alone; the data stage's own work would otherwise be done first
    for key, name in (("judge_base", "./no-judge-base"), ("embedding_model", "offline:nope")):
        bad = [f"verifiers.{key}={name}", f"output_dir={tmp_path}/v"]
        assert cli.main(["--config", "configs/tiny.yaml", *bad]) == 1
        assert f"verifiers.{key}: " in capsys.readouterr().err, key
        load_config("configs/tiny.yaml", bad).check_before_loading(sources=False)  # training=False: not checked
    assert not (tmp_path / "v").exists()
    # YAML 1.1 reads 1e-4 as text: a float field takes it as the number it names
    assert load_config("configs/tiny.yaml", ["probe.lr=1e-4"]).probe.lr == 1e-4
    with pytest.raises(ConfigError, match="probe.lr: expected float, got str 'fast'"):
        load_config("configs/tiny.yaml", ["probe.lr=fast"])


def test_the_draft_can_have_its_own_device(monkeypatch):
    """models.draft_device places the draft (its own GPU for async LR); it is checked like models.device, refused
    for a vLLM draft, and a same-model pair shares its weights only when both land on one device."""
    import torch

    from specprobe.infer import engines
    from specprobe.infer.config import ModelsConfig

    cfg = ModelsConfig(device="cuda:0", draft_device="cuda:1")
    assert (cfg.resolved_device("target"), cfg.resolved_device("draft")) == ("cuda:0", "cuda:1")
    assert ModelsConfig(device="cuda:0").resolved_device("draft") == "cuda:0"
    assert ModelsConfig(device="cpu", draft_device="auto").resolved_device("draft") is None
    with pytest.raises(ConfigError, match="models.draft_device places a transformers draft"):
        load_config("configs/tiny.yaml", ["models.draft_engine=vllm", "models.draft_device=cuda:1"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="models.draft_device is 'cuda:1', but torch sees no CUDA device"):
        ModelsConfig(device="cpu", draft_device="cuda:1").check_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"models.draft_device is 'cuda:1', but torch sees 1 CUDA device"):
        ModelsConfig(device="cpu", draft_device="cuda:1").check_available()
    tiny = dict(target="random:llama-tiny", draft="random:llama-tiny")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    ModelsConfig(device="cuda:0", draft_device="cuda:1", **tiny).check_available()
    # on Ray the models load in replicas, which see ray.gpus_per_replica GPUs each, whatever this machine has
    with pytest.raises(ConfigError, match=r"each Ray replica sees 1 GPU\(s\) \(ray.gpus_per_replica = 1\); set ray."
                                          r"gpus_per_replica to at least 2"):
        ModelsConfig(device="cuda:0", draft_device="cuda:1", **tiny).check_available(replica_gpus=1)
    with pytest.raises(ConfigError, match=r"models.device is 'cuda', but each Ray replica sees 0 GPU"):
        ModelsConfig(device="cuda", **tiny).check_available(replica_gpus=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ModelsConfig(device="cuda:0", draft_device="cuda:1", **tiny).check_available(replica_gpus=2)
    ModelsConfig(device="cuda", **tiny).check_available(replica_gpus=0.5)  # a share of one GPU
    with pytest.raises(ConfigError, match="each Ray replica sees 1 GPU"):
        load_config("configs/tiny.yaml", ["models.device=cuda:1", "ray.gpus_per_replica=1"]).check_before_loading(
            sources=False, ray=True)
    with pytest.raises(ConfigError, match="models.draft_device: 'cuda:01' is not a device"):
        ModelsConfig(draft_device="cuda:01")
    # a bare "cuda" is the current device: the same card as cuda:0 before CUDA starts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert engines.placed_device("cuda") == "cuda:0"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" is the CPU here, as on CI
    monkeypatch.setattr(engines, "HFStepEngine", lambda name, **kw: kw)  # what a transformers engine is given
    assert [engines.build_engine("random:llama-tiny", cfg, role=role)["device"] for role in ("target", "draft")] == [
        "cuda:0", "cuda:1"]

    built = []

    def build(name, models_cfg, *, role, share=None, **kw):
        built.append((role, models_cfg.resolved_device(role), share))
        return f"{role} engine"

    monkeypatch.setattr(engines, "build_engine", build)
    for draft_device, shared in (("cpu", True), (None, True), ("auto", True), ("cuda:1", False)):
        built.clear()
        engines.build_engine_pair(ModelsConfig(device="cpu", draft_device=draft_device, **tiny))
        assert built[1][0] == "draft" and (built[1][2] == "target engine") is shared, draft_device
        assert built[1][1] == (draft_device if draft_device not in (None, "auto") else
                               ("cpu" if draft_device is None else None))
    built.clear()
    engines.build_engine_pair(ModelsConfig(device="cpu", draft_device="cpu", target="random:llama-20m",
                                           draft="random:llama-tiny"))
    assert built[1][2] is None  # two models: nothing to share

    # gamma=adaptive's acceptance probe reads the draft's hidden states: it sits on the draft's device
    from specprobe.infer import bench
    from specprobe.infer.decoding import DecodeOptions

    placed = []
    monkeypatch.setattr(bench, "load_acceptance_probe", lambda path, draft, *, device, **kw: placed.append(device))
    setup = load_config("configs/tiny.yaml", ["models.device=cpu", "models.draft_device=cuda:1"]).bench_setup()
    env = bench.BenchEnv(setup, None, None, [], DecodeOptions(), False, "probe", "some/checkpoint")
    env.depth_policy()
    assert placed == ["cuda:1"]


def test_the_draft_can_have_its_own_decode_graph():
    """models.draft_decode_graph sets the draft's decode step alone (compile on the draft, whose step is mostly
    small kernels); unset, the draft follows models.decode_graph; with a vLLM draft it is refused."""
    from specprobe.infer import engines
    from specprobe.infer.config import ModelsConfig

    cfg = ModelsConfig(device="cpu", decode="fast", decode_graph="none", draft_decode_graph="compile",
                       target="random:llama-tiny", draft="random:llama-tiny")
    assert (cfg.decode_graph_of("target"), cfg.decode_graph_of("draft")) == ("none", "compile")
    assert ModelsConfig(decode_graph="compile").decode_graph_of("draft") == "compile"
    with pytest.raises(ConfigError, match="models.draft_decode_graph sets how a transformers draft"):
        load_config("configs/tiny.yaml", ["models.draft_engine=vllm", "models.draft_decode_graph=compile"])
    with pytest.raises(ConfigError, match="models.draft_decode_graph"):
        load_config("configs/tiny.yaml", ["models.draft_decode_graph=fused"])
    # real engines: one model's weights, loaded once, each role with its own decode step
    target, draft = engines.build_engine_pair(cfg)
    assert draft.model is target.model
    assert (target.decode_step.mode, draft.decode_step.mode) == ("none", "compile")


def test_the_target_stream_priority_reaches_the_target_engine_alone(monkeypatch):
    """models.target_stream_priority: the target engine's CUDA stream is made at torch's most urgent priority
    (torch clamps -100 to it), the draft's at the default; refused for a vLLM target and for unknown values."""
    import torch

    from specprobe.infer import engines
    from specprobe.infer.config import ModelsConfig
    from specprobe.infer.engines import hf

    made = []
    with monkeypatch.context() as m:  # (only here: a module imported later reads torch.cuda.Stream in annotations)
        m.setattr(torch.cuda, "Stream", lambda device, priority=0: made.append((str(device), priority)) or "s")
        assert hf.engine_stream(torch.device("cuda:0"), "high") == "s" and made == [("cuda:0", -100)]
        assert hf.engine_stream(torch.device("cuda:1")) == "s" and made[-1] == ("cuda:1", 0)
        assert hf.engine_stream(torch.device("cpu"), "high") is None and len(made) == 2  # no stream off CUDA
    with pytest.raises(ValueError, match="stream_priority must be one of"):
        hf.engine_stream(torch.device("cuda:0"), "urgent")
    with pytest.raises(ConfigError, match="models.target_stream_priority sets a transformers target"):
        load_config("configs/tiny.yaml", ["models.engine=vllm", "models.target_stream_priority=high"])
    with pytest.raises(ConfigError, match="models.target_stream_priority"):
        load_config("configs/tiny.yaml", ["models.target_stream_priority=urgent"])
    with pytest.raises(ValueError, match="stream_priority must be one of"):  # before any model loads
        engines.HFStepEngine("no/such-model", stream_priority="urgent")
    cfg = ModelsConfig(device="cpu", target_stream_priority="high", target="random:llama-tiny",
                       draft="random:llama-tiny")
    asked = []
    real = hf.engine_stream
    monkeypatch.setattr(hf, "engine_stream", lambda device, priority="normal": asked.append(priority) or real(device, priority))
    target, draft = engines.build_engine_pair(cfg)
    assert asked == ["high", "normal"]  # what each engine asked its stream for (on the CPU: no stream)
    assert (target.stream_priority, draft.stream_priority) == ("high", "normal")


def test_bench_method_options_below_one_are_config_errors():
    from specprobe.infer.bench import parse_method

    with pytest.raises(ConfigError, match="method option gamma in 'lr_sync:gamma=0' must be >= 1"):
        parse_method("lr_sync:gamma=0")
    assert parse_method("lr_sync:gamma=2").overrides == {"gamma": 2}


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("cli", ["train", "bench"])
def test_overrides_right_after_ray_stay_overrides(monkeypatch, cli):
    """`--ray` takes an optional address, so argparse hands it the first key=value after it; the CLIs give it back
    to the overrides (a local Ray instance), and keep a real address."""
    from specprobe.infer import bench_cli
    from specprobe.train import cli as train_cli

    seen = []

    def load(path, overrides):
        seen.append(list(overrides))
        raise _Loaded

    module, loader = (train_cli, "load_config") if cli == "train" else (bench_cli, "load_inference_config")
    monkeypatch.setattr(module, loader, load)
    head = ["--config", "configs/tiny.yaml"] + (["--stage", "data"] if cli == "train" else [])
    for ray_args, want in ((["--ray", "ray.replicas=2", "ray.local_cpus=2"], ["ray.replicas=2", "ray.local_cpus=2"]),
                           (["--ray", "10.0.0.5:6379", "ray.replicas=2"], ["ray.replicas=2"])):
        with pytest.raises(_Loaded):
            module.main(head + ray_args)
        assert seen.pop() == want


def test_split_ray_option_keeps_addresses_and_returns_overrides():
    from specprobe.infer.ray_cluster import split_ray_option

    assert split_ray_option("ray.replicas=2", ["a=1"]) == ("", ["ray.replicas=2", "a=1"])  # local Ray
    for address in ("", "auto", "10.0.0.5:6379", "ray://head:10001"):
        assert split_ray_option(address, ["a=1"]) == (address, ["a=1"])
    assert split_ray_option(None, []) == (None, [])  # no --ray



def test_the_probe_sections_mlp_defaults_are_the_probes_packages():
    # a SemanticProbe built in a notebook with ProbeMLPConfig() trains as probe-train's default config does
    from specprobe.probes.mlp import ProbeMLPConfig
    from specprobe.train.config import ExperimentConfig
    from specprobe.train.probes_train import mlp_config

    assert mlp_config(ExperimentConfig().probe) == ProbeMLPConfig()


def test_progress_lines_estimate_from_this_runs_rate():
    from specprobe.inputs.progress import clock, progress_line

    assert clock(3725.4) == "1:02:05" and clock(59.6) == "0:01:00"
    # 4 of 10 done, 2 of them by this run in 60 s: 30 s each, 6 left
    assert progress_line(4, 10, 2, 60.0, "problems") == "4 of 10 problems, 0:01:00 elapsed, about 0:03:00 left"
    assert progress_line(2, 10, 0, 5.0, "problems") == "2 of 10 problems, 0:00:05 elapsed"  # no rate yet
    assert progress_line(10, 10, 3, 9.0, "contexts") == "10 of 10 contexts, 0:00:09 elapsed"


def test_config_defaults_are_the_librarys_own():
    """A default both the YAML side and the library have is written once (`opt_from`): a notebook calling the
    library without a config gets what the config's default gives; a field opt_from cannot read is refused."""
    from dataclasses import dataclass

    from specprobe.infer.config import RuntimeConfig, SamplingConfig
    from specprobe.infer.decoding.common import DecodeOptions
    from specprobe.infer.decoding.seed import SeedConfig
    from specprobe.infer.decoding.specs import SpecSConfig
    from specprobe.infer.engines.base import SamplingParams
    from specprobe.infer.engines.token_spec import TokenSpecConfig
    from specprobe.inputs.config import opt_from

    rt, lib = RuntimeConfig(), DecodeOptions()
    assert [getattr(rt, k) for k in ("gamma", "width", "max_new_tokens", "max_steps", "seed")] == \
        [getattr(lib, k) for k in ("gamma", "width", "max_new_tokens", "max_steps", "seed")]
    sampling, params = SamplingConfig(), SamplingParams()
    assert (sampling.temperature, sampling.top_p, sampling.max_step_tokens) == \
        (params.temperature, params.top_p, params.max_step_tokens)
    assert (rt.specs.n, rt.specs.tau, rt.tree.k_config) == (SpecSConfig().n, SpecSConfig().tau, list(SeedConfig().k_config))
    assert (rt.ngram_size, rt.num_speculative_tokens) == (TokenSpecConfig().ngram_size, TokenSpecConfig().num_tokens)

    @dataclass
    class Owner:
        plain: int = 1

    with pytest.raises(TypeError, match="no field 'missing'"):
        opt_from(Owner, "missing", "help")
    with pytest.raises(TypeError, match="no help text"):
        opt_from(Owner, "plain")
