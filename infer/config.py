"""Typed experiment configs: one YAML file per experiment, `key=value` overrides on the command line.

Every field has help text (``field_help``) and is type-checked when loaded: an unknown key or a value
of the wrong type is a ``ConfigError`` that names the key and the file. Sections are plain data;
each package reads the section it owns (``data`` → data_gen, ``probe``/``verifiers`` → train,
``runtime``/``bench`` → infer). The config lives in `infer` because every package but `probes`
may import `infer`.
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

    def __post_init__(self) -> None:
        for name in ("max_model_len", "tensor_parallel_size", "max_lora_rank", "block_size"):
            _positive(self, name)
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
    engine: Literal["hf", "vllm"] = opt("hf", "step engine of the target (and of the draft unless draft_engine is "
                                              "set): hf (transformers) or vllm (pip install -e \".[vllm]\")")
    draft_engine: Literal["hf", "vllm"] | None = opt(None, "step engine of the draft (default: models.engine)")
    vllm: VLLMConfig = section(VLLMConfig, "settings of the models served by vLLM")

    def __post_init__(self) -> None:
        _positive(self, "max_batch_rows")

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
        _positive(self, "size")
        if not self.delimiter:
            raise ConfigError("source.delimiter must not be empty")


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
        _positive(self, "max_step_tokens")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("sampling: temperature must be >= 0 and top_p in (0, 1]")


@dataclass
class DataConfig:
    contexts_per_trace: int = opt(2, "contexts (question + first j steps) taken from each trace")
    context_positions: Literal["spread", "first", "all"] = opt(
        "spread", "which j: spread evenly over the chain, the first ones, or all")
    num_samples: int = opt(20, "N one-step continuations per context and model (SemanticSpec: 20)")
    models: list[str] = opt(["target", "draft"], "which models to sample from")
    judge: Literal["nli", "embedding"] = opt("nli", "equivalence judge: nli (DeBERTa MNLI) or embedding (offline approximation)")
    nli_model: str = opt("microsoft/deberta-large-mnli", "sequence-classification NLI model for the nli judge")
    nli_strict: bool = opt(True, "strict: both directions entailment; else no contradiction and not neutral both ways")
    nli_batch_size: int = opt(16, "pairs per NLI batch")
    nli_max_length: int = opt(512, "token limit of premise + hypothesis; the context is trimmed from the left")
    cluster_scheme: Literal["reference", "first_match"] = opt(
        "reference", "greedy clustering: reference = semantic-uncertainty's get_semantic_ids (each new "
                     "representative is compared with every later sample, placed ones included, so a later "
                     "equivalent representative takes a sample over); first_match = each sample joins the first "
                     "cluster whose representative is equivalent (fewer judge pairs; same clusters when the "
                     "judge is transitive)")
    embedding_model: str = opt("offline:minilm", "sentence embedder of the embedding judge")
    embedding_threshold: float = opt(0.8, "cosine threshold of the embedding judge (numbers must also match)")
    layers: str = opt("all", "hidden-state rows to store: all, last, range:a-b or a comma list (0 = embeddings)")
    store_last_token: bool = opt(True, "also store the last token's hidden states")
    contexts_per_shard: int = opt(8, "contexts written per shard file (the unit of resumption)")
    max_context_steps: int | None = opt(None, "keep at most this many trace steps in a context")
    max_contexts: int | None = opt(None, "use only the first this-many contexts of the plan (quick runs); "
                                         "changes the dataset, so a folder made without it is not reused")
    judge_pairs_per_call: int | None = opt(
        1024, "most step pairs per equivalence-judge call; decisions are saved after each call, so this "
              "bounds the judge work a killed run loses (null = one call per clustering round)")

    def __post_init__(self) -> None:
        for name in ("contexts_per_trace", "num_samples", "nli_batch_size", "contexts_per_shard",
                     "max_contexts", "judge_pairs_per_call"):
            _positive(self, name)
        if self.max_context_steps is not None and self.max_context_steps < 0:
            raise ConfigError(f"data.max_context_steps must be >= 0, got {self.max_context_steps}")
        bad = [m for m in self.models if m not in ("target", "draft")]
        if bad or not self.models or len(set(self.models)) != len(self.models):
            raise ConfigError(f"data.models must be a non-empty subset of [target, draft] without repeats, "
                              f"got {self.models}")
        _check_layer_option(self.layers, "data.layers")


@dataclass
class ProbeConfig:
    features: str = opt("all", "hidden-state rows the probe reads: all, last, range:a-b or a comma list "
                               "(0 = embeddings); must be rows the data stored (data.layers)")
    combine: Literal["concat", "mean", "weighted"] = opt(
        "concat", "how the layers are combined: concat, mean, or weighted (learned softmax weights)")
    pooling: Literal["mean", "last"] = opt("mean", "mean over the step's tokens or the last token")
    hidden_dim: int = opt(256, "MLP width")
    dropout: float = opt(0.1, "dropout between MLP layers")
    loss: Literal["bce", "mse"] = opt("bce", "BCE on the soft label or MSE on the probability")
    lr: float = opt(1e-3, "AdamW learning rate (SemanticSpec: 1e-3)")
    betas: list[float] = opt([0.9, 0.95], "AdamW betas (SemanticSpec: 0.9, 0.95)")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    epochs: int = opt(60, "maximum epochs")
    batch_size: int = opt(256, "batch size")
    patience: int = opt(8, "early stopping patience in epochs on the validation loss")
    val_fraction: float = opt(0.2, "share of questions held out for validation")
    test_fraction: float = opt(0.0, "share of questions held out for a final test")
    target_with_draft: bool = opt(True, "train the target probe also on draft steps teacher-forced through the target")
    seed: int = opt(0, "training seed")
    logprob_baseline: Literal["logistic", "isotonic"] = opt(
        "logistic", "how the log-prob baseline maps a step's mean token log-probability to a probability: "
                    "1-D logistic regression on the soft labels, or isotonic regression (fitted on train)")
    num_threads: int | None = opt(
        1, "torch CPU threads while training and scoring probes (small MLPs are fastest on one thread on a "
           "busy machine); null = leave torch's setting")
    device: str = opt("cpu", "device of probe training: cpu, cuda, ... or auto (models.device)")

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "epochs", "batch_size", "patience", "num_threads"):
            _positive(self, name)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"probe.betas needs two numbers in [0, 1), got {self.betas}")
        if not 0 < self.val_fraction < 1 or not 0 <= self.test_fraction < 1:
            raise ConfigError("probe.val_fraction must be in (0, 1), probe.test_fraction in [0, 1)")
        if self.val_fraction + self.test_fraction >= 1:
            raise ConfigError(f"probe.val_fraction + probe.test_fraction must leave training questions, got "
                              f"{self.val_fraction} + {self.test_fraction}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"probe.dropout must be in [0, 1), got {self.dropout}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ConfigError(f"probe.lr must be > 0 and probe.weight_decay >= 0, got {self.lr}, {self.weight_decay}")
        _check_layer_option(self.features, "probe.features")


_VERIFIERS = ("probes", "embedding", "judge")


@dataclass
class VerifiersConfig:
    train: list[str] = opt(["probes", "embedding", "judge"], "what probe-train trains: probes, embedding, judge")
    embedding_model: str = opt("sentence-transformers/all-mpnet-base-v2", "embedder of the threshold verifier")
    target_precision: float = opt(0.95, "the threshold is the highest-recall one at this precision")
    embedding_fixed_thresholds: list[float] = opt(
        [0.85, 0.95], "fixed cosine thresholds scored as baselines (Lookahead Reasoning used 0.85 and 0.95)")
    judge_base: str = opt("Qwen/Qwen2.5-1.5B-Instruct", "base causal LM of the judge-LoRA verifier")
    judge_lora_r: int = opt(16, "LoRA rank")
    judge_lora_alpha: int = opt(32, "LoRA alpha")
    judge_lora_dropout: float = opt(0.05, "LoRA dropout")
    judge_target_modules: list[str] = opt(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "module names LoRA adapts (PEFT target_modules)")
    judge_lora_layers: int | None = opt(
        None, "put LoRA only into the last this-many transformer layers (null = all); fewer layers make the "
              "backward pass cheaper, which matters on a CPU")
    judge_steps: int = opt(300, "judge optimisation steps")
    judge_lr: float = opt(2e-4, "judge learning rate")
    judge_batch_size: int = opt(8, "judge batch size")
    judge_max_pairs: int = opt(4000, "most balanced training pairs for the judge")
    judge_eval_pairs: int = opt(400, "most validation pairs the judge (and its untrained base) is scored on")
    judge_dtype: str = opt("auto", "dtype of the judge's base model: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16")
    seed: int = opt(0, "seed of pair balancing, orientation and LoRA initialisation")

    def __post_init__(self) -> None:
        bad = [t for t in self.train if t not in _VERIFIERS]
        if bad or len(set(self.train)) != len(self.train):
            raise ConfigError(f"verifiers.train: unknown or repeated entries in {self.train}; "
                              f"use a subset of {list(_VERIFIERS)}")
        if not 0 < self.target_precision <= 1:
            raise ConfigError("verifiers.target_precision must be in (0, 1]")
        if any(not -1 <= t <= 1 for t in self.embedding_fixed_thresholds):
            raise ConfigError(f"verifiers.embedding_fixed_thresholds are cosines in [-1, 1], "
                              f"got {self.embedding_fixed_thresholds}")
        for name in ("judge_lora_r", "judge_lora_alpha", "judge_lora_layers", "judge_steps", "judge_batch_size", "judge_max_pairs",
                     "judge_eval_pairs"):
            _positive(self, name)
        if not 0 <= self.judge_lora_dropout < 1:
            raise ConfigError(f"verifiers.judge_lora_dropout must be in [0, 1), got {self.judge_lora_dropout}")
        if not self.judge_lr > 0:
            raise ConfigError(f"verifiers.judge_lr must be > 0, got {self.judge_lr}")
        if not self.judge_target_modules:
            raise ConfigError("verifiers.judge_target_modules must name at least one module")


@dataclass
class EvalConfig:
    n_boot: int = opt(1000, "bootstrap resamples (of whole questions) for every confidence interval")
    alpha: float = opt(0.10, "1 - confidence level of the intervals (0.10 = 90% intervals)")
    n_bins: int = opt(10, "calibration bins (equal-width and equal-mass ECE, MCE, reliability diagram)")
    seed: int = opt(0, "seed of the bootstrap, subsampling, the layer sweep and UMAP")
    split: Literal["auto", "val", "test", "val+test"] = opt(
        "auto", "held-out questions on the training data: auto = test when the run held out a test split, else "
                "val (on another data folder every question not used in training is held out)")
    umap: bool = opt(True, "draw the UMAP view of pooled hidden states (umap-learn; ~30 s of JIT on first use)")
    umap_max_points: int = opt(3000, "most points per model in the UMAP view (subsampled)")
    umap_neighbors: int = opt(15, "UMAP n_neighbors (capped at points - 1 for tiny data)")
    umap_layer: int | str = opt("last", "hidden-state row shown in the UMAP view: 'last' stored row or its index")
    layer_sweep: bool = opt(True, "train one small probe per layer and plot error against depth")
    sweep_hidden_dim: int = opt(32, "MLP width of the per-layer sweep probes")
    sweep_epochs: int = opt(15, "most epochs of each per-layer sweep probe")
    sweep_max_layers: int = opt(32, "most layers swept (evenly spread over the stored rows, both ends kept)")
    verifiers: list[str] = opt(["embedding", "judge"], "pair verifiers evaluated: embedding, judge")
    max_pairs: int = opt(2000, "most held-out step pairs the pair verifiers score (subsampled)")
    judge_max_pairs: int = opt(400, "most of those pairs the judge-LoRA scores (one LM forward per pair; "
                                    "agreement with it is measured on these)")
    num_threads: int | None = opt(1, "torch CPU threads for the sweep probes (null = leave torch's setting)")

    def __post_init__(self) -> None:
        for name in ("n_boot", "n_bins", "umap_neighbors", "sweep_hidden_dim", "sweep_epochs", "sweep_max_layers",
                     "max_pairs", "judge_max_pairs", "num_threads"):
            _positive(self, name)
        if not 0 < self.alpha < 1:
            raise ConfigError(f"eval.alpha must be in (0, 1), got {self.alpha}")
        if self.umap_max_points < 3 or self.umap_neighbors < 2:
            raise ConfigError(f"eval.umap_max_points must be >= 3 and eval.umap_neighbors >= 2, got "
                              f"{self.umap_max_points} and {self.umap_neighbors}")
        layer = str(self.umap_layer).strip().lower()
        if layer != "last" and not (layer.isdigit()):
            raise ConfigError(f"eval.umap_layer must be 'last' or a hidden-state row index, got {self.umap_layer!r}")
        bad = [v for v in self.verifiers if v not in ("embedding", "judge")]
        if bad or len(set(self.verifiers)) != len(self.verifiers):
            raise ConfigError(f"eval.verifiers: unknown or repeated entries in {self.verifiers}; use embedding, judge")


@dataclass
class RuntimeConfig:
    method: Literal["target", "draft", "semanticspec", "lr_sync", "lr_async"] = opt(
        "lr_sync", "decoding method: target / draft (baselines), semanticspec, lr_sync, lr_async")
    gamma: int = opt(3, "draft steps per cycle (lookahead depth γ); sync LR runs γ+1 target steps in one batch")
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
    token_spec: Literal["none", "ngram", "assistant"] = opt(
        "none", "token-level speculation inside each target step: ngram (prompt lookup) or assistant "
                "(the draft model, same tokenizer only); a method suffix +ngram/+assistant sets it per method")
    ngram_size: int = opt(3, "prompt-lookup n-gram size (longest n tried first, down to 1)")
    num_speculative_tokens: int = opt(8, "tokens proposed per token-level speculation round")
    seed: int = opt(0, "seed of sampling and acceptance draws")

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ConfigError(f"runtime.gamma must be >= 1, got {self.gamma}")
        for name in ("width", "max_new_tokens", "max_steps", "ngram_size", "num_speculative_tokens"):
            _positive(self, name)
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
        _positive(self, "num_problems")
        if not self.methods:
            raise ConfigError("bench.methods is empty")
        for name in ("system_target", "system_draft"):
            if not getattr(self, name).startswith("random:"):
                raise ConfigError(f"bench.{name} must name a random:<size> model, got {getattr(self, name)!r}")


@dataclass
class WandbConfig:
    enabled: bool = opt(False, "log metrics and figures to Weights & Biases")
    project: str = opt("specprobe", "wandb project")
    mode: Literal["offline", "online"] = opt("offline", "offline needs no account; sync later with `wandb sync`")
    entity: str | None = opt(None, "wandb entity (team or user); null = the account's default")
    run_name: str | None = opt(None, "wandb run name; null = the experiment name")
    tags: list[str] = opt([], "wandb run tags")
    dir: str | None = opt(None, "where wandb writes its files; null = <output_dir>/wandb")


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
            _positive(self, name)
        for name in ("cpus_per_replica", "gpus_per_replica", "judge_cpus", "judge_gpus", "max_restarts"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ray.{name} must be >= 0, got {getattr(self, name)}")
        if self.gpus_per_replica > 1 and self.gpus_per_replica != int(self.gpus_per_replica):
            raise ConfigError(f"ray.gpus_per_replica above 1 must be a whole number of GPUs, got "
                              f"{self.gpus_per_replica}")
        if not self.connect_timeout_s > 0:
            raise ConfigError("ray.connect_timeout_s must be > 0")


@dataclass
class ExperimentConfig:
    name: str = opt("tiny", "run name; checkpoints go to <output_dir>/checkpoint")
    output_dir: str = opt("runs/tiny", "where this run writes its data, checkpoint and reports")
    models: ModelsConfig = section(ModelsConfig, "draft and target models")
    source: SourceConfig = section(SourceConfig, "reasoning traces")
    sampling: SamplingConfig = section(SamplingConfig, "step sampling")
    data: DataConfig = section(DataConfig, "training-data generation")
    probe: ProbeConfig = section(ProbeConfig, "semantic-probability probes")
    verifiers: VerifiersConfig = section(VerifiersConfig, "pair verifiers")
    eval: EvalConfig = section(EvalConfig, "probe-eval report")
    runtime: RuntimeConfig = section(RuntimeConfig, "decoding runtime")
    bench: BenchConfig = section(BenchConfig, "probe-bench")
    wandb: WandbConfig = section(WandbConfig, "experiment tracking")
    ray: RayConfig = section(RayConfig, "scale-out on Ray (probe-train --stage data --ray, probe-bench --ray)")

    @property
    def data_dir(self) -> Path:
        return Path(self.output_dir) / "data"

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoint"


def _check_layer_option(option: str, key: str) -> None:
    from probes.features import parse_layer_option

    try:
        parse_layer_option(option)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def _positive(obj: Any, name: str) -> None:
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


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), cls: type = ExperimentConfig):
    """Load a YAML config (or the defaults when path is None) and apply `key=value` overrides."""
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


def field_help(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, str, Any]]:
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


def format_help(cls: type = ExperimentConfig) -> str:
    return "\n".join(f"  {k:34s} {h}  [default: {d!r}]" for k, h, d in field_help(cls))
