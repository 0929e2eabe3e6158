"""The training, evaluation and tracking sections of an experiment config, and the experiment config itself.

`ExperimentConfig` extends the inference sections (`infer.config.InferenceConfig`: models, sampling, runtime,
bench, ray, and the source of `inputs.records`) with data_gen's data section and train's probe, verifiers, eval
and wandb, into the one schema of an experiment YAML that `probe-train` loads with `load_config` (probe-bench
reads the inference part of the same file; probe-eval the config saved in a checkpoint).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specprobe.data_gen.config import DataConfig, DataJob, check_layer_option, stored_poolings
from specprobe.infer.config import InferenceConfig, check_dtype_option, check_model_option
from specprobe.inputs import config as base
from specprobe.inputs.config import ConfigError, check_device, check_positive, opt, opt_from, section
from specprobe.probes.mlp import ProbeMLPConfig


def _mlp_opt(name: str):
    """A probe-section field with the default and help of ProbeMLPConfig's field `name`."""
    return opt_from(ProbeMLPConfig, name)


@dataclass
class ProbeConfig:
    features: str = opt("all", "hidden-state rows the probe reads: all, last, range:a-b or a comma list "
                               "(0 = embeddings); must be rows the data stored (data.layers)")
    combine: Literal["concat", "mean", "weighted"] = opt(
        "concat", "how the layers are combined: concat, mean, or weighted (learned softmax weights)")
    pooling: Literal["mean", "last"] = opt("mean", "mean over the step's tokens or the last token")
    # the MLP's settings: defaults and help are the probes package's (ProbeMLPConfig), so a probe built in a
    # notebook trains as probe-train's does
    hidden_dim: int = _mlp_opt("hidden_dim")
    dropout: float = _mlp_opt("dropout")
    loss: Literal["bce", "mse"] = _mlp_opt("loss")
    lr: float = _mlp_opt("lr")
    betas: list[float] = _mlp_opt("betas")
    weight_decay: float = _mlp_opt("weight_decay")
    epochs: int = _mlp_opt("epochs")
    batch_size: int = _mlp_opt("batch_size")
    patience: int = _mlp_opt("patience")
    val_fraction: float = opt(0.2, "share of question families held out for validation (a family: a template's "
                                   "questions, else one question)")
    test_fraction: float = opt(0.2, "share of question families held out for a final test that nothing is tuned on (probe-eval "
                                    "reports on it; 0 = none, then probe-eval falls back to the validation questions "
                                    "and says so)")
    target_with_draft: bool = opt(True, "train the target probe also on draft steps teacher-forced through the target")
    seed: int = opt(0, "training seed")
    logprob_baseline: Literal["logistic", "isotonic"] = opt(
        "logistic", "the form of the per-model log-prob baseline baselines.json keeps (a step's mean token "
                    "log-probability mapped to a probability by 1-D logistic or isotonic regression, fitted on "
                    "train); the reports score both forms per row set, and read this one only for checkpoints "
                    "without per-set baselines")
    num_threads: int | None = opt(
        1, "torch CPU threads while training and scoring probes (small MLPs are fastest on one thread on a "
           "busy machine); null = leave torch's setting")
    device: str = opt("cpu", "device of probe training: cpu, cuda, ... or auto (models.device)")
    kind: Literal["mlp", "logistic"] = opt(
        "mlp", "the runtime probe (probe_target / probe_draft): the MLP above, or the L2 logistic-regression probe "
               "whose layer, pooling and penalty are chosen on validation questions; the other kind is trained "
               "too and saved beside it (probe_<role>_logistic or probe_<role>_mlp) as a comparison")
    logistic_layers: str = opt("all", "hidden-state rows the logistic probe may choose from (one row each): all = "
                                      "every row the data stored (data.layers), or rows among those")
    logistic_pooling: list[str] = opt(["mean", "last"], "token poolings the logistic probe may choose from")
    logistic_l2: list[float] = opt([1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0],
                                   "L2 strengths tried (per row: mean BCE + l2/2 ||w||^2 on standardised features)")

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "epochs", "batch_size", "patience", "num_threads"):
            check_positive(self, name)
        check_layer_option(self.logistic_layers, "probe.logistic_layers")
        if not self.logistic_pooling or any(p not in ("mean", "last") for p in self.logistic_pooling):
            raise ConfigError(f"probe.logistic_pooling must list 'mean' and/or 'last', got {self.logistic_pooling}")
        if not self.logistic_l2 or any(not float(v) > 0 for v in self.logistic_l2):
            raise ConfigError(f"probe.logistic_l2 must list strengths > 0, got {self.logistic_l2}")
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
        check_layer_option(self.features, "probe.features")
        check_device(self.device, "probe.device")


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
    judge_save_every: int = opt(
        50, "every this many judge steps, write the LoRA's weights, optimizer and RNG states to "
            "<output_dir>/checkpoint-judge-steps; the same command after a stop continues from the last (0: never)")
    judge_lr: float = opt(2e-4, "judge learning rate")
    judge_batch_size: int = opt(8, "judge batch size")
    judge_max_pairs: int = opt(4000, "most balanced training pairs for the judge")
    judge_eval_pairs: int = opt(400, "most validation pairs, and most test pairs, the judge (and its untrained "
                                     "base) is scored on")
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
            check_positive(self, name)
        if self.judge_save_every < 0:
            raise ConfigError(f"verifiers.judge_save_every must be >= 0 (0: never), got {self.judge_save_every}")
        if not 0 <= self.judge_lora_dropout < 1:
            raise ConfigError(f"verifiers.judge_lora_dropout must be in [0, 1), got {self.judge_lora_dropout}")
        if not self.judge_lr > 0:
            raise ConfigError(f"verifiers.judge_lr must be > 0, got {self.judge_lr}")
        if not self.judge_target_modules:
            raise ConfigError("verifiers.judge_target_modules must name at least one module")
        check_dtype_option(self.judge_dtype, "verifiers.judge_dtype")

    def check_available(self) -> None:
        """The models the verifiers to train load, named well (offline packages, local paths), before any loads."""
        for verifier, key in (("embedding", "embedding_model"), ("judge", "judge_base")):
            if verifier in self.train:
                check_model_option(getattr(self, key), f"verifiers.{key}")


@dataclass
class EvalConfig:
    n_boot: int = opt(1000, "bootstrap resamples (of whole questions or families) for every confidence interval")
    resample: Literal["family", "question"] = opt(
        "family", "what each bootstrap resample draws whole: the question families (templates) the data records, "
                  "since a template's questions rise and fall together and drawing them one by one narrows the "
                  "intervals (a question without a family is its own), or the questions (reports before this "
                  "setting)")
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
    logistic_sweep: bool = opt(True, "fit the logistic probe on every stored layer x pooling of every row set, with "
                                     "intervals against the set's constant, and run the positive control")
    sweep_l2: list[float] = opt([1e-3, 1e-2, 0.1, 0.3, 1.0, 3.0, 10.0],
                                "L2 strengths the logistic sweep and the positive control choose from on validation")
    verifiers: list[str] = opt(["embedding", "judge"], "pair verifiers evaluated: embedding, judge")
    max_pairs: int = opt(2000, "most held-out step pairs the pair verifiers score (subsampled)")
    judge_max_pairs: int = opt(400, "most of those pairs the judge-LoRA scores (one LM forward per pair; "
                                    "agreement with it is measured on these)")
    num_threads: int | None = opt(1, "torch CPU threads for the small probes of the layer sweep, the logistic sweep "
                                     "and the positive control (null = leave torch's setting)")

    def __post_init__(self) -> None:
        for name in ("n_boot", "n_bins", "umap_neighbors", "sweep_hidden_dim", "sweep_epochs", "sweep_max_layers",
                     "max_pairs", "judge_max_pairs", "num_threads"):
            check_positive(self, name)
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
class WandbConfig:
    enabled: bool = opt(False, "log metrics and figures to Weights & Biases")
    project: str = opt("specprobe", "wandb project")
    mode: Literal["offline", "online"] = opt("offline", "offline needs no account; sync later with `wandb sync`")
    entity: str | None = opt(None, "wandb entity (team or user); null = the account's default")
    run_name: str | None = opt(None, "wandb run name; null = the experiment name")
    tags: list[str] = opt([], "wandb run tags")
    dir: str | None = opt(None, "where wandb writes its files; null = <output_dir>/wandb")


@dataclass
class ExperimentConfig(InferenceConfig):
    """The whole experiment: the inference sections (`infer.config.InferenceConfig`: name, output_dir, models,
    source, sampling, runtime, bench, ray) and the data, training, report and tracking sections. Only the
    CLIs and `train.pipeline` hold it; library code below `train` takes sections (`data_job`, `bench_setup`)."""

    data: DataConfig = section(DataConfig, "training-data generation")
    probe: ProbeConfig = section(ProbeConfig, "semantic-probability probes")
    verifiers: VerifiersConfig = section(VerifiersConfig, "pair verifiers")
    eval: EvalConfig = section(EvalConfig, "probe-eval report")
    wandb: WandbConfig = section(WandbConfig, "experiment tracking")

    @property
    def data_dir(self) -> Path:
        return Path(self.output_dir) / "data"

    def check_before_loading(self, *, sources: bool = True, ray: bool = False, training: bool = False) -> None:
        """InferenceConfig's checks, and with `training` the verifiers' models and settings (a typo found after the
        data stage and the probes' training would cost them: the checkpoint is written at the end)."""
        from specprobe.data_gen.pipeline import loads_models  # (torch and pyarrow: not on every config load)

        # only the data stage loads the target and draft, and not for a finished folder it reuses (asked only
        # where it matters: it reads the folder's manifest and checks its shards)
        def generates() -> bool:
            return loads_models(self.data_job())

        generating = sources and generates()
        super().check_before_loading(sources=sources, ray=ray, models=generating)
        if generating:  # (and loads its judge)
            self.data.check_available()
        if training:
            self.verifiers.check_available()
            asks_last = self.probe.pooling == "last" or "mean" not in self.probe.logistic_pooling
            # data to come without "last" (a finished folder's own poolings are checked when it is read)
            no_last = "last" not in stored_poolings(self.data.store_last_token)
            if asks_last and no_last and "probes" in self.verifiers.train and generates():
                raise ConfigError(f"data.store_last_token=false stores no last-token features, but probe.pooling="
                                  f"{self.probe.pooling} and probe.logistic_pooling={self.probe.logistic_pooling} ask "
                                  "for them: set probe.pooling=mean and probe.logistic_pooling=[mean], or "
                                  "data.store_last_token=true")

    def data_job(self) -> DataJob:
        """The data stage's sections and folder (`data_gen.generate_dataset` takes this, not the whole config)."""
        return DataJob(self.data, self.source, self.models, self.sampling, self.data_dir, self.ray,
                       record=base.to_dict(self))


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The experiment config of a YAML file (or the defaults when path is None) with `key=value` overrides."""
    return base.load_yaml(ExperimentConfig, path, overrides)


def field_help(cls: type = ExperimentConfig, prefix: str = "") -> list[tuple[str, str, object]]:
    """(key, help, default) for every field of the experiment config, nested sections flattened with dots."""
    return base.field_help(cls, prefix)


def format_help(cls: type = ExperimentConfig) -> str:
    return base.format_help(cls)
