"""What probe-train writes into a checkpoint folder.

The layout, file names and format tags belong to `infer.checkpoint_format`, and so does reading it back:
`Checkpoint(path)` there rebuilds every part (probes, baselines, the embedding threshold, the judge's
metadata). This module decides the contents: which trained components go in, and the model card.
"""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from specprobe.data_gen.store import shards_digest
from specprobe.infer import checkpoint_format as fmt
from specprobe.infer.models import describe_source
from specprobe.inputs.config import to_dict
from specprobe.inputs.records import HUB_NAMES, SourceConfig
from specprobe.inputs.versions import package_versions, utc_now
from specprobe.probes.io import front_matter
from specprobe.train.probes_train import other_kind
from specprobe.train.tracking import format_metrics

LOGPROB_INPUTS = {"target_own": "mean_logprob", "draft_via_target": "target_logprob / target_num_tokens",
                  "draft_own": "mean_logprob", "draft_accept": "mean_logprob"}


# ----------------------------------------------------------------------------- writing
def _write_probes(folder: Path, probes) -> list[str]:
    names = []
    for name, trained in probes.probes.items():
        trained.probe.save(folder, name)
        names.append(name)
    per_role = {}
    for role, base in probes.baselines.items():
        main = probes.probes[fmt.probe_name(role)].plan
        per_role[role] = {**base.to_dict(), "trained_on": main.train_sets,
                          "logprob_input": {s: LOGPROB_INPUTS[s] for s in main.train_sets}}
    per_set = {name: {**base.to_dict(), "logprob_input": LOGPROB_INPUTS[name]}
               for name, base in probes.set_baselines.items()}
    return names + [fmt.write_baselines(folder, per_role, per_set)]


def _write_embedding(folder: Path, embedding) -> str:

    return fmt.write_embedding(folder, model=embedding.model, model_id=describe_source(embedding.model),
                               threshold=embedding.threshold,
                               fit=None if embedding.fit is None else embedding.fit.to_dict(),
                               fit_on=embedding.fitted.fit_on, fit_error=embedding.fitted.error,
                               validation=embedding.metrics.get("val"), score=embedding.score_description)


def write_checkpoint(folder: str | os.PathLike, cfg, result, manifest: dict,
                     data_folder: str | os.PathLike | None = None) -> Path:
    """Write every trained component of a `train.pipeline.TrainResult` to `folder` (replacing it)."""

    folder = Path(folder)
    data_folder = data_folder if data_folder is not None else cfg.data_dir
    with fmt.assemble(folder) as tmp:
        components: list[str] = []
        if result.probes is not None:
            components += _write_probes(tmp, result.probes)
        if result.embedding is not None:
            components.append(_write_embedding(tmp, result.embedding))
        if result.reused:  # verifiers an earlier failed run trained (train.pipeline.reusable_verifiers)
            names = [name for kind in result.reused.kinds for name in result.reused.components[kind]]
            fmt.copy_components(result.reused.folder, tmp, names)
            components += names
        if result.judge is not None:
            result.judge.save(tmp / fmt.JUDGE_DIR)
            components.append(fmt.JUDGE)
        metrics = fmt.write_metrics(tmp, result.metrics)
        fmt.write_model_card(tmp, model_card(cfg, metrics, components, manifest, format_metrics(metrics)))
        fmt.write_meta(tmp, name=cfg.name, created=utc_now(),
                       components=components,
                       # relative to the checkpoint, so a checkpoint copied with its data finds the copy
                       data={"folder": os.path.relpath(Path(data_folder).resolve(), Path(folder).resolve()),
                             "engines": manifest["engines"],
                             "layers": manifest["layers"], "created": manifest.get("created"),
                             "fingerprint": manifest.get("fingerprint"), "shards_sha256": shards_digest(manifest)},
                       config=to_dict(cfg), versions=package_versions())
    return folder


# ----------------------------------------------------------------------------- model card
CARD_TAGS = ("specprobe", "speculative-decoding", "speculative-reasoning", "verifier")


def data_source(cfg, manifest: dict) -> SourceConfig:
    """The source the data folder was made from (its manifest's config), else the config's own (`--stage train`
    on data made with another source must not name the config's)."""
    recorded = (manifest.get("config") or {}).get("source")
    if not isinstance(recorded, dict):
        return cfg.source
    known = {f.name for f in fields(SourceConfig)}
    try:
        return SourceConfig(**{k: v for k, v in recorded.items() if k in known})
    except (TypeError, ValueError):  # a manifest of an older format: the config's is the best guess
        return cfg.source


def card_metadata(cfg, components: list[str], manifest: dict) -> dict[str, Any]:
    """The Hub's YAML metadata for the model card: the models the verifiers read, the data they were
    trained on (hub names where the source is a hub data set), tags the Hub can filter on."""

    bases = [e["model_id"] for e in manifest["engines"].values()]
    tags = list(CARD_TAGS)
    if any(fmt.is_probe_component(c) for c in components):
        tags.append("semantic-probe")
    if fmt.JUDGE in components:
        bases.append(describe_source(cfg.verifiers.judge_base))
        tags += ["lora", "peft"]
    src = data_source(cfg, manifest)
    if src.kind == "reasoning_gym":
        dataset = f"reasoning_gym/{src.task}"
    elif src.path:
        dataset = Path(src.path).name  # a local file is read before any hub name
    else:  # a hub data set: its id, also for a short name or a kind's default (gsm8k, s1k)
        name = src.name or src.kind
        dataset = HUB_NAMES.get(name, name if src.name else "")
    meta = {"library_name": "specprobe", "base_model": list(dict.fromkeys(bases)), "tags": tags}
    if dataset:
        meta["datasets"] = [dataset]
    return meta


def _split_line(split: dict, rows: dict) -> str:
    """The card's line on the split: by question or by question family (a family's questions on one side)."""
    families = split.get("families") if split.get("by") == "question family" else None
    sides = []
    for side in ("train", "val", "test"):
        count = f"{len(split.get(side, []))} questions" + (f" of {len(families[side])} families" if families else "")
        samples = ", ".join(f"{m} {n}" for m, n in rows.get(side, {}).items())
        sides.append(f"{side} {count} ({samples} samples)")
    return f"- split by {'question family' if families else 'question'} (seed {split.get('seed')}): " + ", ".join(sides)


def model_card(cfg, metrics: dict, components: list[str], manifest: dict, table: str) -> str:
    eng = manifest["engines"]
    data = metrics.get("data", {})
    rows = data.get("rows", {})
    split = metrics.get("split", {})
    src = data_source(cfg, manifest)
    lines = [
        front_matter(card_metadata(cfg, components, manifest)),
        f"# specprobe checkpoint `{cfg.name}`", "",
        "Verifiers for step-level speculative reasoning (SemanticSpec probes, Lookahead-Reasoning pair verifiers),"
        " trained by `probe-train`.", "",
        "## Models", "",
        *(f"- {role}: `{e['model_id']}` (config name `{e.get('name')}`, revision {e.get('revision') or 'unknown'}, "
          f"{e['num_layers']} layers, hidden size {e['hidden_size']})" for role, e in eng.items()),
        "", "## Data", "",
        f"- folder: `{data.get('folder')}`; {data.get('num_samples_per_context')} samples per context and model, "
        f"meaning clusters by the `{data.get('judge')}` judge",
        f"- source: `{src.kind}` ({src.task if src.kind == 'reasoning_gym' else src.name or src.path})",
        _split_line(split, rows),
        *([f"- made with other data settings than this checkpoint's config (data's -> config's): "
           f"{'; '.join(data['config_differs'])}"] if data.get("config_differs") else []),
        "", "## Components", "",
        *(f"- `{c}`" for c in components),
        *_reuse_lines(metrics),
        "", "## Training", "",
        *_training_lines(cfg, components),
        "", "## Validation metrics", "", "```", table, "```", "",
        "Probe MAE, Spearman and ECE compare with the soft labels; AUROC scores 'this meaning is the majority' "
        "(label ≥ 0.5). Pair verifiers: AUROC of the score, precision / recall / acceptance at each threshold. "
        "All numbers are in `metrics.json`.", "",
        "These are validation-question numbers: the same questions chose the probes' epochs, layers and L2 penalty "
        "and the verifiers' thresholds, so they are optimistic. Held-out (test) numbers with intervals, beside the "
        "per-set constant, the log-prob and classic-probe baselines, are in the `probe-eval --checkpoint` report.", "",
        "## Limitations", "",
        "- Labels come from sampled meaning clusters: with N samples per context a probability is known only "
        "to about 1/N, and the equivalence judge's mistakes become label noise.",
        "- The probes read one specific model's hidden states: they refuse a model with another layer count "
        "or hidden size, and are meaningless for other weights of the same shape.",
        "- Trained on one data distribution (source, prompt format, sampling temperature); other domains may "
        "need new data.",
    ]
    if "offline:" in (cfg.models.target + cfg.models.draft):
        lines.append("- Offline tiny setting: one small LM plays both roles and an embedding judge replaces NLI; "
                     "numbers show the pipeline works, not what full-size models reach.")
    return "\n".join(lines) + "\n"


def _reuse_lines(metrics: dict) -> list[str]:
    """The card's lines on verifiers taken from a failed run's partial checkpoint, and on a run that failed."""
    lines, reused, failed = [], metrics.get("reused"), metrics.get("failed")
    if reused:
        what = list(reused.get("verifiers") or []) + [", ".join(f"`{n}`" for n in reused.get("probes") or [])]
        lines.append(f"- {' and '.join(w for w in what if w)}: reused as they were from a failed run's partial "
                     f"checkpoint (`{reused['from']}`, written {reused.get('created')}) on the same data with the "
                     "same settings")
    if failed:
        unfinished = "the probes it had not finished and " if failed["stage"] == "probes" else ""
        lines.append(f"- **partial**: the {failed['stage']} step failed ({failed['error']}); {unfinished}the "
                     "verifiers after it in verifiers.train are missing")
    return lines


def _training_lines(cfg, components: list[str]) -> list[str]:
    p, v = cfg.probe, cfg.verifiers
    lines = []
    if "probe_target" in components or "probe_draft" in components:
        mlp = (f"3-layer MLP, width {p.hidden_dim}, dropout {p.dropout}, loss {p.loss}, AdamW lr {p.lr} "
               f"betas {tuple(p.betas)} weight decay {p.weight_decay}, ≤ {p.epochs} epochs, early stopping "
               f"patience {p.patience}, seed {p.seed}; features `{p.features}`, combine `{p.combine}`, pooling "
               f"`{p.pooling}`")
        logistic = (f"L2 logistic regression on one hidden-state row, its row (of `{p.logistic_layers}`), pooling "
                    f"(of {', '.join(p.logistic_pooling)}) and penalty (of {', '.join(map(str, p.logistic_l2))}) "
                    "chosen on validation log-loss")
        kinds = {"mlp": mlp, "logistic": logistic}
        other = other_kind(p.kind)
        lines.append(f"- probes (probe_target / probe_draft, the ones the runtime loads): {kinds[p.kind]}; beside "
                     f"them, for comparison (`_{other}`): {kinds[other]}; target probe also on draft steps via the "
                     f"target: {p.target_with_draft}; baselines per row set: constant, log-prob (logistic and isotonic)")
    if "embedding_threshold" in components:
        lines.append(f"- embedding threshold: `{v.embedding_model}`, target precision {v.target_precision}")
    if "judge" in components:
        lines.append(f"- judge LoRA: base `{v.judge_base}`, r {v.judge_lora_r}, alpha {v.judge_lora_alpha}, "
                     f"{'all' if v.judge_lora_layers is None else f'last {v.judge_lora_layers}'} layers, "
                     f"{v.judge_steps} steps, lr {v.judge_lr}, batch {v.judge_batch_size}, ≤ {v.judge_max_pairs} "
                     "balanced pairs")
    return lines
