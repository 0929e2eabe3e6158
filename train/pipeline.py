"""The training stage of probe-train: data folder -> every verifier the config asks for -> checkpoint.

    from specprobe.train.config import load_config
    from specprobe.train.pipeline import train_all
    result = train_all(load_config("configs/tiny.yaml"))   # needs <output_dir>/data (probe-train --stage data)
    result.metrics["probes"]["probe_target"]["val"]["draft_via_target"]["probe"]["mae"]

Order of work: open the data, check it belongs to the configured models, split by question, load and
check EVERYTHING that will be trained on (empty or single-class sets, NaN features, bad labels), and
only then train: probes (+ baselines), the embedding threshold, the judge LoRA. The checkpoint folder is
written at the end, in one rename (a failed run never leaves a half checkpoint behind).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from specprobe.data_gen.store import DataFolderError, open_dataset, settings_diff, shards_digest
from specprobe.infer import checkpoint_format as fmt
from specprobe.infer.checkpoint_format import Checkpoint
from specprobe.infer.models import default_device, describe_source
from specprobe.inputs.config import to_dict
from specprobe.inputs.records import question_digest
from specprobe.probes.base import load_probe
from specprobe.probes.features import same_model_name
from specprobe.probes.io import write_text
from specprobe.probes.splits import group_split
from specprobe.train import pair_verifiers, probes_train
from specprobe.train.checkpoint import write_checkpoint
from specprobe.train.config import ProbeConfig
from specprobe.train.judge_steps import remove_state
from specprobe.train.probes_train import TrainingDataError
from specprobe.train.tracking import Tracker, format_metrics

SIDES = ("train", "val", "test")


# ----------------------------------------------------------------------------- checks and split
def check_data_models(manifest: dict, cfg, folder: Path | str = "the data folder") -> None:
    """TrainingDataError when the data was made with other models than `cfg.models` names. Every identity the
    manifest records (the config's model name, the engine's name, its resolved model id) must match."""
    for role in manifest.get("models", []):
        want = getattr(cfg.models, role)
        engine = manifest["engines"][role]
        made_with = manifest.get("config", {}).get("models", {}).get(role)
        recorded = {f"config.models.{role}": (made_with, want), f"engines.{role}.name": (engine.get("name"), want),
                    f"engines.{role}.model_id": (engine.get("model_id"), describe_source(want))}
        differ = [key for key, (have, expected) in recorded.items() if have and not same_model_name(expected, have)]
        if not differ:
            continue
        raise TrainingDataError(
            f"{folder} was made with {role} model {made_with or engine.get('name')!r} ({engine.get('model_id')}, "
            f"{engine.get('num_layers')} layers, hidden {engine.get('hidden_size')}), but the config's models.{role} "
            f"is {want!r} (manifest fields that differ: {', '.join(differ)}). Probes trained on it would not fit the "
            "configured model: use the output_dir of that data, or generate data for this config (another output_dir)")


def unrecorded_families(ds) -> str | None:
    """Why a split of this data folder may put one template on both sides, or None."""
    source = (ds.manifest.get("config") or {}).get("source") or {}
    if source.get("kind") != "reasoning_gym" or ds.families_recorded:
        return None
    return (f"{ds.folder} was made before the data stage recorded question families: its reasoning-gym questions "
            "are split by id, so items of one template can fall on both sides and held-out numbers may be "
            "optimistic. Generate the data again (another output_dir) to split by template.")


def split_groups(question_ids, families: dict[str, str]) -> list[str]:
    """What a split keeps together, per question: the question itself when it has no family; the question its
    family names when that is a question without one (a renamed duplicate record and its original); else its
    family, marked, so that a template named like a question id is not that question."""
    question_ids = list(question_ids)
    present = set(question_ids)

    def key(q: str) -> str:
        f = families.get(q, q)
        if f == q or (f in present and families.get(f, f) == f):
            return f
        return f"family:{f}"

    return [key(q) for q in question_ids]


@dataclass
class QuestionSplit:
    """Which side (train/val/test) each question id is on; built once and shared by every component."""

    side_of: dict[str, str]
    seed: int
    val_fraction: float
    test_fraction: float
    family_of: dict[str, str] = field(default_factory=dict)  # questions that share a family (a template) only

    @classmethod
    def make(cls, question_ids, probe_cfg, families: dict[str, str] | None = None) -> QuestionSplit:
        """Split the questions; those of one family (`families`: question -> family, e.g. one template)
        all land on one side, and the fractions count families."""
        unique = sorted({str(q) for q in question_ids})
        if not unique:
            raise TrainingDataError("the data folder holds no samples (no question ids): nothing to train on")
        present = set(unique)
        family_of = {q: str(f) for q, f in (families or {}).items() if q in present and str(f) != q}
        groups = split_groups(unique, family_of)
        try:
            parts = group_split(groups, probe_cfg.val_fraction, probe_cfg.test_fraction, seed=probe_cfg.seed,
                                exact_sizes=True)  # small sets: the fractions must hold
        except ValueError as err:
            what = f"{len(set(groups))} question families" if family_of else f"{len(unique)} question(s)"
            raise TrainingDataError(f"cannot split {what}: {err}") from None
        side_of = {unique[i]: side for side, idx in zip(SIDES, parts) for i in idx}
        return cls(side_of, probe_cfg.seed, probe_cfg.val_fraction, probe_cfg.test_fraction, family_of)

    def sides(self, question_ids) -> np.ndarray:
        """Side of each row's question ('train', 'val', 'test'); unknown questions are an error."""
        try:
            return np.asarray([self.side_of[str(q)] for q in question_ids], dtype=object)
        except KeyError as err:
            raise TrainingDataError(f"question {err.args[0]!r} has no side in the split (it is not among the "
                                    "samples' question ids)") from None

    def questions(self, side: str) -> list[str]:
        return sorted(q for q, s in self.side_of.items() if s == side)

    @staticmethod
    def recorded_settings(probe_section: dict[str, Any]) -> SimpleNamespace:
        """The split settings a checkpoint's probe section records (`SPLIT_SETTINGS`); a key it lacks predates the
        setting: test_fraction came later (no test split then), the others take ProbeConfig's default."""
        defaults = ProbeConfig()
        return SimpleNamespace(val_fraction=float(probe_section.get("val_fraction", defaults.val_fraction)),
                               test_fraction=float(probe_section.get("test_fraction", 0.0)),
                               seed=int(probe_section.get("seed", defaults.seed)))

    @classmethod
    def of_data(cls, ds, probe_cfg) -> QuestionSplit:
        """The split probe-train makes of a data folder (its questions, kept together by family)."""
        return cls.make(ds.question_ids(), probe_cfg, ds.question_families())

    def families(self, side: str) -> list[str]:
        """The families of the questions on one side that have one."""
        return sorted({self.family_of[q] for q in self.questions(side) if q in self.family_of})

    def to_dict(self) -> dict[str, Any]:
        out = {"by": "question family" if self.family_of else "question_id", "seed": self.seed,
               "val_fraction": self.val_fraction, "test_fraction": self.test_fraction,
               **{side: self.questions(side) for side in SIDES}}
        if self.family_of:  # probe-eval on other data holds out no question of a family trained on
            out["families"] = {side: self.families(side) for side in SIDES}
        return out


def question_digests(ds) -> dict[str, str]:
    """Each question id's digest of its text (whitespace collapsed): how probe-eval knows a training question in
    another data folder whose records gave it another id (`<file stem>-<index>`, where the records carry none)."""
    table = ds.contexts.select(["question_id", "question"]).to_pydict()
    return {str(q): question_digest(text) for q, text in zip(table["question_id"], table["question"])}


# ----------------------------------------------------------------------------- result
@dataclass
class Reused:
    """Verifiers an earlier run of this config trained before it failed or was stopped (its partial checkpoint),
    taken as they are instead of trained again."""

    source: Path  # the partial checkpoint
    components: dict[str, list[str]]  # "probes" / "embedding" -> its checkpoint component names
    metrics: dict[str, Any]  # the partial checkpoint's metrics.json
    folder: Path  # where their files wait for the checkpoint (copied when reuse is decided)
    created: str | None = None  # when the partial checkpoint was written
    # the probes step itself failed: the probes it finished (name -> what TrainedProbe.to_metrics recorded), taken
    # into this run's probes step, which trains the others
    probes_finished: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        return list(self.components)


@dataclass
class TrainResult:
    checkpoint_dir: Path
    metrics: dict[str, Any]
    probes: probes_train.ProbeResults | None = None
    embedding: pair_verifiers.EmbeddingResult | None = None
    judge: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    reused: Reused | None = None

    def summary(self) -> str:
        """The validation table (and the test table when a test split was held out)."""
        has_test = any("test" in entry for entry in self.metrics.get("probes", {}).values()) or any(
            "test" in self.metrics.get(k, {}) for k in ("embedding", "judge"))
        return format_metrics(self.metrics) + ("\n" + format_metrics(self.metrics, "test") if has_test else "")


@dataclass
class _Prepared:
    plans: list = field(default_factory=list)
    specs: dict = field(default_factory=dict)
    sets: dict = field(default_factory=dict)
    pairs: dict[str, pair_verifiers.PairSet] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _device(name: str, cfg) -> str:
    if name != "auto":
        return name

    return cfg.models.resolved_device() or default_device()


def prepare(ds, cfg, split: QuestionSplit, reused: Sequence[str] = ()) -> _Prepared:
    """Load and check every training input of the verifiers to train (those `reused` from an earlier run need
    none); raises TrainingDataError before anything is trained."""
    if not cfg.verifiers.train:
        raise TrainingDataError("verifiers.train is empty: nothing to train")
    if len(ds) == 0:
        raise TrainingDataError(f"{ds.folder} holds no samples: nothing to train on")
    todo = [kind for kind in cfg.verifiers.train if kind not in reused]
    out = _Prepared()
    if "probes" in todo:
        out.plans, out.specs, out.sets, out.skipped = probes_train.prepare_probes(
            ds, cfg.probe, ds.manifest["models"], split.sides)
    if "embedding" in todo or "judge" in todo:
        pairs = pair_verifiers.load_pairs(ds)
        sides = split.sides(pairs.questions) if len(pairs) else np.empty(0, dtype=object)
        out.pairs = {side: pairs.take(sides == side) for side in SIDES}
        what = " and ".join(t for t in ("embedding", "judge") if t in todo) + " verifier"
        pair_verifiers.check_pairs(out.pairs["train"], out.pairs["val"], what)
    return out


# ----------------------------------------------------------------------------- the stage
def train_all(cfg, *, dataset=None, print_fn: Callable[[str], None] = print, embedder=None,
              judge_model=None, progress: bool = False) -> TrainResult:
    """Train every verifier in ``cfg.verifiers.train`` on ``<output_dir>/data`` and write the checkpoint.

    dataset: an open ProbeDataset instead of ``cfg.data_dir``; embedder: a SentenceEmbedder to reuse;
    judge_model: a preloaded (model, tokenizer) of ``verifiers.judge_base`` (the LoRA adapter is injected
    into that model in place); progress: progress bars for the logistic probes' readings and the judge LoRA's
    scoring and steps. Raises TrainingDataError (a ValueError) for unusable input before any
    training starts.
    """

    t0 = time.perf_counter()
    ds = dataset if dataset is not None else _open(cfg)
    check_data_models(ds.manifest, cfg, ds.folder)
    split = QuestionSplit.of_data(ds, cfg.probe)
    reused, note = reusable_verifiers(cfg, ds)  # before prepare: what is reused needs no training data loaded
    try:
        prepared = prepare(ds, cfg, split, reused.kinds if reused else ())
        return _train(cfg, ds, split, prepared, reused, note, t0, print_fn=print_fn, embedder=embedder,
                      judge_model=judge_model, progress=progress)
    finally:
        if reused:
            shutil.rmtree(reused.folder, ignore_errors=True)


def _train_probes(cfg, prepared: _Prepared, reused: Reused | None, result: TrainResult, metrics: dict,
                  tracker: Tracker, progress: bool) -> None:
    """The probes step: every planned probe, except those an earlier run finished before its probes step failed."""
    start = time.perf_counter()
    result.probes = restore_probes(reused, prepared)  # filled as each probe finishes: a failure keeps those
    earlier = sum(t.seconds for t in result.probes.probes.values())
    if result.probes.probes:
        names = list(result.probes.probes)
        metrics.setdefault("reused", {"from": str(reused.source), "created": reused.created,
                                      "verifiers": reused.kinds})["probes"] = names
        tracker.message(f"reusing {', '.join(names)} of {reused.source}: an earlier run of this config trained them "
                        "on this data with these settings before its probes step failed (to train them again, delete that folder "
                        "before the run); training the others")
    probes_train.train_probes(prepared.plans, prepared.specs, prepared.sets, cfg.probe, curve=tracker.curve,
                              device=_device(cfg.probe.device, cfg), out=result.probes, log=tracker.message,
                              progress=progress)
    metrics["probes"] = result.probes.metrics
    if prepared.skipped:
        metrics["probes_skipped"] = prepared.skipped
        for name, reason in prepared.skipped.items():
            tracker.message(f"  {name} skipped: {reason}")
    result.seconds["probes"] = time.perf_counter() - start + earlier


def _train(cfg, ds, split: QuestionSplit, prepared: _Prepared, reused: Reused | None, note: str, t0: float, *,
           print_fn, embedder, judge_model, progress: bool) -> TrainResult:
    result = TrainResult(cfg.checkpoint_dir, {})
    metrics: dict[str, Any] = {"data": _data_summary(ds, split), "split": split.to_dict()}
    digest = question_digests(ds)  # (the questions trained or validated on, by text: see probe-eval)
    metrics["split"]["question_digests"] = {side: sorted({digest[q] for q in split.questions(side) if q in digest})
                                            for side in ("train", "val")}
    caveat = unrecorded_families(ds)
    if caveat:
        metrics["split"]["warning"] = caveat
    differ = settings_diff(ds.manifest, to_dict(cfg))
    if differ:  # the data is what it is: the checkpoint records its settings, and the run says so
        metrics["data"]["config_differs"] = differ
    with Tracker(cfg.wandb, run_name=cfg.name, output_dir=cfg.output_dir, config=to_dict(cfg), print_fn=print_fn) as tracker:
        tracker.message(f"probe-train: {len(ds)} samples from {ds.folder}; questions train/val/test = "
                        + "/".join(str(len(split.questions(s))) for s in SIDES)
                        + (" (templates " + "/".join(str(len(split.families(s))) for s in SIDES) + ")"
                           if split.family_of else ""))
        if caveat:
            tracker.message(f"WARNING: {caveat}")
        if differ:
            tracker.message(f"WARNING: {ds.folder} was made with other data settings than this config (data's -> "
                            f"config's): {'; '.join(differ)}. The verifiers train on the data as it is; the "
                            "checkpoint's card names the data's source. To train on data of this config, use another "
                            "output_dir (the data stage generates it)")
        if note:
            tracker.message(note)
        if reused:
            result.reused = reused
        if reused and reused.kinds:
            metrics["reused"] = {"from": str(reused.source), "created": reused.created, "verifiers": reused.kinds}
            for kind in reused.kinds:
                metrics[kind] = reused.metrics[kind]
                if kind == "probes" and "probes_skipped" in reused.metrics:
                    metrics["probes_skipped"] = reused.metrics["probes_skipped"]
                result.seconds[kind] = (reused.metrics.get("seconds") or {}).get(kind, 0.0)
            tracker.message(f"reusing the {' and '.join(reused.kinds)} of {reused.source}: an earlier run of "
                            "this config trained them on this data with these settings before it failed (to "
                            "train them again, delete that folder before the run)")
        stage = "probes"
        try:
            if prepared.plans and not (reused and "probes" in reused.kinds):
                _train_probes(cfg, prepared, reused, result, metrics, tracker, progress)
            stage = "embedding"
            if "embedding" in cfg.verifiers.train and not (reused and "embedding" in reused.kinds):
                tracker.message(f"embedding threshold verifier ({cfg.verifiers.embedding_model}) ...")
                result.embedding = pair_verifiers.train_embedding(
                    prepared.pairs["train"], prepared.pairs["val"], cfg.verifiers, cfg.models.resolved_device(),
                    embedder, test=prepared.pairs["test"])
                metrics["embedding"] = result.embedding.metrics
                result.seconds["embedding"] = result.embedding.seconds
            stage = "judge"
            if "judge" in cfg.verifiers.train:
                tracker.message(f"judge LoRA on {cfg.verifiers.judge_base} ...")
                result.judge = pair_verifiers.train_judge(
                    prepared.pairs["train"], prepared.pairs["val"], cfg.verifiers, _device("auto", cfg),
                    log_fn=tracker.curve("judge", "step"), model=judge_model, test=prepared.pairs["test"],
                    progress=progress, state_dir=judge_steps_dir(cfg), message=tracker.message)
                metrics["judge"] = result.judge.metrics
                result.seconds["judge"] = result.judge.seconds
        except BaseException as err:
            _keep_finished(cfg, result, metrics, ds, stage, err, tracker.message)
            raise
        result.seconds["total"] = time.perf_counter() - t0
        metrics["seconds"] = dict(result.seconds)
        result.metrics = metrics
        try:
            write_checkpoint(cfg.checkpoint_dir, cfg, result, ds.manifest, ds.folder)
        except BaseException as err:  # (a full disk, a stop): what trained goes to the partial folder, if it can
            _keep_finished(cfg, result, metrics, ds, "checkpoint", err, tracker.message)
            raise
        questions = test_questions_file(cfg)
        if split.questions("test"):  # what probe-bench's configs read (bench.source.path) to time held-out problems
            n = write_questions(ds, split.questions("test"), questions)
            tracker.message(f"test questions: {n} -> {questions} (bench.source.kind=jsonl)")
        elif questions.is_file():  # an earlier split's: its questions may now be trained on
            questions.unlink()
            tracker.message(f"removed {questions} (an earlier run's test questions; this split holds none)")
        _drop_covered_partial(cfg, tracker.message)
        if result.judge is not None and remove_state(judge_steps_dir(cfg)):
            tracker.message(f"removed {judge_steps_dir(cfg)} (the judge LoRA's training state; {cfg.checkpoint_dir} "
                            "holds the trained judge)")
        tracker.final(metrics)
        tracker.message(result.summary())
        tracker.message(f"checkpoint: {cfg.checkpoint_dir}")
    return result


SPLIT_SETTINGS = ("seed", "val_fraction", "test_fraction")  # of the probe section: the question split


def _settings(config: dict, kind: str) -> dict[str, Any]:
    """The settings a verifier kind's training reads: the probes the whole probe section; the embedding threshold
    the question split and the verifiers' settings other than the judge's (verifiers.seed seeds only the judge)."""
    probe, verifiers = config.get("probe") or {}, config.get("verifiers") or {}
    if kind == "probes":
        return dict(probe)
    return {**{f"probe.{k}": probe.get(k) for k in SPLIT_SETTINGS},
            **{k: v for k, v in verifiers.items() if k not in ("train", "seed") and not k.startswith("judge_")}}


def reusable_verifiers(cfg, ds) -> tuple[Reused | None, str]:
    """The verifiers of an earlier failed run's partial checkpoint that this run would train identically (the same
    data folder, made once, and the same settings), and a line saying why one there is not reused ("" if none)."""
    partial = partial_checkpoint_dir(cfg)
    if not partial.is_dir():
        return None, ""
    try:
        ckpt = Checkpoint(partial)
        metrics, names, data = ckpt.metrics, ckpt.components, dict(ckpt.meta.get("data") or {})
        config = dict(ckpt.config)
    except (OSError, ValueError, TypeError) as err:
        return None, f"{partial} (an earlier run's partial checkpoint) is not reused: it cannot be read ({err})"
    # the same folder, made once, complete, with the same shard files (a notebook may train on a folder still
    # being generated; a broken shard made again keeps the folder's creation time)
    same = ([data.get("fingerprint"), data.get("created"), data.get("shards_sha256")]
            == [ds.manifest.get("fingerprint"), ds.manifest.get("created"), shards_digest(ds.manifest)])
    if not same or ds.manifest.get("status") != "complete":
        return None, (f"{partial} (an earlier run's partial checkpoint) is not reused: it was trained on other data "
                      f"than {ds.folder} (made {ds.manifest.get('created')})")
    finished = {n: m for n, m in (metrics.get(UNFINISHED_PROBES) or {}).items() if n in names}
    found = {"probes": [n for n in names if fmt.is_probe_component(n) or n == fmt.BASELINES],
             "embedding": [n for n in names if n == fmt.EMBEDDING]}
    mine, why, components = to_dict(cfg), [], {}
    for kind, parts in found.items():
        done = kind in metrics or (kind == "probes" and bool(finished))
        if kind not in cfg.verifiers.train or not done or not parts:
            continue
        if _settings(config, kind) != _settings(mine, kind):
            why.append(f"its {kind} were trained with other settings")
            continue
        if not all(path.exists() for name in parts for path in fmt.component_files(partial, name)):
            why.append(f"files of its {kind} are missing")
            continue
        components[kind] = parts
    note = (f"{partial} (an earlier run's partial checkpoint) is not reused where {'; '.join(why)}" if why else "")
    if not components:
        return None, note
    # copied now: the partial may be replaced or deleted before this run writes its checkpoint
    staged = Path(tempfile.mkdtemp(prefix=f".{partial.name}-reused-", dir=partial.parent))
    fmt.copy_components(partial, staged, [name for parts in components.values() for name in parts])
    reused = Reused(partial, components, metrics, staged, ckpt.meta.get("created"))
    if "probes" in components and "probes" not in metrics:  # its probes step failed: those it finished
        del components["probes"]
        reused.probes_finished = finished
    return reused, note


UNFINISHED_PROBES = "probes_finished"  # a partial checkpoint's metrics key when its probes step failed


def restore_probes(reused: Reused, prepared: _Prepared) -> probes_train.ProbeResults:
    """The probes an earlier run finished before its probes step failed, ready to be scored beside the ones this
    run trains (none when nothing was reused)."""
    out = probes_train.ProbeResults()
    plans = {plan.name: plan for plan in prepared.plans}
    for name, recorded in (reused.probes_finished if reused else {}).items():
        if name in plans:
            trained = probes_train.TrainedProbe.restore(plans[name], load_probe(reused.folder, name),
                                                        prepared.specs[name], recorded)
            if trained is not None:
                out.probes[name] = trained
    return out


def test_questions_file(cfg) -> Path:
    """Where probe-train writes its test questions for probe-bench: <output_dir>/test_questions.jsonl."""
    return Path(cfg.output_dir) / "test_questions.jsonl"


def write_questions(ds, question_ids: Sequence[str], out: str | Path) -> int:
    """Write `question_ids` of a data folder as jsonl for probe-bench (id, question, gold answer, and the family
    where the split keeps the question with others, so that its intervals draw them together), in the data's
    order; atomically.
    Returns how many were written (a question the data lacks is an error naming it)."""
    wanted, seen = set(question_ids), set()
    # the training split's groups (`split_groups`): a renamed duplicate record and its original share one, as
    # template members do; a group of one question is no family (a template named like a question id merges with
    # it here: a wider interval, never a narrower one)
    ids = ds.question_ids()
    groups = dict(zip(ids, split_groups(ids, ds.question_families())))
    size = Counter(groups.values())
    ctx = ds.contexts
    lines = []
    for qid, question, answer in zip(ctx.column("question_id").to_pylist(), ctx.column("question").to_pylist(),
                                     ctx.column("answer").to_pylist()):
        if qid in wanted and qid not in seen:
            seen.add(qid)
            group = groups.get(qid, qid)
            family = {"family": group.removeprefix("family:")} if group != qid or size[group] > 1 else {}
            lines.append(json.dumps({"id": qid, "question": question, "answer": answer, **family}) + "\n")
    missing = sorted(wanted - seen)
    if missing:
        raise TrainingDataError(f"{ds.folder} holds no context of question(s) {missing[:5]}"
                                f"{' ...' if len(missing) > 5 else ''}: cannot write them")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text(out, "".join(lines))
    return len(lines)


def partial_checkpoint_dir(cfg) -> Path:
    """Where a train stage that failed after some verifiers finished keeps them (beside the checkpoint, which
    it leaves as it was)."""
    folder = Path(cfg.checkpoint_dir)
    return folder.with_name(folder.name + "-partial")


def judge_steps_dir(cfg) -> Path:
    """Where the judge LoRA's training keeps its state every ``verifiers.judge_save_every`` steps (beside the
    checkpoint; removed once a checkpoint holds the trained judge)."""
    folder = Path(cfg.checkpoint_dir)
    return folder.with_name(folder.name + "-judge-steps")


def _drop_covered_partial(cfg, message: Callable[[str], None]) -> None:
    """Remove an earlier failed run's partial checkpoint once the new checkpoint holds every component it held; one
    with a verifier this run did not train (say, a judge, when verifiers.train is now [probes]) stays."""
    partial = partial_checkpoint_dir(cfg)
    if not partial.is_dir():
        return
    try:
        left = set(Checkpoint(partial).components) - set(Checkpoint(cfg.checkpoint_dir).components)
    except (OSError, ValueError):  # unreadable: nothing in it can be loaded
        left = set()
    if left:
        message(f"kept {partial} (an earlier run's partial checkpoint): it holds {', '.join(sorted(left))}, which "
                f"{cfg.checkpoint_dir} does not")
        return
    shutil.rmtree(partial, ignore_errors=True)
    message(f"removed {partial} (an earlier run's partial checkpoint; {cfg.checkpoint_dir} holds all it held)")


def _keep_finished(cfg, result: TrainResult, metrics: dict, ds, stage: str, err: BaseException,
                   message: Callable[[str], None]) -> None:
    """A verifier failed (or the run was stopped) after others trained: write those to the partial checkpoint
    folder, so minutes of training are not lost with the error, and say so. The checkpoint itself is untouched
    (a complete one from an earlier run stays). When the probes step itself fails, the probes it finished are kept,
    with what a rerun needs to take them as they are (`restore_probes`)."""
    finished = result.probes.probes if result.probes is not None and stage == "probes" else None
    if finished is not None:
        if finished:
            metrics[UNFINISHED_PROBES] = {name: trained.to_metrics() for name, trained in finished.items()}
        else:
            result.probes = None
    if result.probes is None and result.embedding is None and not (result.reused and result.reused.kinds):
        return
    metrics["failed"] = {"stage": stage, "error": f"{type(err).__name__}: {err}"}
    metrics["seconds"] = dict(result.seconds)  # a rerun that reuses these reports their training time
    result.metrics = metrics
    folder = partial_checkpoint_dir(cfg)
    try:
        write_checkpoint(folder, cfg, result, ds.manifest, ds.folder)
    except Exception as write_err:  # noqa: BLE001 (the training error is the one to raise)
        message(f"the {stage} step failed, and keeping what had trained failed too: {write_err}")
        return
    kept = [name for name, part in (("probes", result.probes), ("embedding", result.embedding)) if part is not None]
    if finished:
        kept[0] = f"the probes {', '.join(finished)}"
    kept += result.reused.kinds if result.reused else []
    lacks = ("the judge" if result.judge is not None else "nothing trained" if stage == "checkpoint"
             else "the probes not finished" if finished else f"the {stage} verifier")
    message(f"the {stage} step failed ({type(err).__name__}); what had trained ({', '.join(kept)}) is in {folder}, "
            f"a checkpoint without {lacks} (runtime.checkpoint={folder} uses it); {cfg.checkpoint_dir} is unchanged")


def _open(cfg):
    try:
        return open_dataset(cfg.data_dir)
    except DataFolderError as err:
        raise DataFolderError(f"{err}\n(probe-train --stage train needs the data stage's output in "
                              f"{cfg.data_dir}; run `probe-train --config <file>` to generate it)") from None


def _data_summary(ds, split: QuestionSplit) -> dict[str, Any]:
    m = ds.manifest
    models = ds.column("model")
    sides = split.sides(ds.column("question_id"))
    return {"folder": str(ds.folder), "engines": m["engines"], "layers": m["layers"],
            "num_samples_per_context": m.get("num_samples"), "judge": m.get("judge"),
            "rows": {side: {model: int(((sides == side) & (models == model)).sum()) for model in m["models"]}
                     for side in SIDES}}
