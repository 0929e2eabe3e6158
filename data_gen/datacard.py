"""Every column and tensor of a training-data folder, with its type and meaning, in one place.

The parquet schemas (`data_gen.store`) are built from these lists and the data card
(``<output_dir>/data/README.md``) is rendered from them, so the card cannot miss a column.
"""
from __future__ import annotations

import pyarrow as pa

from specprobe.probes.io import front_matter

__all__ = ["SAMPLE_COLUMNS", "CONTEXT_COLUMNS", "PAIR_COLUMNS", "TENSORS", "schema", "render_card"]

# (name, arrow type, nullable, meaning)
SAMPLE_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("sample_id", pa.string(), False, "`<context_id>/<model>/<sample_index>`, unique in the data set"),
    ("context_id", pa.string(), False, "`<question_id>@<j>`: the context this step continues"),
    ("question_id", pa.string(), False, "id of the source trace (split on this: a question's contexts stay together)"),
    ("domain", pa.string(), False, "domain of the trace (e.g. math, science)"),
    ("context_j", pa.int32(), False, "number of reference steps in the context (0 = the question alone)"),
    ("model", pa.string(), False, "who sampled the step: `target` or `draft`"),
    ("sample_index", pa.int32(), False, "k in 0..N-1 among that model's N draws for this context (empty draws are not stored, so gaps are possible)"),
    ("text", pa.string(), False, "the sampled step, including the delimiter when it stopped on one"),
    ("num_tokens", pa.int32(), False, "tokens the producing model generated (its own tokenizer, EOS included)"),
    ("stop_reason", pa.string(), False, "`delimiter`, `eos` or `length` (hit sampling.max_step_tokens)"),
    ("logprob", pa.float64(), False, "sum of the sampled tokens' log-probabilities under the producing model (untempered)"),
    ("mean_logprob", pa.float64(), False, "logprob / num_tokens"),
    ("target_logprob", pa.float64(), False, "log-probability of `text` under the target, teacher-forced after the target's prefix (text re-encoded by the target's tokenizer)"),
    ("target_num_tokens", pa.int32(), False, "tokens of `text` under the target's tokenizer"),
    ("cluster_id", pa.int32(), False, "meaning cluster among this model's samples of this context (0..K-1, in order of first appearance)"),
    ("cluster_size", pa.int32(), False, "|C_k|: this model's samples of this context in that cluster"),
    ("semantic_prob", pa.float64(), False, "|C_k| / N: SemanticSpec's definition; C_k includes this sample, so it is at least 1 / N and averages pi + (1 - pi) / N for a meaning of probability pi"),
    ("own_prob", pa.float64(), True, "(|C_k| - 1) / (N - 1): the other N - 1 samples that agree with this one (averages pi), on the scale of a draft step's prob_under_target; the label the probes learn for a model's own steps; null when N = 1"),
    ("num_samples", pa.int32(), False, "N drawn per model and context (empty draws included)"),
    ("num_empty", pa.int32(), False, "draws of this model on this context whose text was empty; not stored, they count in N as one extra meaning"),
    ("num_clusters", pa.int32(), False, "meanings among this model's N draws (the empty group counts as one when present)"),
    ("semantic_entropy", pa.float64(), False, "entropy (nats) of this model's meaning distribution |C_k| / N on this context"),
    ("target_cluster_id", pa.int32(), False, "draft rows: the target cluster this step means the same as, or -1; target rows: own cluster_id; -1 when no target samples were drawn"),
    ("prob_under_target", pa.float64(), True, "draft rows: |target cluster| / N_target (0 when unmatched), i.e. the label of the TARGET probe on this draft step; the draft step is not one of the N_target samples, so it does not count itself (a target row's semantic_prob does; its own_prob does not); target rows: own_prob (the same scale); null when the target was not sampled"),
    ("own_feature_row", pa.int64(), False, "row of this step's own-model features in this shard: target rows index `target.*`, draft rows index `draft.*`"),
    ("target_feature_row", pa.int64(), False, "row of this step's target-view features (`target.*`) in this shard, for target AND draft rows"),
]

CONTEXT_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("context_id", pa.string(), False, "`<question_id>@<j>`"),
    ("question_id", pa.string(), False, "id of the source trace"),
    ("domain", pa.string(), False, "domain of the trace"),
    ("j", pa.int32(), False, "number of reference steps given"),
    ("question", pa.string(), False, "the question"),
    ("steps", pa.list_(pa.string()), False, "the j reference steps given; each model's prefix is its `format_prefix(question, steps)`"),
    ("answer", pa.string(), False, "the trace's final answer (may be empty)"),
    ("context_text", pa.string(), False, "question and steps as plain text: the context the equivalence judge saw"),
    ("num_samples", pa.int32(), False, "N drawn per model"),
    ("target_seed", pa.int64(), True, "sampling seed of the target on this context (null when not sampled)"),
    ("target_num_clusters", pa.int32(), True, "meanings among the target's N draws"),
    ("target_semantic_entropy", pa.float64(), True, "entropy (nats) of the target's meaning distribution"),
    ("target_num_empty", pa.int32(), True, "empty target draws (not stored)"),
    ("draft_seed", pa.int64(), True, "sampling seed of the draft on this context"),
    ("draft_num_clusters", pa.int32(), True, "meanings among the draft's N draws"),
    ("draft_semantic_entropy", pa.float64(), True, "entropy (nats) of the draft's meaning distribution"),
    ("draft_num_empty", pa.int32(), True, "empty draft draws (not stored)"),
    ("draft_mass_under_target", pa.float64(), True, "mean prob_under_target of the draft's stored samples (how much of the draft's output the target would also say)"),
]

PAIR_COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("context_id", pa.string(), False, "context both steps continue"),
    ("question_id", pa.string(), False, "id of the source trace"),
    ("a_text", pa.string(), False, "first step: a cluster representative (first member of its cluster)"),
    ("b_text", pa.string(), False, "second step: a sample compared with it"),
    ("a_model", pa.string(), False, "who sampled a_text"),
    ("b_model", pa.string(), False, "who sampled b_text"),
    ("equivalent", pa.bool_(), False, "same meaning. Symmetric: each unordered pair of (normalised) texts appears once per context"),
    ("source", pa.string(), False, "`cluster` (both from one model's clustering) or `draft_vs_target` (draft sample vs target representative)"),
    ("judged", pa.bool_(), False, "true: the equivalence judge decided this pair; false: the label follows from cluster membership"),
]

TENSORS: list[tuple[str, str]] = [
    ("target.mean", "(rows, L_target, H_target) float16: the TARGET's hidden states mean-pooled over the step's tokens, for every sample row of the shard (target samples, and draft samples teacher-forced through the target); row r belongs to the sample whose `target_feature_row` is r"),
    ("target.last", "same, at the step's last token (only with data.store_last_token)"),
    ("draft.mean", "(draft rows, L_draft, H_draft) float16: the DRAFT's hidden states of its own samples, mean-pooled; indexed by `own_feature_row` of draft rows"),
    ("draft.last", "same, at the last token (only with data.store_last_token)"),
]


def schema(columns: list[tuple[str, pa.DataType, bool, str]]) -> pa.Schema:
    return pa.schema([pa.field(name, tp, nullable=nullable) for name, tp, nullable, _ in columns])


def _table(columns) -> str:
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {t}{' (nullable)' if nullable else ''} | {doc} |" for n, t, nullable, doc in columns]
    return "\n".join(lines)


def _summary(manifest: dict) -> str:
    counts = manifest.get("counts", {})
    engines = manifest.get("engines", {})
    layers = manifest.get("layers", {})
    lines = [f"- status: **{manifest.get('status')}**, created {manifest.get('created')}, "
             f"updated {manifest.get('updated')}",
             f"- N = {manifest.get('num_samples')} samples per model and context; models sampled: "
             f"{', '.join(manifest.get('models', []))}; judge: `{manifest.get('judge')}`"]
    for role, info in engines.items():
        lines.append(f"- {role}: `{info.get('model_id')}` (revision {info.get('revision')}), "
                     f"{info.get('num_layers')} layers, hidden size {info.get('hidden_size')}; "
                     f"hidden-state rows kept: {layers.get(role)} (0 = embeddings)")
    lines.append(f"- contexts: {counts.get('contexts', 0)} stored, {counts.get('skipped_contexts', 0)} skipped; "
                 f"samples: {counts.get('samples', {})}; pairs: {counts.get('pairs', 0)}; "
                 f"shards: {len(manifest.get('shards', []))} of {manifest.get('plan', {}).get('num_shards')}")
    families = manifest.get("question_families") or {}
    if families:
        lines.append(f"- question families: {len(families)} questions come from {len(set(families.values()))} "
                     "templates (manifest `question_families`); split by family (`ds.question_families()`), "
                     "or a held-out question may be a training question with new names and numbers")
    return "\n".join(lines)


USAGE = '''```python
from specprobe.data_gen.store import open_dataset

ds = open_dataset("OUTPUT_DIR/data")
samples = ds.samples.to_pandas()                 # one row per sample, no features
val = ds.question_mask(some_question_ids)        # split by question without touching features
x_q = ds.own_features("draft", mask=~val)        # draft probe inputs, rows = ds.rows("draft", ~val)
x_p = ds.target_view_features(mask=~val)         # target-view inputs of every sample row in the mask
y_p = samples["prob_under_target"][~val]         # target-probe labels (draft rows: under the target)

import datasets                                  # the tables also open without specprobe
datasets.load_dataset("OUTPUT_DIR/data", split="train")             # samples (this card's `configs`)
datasets.load_dataset("OUTPUT_DIR/data", "pairs", split="train")    # or contexts
```'''


TABLES = ("samples", "contexts", "pairs")  # parquet kinds of a shard; samples is the default Hub config


def card_metadata(manifest: dict) -> dict:
    """The Hub's YAML header: one `configs` entry per table listing exactly the manifest's complete shards
    (so `datasets.load_dataset(<data folder>)` opens the samples and never an unfinished write)."""
    files = {kind: [s["files"][kind] for s in manifest.get("shards", []) if "files" in s] for kind in TABLES}
    configs = [{"config_name": kind, "data_files": [{"split": "train", "path": files[kind]}],
                **({"default": True} if kind == "samples" else {})} for kind in TABLES if files[kind]]
    meta: dict = {"tags": ["specprobe", "speculative-decoding", "semantic-uncertainty"]}
    if configs:
        meta["configs"] = configs
    return meta


def render_card(manifest: dict) -> str:
    """The data card (markdown) of a data folder described by `manifest`, with the Hub's YAML header."""
    return front_matter(card_metadata(manifest)) + "\n" + "\n\n".join([
        "# Step-level semantic-probability training data",
        "Generated by `probe-train --stage data` (specprobe `data_gen.pipeline`). For each context "
        "(question + the first j steps of a reference trace), N one-step continuations were sampled from "
        "each model, clustered by meaning with an equivalence judge, and labelled with their semantic "
        "probability |C_k| / N (SemanticSpec). Each draft step is also labelled with its probability under "
        "the target's meaning distribution and recorded through the target (teacher forcing). Hidden "
        "states are pooled per step for the configured layers.",
        "## This folder\n\n" + _summary(manifest),
        "## Files\n\n"
        "- `manifest.json`: config, models (EngineInfo), layers kept, N, judge, package versions, counts, "
        "and the list of COMPLETE shards. Only shards listed there are part of the data set; any other "
        "file in `shards/` is an unfinished write and is ignored.\n"
        "- `shards/samples-XXXXX.parquet`: one row per stored sample (columns below).\n"
        "- `shards/features-XXXXX.safetensors`: pooled hidden states (tensors below).\n"
        "- `shards/contexts-XXXXX.parquet`: one row per context.\n"
        "- `shards/pairs-XXXXX.parquet`: step pairs with equivalence labels, for pair verifiers.\n"
        "- `judge-cache.jsonl`: the judge's decisions (reused when a run resumes).",
        "## Loading\n\n" + USAGE.replace("OUTPUT_DIR", str(manifest.get("config", {}).get("output_dir", "OUTPUT_DIR"))),
        "## samples-XXXXX.parquet\n\n" + _table(SAMPLE_COLUMNS),
        "Empty draws (text empty or whitespace, e.g. the model stopped at once) are not stored; they "
        "count in N as one extra meaning. So within a context and model, `semantic_prob == cluster_size / "
        "num_samples` and the distinct clusters' sizes plus `num_empty` sum to `num_samples`.",
        "## features-XXXXX.safetensors\n\n" + "\n".join(f"- `{k}`: {doc}" for k, doc in TENSORS)
        + "\n\nThe layer axis holds the hidden-state rows listed under `layers` in the manifest "
        "(row 0 = embedding output, row num_layers = final layer after the final norm). Values outside "
        "the float16 range are clipped.",
        "## contexts-XXXXX.parquet\n\n" + _table(CONTEXT_COLUMNS),
        "## pairs-XXXXX.parquet\n\n" + _table(PAIR_COLUMNS),
        "Pairs: every distinct sample against every cluster representative of the same model "
        "(`cluster`), and every distinct draft sample against every target representative "
        "(`draft_vs_target`). Pairs of identical (normalised) texts are left out. Use "
        "`ProbeDataset.symmetric_pairs()` for both orientations.",
    ]) + "\n"
