"""The config sections the inference side owns (models, sampling, runtime, benchmark, Ray), and `BenchSetup`,
the sections a benchmark reads.

`data_gen` reads models and sampling too. The machinery (`opt`, `section`, loading, help) is
`inputs.config`; the source section is `inputs.records.SourceConfig`, beside the reader it configures.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specprobe.infer.decoding.common import DecodeOptions
from specprobe.infer.decoding.seed import SeedConfig
from specprobe.infer.decoding.specs import SpecSConfig
from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER, SamplingParams
from specprobe.infer.engines.token_spec import LookaheadConfig, TokenSpecConfig
from specprobe.infer.models import DTYPE_NAMES, OFFLINE_PREFIX, check_model_name, offline_model_folder
from specprobe.inputs.config import (
    ConfigError,
    check_device,
    check_folder,
    check_positive,
    load_yaml,
    opt,
    opt_from,
    section,
    to_dict,
)
from specprobe.inputs.records import BenchSourceConfig, SourceConfig
from specprobe.probes.acceptance import DEFAULT_EPS


def check_model_option(name: str | None, key: str, *, local_paths: bool = True) -> None:
    """ConfigError naming `key` when model `name` cannot be found without loading it (`infer.models.check_model_name`:
    an unknown offline/random name, a missing local path unless local_paths is False); None (unset) passes."""
    problem = None if name is None else check_model_name(name, local_paths=local_paths)
    if problem:
        raise ConfigError(f"{key}: {problem}")


def check_dtype_option(value: str, key: str) -> None:
    """ConfigError naming `key` unless `value` is auto or a dtype name `infer.models.parse_dtype` reads."""
    if value != "auto" and value not in DTYPE_NAMES:
        raise ConfigError(f"{key}: unknown dtype {value!r}; use auto or one of {sorted(DTYPE_NAMES)}")


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
    draft_device: str | None = opt(
        None, "device of the draft model on the transformers engine (e.g. cuda:1), default models.device. On its own "
              "GPU the draft no longer shares the target's SMs and memory bandwidth: the setting in which async "
              "Lookahead Reasoning overlaps the two (on one GPU it does not)")
    dtype: str = opt("auto", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    cache_dir: str | None = opt(None, "where converted GGUF models are cached (default $SPECPROBE_CACHE or ~/.cache/specprobe)")
    use_chat_template: bool = opt(True, "wrap questions in each model's own chat template")
    system_prompt: str | None = opt(None, "optional system message for both models")
    max_batch_rows: int = opt(32, "most sequences decoded or scored in one batch")
    decode: Literal["auto", "fast", "eager"] = opt(
        "auto", "transformers decode path: fast (static KV buffers, device-side sampling, one host sync per "
                "plain iteration, CUDA graphs), eager (the reference path) or auto (fast on CUDA, eager on CPU); "
                "token speculation runs on both")
    decode_graph: Literal["auto", "cuda_graph", "compile", "none"] = opt(
        "auto", "how the fast path runs its plain decode step: cuda_graph (captured once per KV buffer and replayed), "
                "compile (inductor's fused kernels, captured like cuda_graph on CUDA; two compilations of tens of "
                "seconds each serve every buffer), none (eager), auto (cuda_graph on CUDA, none elsewhere)")
    capture_joins: bool = opt(
        True, "with a captured decode step (CUDA), also capture the forwards of rows joining a batch (a Lookahead "
              "batch's drafts, a draft taking the target's step), padded to a few widths, once per buffer and width; "
              "false: those run eagerly (on a GPU tens of milliseconds of launches each on a large model). Measured "
              "on an H100: benchmarks/results/gpu_h100/README.md")
    draft_decode_graph: Literal["auto", "cuda_graph", "compile", "none"] | None = opt(
        None, "the draft's decode_graph (default models.decode_graph). compile pays most on the draft, whose step "
              "is mostly small per-layer kernels that fusion removes: a 1.5B's batch-1 rate on an H100 was 213 tok/s "
              "captured and 329 compiled (two runs), lowering the draft's cost c per target step "
              "(benchmarks/results/gpu_h100)")
    target_stream_priority: Literal["normal", "high"] = opt(
        "normal", "priority of the transformers target's CUDA stream: high starts the target's kernels before the "
                  "draft's when both are ready, which may let a draft decoding beside it on one GPU (async Lookahead "
                  "Reasoning) slow it less (running kernels are not preempted; both share the memory bandwidth); not "
                  "yet measured on a GPU (ignored on the CPU)")
    fused_norm: bool | Literal["auto"] = opt(
        "auto", "run the transformers models' RMSNorm layers as one fused kernel each (torch's rms_norm) instead of "
                "transformers' chain of about eight small ones: true, false, or auto (on for weights on CUDA, where a "
                "captured decode step of batch 1 pays each kernel's launch: on an H100 113.6 -> 120.7 tok/s on a "
                "random 7B, 32.3 -> 33.5 on a 32B; off on the CPU, which gains no speed). A layer whose formula "
                "differs (Gemma's 1 + weight) is kept as it is. bf16 results move by at most about one unit in the "
                "last place")
    merged_linear: bool | Literal["auto"] = opt(
        "auto", "run the transformers models' linear layers that read one input (attention's q/k/v projections, a "
                "gated MLP's gate/up) as one matrix product each, as vLLM stores them: true, false, or auto (on for "
                "weights on CUDA, where a batch-1 step reads the small key and value projections well below the "
                "memory bandwidth and pays a launch for each; off on the CPU). The modules and checkpoint keys stay; "
                "each weight becomes a view of the merged one. On an H100, batch-1 decoding: 7B 120.6 -> 126.6 tok/s, "
                "32B 34.3 -> 34.8 (benchmarks/results/gpu_h100/open_2026-11-28/)")
    engine: Literal["hf", "vllm"] = opt("hf", "step engine of the target (and of the draft unless draft_engine is "
                                              "set): hf (transformers) or vllm (pip install -e \".[vllm]\")")
    draft_engine: Literal["hf", "vllm"] | None = opt(None, "step engine of the draft (default: models.engine)")
    vllm: VLLMConfig = section(VLLMConfig, "settings of the models served by vLLM")

    def __post_init__(self) -> None:
        check_positive(self, "max_batch_rows")
        check_dtype_option(self.dtype, "models.dtype")
        for key in ("device", "draft_device"):
            value = getattr(self, key)
            if value is not None or key == "device":
                check_device(value, f"models.{key}")
        if self.draft_device is not None and self.engine_of("draft") == "vllm":
            raise ConfigError("models.draft_device places a transformers draft; vLLM places its models itself "
                              "(CUDA_VISIBLE_DEVICES, models.vllm.tensor_parallel_size): unset models.draft_device "
                              "or use models.draft_engine=hf")
        if self.draft_decode_graph is not None and self.engine_of("draft") == "vllm":
            raise ConfigError("models.draft_decode_graph sets how a transformers draft runs its decode step; a vLLM "
                              "draft captures its own graphs (models.vllm.enforce_eager): unset it or use "
                              "models.draft_engine=hf")
        if self.target_stream_priority != "normal" and self.engine_of("target") == "vllm":
            raise ConfigError("models.target_stream_priority sets a transformers target's CUDA stream; vLLM runs its "
                              "own: unset it or use models.engine=hf")
        if self.fused_norm is True and self.engine_of("target") == "vllm" and self.engine_of("draft") == "vllm":
            raise ConfigError("models.fused_norm swaps the norms of transformers models; vLLM runs fused norms of its "
                              "own: unset it or use models.engine=hf")
        if self.merged_linear is True and self.engine_of("target") == "vllm" and self.engine_of("draft") == "vllm":
            raise ConfigError("models.merged_linear merges the linear layers of transformers models; vLLM merges its "
                              "own: unset it or use models.engine=hf")
        for role in ("target", "draft"):  # the names; a local path is checked where the model loads (check_available)
            check_model_option(getattr(self, role), f"models.{role}", local_paths=False)

    def check_available(self, replica_gpus: float | None = None, *, models: bool = True) -> None:
        """Before any model loads: the devices exist and, with `models` (a stage that loads the target and draft),
        the models can be found (offline packages installed, local paths present). Hub ids are checked when they
        load. replica_gpus: the models load in Ray replicas that see this many GPUs each (ray.gpus_per_replica),
        not on this machine."""
        import torch

        for key in ("device", "draft_device"):
            value = getattr(self, key) or ""
            if not value.startswith("cuda"):
                continue
            index = int(value.split(":")[1]) if ":" in value else 0
            if replica_gpus is None:
                count = torch.cuda.device_count() if torch.cuda.is_available() else 0
                where = f"torch sees {count or 'no'} CUDA device(s) here (torch {torch.__version__})"
                fix = f"use models.{key}=cpu or auto" if not count else f"use cuda:0 to cuda:{count - 1}"
            else:
                count = math.ceil(replica_gpus)  # a share of one GPU still shows that GPU
                where = f"each Ray replica sees {count} GPU(s) (ray.gpus_per_replica = {replica_gpus:g})"
                fix = f"set ray.gpus_per_replica to at least {index + 1}, or models.{key}=cpu"
            if index >= count:
                raise ConfigError(f"models.{key} is {value!r}, but {where}; {fix}")
        if not models:
            return
        for role in ("target", "draft"):
            name = getattr(self, role)
            check_model_option(name, f"models.{role}")
            if name.startswith(OFFLINE_PREFIX):
                offline_model_folder(name)  # a clear error naming the package to install

    def engine_of(self, role: str) -> str:
        """The engine kind ("hf" / "vllm") of the "target" or "draft" model."""
        if role == "draft" and self.draft_engine is not None:
            return self.draft_engine
        return self.engine

    def decode_graph_of(self, role: str) -> str:
        """How the "target" or "draft" model's fast path runs its decode step (transformers engine)."""
        if role == "draft" and self.draft_decode_graph is not None:
            return self.draft_decode_graph
        return self.decode_graph

    def resolved_device(self, role: str = "target") -> str | None:
        """The device a role's model loads on; None: the engine picks (CUDA when present)."""
        device = self.draft_device if role == "draft" and self.draft_device is not None else self.device
        return None if device == "auto" else device


@dataclass
class SamplingConfig:
    temperature: float = opt_from(SamplingParams, "temperature", "sampling temperature (0 = greedy); LR uses 0.6")
    top_p: float = opt_from(SamplingParams, "top_p", "nucleus sampling mass")
    max_step_tokens: int = opt_from(SamplingParams, "max_step_tokens",
                                    "token cap of one step; a step cut here has stop reason 'length'")
    seed: int = opt(0, "seed of the data stage's samples (per context and model; probe-bench's decoding draws from runtime.seed)")
    draft_temperature: float | None = opt(
        None, "draft's temperature when it differs from the target's (the tiny config uses one LM for both "
              "roles, sampled hotter as the draft, since only one LM ships offline)")

    def __post_init__(self) -> None:
        check_positive(self, "max_step_tokens")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("sampling: temperature must be >= 0 and top_p in (0, 1]")


@dataclass
class SpecSSettings:
    n: int = opt_from(SpecSConfig, "n", "SpecS: candidate steps per round (beam width n; the paper's tables use 4, 8, 16)")
    beta: float | None = opt_from(SpecSConfig, "beta", "SpecS: inverse temperature β of the soft verification "
                                   "(null: 2 x sampling.max_step_tokens, the paper's robust choice)")
    tau: float = opt_from(SpecSConfig, "tau", "SpecS: switch to the draft when some candidate's reward exceeds τ (the paper: "
                          "0.7 / 0.8 / 0.9); beam_target never switches")

    def __post_init__(self) -> None:
        check_positive(self, "n")
        if self.beta is not None and self.beta < 0:
            raise ConfigError(f"runtime.specs.beta must be >= 0 or null, got {self.beta}")


@dataclass
class TreeSearchSettings:
    thoughts: int = opt_from(SeedConfig, "thoughts", "tree of thoughts (seed_tot, tot_target): thoughts (steps) per kept state, n")
    keep: int = opt_from(SeedConfig, "keep", "tree of thoughts: best states kept per level, b")
    depth: int = opt_from(SeedConfig, "depth", "tree of thoughts: levels T (the SEED paper: 4 for GSM8K)")
    k_config: list[int] = opt_from(SeedConfig, "k_config", "SEED: draft token tree, candidates per position ([1,1,1] is a chain, "
                                         "the paper's base setting; [2,2,1] its tree-attention setting)")
    threaded: bool = opt_from(SeedConfig, "threaded", "SEED: draft in a thread while the target verifies (false: one-thread rounds)")

    def __post_init__(self) -> None:
        for name in ("thoughts", "keep", "depth"):
            check_positive(self, name)
        if not self.k_config or any(int(k) < 1 for k in self.k_config):
            raise ConfigError(f"runtime.tree.k_config must be a non-empty list of ints >= 1, got {self.k_config}")


@dataclass
class LookaheadDecodingSettings:
    window: int = opt_from(LookaheadConfig, "window", "Lookahead Decoding (+lookahead): window W of future positions (paper: 15 for 7B)")
    ngram: int = opt_from(LookaheadConfig, "ngram", "Lookahead Decoding: n-gram size N, i.e. N-1 past Jacobi iterations (paper: 5)")
    max_verify: int | None = opt_from(LookaheadConfig, "max_verify", "Lookahead Decoding: n-grams verified per step G (null: G = W)")

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
    forecast_skip: bool = opt(False, "gamma=adaptive, lr_sync / semanticspec: a cycle whose steps, forecast at the "
                                     "last estimate, would not pay drafts nothing (the target writes the step and "
                                     "the draft scores it for the next forecast); false: every cycle drafts one "
                                     "step to learn its estimate")

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
        "lr_sync", "not read by probe-bench, which runs bench.methods (or --methods); kept so that older configs "
                   "load. Only its check remains: lr_async with runtime.width > 1 is refused")
    gamma: int = opt_from(DecodeOptions, "gamma", "draft steps per cycle (lookahead depth γ); sync LR runs γ+1 target steps in one batch")
    gamma_policy: Literal["fixed", "adaptive"] = opt(
        "fixed", "fixed: every cycle drafts gamma steps; adaptive: each cycle drafts as far as the predicted acceptance "
                 "pays, up to runtime.adaptive.gamma_max (the checkpoint's acceptance probe; system-speed: "
                 "runtime.difficulty's simulated one). A method suffix :gamma=adaptive sets it per method")
    width: int = opt_from(DecodeOptions, "width", "draft branches per position (multi-branch LR, sync only; the tree has W^γ leaves)")
    verifier: str = opt("probe", "probe | embedding | judge | llm_judge | exact | accept_all | reject_all | bernoulli")
    checkpoint: str | None = opt(None, "checkpoint folder with trained verifiers (default: <output_dir>/checkpoint)")
    bernoulli_alpha: float = opt(0.6, "acceptance probability of the bernoulli verifier")
    probe_eps: float = opt(DEFAULT_EPS, "guard of the probe rule min(1, p / max(q, eps)) when q -> 0")
    judge_threshold: float | None = opt(None, "accept when P(aligned) >= this (default: judge.json's, else 0.5); "
                                              "for embedding: overrides the fitted cosine threshold")
    llm_judge_model: str | None = opt(None, "instruct model for the prompted llm_judge verifier "
                                            "('target' reuses the target model)")
    allow_model_mismatch: bool = opt(False, "accept probes trained on a model of the same shape under another name")
    checkpoint_judge_base: str | None = opt(
        None, "the base model the checkpoint's judge-LoRA loads instead of the one judge.json names: the same model "
              "where this machine has it (a local copy, or the hub id of a local path used in training); its "
              "tokenizer must give the adapter's answer tokens")
    checkpoint_embedding_model: str | None = opt(
        None, "the embedder the checkpoint's embedding verifier loads instead of the one embedding_threshold.json "
              "names (the same model where this machine has it)")
    max_new_tokens: int = opt_from(DecodeOptions, "max_new_tokens", "token limit of one generation (target tokens); stop reason max_new_tokens")
    max_steps: int = opt_from(DecodeOptions, "max_steps", "step limit of one generation; stop reason max_steps")
    accept_length_cut: bool = opt_from(DecodeOptions, "accept_length_cut", "allow accepting a draft step cut by the step-token cap (LR never does; "
                                         "system-speed runs set it, random models rarely write the delimiter)")
    judge_after_cut: bool = opt_from(DecodeOptions, "judge_after_cut", "judge drafts that continue a committed step cut by the token cap (off: "
                                       "Lookahead Reasoning's public rule ignore_half_sentence, such drafts are refused)")
    refuse_boxed: bool = opt(False, "refuse drafts that write a \\boxed{} answer (no paper or public code does; the "
                                    "answer's EOS step is always the target's)")
    accept_draws: Literal["prefix", "position"] = opt(
        "prefix", "what a stochastic verifier's draw (bernoulli) is keyed by: the prefix's text (a method that reaches "
                  "the same prefix draws the same), or the question and the answer position (every method draws the "
                  "same at each position, whatever it wrote before: common random numbers, so that methods compared "
                  "on a few problems see the same acceptances; with random weights each method's text differs). "
                  "lr_sync, lr_async and semanticspec; SpecS's and SEED's rewards stay keyed by the prefix")
    token_spec: Literal["none", "ngram", "assistant", "lookahead"] = opt(
        "none", "token-level speculation inside each target step: ngram (prompt lookup), assistant "
                "(the draft model, same tokenizer only) or lookahead (Lookahead Decoding, runtime.lookahead); "
                "a method suffix +ngram/+assistant/+lookahead sets it per method")
    ngram_size: int = opt_from(TokenSpecConfig, "ngram_size", "prompt-lookup n-gram size (longest n tried first, down to 1)")
    num_speculative_tokens: int = opt_from(TokenSpecConfig, "num_tokens", "tokens proposed per token-level speculation round")
    seed: int = opt_from(DecodeOptions, "seed", "seed of sampling and acceptance draws")
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

    def check_available(self) -> None:
        """Before any model loads (probe-bench; not at config load: a machine that trains need not have them): the
        checkpoint's model overrides are named well (a local path exists)."""
        for key in ("checkpoint_judge_base", "checkpoint_embedding_model"):
            check_model_option(getattr(self, key), f"runtime.{key}")


@dataclass
class BenchConfig:
    source: BenchSourceConfig = section(BenchSourceConfig, "problems to decode: kind reasoning_gym (offline), gsm8k, "
                                                           "or jsonl (a local file, or a hub name: math500, aime24, "
                                                           "amc23, ...)")
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
    warmup: bool = opt(True, "one untimed generation per method before timing (allocations, lazy init, graph "
                               "captures), its steps run past EOS to max_steps so that it is as long as a timed one")
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


@dataclass
class BenchSetup:
    """What a benchmark reads: its config sections, the step delimiter, the folder where a trained
    checkpoint is looked for when none is named, and the config its results record. The experiment config
    hands it down (``ExperimentConfig.bench_setup()``); a notebook can build one from the sections."""

    models: ModelsConfig
    sampling: SamplingConfig
    runtime: RuntimeConfig
    bench: BenchConfig
    ray: RayConfig = field(default_factory=RayConfig)
    delimiter: str = DEFAULT_STEP_DELIMITER
    checkpoint_dir: Path | None = None
    record: dict | None = None  # the whole experiment config as a dict; None: these sections

    def config_record(self) -> dict:
        return self.record if self.record is not None else to_dict(self, ("models", "sampling", "runtime", "bench", "ray"))


@dataclass
class InferenceConfig:
    """The inference side of an experiment config: what probe-bench loads (`load_inference_config`) from the
    same YAML file as probe-train, whose `train.config.ExperimentConfig` adds the data, training, report and
    tracking sections to these."""

    name: str = opt("tiny", "run name; checkpoints go to <output_dir>/checkpoint")
    output_dir: str = opt("runs/tiny", "where this run writes its data, checkpoint and reports")
    models: ModelsConfig = section(ModelsConfig, "draft and target models")
    source: SourceConfig = section(SourceConfig, "reasoning traces")
    sampling: SamplingConfig = section(SamplingConfig, "step sampling")
    runtime: RuntimeConfig = section(RuntimeConfig, "decoding runtime")
    bench: BenchConfig = section(BenchConfig, "probe-bench")
    ray: RayConfig = section(RayConfig, "scale-out on Ray (probe-train --stage data --ray, probe-bench --ray)")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoint"

    @property
    def bench_out_dir(self) -> Path:
        """Where probe-bench writes: bench.out_dir, else <output_dir>/bench."""
        return Path(self.bench.out_dir or Path(self.output_dir) / "bench")

    def bench_setup(self) -> BenchSetup:
        """probe-bench's sections (`infer.bench.prepare` takes this); the checkpoint this run trained, if any,
        is the default verifier checkpoint."""
        return BenchSetup(self.models, self.sampling, self.runtime, self.bench, self.ray, self.source.delimiter,
                          self.checkpoint_dir, record=to_dict(self))

    def check_before_loading(self, *, sources: bool = True, ray: bool = False, models: bool = True) -> None:
        """What can be checked before any model loads (a wrong device or path found after minutes of loading
        is time lost): the output folder, the devices (ray: as a Ray replica sees them), with `models` the target's
        and draft's offline packages and local paths (a machine that only trains need not have them), a local
        source file."""
        check_folder(self.output_dir, "output_dir")
        self.models.check_available(self.ray.gpus_per_replica if ray else None, models=models)
        if sources:
            self.source.check_available()


# the sections of an experiment YAML that probe-train reads and probe-bench does not (tests/test_config_flow.py
# checks this list against train.config.ExperimentConfig, so the two cannot drift apart)
TRAINING_SECTIONS = ("data", "probe", "verifiers", "eval", "wandb")


def load_inference_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> InferenceConfig:
    """The inference sections of an experiment YAML (its data and training sections are skipped unread)."""
    return load_yaml(InferenceConfig, path, overrides, other_sections=TRAINING_SECTIONS)
