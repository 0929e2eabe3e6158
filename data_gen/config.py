"""The data-generation section of an experiment config (`data:`), owned by `data_gen`, and `DataJob`, the
sections the data stage reads. `train.config.ExperimentConfig` assembles the section with the others' and
hands the job down (`data_job()`); data_gen never sees the whole config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specprobe.infer.config import ModelsConfig, RayConfig, SamplingConfig, check_model_option
from specprobe.inputs.config import ConfigError, check_positive, opt, to_dict
from specprobe.inputs.records import SourceConfig
from specprobe.probes.features import parse_layer_option


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
    nli_max_length: int = opt(512, "token limit of premise + hypothesis, each 'context + step'; the context (the "
                                   "question and the steps so far) is trimmed from the left, so on long contexts "
                                   "the question's start is cut first (the semantic-uncertainty code gives the "
                                   "question alone)")
    cluster_scheme: Literal["reference", "first_match"] = opt(
        "reference", "greedy clustering: reference = semantic-uncertainty's get_semantic_ids (each new "
                     "representative is compared with every later sample, placed ones included, so a later "
                     "equivalent representative takes a sample over); first_match = each sample joins the first "
                     "cluster whose representative is equivalent (fewer judge pairs; same clusters when the "
                     "judge is transitive). Draft steps are placed among the target's clusters by the same "
                     "rule (reference: the last equivalent target representative)")
    embedding_model: str = opt("offline:minilm", "sentence embedder of the embedding judge")
    embedding_threshold: float = opt(0.8, "cosine threshold of the embedding judge (numbers must also match)")
    layers: str = opt("all", "hidden-state rows to store: all, last, range:a-b or a comma list (0 = embeddings)")
    store_last_token: bool = opt(True, "also store the last token's hidden states")
    contexts_per_shard: int = opt(8, "contexts written per shard file (the unit of resumption)")
    max_context_steps: int | None = opt(None, "keep at most this many trace steps in a context")
    max_contexts: int | None = opt(None, "use only the first this-many contexts of the plan (quick runs); "
                                         "changes the dataset, so a folder made without it is not reused")
    pilot_contexts: int = opt(8, "contexts after which the run reports the share of sampled steps cut by the token "
                                 "cap (the pilot), and stops if it is above max_capped_share")
    skip_failing_contexts: bool = opt(
        False, "an unexpected error on one context (say, out of GPU memory on one long context) skips that context, "
               "its reason kept in the manifest, instead of stopping the run (a shard whose every context fails "
               "still stops it: a lasting fault such as a lost device); off: the run stops at the first such error, "
               "naming the context (a broken setup fails at once), and the same shard fails on every resume")
    max_capped_share: float | None = opt(
        None, "stop after the pilot when more than this share of sampled steps hit sampling.max_step_tokens without "
              "the delimiter (cut steps make singleton meanings and labels the model never writes); null: report only")
    judge_pairs_per_call: int | None = opt(
        1024, "most step pairs per equivalence-judge call; in one process decisions are saved after each call, so "
              "this bounds the judge work a killed run loses (on Ray a replica's decisions come back with its "
              "finished shard); null = one call per clustering round")

    def __post_init__(self) -> None:
        for name in ("contexts_per_trace", "num_samples", "nli_batch_size", "contexts_per_shard",
                     "max_contexts", "judge_pairs_per_call", "pilot_contexts"):
            check_positive(self, name)
        if self.max_capped_share is not None and not 0 <= self.max_capped_share <= 1:
            raise ConfigError(f"data.max_capped_share must be in [0, 1] or null, got {self.max_capped_share}")
        if self.max_context_steps is not None and self.max_context_steps < 0:
            raise ConfigError(f"data.max_context_steps must be >= 0, got {self.max_context_steps}")
        bad = [m for m in self.models if m not in ("target", "draft")]
        if bad or not self.models or len(set(self.models)) != len(self.models):
            raise ConfigError(f"data.models must be a non-empty subset of [target, draft] without repeats, "
                              f"got {self.models}")
        check_layer_option(self.layers, "data.layers")

    def check_available(self) -> None:
        """Before the data stage loads anything (not at config load: the train stage does not read it): the
        configured judge's model is named well (a local path exists)."""
        key = "nli_model" if self.judge == "nli" else "embedding_model"
        check_model_option(getattr(self, key), f"data.{key}")


@dataclass
class DataJob:
    """What the data stage reads: the four sections that decide the data, the folder it writes, the Ray
    section (for ``generate_dataset_on_ray``) and the config its manifest records. The experiment config
    hands it down (``ExperimentConfig.data_job()``); a notebook can build one from the sections."""

    data: DataConfig
    source: SourceConfig
    models: ModelsConfig
    sampling: SamplingConfig
    folder: Path
    ray: RayConfig = field(default_factory=RayConfig)
    record: dict | None = None  # the whole experiment config as a dict; None: these sections

    def config_record(self) -> dict:
        """The config the manifest keeps (its sections decide reuse: `data_gen.store.fingerprint`)."""
        if self.record is not None:
            return self.record
        return {"output_dir": str(Path(self.folder).parent), **to_dict(self, ("models", "source", "sampling", "data"))}


def check_layer_option(option: str, key: str) -> None:
    try:
        parse_layer_option(option)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None


def stored_poolings(store_last_token: bool) -> tuple[str, ...]:
    """The token poolings whose features a data folder holds: the step's mean, and its last token only with
    data.store_last_token."""
    return ("mean", "last") if store_last_token else ("mean",)
