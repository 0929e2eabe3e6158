"""Training-data generation: contexts -> samples -> meaning clusters -> labels -> hidden states -> shards.

``generate_dataset(job)`` is the whole data stage (``probe-train --stage data`` calls it with
``ExperimentConfig.data_job()``; a notebook can build a `DataJob` from the sections itself and pass its own
traces, engines or judge). Work goes shard by shard (``data.contexts_per_shard``
contexts each); within a shard:

1. per context and model: N one-step samples from ``engine.generate`` with a seed derived from
   (sampling.seed, context id, role), the engine's prefix cache cleared first, so a context's samples
   and features never depend on what ran before it (resumed, sharded and single runs agree);
2. per context: hidden states with ONE ``score`` call per model while the prefix's KV cache is still
   warm from sampling: the target scores its own samples and the draft's (teacher forcing), the
   draft scores its own;
3. per shard: ``cluster_many`` per model over all the shard's contexts (lockstep rounds: one judge call
   per round for the whole shard), then ``assign_many`` of draft samples to target clusters;
4. labels, pairs and features are written as one shard (atomically), then the manifest is updated.

A killed run is resumed by running the same command: complete shards are kept, the rest redone; the
judge's decisions are cached in the folder, so redone clustering costs no model calls.

Who processes the shards is a `ShardWorkers` (this process by default; ``data_gen.distributed`` spreads
them over Ray replicas); whoever does, only the process that called `generate_dataset` writes them.
"""
from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specprobe.data_gen.cluster import DRAFT_ASSIGNMENT, Clustering, PairQuery, assign_many, cluster_many
from specprobe.data_gen.config import DataJob, stored_poolings
from specprobe.data_gen.contexts import (
    Context,
    DataWarning,
    build_contexts,
    coerce_traces,
    context_seed,
    part_shards,
    plan_shards,
    question_families,
)
from specprobe.data_gen.judges import CachedJudge, EquivalenceJudge, make_judge
from specprobe.data_gen.labels import (
    ModelLabels,
    build_pairs,
    draft_under_target,
    is_empty_step,
    model_labels,
    pair_key,
)
from specprobe.data_gen.sources import load_traces
from specprobe.data_gen.store import (
    FAMILIES,
    FORMAT,
    JUDGE_CACHE,
    DataFolderError,
    FolderLock,
    ShardData,
    check_same_assignment,
    check_same_data,
    check_same_judge,
    check_some_contexts,
    clean_temporaries,
    file_digests,
    fingerprint,
    open_dataset,
    part_dir,
    plan_changes,
    read_manifest,
    remember_verified,
    remove_unlisted_shards,
    summarize_shards,
    verify_shards,
    write_card,
    write_manifest,
    write_shard,
)
from specprobe.infer.engines import Prefix, PromptTooLongError, StepRequest, build_engine_pair, sampling_params
from specprobe.inputs.progress import progress_line
from specprobe.inputs.versions import package_versions, utc_now
from specprobe.probes.features import layers_from_option

__all__ = ["generate_dataset", "DataResult", "DataGenStats", "layer_rows", "build_judge", "load_source_traces",
           "engine_info", "process_shard", "ShardWorkers"]

ROLES = ("target", "draft")


# ----------------------------------------------------------------------------- small helpers
def layer_rows(option: str, num_layers: int) -> list[int]:
    """Hidden-state rows (0 = embeddings, num_layers = last layer) kept for data.layers."""
    try:
        return layers_from_option(str(option), num_layers)
    except ValueError as err:
        raise ValueError(f"data.layers: {err}") from None


def build_judge(data_cfg, cache_path: str | Path | None, device: str | None = None) -> CachedJudge:
    """The configured equivalence judge wrapped in a (persistent) CachedJudge. An NLI model without an
    entailment label fails here, before any sampling."""
    if data_cfg.judge == "nli":
        inner = make_judge("nli", model=data_cfg.nli_model, strict=data_cfg.nli_strict,
                           batch_size=data_cfg.nli_batch_size, max_length=data_cfg.nli_max_length, device=device)
    else:
        inner = make_judge("embedding", embedder=data_cfg.embedding_model,
                           threshold=data_cfg.embedding_threshold, device=device)
    return CachedJudge(inner, cache_path)


def load_source_traces(source_cfg) -> list:
    """Traces of the configured source (bad records are skipped by data_gen.sources with a warning)."""

    name = source_cfg.task if source_cfg.kind == "reasoning_gym" else source_cfg.name
    return load_traces(source_cfg.kind, path=source_cfg.path, name=name, split=source_cfg.split,
                       limit=source_cfg.limit, seed=source_cfg.seed, size=source_cfg.size,
                       step_mode=source_cfg.step_mode, delimiter=source_cfg.delimiter,
                       trajectory=source_cfg.trajectory, domains=source_cfg.domains,
                       fields=source_cfg.fields, max_step_chars=source_cfg.max_step_chars,
                       strip_calculator=source_cfg.strip_calculator)


def engine_info(engine) -> dict:
    """What the manifest records of an engine (and what a resumed run must match)."""
    info = engine.info
    return {"model_id": info.model_id, "revision": info.revision, "num_layers": info.num_layers,
            "hidden_size": info.hidden_size, "vocab_size": info.vocab_size, "name": info.extra.get("name")}


log = logging.getLogger(__name__)


def _warn(message: str) -> None:
    warnings.warn(message, DataWarning, stacklevel=3)


class _RecordingJudge:
    """Passes pairs to the cached judge and remembers each decision (for the pairs table) and how many
    pairs each phase asked for."""

    def __init__(self, inner: EquivalenceJudge):
        self.inner = inner
        self.name = inner.name
        self.decisions: dict[tuple[str, str, str], bool] = {}
        self.pairs_asked = 0

    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        items = list(items)
        got = self.inner.judge(items)
        self.pairs_asked += len(items)
        for q, d in zip(items, got):
            self.decisions.setdefault(pair_key(q.context, q.a, q.b), bool(d))
        return got


# ----------------------------------------------------------------------------- results
@dataclass
class DataGenStats:
    """What this call did (a resumed run counts only its own work)."""

    contexts: int = 0
    skipped: int = 0
    shards: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"sampling": 0.0, "recording": 0.0,
                                                               "clustering": 0.0, "writing": 0.0})
    recording_passes: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    recording_calls: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    prefix_reused: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ROLES})
    wall_seconds: float = 0.0

    def add(self, other: dict) -> None:
        for key in ("seconds", "recording_passes", "recording_calls", "prefix_reused"):
            for name, value in other.get(key, {}).items():
                getattr(self, key)[name] = getattr(self, key).get(name, 0) + value


@dataclass
class DataResult:
    data_dir: Path
    manifest: dict
    reused: bool
    run: DataGenStats

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete"

    def dataset(self):
        return open_dataset(self.data_dir, allow_incomplete=not self.complete)

    def summary(self) -> str:
        return format_summary(self.manifest, self.run, self.reused, self.data_dir)


def format_summary(manifest: dict, run: DataGenStats, reused: bool, folder: Path) -> str:
    c = manifest["counts"]
    n = manifest["num_samples"]
    plan = manifest["plan"]
    lines = [f"data: {folder} ({manifest['status']}{', reused' if reused else ''}): {c['contexts']} contexts "
             f"({c['skipped_contexts']} skipped) in {c['shards']} of {plan['num_shards']} shards"]
    samples = c["samples"]
    lines.append("samples: " + ", ".join(f"{m} {samples.get(m, 0)}" for m in manifest["models"])
                 + f" (N = {n} per context and model; empty draws are not stored)")
    contexts = max(1, c["contexts"])
    lines.append("mean clusters per context: " + ", ".join(
        f"{m} {c['sum_num_clusters'].get(m, 0) / contexts:.2f}" for m in manifest["models"]))
    lines.append("mean semantic probability: " + ", ".join(
        f"{m} {c['sum_semantic_prob'].get(m, 0) / max(1, samples.get(m, 0)):.3f}" for m in manifest["models"]))
    j = c["judge"]
    all_pairs = j.get("all_pairs", 0)
    lines.append(f"judge ({manifest['judge']}): {j.get('cluster_pairs', 0)} pairs asked by clustering + "
                 f"{j.get('assign_pairs', 0)} by draft-vs-target assignment; {j.get('model_calls', 0)} reached "
                 f"the model; all pairs N(N-1)/2 = {all_pairs} (N(N-1) = {2 * all_pairs} directed NLI calls)")
    if run.contexts:
        total = sum(run.seconds.values()) or 1.0
        shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in run.seconds.items())
        rate = 60 * run.contexts / max(run.wall_seconds, 1e-9)
        lines.append(f"this run: {run.contexts} contexts in {run.wall_seconds:.0f}s ({rate:.1f} contexts/min); "
                     f"time: {shares}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- one context
@dataclass
class _ContextWork:
    context: Context
    seeds: dict[str, int]
    steps: dict[str, list] = field(default_factory=dict)  # kept (non-empty) Steps per sampled model
    indices: dict[str, list[int]] = field(default_factory=dict)  # their draw index k
    under_target: dict[str, list] = field(default_factory=dict)  # per sampled model: its ScoredSteps via the target
    own_draft: list = field(default_factory=list)  # ScoredSteps of kept draft samples through the draft

    def texts(self, role: str) -> list[str]:
        return [s.text for s in self.steps.get(role, [])]


class _FeatureRows:
    """A shard's feature tensors as they are filled: `add` returns the row a sample's features went to,
    which its sample row records (`target_feature_row`, `own_feature_row`)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, list]] = {r: {"mean": [], "last": []} for r in ROLES}

    def add(self, model: str, scored) -> int:
        """Store one ScoredStep's pooled hidden states as read by `model`; its row index."""
        rows = self.rows[model]
        rows["mean"].append(scored.mean_hidden)
        rows["last"].append(scored.last_hidden)
        return len(rows["mean"]) - 1


class _ShardRunner:
    """Processes the contexts of one shard with fixed engines, judge and settings."""

    def __init__(self, job: DataJob, engines: dict[str, Any], judge: EquivalenceJudge, layers: dict[str, list[int]]):
        self.job = job
        self.engines = engines
        self.judge = judge
        self.layers = layers
        self.models = [r for r in ROLES if r in job.data.models]  # target first: the row order
        self.n = job.data.num_samples
        self.delimiter = job.source.delimiter

    # -- sampling and recording
    def _prefix(self, ctx: Context):

        return Prefix(ctx.question, tuple(ctx.steps), self.delimiter)  # reference steps: delimiter after each

    def sample(self, ctx: Context, timing: dict) -> _ContextWork | str:
        """The context's samples, or the reason it must be skipped."""

        work = _ContextWork(ctx, {r: context_seed(self.job.sampling.seed, ctx.id, r) for r in self.models})
        for engine in {id(e): e for e in self.engines.values()}.values():
            if hasattr(engine, "clear_prefix_cache"):
                engine.clear_prefix_cache()  # a context's results must not depend on the one before it
        start = time.perf_counter()
        try:
            for role in self.models:
                params = sampling_params(self.job.sampling, role, self.delimiter, work.seeds[role])
                drawn = self.engines[role].generate([StepRequest(self._prefix(ctx), self.n)], params).steps[0]
                kept = [(k, s) for k, s in enumerate(drawn) if not is_empty_step(s.text)]
                work.steps[role] = [s for _, s in kept]
                work.indices[role] = [k for k, _ in kept]
                if len(drawn) != self.n:
                    return f"the {role} engine returned {len(drawn)} samples instead of {self.n}"
                if not kept:
                    return f"all {self.n} {role} samples are empty"
        except PromptTooLongError as err:
            return f"prompt too long: {err}"
        except Exception as err:
            if self.job.data.skip_failing_contexts:
                return _skip_reason(err, "sampling")
            _name_context(err, ctx, "sampling")
            raise
        finally:
            timing["sampling"] += time.perf_counter() - start
        return work

    def record(self, work: _ContextWork, timing: dict) -> str | None:
        """Hidden states: one score call per model (target: own samples + draft samples); or the reason the
        context must be skipped (a step re-encoded by the target may not fit where it was sampled)."""
        start = time.perf_counter()
        texts = {role: work.texts(role) for role in self.models}
        try:
            scored = self._score("target", work.context, [t for role in self.models for t in texts[role]], timing)
            for role in self.models:  # hand each model's samples their part of the one call
                work.under_target[role], scored = scored[:len(texts[role])], scored[len(texts[role]):]
            if "draft" in self.models:
                work.own_draft = self._score("draft", work.context, work.texts("draft"), timing)
        except PromptTooLongError as err:
            return f"prompt and step too long to score: {err}"
        except Exception as err:
            if self.job.data.skip_failing_contexts:
                return _skip_reason(err, "recording hidden states")
            _name_context(err, work.context, "recording hidden states")
            raise
        finally:
            timing["recording"] = timing.get("recording", 0.0) + time.perf_counter() - start
        return None

    def _score(self, role: str, ctx: Context, texts: list[str], timing: dict) -> list:
        out = self.engines[role].score(self._prefix(ctx), texts, hidden=True, layers=self.layers[role])
        scored = out.steps
        timing["recording_passes"][role] += out.stats.forward_passes
        timing["recording_calls"][role] += 1
        timing["prefix_reused"][role] += int(out.stats.reused_prefix_tokens > 0)
        if len(scored) != len(texts):
            raise RuntimeError(f"{role} engine scored {len(scored)} of {len(texts)} steps of context {ctx.id}")
        return scored

    # -- clustering
    def cluster(self, works: list[_ContextWork], recorder: _RecordingJudge, timing: dict) -> tuple[dict, list, dict]:
        """Per model the clusterings of every context, the draft->target matches, and judge counts."""
        start = time.perf_counter()
        calls_before = self.judge.model_calls
        per_call = self.job.data.judge_pairs_per_call
        contexts = [w.context.text for w in works]
        clusterings: dict[str, list[Clustering]] = {}
        for role in self.models:
            clusterings[role] = cluster_many(contexts, [w.texts(role) for w in works], recorder, per_call,
                                             scheme=self.job.data.cluster_scheme)
        cluster_pairs = recorder.pairs_asked
        matches: list = [None] * len(works)
        if "target" in self.models and "draft" in self.models:
            matches = assign_many(contexts, [w.texts("draft") for w in works], [w.texts("target") for w in works],
                                  [c.cluster_ids for c in clusterings["target"]], recorder, per_call,
                                  scheme=self.job.data.cluster_scheme)
        timing["clustering"] += time.perf_counter() - start
        counts = {"cluster_pairs": cluster_pairs, "assign_pairs": recorder.pairs_asked - cluster_pairs,
                  "model_calls": self.judge.model_calls - calls_before,
                  "all_pairs": len(works) * len(self.models) * self.n * (self.n - 1) // 2}
        return clusterings, matches, counts

    # -- rows
    def rows(self, works: list[_ContextWork], clusterings: dict, matches: list, recorder: _RecordingJudge,
             shard: ShardData, stats: dict) -> None:
        feats = _FeatureRows()
        for i, work in enumerate(works):
            ctx = work.context
            labels = {r: model_labels(clusterings[r][i].cluster_ids, self.n) for r in self.models}
            under = self._under_target(work, labels, matches[i])
            for role in self.models:
                self._model_rows(work, role, labels[role], under, shard, feats, stats)
            shard.contexts.append(self._context_row(work, labels, under))
            texts = {r: work.texts(r) for r in self.models}
            pairs, conflicts = build_pairs(ctx.text, texts, labels, matches[i], recorder.decisions)
            stats["judge"]["pairs_conflicting"] = stats["judge"].get("pairs_conflicting", 0) + conflicts
            shard.pairs += [dict(context_id=ctx.id, question_id=ctx.question_id, **p) for p in pairs]
        shard.features = self._features(feats)

    def _under_target(self, work: _ContextWork, labels: dict[str, ModelLabels], matches) -> dict:
        if "target" not in labels:
            return {"draft_ids": [-1] * len(work.steps["draft"]), "draft_probs": [None] * len(work.steps["draft"])}
        if "draft" not in labels:
            return {"draft_ids": [], "draft_probs": []}
        ids, probs = draft_under_target(matches, labels["target"])
        return {"draft_ids": ids, "draft_probs": probs}

    def _model_rows(self, work: _ContextWork, role: str, lab: ModelLabels, under: dict, shard: ShardData,
                    feats: _FeatureRows, stats: dict) -> None:
        ctx = work.context
        probs, own = lab.semantic_probs, lab.own_probs
        entropy = lab.semantic_entropy
        for n, step in enumerate(work.steps[role]):
            target_view = work.under_target[role][n]
            target_row = feats.add("target", target_view)
            own_row = feats.add("draft", work.own_draft[n]) if role == "draft" else target_row
            cid = lab.cluster_ids[n]
            k = work.indices[role][n]
            shard.samples.append(dict(
                sample_id=f"{ctx.id}/{role}/{k}", context_id=ctx.id, question_id=ctx.question_id,
                domain=ctx.domain, context_j=ctx.j, model=role, sample_index=k, text=step.text,
                num_tokens=step.num_tokens, stop_reason=step.stop_reason, logprob=float(step.logprob),
                mean_logprob=float(step.logprob) / max(1, step.num_tokens),
                target_logprob=float(target_view.logprob), target_num_tokens=target_view.num_tokens,
                cluster_id=cid, cluster_size=lab.cluster_sizes[cid], semantic_prob=probs[n], own_prob=own[n],
                num_samples=self.n, num_empty=lab.num_empty, num_clusters=lab.num_clusters,
                semantic_entropy=entropy,
                target_cluster_id=cid if role == "target" else under["draft_ids"][n],
                prob_under_target=own[n] if role == "target" else under["draft_probs"][n],
                own_feature_row=own_row, target_feature_row=target_row))
        stats["samples"][role] = stats["samples"].get(role, 0) + len(work.steps[role])
        capped = sum(1 for s in work.steps[role] if s.stop_reason == "length")
        stats.setdefault("capped", {})[role] = stats.get("capped", {}).get(role, 0) + capped
        stats["sum_semantic_prob"][role] = stats["sum_semantic_prob"].get(role, 0.0) + float(sum(probs))
        stats["sum_num_clusters"][role] = stats["sum_num_clusters"].get(role, 0) + lab.num_clusters

    def _context_row(self, work: _ContextWork, labels: dict[str, ModelLabels], under: dict) -> dict:
        ctx = work.context
        row = dict(context_id=ctx.id, question_id=ctx.question_id, domain=ctx.domain, j=ctx.j,
                   question=ctx.question, steps=list(ctx.steps), answer=ctx.answer, context_text=ctx.text,
                   num_samples=self.n, draft_mass_under_target=None)
        for role in ROLES:
            lab = labels.get(role)
            row[f"{role}_seed"] = work.seeds.get(role)
            row[f"{role}_num_clusters"] = lab.num_clusters if lab else None
            row[f"{role}_semantic_entropy"] = lab.semantic_entropy if lab else None
            row[f"{role}_num_empty"] = lab.num_empty if lab else None
        probs = [p for p in under["draft_probs"] if p is not None]
        if "draft" in labels and "target" in labels and probs:
            row["draft_mass_under_target"] = sum(probs) / len(probs)
        return row

    def _features(self, feats: _FeatureRows) -> dict[str, torch.Tensor]:
        def stack(role: str, pooling: str) -> torch.Tensor:
            rows = feats.rows[role][pooling]
            if rows:
                return torch.stack(rows)
            hidden = self.engines[role].info.hidden_size
            return torch.zeros((0, len(self.layers[role]), hidden))

        return {f"{role}.{pooling}": stack(role, pooling)
                for pooling in stored_poolings(self.job.data.store_last_token) for role in ROLES}

    # -- the shard
    def run(self, index: int, contexts: list[Context], on_context: Callable[[], None]) -> tuple[ShardData, dict]:
        timing = {"sampling": 0.0, "recording": 0.0, "clustering": 0.0,
                  "recording_passes": {r: 0 for r in ROLES}, "recording_calls": {r: 0 for r in ROLES},
                  "prefix_reused": {r: 0 for r in ROLES}}
        works, skipped = [], []
        for ctx in contexts:
            work = self.sample(ctx, timing)
            problem = work if isinstance(work, str) else self.record(work, timing)
            if problem is not None:
                _warn(f"context {ctx.id!r} (trace {ctx.question_id!r}, j={ctx.j}) skipped: {problem}")
                skipped.append({"context_id": ctx.id, "reason": problem})
            else:
                works.append(work)
            on_context()
        failed = [x for x in skipped if x["reason"].endswith(SKIPPED_FOR_ERROR)]
        if failed and len(failed) == len(contexts):
            # a lasting fault (a lost device) would otherwise commit every later shard as complete and empty
            raise DataFolderError(f"every context of shard {index} failed ({len(failed)}; first: {failed[0]['reason']})"
                                  ": stopping rather than skip the rest of the data. The finished shards are kept; "
                                  "fix the cause and run the same command again")
        recorder = _RecordingJudge(self.judge)
        clusterings, matches, judge_counts = (self.cluster(works, recorder, timing) if works
                                              else ({r: [] for r in self.models}, [], {}))
        shard = ShardData(index)
        stats = {"samples": {}, "sum_semantic_prob": {}, "sum_num_clusters": {}, "judge": dict(judge_counts),
                 "capped": {}}
        self.rows(works, clusterings, matches, recorder, shard, stats)
        entry = {"index": index, "contexts": [w.context.id for w in works], "skipped": skipped,
                 "rows": len(shard.samples), "target_feature_rows": len(shard.samples),
                 "draft_feature_rows": sum(len(w.own_draft) for w in works), "pairs": len(shard.pairs),
                 "stats": stats, "timing": {"seconds": {k: timing[k] for k in ("sampling", "recording", "clustering")},
                                            **{k: timing[k] for k in ("recording_passes", "recording_calls",
                                                                      "prefix_reused")}}}
        return shard, entry


def process_shard(job: DataJob, engines: dict[str, Any], judge: EquivalenceJudge, index: int, contexts: list[Context],
                  on_context: Callable[[], None] | None = None) -> tuple[ShardData, dict]:
    """The rows of shard `index` from its contexts, written by nobody: the caller writes the shard and
    its manifest entry. engines: {"target": ..., "draft": ...}. A context's rows depend only on the
    context and the config (its seeds and a cleared prefix cache), so any process can run any shard."""
    layers = {r: layer_rows(job.data.layers, e.info.num_layers) for r, e in engines.items()}
    return _ShardRunner(job, engines, judge, layers).run(index, contexts, on_context or (lambda: None))


class ShardWorkers:
    """Who processes the shards of a run for `generate_dataset`, whose process alone writes them.

    ``start(judge_cache)`` loads what is needed and returns ``{"engines": {role: engine_info},
    "judge": judge name}``; ``run(todo, on_context)`` yields ``(ShardData, manifest entry)`` for each
    ``(index, contexts)`` of `todo`, in any order, calling ``on_context()`` once per context done.
    This class runs them one by one in this process; ``data_gen.distributed`` spreads them over Ray.
    """

    def __init__(self, job: DataJob, engines: tuple | None, judge: EquivalenceJudge):
        self.job = job
        self.engines = engines
        self.judge = judge

    def start(self, judge_cache: Path) -> dict:
        if self.engines is None:
            self.engines = build_engine_pair(self.job.models)
        self.engine_map = dict(zip(ROLES, self.engines))
        return {"engines": {r: engine_info(e) for r, e in self.engine_map.items()}, "judge": self.judge.name}

    def run(self, todo: list[tuple[int, list[Context]]], on_context: Callable[[], None]):
        for index, contexts in todo:
            yield process_shard(self.job, self.engine_map, self.judge, index, contexts, on_context)


# ----------------------------------------------------------------------------- the stage
def _name_context(err: Exception, ctx: Context, what: str) -> None:
    """Add to an unexpected error which context it came from (its shard's finished contexts are redone on the
    next run; the judge's decisions so far are kept in its cache)."""
    if hasattr(err, "add_note"):  # Python >= 3.11; the CLIs print notes
        err.add_note(f"while {what} for context {ctx.id} (question {ctx.question_id}); if it fails there on every "
                     "run, data.skip_failing_contexts=true skips it")


SKIPPED_FOR_ERROR = "(data.skip_failing_contexts)"  # the end of a skip reason that stands for an error


def _skip_reason(err: Exception, what: str) -> str:
    """A context skipped for an unexpected error (data.skip_failing_contexts): the error, where, and why skipped."""
    _free_device_memory()
    return f"{type(err).__name__} while {what}: {err} {SKIPPED_FOR_ERROR}"


def _free_device_memory() -> None:
    """After an out-of-memory error the allocator holds the failed step's blocks; give them back before the next
    context."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _new_manifest(cfg_dict: dict, job: DataJob, engines: dict[str, dict], layers: dict, judge_name: str, plan: dict,
                  part: tuple[int, int] | None, my_shards: list[int]) -> dict:
    return {"format": FORMAT, "status": "in_progress", "created": utc_now(), "updated": utc_now(), "completed": None,
            "config": cfg_dict, "fingerprint": fingerprint(cfg_dict),
            "engines": engines, "layers": layers,
            "layers_option": job.data.layers, "store_last_token": job.data.store_last_token,
            "feature_dtype": "float16", "num_samples": job.data.num_samples, "models": list(job.data.models),
            "judge": judge_name, "draft_assignment": DRAFT_ASSIGNMENT[job.data.cluster_scheme],
            "versions": package_versions(), "plan": plan,
            "part": None if part is None else {"index": part[0], "count": part[1], "shards": my_shards},
            "shards": []}


def _check_engines(folder: Path, manifest: dict, engines: dict[str, dict]) -> None:
    for role, new in engines.items():
        old = manifest["engines"][role]
        keys = ("model_id", "num_layers", "hidden_size", "vocab_size")
        if old.get("revision") and new.get("revision") and old["revision"] != new["revision"]:
            raise DataFolderError(f"{folder} was made with {role} {old['model_id']} at revision {old['revision']}, but "
                                  f"the loaded one is at revision {new['revision']}: its shards would mix two sets "
                                  f"of weights. Pin the revision ({old['model_id']}@{old['revision']}) or use "
                                  "another output_dir")
        if any(old[k] != new[k] for k in keys):
            raise DataFolderError(f"{folder} was made with {role} {old['model_id']} ({old['num_layers']} layers, "
                                  f"hidden {old['hidden_size']}), but the loaded {role} is {new['model_id']} "
                                  f"({new['num_layers']} layers, hidden {new['hidden_size']}); use another output_dir")


def _planned_contexts(job: DataJob, traces: Sequence | None) -> tuple[list[Context], dict[str, str]]:
    """The contexts to generate (from `traces`, else the configured source) and their questions' families."""
    usable = coerce_traces(load_source_traces(job.source) if traces is None else traces)
    contexts = build_contexts(usable, job.data.contexts_per_trace, job.data.context_positions,
                              job.data.max_context_steps)
    if job.data.max_contexts is not None:
        contexts = contexts[: job.data.max_contexts]
    if not contexts:
        raise DataFolderError("no contexts to generate: the source gave no usable trace "
                              f"(source.kind={job.source.kind!r}); see the warnings above")
    return contexts, question_families(usable, {c.question_id for c in contexts})


def _check_resumable(folder: Path, manifest: dict, cfg_dict: dict, engine_infos: dict, judge_name: str,
                     plan: dict) -> None:
    """A started folder continues only with the same settings, models and contexts; broken shards are dropped."""
    check_same_data(folder, manifest, cfg_dict)
    _check_engines(folder, manifest, engine_infos)
    check_same_judge(folder, manifest, judge_name)
    check_same_assignment(folder, manifest, DRAFT_ASSIGNMENT[cfg_dict["data"]["cluster_scheme"]])
    changed = plan_changes(manifest["plan"], plan)
    if changed:
        raise DataFolderError(f"{folder}: the context plan changed since this folder was started ({', '.join(changed)} "
                              "differ); the source data differ. Use another output_dir.")
    _drop_broken_shards(folder, manifest)


def _plan(contexts: list[Context], per_shard: int) -> tuple[list[list[Context]], dict]:
    import hashlib

    shards = plan_shards(contexts, per_shard)
    ids_hash = hashlib.sha256("\n".join(c.id for c in contexts).encode("utf-8")).hexdigest()
    # the texts too: a source record edited under the same id would otherwise mix old and new contexts
    texts = hashlib.sha256()
    for c in contexts:
        texts.update(c.text.encode("utf-8", errors="surrogatepass") + b"\0")
    return shards, {"num_contexts": len(contexts), "num_shards": len(shards), "contexts_per_shard": per_shard,
                    "context_ids_sha256": ids_hash, "context_texts_sha256": texts.hexdigest()}


def _reuse(folder: Path, cfg_dict: dict, judge_name: str | None) -> DataResult | None:
    """The folder's data when it is complete and made with these settings (and `judge_name`'s judge, when a judge
    object was passed in: a configured judge's settings are in `cfg_dict`); None when there is work to do. Raises
    for a folder that cannot be used (other settings, every context skipped)."""
    manifest = read_manifest(folder)
    if manifest is None or _nothing_finished(manifest):
        return None  # (nothing finished: the run starts over with these settings)
    check_same_data(folder, manifest, cfg_dict)
    if judge_name is not None:
        check_same_judge(folder, manifest, judge_name)
    if manifest["status"] == "complete" and not verify_shards(folder, manifest):
        if manifest.get("part") is None:  # an empty data set is an error on every call, not once
            check_some_contexts(folder, manifest)
        return DataResult(folder, manifest, True, DataGenStats())
    return None  # unfinished, or a shard broke since: generate_dataset redoes what is missing


def loads_models(job: DataJob) -> bool:
    """Whether `generate_dataset(job)` would load the language models and the judge: not for a folder it reuses as
    it is, nor for one it refuses before loading anything (made with other settings, a broken manifest: its error
    says what to do)."""
    try:
        return _reuse(Path(job.folder), job.config_record(), None) is None
    except Exception:  # noqa: BLE001 (generate_dataset raises the same error first)
        return False


def _nothing_finished(manifest: dict) -> bool:
    """An unfinished folder without one finished shard (a part with no shard of the plan is complete and empty)."""
    return not manifest["shards"] and manifest["status"] != "complete"


def _drop_broken_shards(folder: Path, manifest: dict) -> None:
    """Take shards whose files are missing, truncated or changed out of the manifest (they are redone)."""
    bad = verify_shards(folder, manifest)
    if not bad:
        return
    for k, why in sorted(bad.items()):
        _warn(f"shard {k} will be generated again: {why}")
    manifest["shards"] = [s for s in manifest["shards"] if s["index"] not in bad]
    manifest["status"], manifest["completed"] = "in_progress", None
    write_manifest(folder, manifest)


def _check_no_orphan_shards(folder: Path) -> None:
    """Shard files without a manifest: generating here would overwrite them silently."""
    orphans = sorted((folder / "shards").glob("*.parquet")) + sorted((folder / "shards").glob("*.safetensors"))
    if orphans:
        raise DataFolderError(
            f"{folder} holds {len(orphans)} shard files (e.g. {orphans[0].name}) but no manifest.json, so nothing "
            "says which settings made them or whether they are whole. Restore manifest.json to resume, or move the "
            "folder away (or delete it) to generate the data again; nothing was overwritten")


def generate_dataset(job: DataJob, *, traces: Sequence | None = None, engines: tuple | None = None,
                     judge: EquivalenceJudge | None = None, part: tuple[int, int] | None = None,
                     progress: bool = True, workers: ShardWorkers | None = None) -> DataResult:
    """Generate (or resume, or reuse) the training data of `job` in ``job.folder``.

    traces: Trace objects or dicts instead of the configured source (malformed ones are skipped with
    a warning). engines: a preloaded (target, draft) pair. judge: an equivalence judge instead of the
    configured one (it is wrapped in a CachedJudge persisted in the folder). part: (i, n) to process
    every n-th shard from i into ``data/part-i-of-n`` (join with `data_gen.store.merge_parts`).
    A complete folder made with the same settings is reused as is; one made with other models or
    settings is a DataMismatchError. workers: who processes the shards (default: this process, with
    `engines` and `judge`; ``data_gen.distributed`` passes Ray actors); this process writes them.
    """

    started = time.perf_counter()
    cfg_dict = job.config_record()
    root = Path(job.folder)
    folder = root if part is None else part_dir(root, *part)
    # a part run has nothing to do once the joined folder is complete
    judge_name = None if judge is None else judge.name
    reused = _reuse(folder, cfg_dict, judge_name) or (_reuse(root, cfg_dict, judge_name) if part is not None else None)
    if reused is not None:
        if judge_name is None and reused.manifest.get("judge_passed"):
            # the configured judge is not built to reuse a folder, so it cannot be compared: say whose clusters
            _warn(f"reusing {reused.data_dir}, clustered by the judge {reused.manifest.get('judge')!r} that was passed "
                  "from code, not built from the config (data.judge); delete the folder to cluster with the "
                  "configured one")
        return reused
    if part is None and read_manifest(folder) is None and any(root.glob("part-*-of-*")):
        _warn(f"{root} holds part-i-of-n folders but no merged data: run with --merge to join them "
              "instead of generating everything again")
    # the lock first: a second launch must not open (and repair) the judge cache or load models for nothing
    with FolderLock(folder):
        cache = folder / JUDGE_CACHE
        if workers is None:  # the judge first: a bad NLI model fails before the source is read
            device = job.models.resolved_device()
            judge = build_judge(job.data, cache, device) if judge is None else (
                judge if isinstance(judge, CachedJudge) else CachedJudge(judge, cache))
            workers = ShardWorkers(job, engines, judge)
        contexts, families = _planned_contexts(job, traces)
        shards, plan = _plan(contexts, job.data.contexts_per_shard)
        my_shards = list(range(len(shards))) if part is None else part_shards(len(shards), *part)
        if not my_shards:  # (before the language models load)
            raise DataFolderError(
                f"part {part[0]} of {part[1]} has no shard: the plan has {len(shards)} shard(s) ({len(contexts)} "
                f"contexts, data.contexts_per_shard={job.data.contexts_per_shard}); split into at most "
                f"{len(shards)} parts, or lower data.contexts_per_shard")
        started_workers = workers.start(cache)
        engine_infos = started_workers["engines"]
        layers = {r: layer_rows(job.data.layers, info["num_layers"]) for r, info in engine_infos.items()}
        run = DataGenStats()
        manifest = read_manifest(folder)
        if manifest is None or _nothing_finished(manifest):
            if manifest is None:
                _check_no_orphan_shards(folder)
            # (nothing finished under an empty manifest: a run that failed on its first shard is retried with
            # whatever settings are given now; the files it left are unlisted, so they are removed below)
            manifest = _new_manifest(cfg_dict, job, engine_infos, layers, started_workers["judge"], plan, part,
                                     my_shards)
            manifest["judge_passed"] = judge_name is not None  # not the configured judge: _reuse checks it
        else:
            _check_resumable(folder, manifest, cfg_dict, engine_infos, started_workers["judge"], plan)
        manifest[FAMILIES] = families  # (a folder started before families were recorded gets them now)
        # written before any shard: a run killed between a shard's files and its manifest entry then leaves a
        # folder that resumes (the unlisted files are removed here and their shards redone), not one refused as
        # foreign shards
        write_manifest(folder, manifest)
        clean_temporaries(folder)
        removed = remove_unlisted_shards(folder, manifest)
        if removed:
            _warn(f"removed {len(removed)} shard file(s) that no finished shard lists (e.g. {removed[0]}): a broken "
                  "shard's, or a stopped run's; the planned shards among them are generated again")
        pilot = CappedPilot(job.data.pilot_contexts, job.data.max_capped_share, job.sampling.max_step_tokens,
                            job.source.delimiter, folder)
        pilot.check(manifest["shards"])  # a resumed run that already passed the pilot size is checked at once
        _run_shards(folder, manifest, shards, my_shards, workers, run, progress, pilot)
        if len(manifest["shards"]) == len(my_shards) and manifest["status"] != "complete":
            manifest["status"], manifest["completed"] = "complete", utc_now()
            write_manifest(folder, manifest)
        write_card(folder, manifest)
        if part is None:  # a part's contexts may all be skipped where the whole set's are not: merge_parts checks
            check_some_contexts(folder, manifest)
    run.wall_seconds = time.perf_counter() - started
    return DataResult(folder, manifest, False, run)


class CappedStepsError(DataFolderError):
    """Too many sampled steps were cut by the token cap (raised after the pilot; finished shards are kept)."""


@dataclass
class CappedPilot:
    """After `contexts` contexts, report the share of sampled steps cut by the token cap, and stop the run
    when it is above `max_share` (None: report only). Checked once per run."""

    contexts: int
    max_share: float | None
    cap: int
    delimiter: str
    folder: Path
    done: bool = False
    share: float | None = None

    def check(self, finished_shards: Sequence[dict]) -> None:
        if self.done:
            return
        counts = summarize_shards(finished_shards)
        if counts["contexts"] < self.contexts:
            return
        self.done = True
        samples, capped = sum(counts["samples"].values()), sum(counts["capped"].values())
        if not samples:
            return
        self.share = capped / samples
        per_model = ", ".join(f"{m} {counts['capped'].get(m, 0)}/{n}" for m, n in sorted(counts["samples"].items()))
        log.info("pilot (%d contexts): %.1f%% of sampled steps hit the %d-token cap (%s)", counts["contexts"],
                 100 * self.share, self.cap, per_model)
        if self.max_share is not None and self.share > self.max_share:
            raise CappedStepsError(
                f"{self.folder}: after the pilot's {counts['contexts']} contexts, {100 * self.share:.1f}% of the "
                f"sampled steps ({per_model}) hit sampling.max_step_tokens={self.cap} before the step delimiter "
                f"{self.delimiter!r}, above data.max_capped_share={self.max_share}. Cut steps make singleton "
                "meanings and labels of text the model never writes as a step. Set the delimiter the model writes "
                "(source.delimiter, e.g. '\\n' for models that end lines, not paragraphs) or raise the cap and use "
                "another output_dir, or set data.max_capped_share=null to go on with this data (the finished "
                "shards are kept)")


@contextlib.contextmanager
def _remembering(folder: Path, hashed: dict):
    """Record the files hashed while writing once the run ends, stopped or not (one write, not one per shard)."""
    try:
        yield
    finally:
        remember_verified(folder, hashed)


def _run_shards(folder: Path, manifest: dict, shards: list[list[Context]], my_shards: list[int],
                workers: ShardWorkers, run: DataGenStats, progress: bool, pilot: CappedPilot | None = None) -> None:
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    done = {s["index"] for s in manifest["shards"]}
    todo = [k for k in my_shards if k not in done]
    total = sum(len(shards[k]) for k in my_shards)
    initial = total - sum(len(shards[k]) for k in todo)
    started, finished = time.perf_counter(), initial
    hashed: dict = {}  # files this run hashed: the readers' check need not hash them again
    # logging_redirect_tqdm: log lines (the pilot's, a skipped context's) print above the bar instead of through it
    with tqdm(total=total, initial=initial, unit="ctx", desc="data", disable=not progress,
              dynamic_ncols=True) as bar, logging_redirect_tqdm(), _remembering(folder, hashed):
        for shard, entry in workers.run([(k, shards[k]) for k in todo], lambda: bar.update(1)):
            k = shard.index
            finished += len(shards[k])
            start = time.perf_counter()
            entry["files"] = write_shard(folder, shard, metadata={"format": FORMAT, "shard": str(k)})
            entry["digests"] = file_digests(folder, entry["files"], verified=hashed)
            entry["timing"]["seconds"]["writing"] = time.perf_counter() - start
            manifest["shards"].append(entry)  # only now is the shard part of the data set
            manifest["shards"].sort(key=lambda s: s["index"])
            write_manifest(folder, manifest)
            if not progress:  # no bar: one line per shard, with this run's rate as the ETA
                log.info("data: shard %d written; %s", k, progress_line(finished, total, finished - initial,
                                                                         time.perf_counter() - started, "contexts"))
            run.add(entry["timing"])
            run.contexts += len(entry["contexts"])
            run.skipped += len(entry["skipped"])
            run.shards += 1
            if pilot is not None:
                pilot.check(manifest["shards"])
