"""Config machinery, and the config sections the inference side owns.

One YAML file per experiment, `key=value` overrides on the command line. Every field has help text
(``field_help``) and is type-checked when loaded: an unknown key or a value of the wrong type is a
``ConfigError`` that names the key and the file.

Each package keeps its sections beside its code, as TRL keeps a trainer's config next to the trainer:
here the models, sampling, trace/problem source, runtime, benchmark and Ray sections (`infer` reads them,
and `data_gen` reads models/sampling/source too); `data_gen.config` the data-generation section;
`train.config` the probe, verifier, evaluation and tracking sections and `ExperimentConfig`, which
assembles all of them and is what every CLI loads (`train.config.load_config`). The machinery lives
here because every package but `probes` may import `infer`.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from specprobe.infer.models import DTYPE_NAMES, OFFLINE_PREFIX, check_model_name, offline_model_folder
from specprobe.probes.features import parse_layer_option


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def opt(default: Any, help: str, **kw) -> Any:
    """A dataclass field with help text (shown by `--help-config`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


# ----------------------------------------------------------------------------- sections
@dataclass
class VLLMConfig:
    """Engine-start settings of models served by vLLM (`models.engine: vllm`)."""

    max_model_len: int = opt(4096, "context window vLLM reserves per sequence (prompt + step), in tokens")
    tensor_parallel_size: int = opt(1, "GPUs one model is split over")
    gpu_memory_utilization: float = opt(0.45, "fraction of GPU memory each vLLM engine takes; draft and target on "
                                              "one GPU must sum to < 1 (CPU build: ignored when kv_cache_gib is set)")
    kv_cache_gib: float | None = opt(None, "explicit KV-cache size in GiB (default: vLLM's on GPU, 1 GiB on CPU)")
    enforce_eager: bool = opt(False, "skip CUDA-graph / torch.compile capture: starts faster, decodes slower")
    block_size: int | None = opt(None, "KV-cache block size in tokens (default: vLLM's); prefix-cache hits come in "
                                       "whole blocks, so short prompts need small blocks")
    enable_lora: bool = opt(False, "let the engine serve LoRA adapters (the judge-LoRA verifier on the target)")
    max_lora_rank: int = opt(16, "largest LoRA rank served when enable_lora is on")
    hidden_states: Literal["transformers", "vllm"] = opt(
        "transformers", "where hidden states (probe features) come from: a transformers engine on the same weights "
                        "(built on first use; a second copy of the weights), or vllm (not implemented: needs a GPU "
                        "to test extract_hidden_states)")
    chunked_prefill: bool | None = opt(
        None, "vLLM's chunked prefill (default: off on the CPU build, where a seeded sample whose prefill is split "
              "kills the engine; vLLM's default on GPU). On CPU with it on, calls are sent in waves that fit one step")

    def __post_init__(self) -> None:
        for name in ("max_model_len", "tensor_parallel_size", "max_lora_rank", "block_size"):
            check_positive(self, name)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"models.vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ConfigError(f"models.vllm.kv_cache_gib must be > 0, got {self.kv_cache_gib}")


@dataclass
class ModelsConfig:
    target: str = opt("offline:smollm2-135m-instruct",
                      "target model (large, p): hub id, local folder, .gguf file, offline:<name> or random:<size>")
    draft: str = opt("offline:smollm2-135m-instruct",
                     "draft model (small, q); may use a different tokenizer than the target")
    device: str = opt("auto", "auto (CUDA when present, else CPU), cpu, cuda, cuda:1, ...")
    dtype: str = opt("auto", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    cache_dir: str | None = opt(None, "where converted GGUF models are cached (default $SPECPROBE_CACHE or ~/.cache/specprobe)")
    use_chat_template: bool = opt(True, "wrap questions in each model's own chat template")
    system_prompt: str | None = opt(None, "optional system message for both models")
    max_batch_rows: int = opt(32, "most sequences decoded or scored in one batch")
    decode: Literal["auto", "fast", "eager"] = opt(
        "auto", "transformers decode path: fast (static KV buffers, device-side sampling, one host sync per "
                "iteration, CUDA graphs), eager (the reference path; token speculation always runs there) or auto "
                "(fast on CUDA, eager on CPU)")
    compile_decode: bool | None = opt(None, "compile the fast path's decode step (CUDA graphs via torch.compile "
                                            "'reduce-overhead'); default: on CUDA only")
    engine: Literal["hf", "vllm"] = opt("hf", "step engine of the target (and of the draft unless draft_engine is "
                                              "set): hf (transformers) or vllm (pip install -e \".[vllm]\")")
    draft_engine: Literal["hf", "vllm"] | None = opt(None, "step engine of the draft (default: models.engine)")
    vllm: VLLMConfig = section(VLLMConfig, "settings of the models served by vLLM")

    def __post_init__(self) -> None:
        import re

        check_positive(self, "max_batch_rows")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"models.dtype: unknown dtype {self.dtype!r}; use auto or one of {sorted(DTYPE_NAMES)}")
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", str(self.device)):
            raise ConfigError(f"models.device: {self.device!r} is not a device; use auto, cpu, cuda, cuda:N or mps")
        for role in ("target", "draft"):
            problem = check_model_name(getattr(self, role))
            if problem:
                raise ConfigError(f"models.{role}: {problem}")

    def check_available(self) -> None:
        """Before any model loads: the device exists here and the models can be found (offline packages
        installed, local paths present). Hub ids are checked when they load."""
        import torch

        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"models.device is {self.device!r}, but torch sees no CUDA device here (torch "
                              f"{torch.__version__}); use models.device=cpu or auto")
        for role in ("target", "draft"):
            name = getattr(self, role)
            if name.startswith(OFFLINE_PREFIX):
                offline_model_folder(name)  # a clear error naming the package to install

    def engine_of(self, role: str) -> str:
        """The engine kind ("hf" / "vllm") of the "target" or "draft" model."""
        if role == "draft" and self.draft_engine is not None:
            return self.draft_engine
        return self.engine

    def resolved_device(self) -> str | None:
        return None if self.device == "auto" else self.device


@dataclass
class SourceConfig:
    kind: Literal["reasoning_gym", "s1k", "gsm8k", "champ", "jsonl"] = opt(
        "reasoning_gym", "trace source: reasoning_gym (offline default), s1k, gsm8k, champ, jsonl")
    path: str | None = opt(None, "local file (jsonl/parquet) for s1k, gsm8k and jsonl sources")
    name: str | None = opt(None, "datasets hub name, e.g. simplescaling/s1K-1.1 (needs hub access or a cache)")
    split: str = opt("train", "dataset split")
    task: str = opt("gsm_symbolic", "reasoning-gym task name")
    size: int = opt(24, "number of generated reasoning-gym problems")
    limit: int | None = opt(None, "read at most this many traces")
    seed: int = opt(0, "seed for generated sources")
    step_mode: Literal["delimiter", "sentence"] = opt("delimiter", "split reasoning on the delimiter or on sentence punctuation")
    delimiter: str = opt("\n\n", "step delimiter")
    trajectory: Literal["deepseek", "gemini"] = opt("deepseek", "which s1K-1.1 trajectory to read")
    domains: list[str] | None = opt(None, "keep only these domains (e.g. [math])")
    fields: dict | None = opt(None, "jsonl source: field names, e.g. {question: prompt, steps: reasoning, answer: label}")
    max_step_chars: int | None = opt(None, "skip (with a warning) traces that have a step longer than this")
    strip_calculator: bool = opt(
        True, "gsm8k / reasoning_gym: remove GSM8K's calculator annotations (<<48/2=24>>) from the steps; "
              "false keeps the rationale exactly as written")

    def __post_init__(self) -> None:
        check_positive(self, "size")
        if not self.delimiter:
            raise ConfigError("source.delimiter must not be empty")
        if self.kind == "jsonl" and not self.path:
            raise ConfigError("source.kind is jsonl but source.path is not set; name the .jsonl file (source.path=...)")

    def check_available(self) -> None:
        """Before any model loads: a local source file exists."""
        if self.path and not Path(self.path).expanduser().exists():
            raise ConfigError(f"source.path: {self.path} does not exist (source.kind={self.kind})")


@dataclass
class SamplingConfig:
    temperature: float = opt(0.6, "sampling temperature (0 = greedy); LR uses 0.6")
    top_p: float = opt(0.95, "nucleus sampling mass")
    max_step_tokens: int = opt(100, "token cap of one step; a step cut here has stop reason 'length'")
    seed: int = opt(0, "sampling seed")
    draft_temperature: float | None = opt(
        None, "draft's temperature when it differs from the target's (the tiny config uses one LM for both "
              "roles, sampled hotter as the draft, since only one LM ships offline)")

    def __post_init__(self) -> None:
        check_positive(self, "max_step_tokens")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("sampling: temperature must be >= 0 and top_p in (0, 1]")


@dataclass
class SpecSSettings:
    n: int = opt(4, "SpecS: candidate steps per round (beam width n; the paper's tables use 4, 8, 16)")
    beta: float | None = opt(None, "SpecS: inverse temperature β of the soft verification "
                                   "(null: 2 x sampling.max_step_tokens, the paper's robust choice)")
    tau: float = opt(0.8, "SpecS: switch to the draft when some candidate's reward exceeds τ (the paper: "
                          "0.7 / 0.8 / 0.9); beam_target never switches")

    def __post_init__(self) -> None:
        check_positive(self, "n")
        if self.beta is not None and self.beta < 0:
            raise ConfigError(f"runtime.specs.beta must be >= 0 or null, got {self.beta}")


@dataclass
class TreeSearchSettings:
    thoughts: int = opt(3, "tree of thoughts (seed_tot, tot_target): thoughts (steps) per kept state, n")
    keep: int = opt(1, "tree of thoughts: best states kept per level, b")
    depth: int = opt(4, "tree of thoughts: levels T (the SEED paper: 4 for GSM8K)")
    k_config: list[int] = opt([2, 2, 1], "SEED: draft token tree, candidates per position ([1,1,1] is a chain, "
                                         "the paper's base setting; [2,2,1] its tree-attention setting)")
    threaded: bool = opt(True, "SEED: draft in a thread while the target verifies (false: one-thread rounds)")

    def __post_init__(self) -> None:
        for name in ("thoughts", "keep", "depth"):
            check_positive(self, name)
        if not self.k_config or any(int(k) < 1 for k in self.k_config):
            raise ConfigError(f"runtime.tree.k_config must be a non-empty list of ints >= 1, got {self.k_config}")


@dataclass
class LookaheadDecodingSettings:
    window: int = opt(15, "Lookahead Decoding (+lookahead): window W of future positions (paper: 15 for 7B)")
    ngram: int = opt(5, "Lookahead Decoding: n-gram size N, i.e. N-1 past Jacobi iterations (paper: 5)")
    max_verify: int | None = opt(None, "Lookahead Decoding: n-grams verified per step G (null: G = W)")

    def __post_init__(self) -> None:
        check_positive(self, "window")
        if self.ngram < 2:
            raise ConfigError(f"runtime.lookahead.ngram must be >= 2, got {self.ngram}")
        if self.max_verify is not None and self.max_verify < 0:
            raise ConfigError(f"runtime.lookahead.max_verify must be >= 0 or null, got {self.max_verify}")


@dataclass
class AdaptiveDepthSettings:
    gamma_max: int = opt(6, "gamma=adaptive: the most steps one cycle drafts")
    c: float | None = opt(None, "gamma=adaptive: draft step / target step cost (null: measured once per run on a "
                                "calibration problem)")
    b: list[float] | None = opt(None, "gamma=adaptive, Lookahead Reasoning: target pass over k rows in single-row "
                                      "units, b(1..n) (null: measured; past the list it grows linearly)")
    v: list[float] | None = opt(None, "gamma=adaptive, SemanticSpec: teacher-forced target pass over k drafts in "
                                      "target steps, v(1..n) (null: measured)")

    def __post_init__(self) -> None:
        check_positive(self, "gamma_max")
        if self.c is not None and not self.c >= 0:
            raise ConfigError(f"runtime.adaptive.c must be >= 0 or null, got {self.c}")
        for name in ("b", "v"):
            values = getattr(self, name)
            if values is not None and any(not x >= 0 for x in values):
                raise ConfigError(f"runtime.adaptive.{name} must list numbers >= 0 (or be null), got {values}")


@dataclass
class DifficultySettings:
    hard_share: float = opt(0.0, "system-speed: share of hard answer positions (0: every draft is accepted with "
                                 "runtime.bernoulli_alpha)")
    easy_alpha: float | None = opt(None, "system-speed: acceptance of a draft at an easy position "
                                         "(null: runtime.bernoulli_alpha)")
    hard_alpha: float = opt(0.2, "system-speed: acceptance of a draft at a hard position")
    persistence: float = opt(0.0, "system-speed: chance a position has the class of the one before (0: independent; "
                                  "near 1: long easy and hard stretches)")
    noise: float = opt(0.0, "system-speed: the simulated acceptance probe sees a random class instead of the true "
                            "one this often (0: perfect, 1: no information); its estimate stays calibrated")

    def __post_init__(self) -> None:
        for name in ("hard_share", "easy_alpha", "hard_alpha", "persistence", "noise"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ConfigError(f"runtime.difficulty.{name} must be in [0, 1], got {value}")


@dataclass
class RuntimeConfig:
    method: Literal["target", "draft", "semanticspec", "lr_sync", "lr_async", "specs", "beam_target", "seed_tot",
                    "tot_target"] = opt(
        "lr_sync", "decoding method: target / draft (baselines), semanticspec, lr_sync, lr_async, specs "
                   "(SpecS), beam_target (its target beam-search baseline), seed_tot (SEED tree of thoughts), "
                   "tot_target (target-only tree of thoughts)")
    gamma: int = opt(3, "draft steps per cycle (lookahead depth γ); sync LR runs γ+1 target steps in one batch")
    gamma_policy: Literal["fixed", "adaptive"] = opt(
        "fixed", "fixed: every cycle drafts gamma steps; adaptive: each cycle drafts as far as the predicted acceptance "
                 "pays, up to runtime.adaptive.gamma_max (the checkpoint's acceptance probe; system-speed: "
                 "runtime.difficulty's simulated one). A method suffix :gamma=adaptive sets it per method")
    width: int = opt(1, "draft branches per position (multi-branch LR, sync only; the tree has W^γ leaves)")
    verifier: str = opt("probe", "probe | embedding | judge | llm_judge | exact | accept_all | reject_all | bernoulli")
    checkpoint: str | None = opt(None, "checkpoint folder with trained verifiers (default: <output_dir>/checkpoint)")
    bernoulli_alpha: float = opt(0.6, "acceptance probability of the bernoulli verifier")
    probe_eps: float = opt(1e-6, "guard of the probe rule min(1, p / max(q, eps)) when q -> 0")
    judge_threshold: float | None = opt(None, "accept when P(aligned) >= this (default: judge.json's, else 0.5); "
                                              "for embedding: overrides the fitted cosine threshold")
    llm_judge_model: str | None = opt(None, "instruct model for the prompted llm_judge verifier "
                                            "('target' reuses the target model)")
    allow_model_mismatch: bool = opt(False, "accept probes trained on a model of the same shape under another name")
    max_new_tokens: int = opt(512, "token limit of one generation (target tokens); stop reason max_new_tokens")
    max_steps: int = opt(40, "step limit of one generation; stop reason max_steps")
    accept_length_cut: bool = opt(False, "allow accepting a draft step cut by the step-token cap (LR never does; "
                                         "system-speed runs set it, random models rarely write the delimiter)")
    judge_after_cut: bool = opt(False, "judge drafts that continue a committed step cut by the token cap (off: "
                                       "Lookahead Reasoning's public rule ignore_half_sentence, such drafts are refused)")
    refuse_boxed: bool = opt(False, "refuse drafts that write a \\boxed{} answer (no paper or public code does; the "
                                    "answer's EOS step is always the target's)")
    token_spec: Literal["none", "ngram", "assistant", "lookahead"] = opt(
        "none", "token-level speculation inside each target step: ngram (prompt lookup), assistant "
                "(the draft model, same tokenizer only) or lookahead (Lookahead Decoding, runtime.lookahead); "
                "a method suffix +ngram/+assistant/+lookahead sets it per method")
    ngram_size: int = opt(3, "prompt-lookup n-gram size (longest n tried first, down to 1)")
    num_speculative_tokens: int = opt(8, "tokens proposed per token-level speculation round")
    seed: int = opt(0, "seed of sampling and acceptance draws")
    specs: SpecSSettings = section(SpecSSettings, "SpecS soft verification and switching (method specs)")
    tree: TreeSearchSettings = section(TreeSearchSettings, "tree-of-thoughts search (methods seed_tot, tot_target)")
    lookahead: LookaheadDecodingSettings = section(LookaheadDecodingSettings,
                                                   "Lookahead Decoding inside steps (token_spec lookahead)")
    adaptive: AdaptiveDepthSettings = section(AdaptiveDepthSettings, "gamma_policy adaptive: cap and costs")
    difficulty: DifficultySettings = section(DifficultySettings, "system-speed runs: heterogeneous acceptance (easy "
                                                                 "and hard positions) and its simulated estimate")

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ConfigError(f"runtime.gamma must be >= 1, got {self.gamma}")
        for name in ("width", "max_new_tokens", "max_steps", "ngram_size", "num_speculative_tokens"):
            check_positive(self, name)
        if not 0 <= self.bernoulli_alpha <= 1:
            raise ConfigError("runtime.bernoulli_alpha must be in [0, 1]")
        if not self.probe_eps > 0:
            raise ConfigError("runtime.probe_eps must be > 0")
        if self.judge_threshold is not None and not -1 <= self.judge_threshold <= 1:
            raise ConfigError("runtime.judge_threshold must be in [-1, 1] (cosine) or [0, 1] (judge)")
        kinds = ("probe", "embedding", "judge", "llm_judge", "exact", "accept_all", "reject_all", "bernoulli")
        if self.verifier not in kinds:
            raise ConfigError(f"runtime.verifier {self.verifier!r} is not one of {list(kinds)}")
        if self.method == "lr_async" and self.width != 1:
            raise ConfigError("runtime.width > 1 (multi-branch) needs method lr_sync")


@dataclass
class BenchConfig:
    source: SourceConfig = section(SourceConfig, "problems to decode: kind reasoning_gym (offline), gsm8k, or jsonl "
                                                 "(a local file, or a hub name: math500, aime24, amc23, ...)")
    num_problems: int = opt(4, "problems per method")
    methods: list[str] = opt(["target", "draft", "semanticspec", "lr_sync", "lr_async", "lr_sync+ngram"],
                             "methods run in one benchmark, each over the same problems; a method may carry "
                             "+ngram/+assistant (token speculation) and :key=value runtime overrides, "
                             "e.g. lr_sync:width=2:gamma=2")
    prompt_suffix: str = opt("\nPlease reason step by step, and put your final answer within \\boxed{}.",
                             "appended to every question")
    system_speed: bool = opt(False, "random-weight models and a Bernoulli verifier: measure the runtime itself")
    system_target: str = opt("random:qwen2-0.5b", "target of system-speed mode (random:<size>)")
    system_draft: str = opt("random:llama-20m", "draft of system-speed mode (random:<size>)")
    warmup: bool = opt(True, "one untimed generation per method before timing (allocations, lazy init)")
    trace: bool = opt(True, "write the per-cycle JSONL trace of every generation")
    out_dir: str | None = opt(None, "where results go (default <output_dir>/bench)")

    def __post_init__(self) -> None:
        check_positive(self, "num_problems")
        if not self.methods:
            raise ConfigError("bench.methods is empty")
        for name in ("system_target", "system_draft"):
            if not getattr(self, name).startswith("random:"):
                raise ConfigError(f"bench.{name} must name a random:<size> model, got {getattr(self, name)!r}")


@dataclass
class RayConfig:
    address: str | None = opt(None, "Ray cluster to join: host:port of `ray start --head` (default port 6379), "
                                    "ray://host:10001 or auto; null = start a local instance. `--ray ADDRESS` "
                                    "overrides it")
    replicas: int = opt(1, "engine replicas: actors that each load the target and draft and process whole "
                           "shards (data) or a share of the problems (bench)")
    cpus_per_replica: float = opt(1.0, "CPUs reserved per replica (also its torch threads on CPU)")
    gpus_per_replica: float = opt(0.0, "GPUs per replica: 1 = one GPU each, 0.5 = two replicas share a GPU, "
                                       "k > 1 = k GPUs for a tensor-parallel engine (vLLM with "
                                       "models.vllm.tensor_parallel_size = k; transformers uses one)")
    judge: Literal["colocated", "actors"] = opt(
        "colocated", "data stage: where the equivalence judge runs: colocated = in every replica beside the "
                     "models, actors = on judge_replicas actors of its own that every replica calls")
    judge_replicas: int = opt(1, "judge actors when judge = actors")
    judge_cpus: float = opt(1.0, "CPUs per judge actor")
    judge_gpus: float = opt(0.0, "GPUs per judge actor (e.g. 0.25: four NLI judges share a GPU)")
    local_cpus: int | None = opt(None, "CPUs of a local instance (null = all of this machine)")
    max_restarts: int = opt(3, "how often Ray restarts a crashed replica; its unfinished work is redone")
    connect_timeout_s: float = opt(10.0, "seconds to wait for a cluster address to answer before failing")

    def __post_init__(self) -> None:
        for name in ("replicas", "judge_replicas", "local_cpus"):
            check_positive(self, name)
        for name in ("cpus_per_replica", "gpus_per_replica", "judge_cpus", "judge_gpus", "max_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ray.{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_replica > 1 and self.gpus_per_replica != int(self.gpus_per_replica):
            raise ConfigError(f"ray.gpus_per_replica above 1 must be a whole number of GPUs, got "
                              f"{self.gpus_per_replica}")
        if not self.connect_timeout_s > 0:
            raise ConfigError("ray.connect_timeout_s must be > 0")


def check_layer_option(option: str, key: str) -> None:

    try:
        parse_layer_option(option)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def check_positive(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if value is not None and value < 1:
        raise ConfigError(f"{type(obj).__name__}.{name} must be >= 1, got {value}")


# ----------------------------------------------------------------------------- loading
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{key}: bad value in {where}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)} (in {where})")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r} (in {where})")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping (in {where})")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (mapping), got {value!r} (in {where})")
        return build(tp, value, where, prefix=key + ".")
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool) or tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r} (in {where})")
    if not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r} (in {where})")
    return value


def build(cls: type, values: dict, where: str = "<dict>", prefix: str = "") -> Any:
    """Instantiate dataclass `cls` from a (nested) dict, checking every key and type."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]} in {where}; "
                          f"valid keys of {prefix.rstrip('.') or 'the top level'}: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], prefix + k, where) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(f"{err} (in {where})") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` → (["a", "b"], value); the value is read as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. data.num_samples=8)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:  # not YAML (e.g. a path with a colon): keep the text
        value = raw
    return key.strip().split("."), value


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


def load_yaml(cls: type, path: str | Path | None = None, overrides: Sequence[str] = ()):
    """Dataclass `cls` from a YAML file (or its defaults when path is None) with `key=value` overrides.
    The experiment config every CLI loads is `train.config.load_config`."""
    tree: dict = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        where = str(path)
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(tree, keys, value)
    if overrides:
        where += f" + overrides {list(overrides)}"
    return build(cls, tree, where)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def field_help(cls: type, prefix: str = "") -> list[tuple[str, str, Any]]:
    """(key, help, default) for every field, nested sections flattened with dots."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_help(tp, prefix + f.name + "."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((prefix + f.name, f.metadata.get("help", ""), default))
    return rows


def format_help(cls: type) -> str:
    return "\n".join(f"  {k:34s} {h}  [default: {d!r}]" for k, h, d in field_help(cls))
