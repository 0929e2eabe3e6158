"""Semantic-probability probes: the target's p and the draft's q (SemanticSpec, papers.md §1).

Four labelled row sets come out of a data folder (``load_row_sets``):

| set                | rows          | features            | label               | log-prob baseline input          |
|--------------------|---------------|---------------------|---------------------|----------------------------------|
| `target_own`       | target steps  | target view         | `own_prob`          | `mean_logprob`                   |
| `draft_via_target` | draft steps   | target view (t.f.)  | `prob_under_target` | `target_logprob / target_num_tokens` |
| `draft_own`        | draft steps   | draft's own         | `own_prob`          | `mean_logprob`                   |
| `draft_accept`     | draft steps   | draft's own         | `prob_under_target` | `mean_logprob`                   |

Both labels (`own_prob`, `prob_under_target`) are on one scale: the share of a model's N samples (the other
N - 1 for its own steps) that mean the same as the step, averaging the meaning's probability pi (see
`data_gen.labels`). `draft_accept`
feeds the acceptance probe (`probe_acceptance`, logistic): the target-side label from features the draft has
before the target runs, what an adaptive drafting depth needs.

The target probe scores DRAFT steps at run time, so its headline validation set is
`draft_via_target`. With ``probe.target_with_draft`` it learns from `target_own` + `draft_via_target`
and the `target_own`-only variant is trained too, as a comparison; without it, only the
`target_own` probe is trained. The draft probe learns from `draft_own`.

Two kinds of probe read the hidden states: the MLP (`probes.fit_probe`, early stopping on the validation
split of the same sets) and the L2 logistic regression (`probes.logistic`, its layer, pooling and penalty
chosen on the validation split). ``probe.kind`` says which one is the runtime probe (`probe_<role>`); the other
is trained on the same sets and saved as `probe_<role>_<kind>`. Beside them: a last-layer MLP, and each row
set's own baselines (`SetBaselines`: its constant, its log-prob calibrated by a logistic fit and by isotonic
regression), fitted on that set's training rows, so no set is scored against another set's level. All
validation numbers are `probes.metrics.probe_report`s.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from specprobe.probes.base import HiddenStateProbe
from specprobe.probes.baselines import ConstantBaseline, LogprobBaseline
from specprobe.probes.features import FeatureSpec, layers_from_option
from specprobe.probes.logistic import Candidate, select_logistic
from specprobe.probes.metrics import probe_report
from specprobe.probes.mlp import FitHistory, fit_probe
from specprobe.probes.mlp import ProbeMLPConfig as MLPConfig

LogFn = Callable[[dict[str, Any]], None]


class TrainingDataError(ValueError):
    """The training data cannot be trained on (raised before any training starts)."""


# ----------------------------------------------------------------------------- row sets
@dataclass(frozen=True)
class SetDef:
    name: str
    model: str  # whose samples
    view: str  # whose hidden states
    label: str  # label column
    description: str

    @property
    def label_includes_self(self) -> bool:
        """semantic_prob (|C_k|/N) counts the labelled sample among the N; own_prob and prob_under_target
        do not (no set uses semantic_prob since the leave-one-out label)."""
        return self.label == "semantic_prob"

    def label_draws(self, num_samples: int) -> int:
        """The binomial draws behind one label: N - 1 for own_prob (the other samples), else N."""
        return num_samples - 1 if self.label == "own_prob" else num_samples


ROW_SETS: dict[str, SetDef] = {s.name: s for s in (
    SetDef("target_own", "target", "target", "own_prob", "target steps, target features"),
    SetDef("draft_via_target", "draft", "target", "prob_under_target",
           "draft steps teacher-forced through the target"),
    SetDef("draft_own", "draft", "draft", "own_prob", "draft steps, draft features"),
    SetDef("draft_accept", "draft", "draft", "prob_under_target",
           "draft steps, draft features, labelled by the target: will a verifier accept the step?"),
)}


@dataclass
class RowSet:
    """Labelled rows of one set, features over the data's stored layers [n, L_kept, H]."""

    name: str
    sample_ids: np.ndarray
    questions: np.ndarray
    x: torch.Tensor
    y: torch.Tensor
    logprob: np.ndarray

    def __len__(self) -> int:
        return len(self.sample_ids)

    def take(self, mask: np.ndarray) -> RowSet:
        idx = np.flatnonzero(mask)
        t = torch.from_numpy(idx)
        return RowSet(self.name, self.sample_ids[idx], self.questions[idx], self.x[t], self.y[t], self.logprob[idx])


def _float_column(ds, name: str, rows: np.ndarray) -> np.ndarray:
    col = ds.samples.column(name).take(rows)
    return np.array(col.to_numpy(zero_copy_only=False), dtype=np.float64)  # a writable copy; nulls -> NaN


def _logprob_input(ds, set_def: SetDef, rows: np.ndarray) -> np.ndarray:
    if set_def.name == "draft_via_target":
        tokens = _float_column(ds, "target_num_tokens", rows)
        with np.errstate(divide="ignore", invalid="ignore"):
            return _float_column(ds, "target_logprob", rows) / tokens
    return _float_column(ds, "mean_logprob", rows)


def load_row_set(ds, name: str, pooling: str) -> RowSet:
    """One labelled set of a `data_gen.store.ProbeDataset` (features over every stored layer)."""
    set_def = ROW_SETS[name]
    rows = ds.rows(set_def.model)
    x = ds.features(set_def.view, pooling, rows) if rows.size else torch.empty(0)
    return RowSet(name, np.asarray(ds.column("sample_id")[rows], dtype=object),
                  np.asarray(ds.column("question_id")[rows], dtype=object), x,
                  torch.from_numpy(_float_column(ds, set_def.label, rows)).float(),
                  _logprob_input(ds, set_def, rows))


# ----------------------------------------------------------------------------- plans
@dataclass
class ProbePlan:
    """One probe to train: which model it stands for, what it reads, what it learns from."""

    name: str  # checkpoint file stem
    role: str  # target | draft
    train_sets: list[str]
    eval_sets: list[str]
    layers: str  # layer option
    kind: str  # main | variant | last_layer | logistic | mlp (the other kind beside a main probe) | acceptance
    description: str
    model: str = "mlp"  # mlp | logistic


def other_kind(kind: str) -> str:
    """The probe kind trained beside the runtime's (probe.kind) for comparison."""
    return "logistic" if kind == "mlp" else "mlp"


def plan_probes(probe_cfg, models: Sequence[str]) -> list[ProbePlan]:
    """The probes `probe-train` trains for the sampled models: main probes (of kind probe.kind), the other kind
    on the same sets, the target-steps-only variant and the last-layer baselines."""
    main_kind = getattr(probe_cfg, "kind", "mlp")
    other = other_kind(main_kind)
    plans: list[ProbePlan] = []

    def with_other(role: str, sets: list[str], evals: list[str], what: str) -> None:
        plans.append(ProbePlan(f"probe_{role}", role, sets, evals, probe_cfg.features, "main",
                               f"{role} probe {what} ({main_kind}) on " + " + ".join(sets), main_kind))
        plans.append(ProbePlan(f"probe_{role}_{other}", role, sets, evals, probe_cfg.features, other,
                               f"{other} {role} probe on the same sets (comparison)", other))

    if "target" in models:
        with_draft = probe_cfg.target_with_draft and "draft" in models
        main_sets = ["target_own", "draft_via_target"] if with_draft else ["target_own"]
        evals = ["draft_via_target", "target_own"] if "draft" in models else ["target_own"]
        with_other("target", main_sets, evals, "p")
        if with_draft:
            plans.append(ProbePlan("probe_target_own", "target", ["target_own"], evals, probe_cfg.features,
                                   "variant", "target MLP probe trained on target steps only (comparison)"))
        plans.append(ProbePlan("baseline_last_layer_target", "target", main_sets, evals, "last", "last_layer",
                               "last-layer target MLP probe (baseline)"))
    if "draft" in models:
        with_other("draft", ["draft_own"], ["draft_own"], "q")
        plans.append(ProbePlan("baseline_last_layer_draft", "draft", ["draft_own"], ["draft_own"], "last",
                               "last_layer", "last-layer draft MLP probe (baseline)"))
    if "draft" in models and "target" in models:
        plans.append(ProbePlan("probe_acceptance", "draft", ["draft_accept"], ["draft_accept"], probe_cfg.features,
                               "acceptance", "acceptance probe: the target-side probability of a draft step read from "
                               "the draft's own hidden states, before the target runs (adaptive drafting depth)",
                               "logistic"))
    return plans


def feature_spec(engine: dict, kept_layers: Sequence[int], option: str, combine: str, pooling: str,
                 role: str) -> tuple[FeatureSpec, list[int]]:
    """The probe's FeatureSpec and the columns of the stored-layer features it reads."""
    num_layers = int(engine["num_layers"])
    try:
        layers = layers_from_option(option, num_layers)
    except ValueError as err:
        raise TrainingDataError(f"probe.features for the {role}: {err}") from None
    kept = list(kept_layers)
    missing = [r for r in layers if r not in kept]
    if missing:
        raise TrainingDataError(
            f"the {role} probe reads hidden-state rows {layers} ({option!r}) but the data folder stored only "
            f"rows {kept} (data.layers); rows {missing} are missing. Choose probe.features among the stored "
            "rows, or generate the data again with data.layers covering them")
    return engine_spec(engine, layers, combine if len(layers) > 1 else "concat", pooling), [kept.index(r) for r in layers]


def engine_spec(engine: dict, layers: Sequence[int], combine: str = "concat", pooling: str = "mean") -> FeatureSpec:
    """The features of hidden-state rows `layers` of a model as a data folder's manifest records it (`engines`)."""
    return FeatureSpec(model_id=engine["model_id"], revision=engine.get("revision"),
                       num_layers=int(engine["num_layers"]), hidden_size=int(engine["hidden_size"]),
                       layers=list(layers), combine=combine, pooling=pooling)


def mlp_config(probe_cfg) -> MLPConfig:
    """The experiment's `probe` section as the probes package's ProbeMLPConfig."""
    return MLPConfig(hidden_dim=probe_cfg.hidden_dim, dropout=probe_cfg.dropout, loss=probe_cfg.loss,
                     lr=probe_cfg.lr, betas=tuple(probe_cfg.betas), weight_decay=probe_cfg.weight_decay,
                     epochs=probe_cfg.epochs, batch_size=probe_cfg.batch_size, patience=probe_cfg.patience,
                     seed=probe_cfg.seed)


# ----------------------------------------------------------------------------- checks
def check_row_set(rows: RowSet, split: str, role_hint: str = "") -> None:
    """Clear errors for empty sets, NaN/inf features, bad labels or log-probs (naming the sample)."""
    where = f"{split} rows of {rows.name}{role_hint}"
    if len(rows) == 0:
        raise TrainingDataError(f"empty {where}: no samples to {'train' if split == 'training' else 'validate'} on "
                                f"({ROW_SETS[rows.name].description}); check data.models, the data folder and "
                                "probe.val_fraction")
    bad = (~torch.isfinite(rows.x)).flatten(1).any(dim=1)
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0])
        raise TrainingDataError(f"{where}: {int(bad.sum())} of {len(rows)} rows have NaN/inf features, "
                                f"first sample_id {rows.sample_ids[first]!r}")
    label = ROW_SETS[rows.name].label
    y = rows.y.double()
    bad_y = ~torch.isfinite(y) | (y < 0) | (y > 1)
    if bool(bad_y.any()):
        first = int(torch.nonzero(bad_y)[0])
        raise TrainingDataError(f"{where}: field {label!r} must be a probability in [0, 1]; {int(bad_y.sum())} rows "
                                f"are not (null/NaN/out of range), first sample_id {rows.sample_ids[first]!r} "
                                f"with {float(y[first])!r}")
    bad_lp = ~np.isfinite(rows.logprob)
    if bad_lp.any():
        first = int(np.flatnonzero(bad_lp)[0])
        raise TrainingDataError(f"{where}: {int(bad_lp.sum())} rows have a non-finite length-normalised "
                                f"log-probability, first sample_id {rows.sample_ids[first]!r}")


def check_labels_vary(train: Sequence[RowSet], plan: ProbePlan) -> None:
    y = torch.cat([s.y for s in train])
    if y.numel() and float(y.max()) == float(y.min()):
        raise TrainingDataError(
            f"single-class training set for {plan.name} ({' + '.join(plan.train_sets)}): all {y.numel()} "
            f"labels equal {float(y[0]):.4g}; there is nothing to learn (too few samples per context, a judge "
            "that merges everything, or a split that kept one kind of question)")


# ----------------------------------------------------------------------------- training
@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Temporarily set torch's CPU thread count (None: leave it)."""
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass
class TrainedProbe:
    plan: ProbePlan
    probe: HiddenStateProbe
    cols: list[int]
    history: FitHistory | None  # the MLP's epochs (None for the logistic probe)
    seconds: float
    n_train: int
    n_val: int
    selection: list[dict[str, Any]] | None = None  # logistic: every (row, pooling, l2) tried, validation scores

    @property
    def pooling(self) -> str:
        return self.probe.spec.pooling

    def predict(self, rows: RowSet) -> np.ndarray:
        if len(rows) == 0:
            return np.empty(0)
        return self.probe.predict_proba(rows.x[:, self.cols]).double().numpy()

    def to_metrics(self) -> dict[str, Any]:
        out = {"kind": self.probe.KIND, "trained_on": self.plan.train_sets, "features": self.probe.spec.to_dict(),
               "n_train": self.n_train, "n_val": self.n_val, "seconds": self.seconds}
        if self.history is not None:
            out["history"] = self.history.to_dict()
        if self.selection is not None:
            out["l2"] = self.probe.l2
            out["selection"] = self.selection
        return out

    @classmethod
    def restore(cls, plan: ProbePlan, probe: HiddenStateProbe, spec_entry,
                recorded: dict[str, Any]) -> TrainedProbe | None:
        """A probe an earlier run trained, rebuilt from its saved weights and what `to_metrics` recorded of it;
        spec_entry is `prepare_probes`' specs[plan.name] (its stored columns). None when this run would read other
        features (the probe is then trained again)."""
        candidates = spec_entry if plan.model == "logistic" else [spec_entry]
        cols = next((c for spec, c in candidates if spec.to_dict() == probe.spec.to_dict()), None)
        if cols is None or probe.KIND != recorded.get("kind"):
            return None
        history = FitHistory.from_dict(recorded["history"]) if recorded.get("history") else None
        return cls(plan, probe, cols, history, float(recorded.get("seconds") or 0.0), int(recorded["n_train"]),
                   int(recorded["n_val"]), recorded.get("selection"))


def _stack(sets: Sequence[RowSet], cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([s.x[:, cols] for s in sets]), torch.cat([s.y for s in sets])


def _provenance(plan: ProbePlan, n_train: int, n_val: int, **more: Any) -> dict[str, Any]:
    return {"component": plan.name, "role": plan.role, "kind": plan.kind, "description": plan.description,
            "trained_on": list(plan.train_sets), "n_train": n_train, "n_val": n_val, **more}


def train_one(plan: ProbePlan, spec: FeatureSpec, cols: list[int], train: Sequence[RowSet], val: Sequence[RowSet],
              cfg: MLPConfig, log_fn: LogFn | None = None, device: str = "cpu") -> TrainedProbe:
    tx, ty = _stack(train, cols)
    vx, vy = _stack(val, cols)
    start = time.perf_counter()
    probe, history = fit_probe(tx, ty, vx, vy, spec, cfg, log_fn=log_fn, device=device)
    probe = probe.cpu()
    probe.extra = _provenance(plan, int(tx.shape[0]), int(vx.shape[0]), best_epoch=history.best_epoch,
                              epochs_run=history.epochs_run)
    return TrainedProbe(plan, probe, cols, history, time.perf_counter() - start, int(tx.shape[0]), int(vx.shape[0]))


def logistic_candidates(engine: dict, kept: Sequence[int], option: str, poolings: Sequence[str],
                        role: str) -> list[tuple[FeatureSpec, list[int]]]:
    """(spec, stored column) of every one-row reading the logistic probe may choose: probe.logistic_layers ("all":
    every row the data stored) x probe.logistic_pooling."""
    rows = (list(kept) if str(option).strip().lower() == "all"
            else feature_spec(engine, kept, option, "concat", "mean", role)[0].layers)
    return [feature_spec(engine, kept, str(row), "concat", pooling, role) for pooling in poolings for row in rows]


def train_logistic(plan: ProbePlan, candidates: list[tuple[FeatureSpec, list[int]]],
                   sets: dict[str, dict[str, dict[str, RowSet]]], l2s: Sequence[float],
                   progress: bool = False) -> TrainedProbe:
    """Fit the logistic probe for every candidate reading and L2 strength on the plan's training rows; keep the
    one with the lowest validation log-loss (validation questions only). progress: a bar over the readings (a
    full-size model's every row and pooling: minutes)."""
    start = time.perf_counter()
    options, ys = {}, {}
    for spec, cols in candidates:
        train = [sets[spec.pooling]["train"][n] for n in plan.train_sets]
        val = [sets[spec.pooling]["val"][n] for n in plan.train_sets]
        tx, ty = _stack(train, cols)
        vx, vy = _stack(val, cols)
        options[(spec.pooling, spec.layers[0])] = Candidate(spec, tx, vx)
        ys = {"train": ty, "val": vy}  # the same rows in the same order under every pooling
    with tqdm(total=len(options), desc=f"{plan.name}: readings", unit="reading", leave=False,
              disable=not progress) as bar:
        chosen = select_logistic(options, ys["train"], ys["val"], l2s, on_candidate=bar.update)
    pooling, row = chosen.key
    cols = next(c for s, c in candidates if s.pooling == pooling and s.layers == [row])
    n_train, n_val = int(ys["train"].shape[0]), int(ys["val"].shape[0])
    probe = chosen.probe
    probe.extra = _provenance(plan, n_train, n_val, l2=probe.l2, chosen_on="validation log-loss",
                              newton_iterations=getattr(probe, "newton_iterations", None))
    table = [{k: v for k, v in r.items() if k != "candidate"} for r in chosen.table]
    return TrainedProbe(plan, probe, cols, None, time.perf_counter() - start, n_train, n_val, table)


@dataclass
class SetBaselines:
    """The baselines of one row set, fitted on that set's training rows only: its constant (mean label) and
    its log-prob input calibrated by a 1-D logistic fit and by isotonic regression."""

    constant: ConstantBaseline
    logprob: LogprobBaseline
    logprob_isotonic: LogprobBaseline

    def predict(self, rows: RowSet) -> dict[str, np.ndarray]:
        return {"constant": self.constant.predict(len(rows)), "logprob": self.logprob.predict(rows.logprob),
                "logprob_isotonic": self.logprob_isotonic.predict(rows.logprob)}

    def to_dict(self) -> dict[str, Any]:
        return {"constant": self.constant.to_dict(), "logprob": self.logprob.to_dict(),
                "logprob_isotonic": self.logprob_isotonic.to_dict()}

    @classmethod
    def fit(cls, rows: RowSet) -> SetBaselines:
        y = rows.y.double().numpy()
        return cls(ConstantBaseline.fit(y), LogprobBaseline.fit(rows.logprob, y, "logistic"),
                   LogprobBaseline.fit(rows.logprob, y, "isotonic"))


@dataclass
class RoleBaselines:
    """The role's baselines over its main probe's training sets together (what baselines.json kept before
    per-set baselines; the per-set ones are what reports compare against)."""

    constant: ConstantBaseline
    logprob: LogprobBaseline

    def to_dict(self) -> dict[str, Any]:
        return {"constant": self.constant.to_dict(), "logprob": self.logprob.to_dict()}


def fit_baselines(train: Sequence[RowSet], kind: str) -> RoleBaselines:
    y = np.concatenate([s.y.double().numpy() for s in train])
    lp = np.concatenate([s.logprob for s in train])
    return RoleBaselines(ConstantBaseline.fit(y), LogprobBaseline.fit(lp, y, kind))


def report(pred: np.ndarray, rows: RowSet) -> dict[str, Any]:
    """probe_report against the soft labels (AUROC/AUPRC for 'this meaning is the majority': label >= 0.5)."""
    return probe_report(np.clip(pred, 0.0, 1.0), rows.y.double().numpy(), threshold=0.5, n_bins=10)


@dataclass
class ProbeResults:
    probes: dict[str, TrainedProbe] = field(default_factory=dict)
    baselines: dict[str, RoleBaselines] = field(default_factory=dict)  # by role
    set_baselines: dict[str, SetBaselines] = field(default_factory=dict)  # by row set
    metrics: dict[str, Any] = field(default_factory=dict)


def logistic_poolings(probe_cfg, stored: Sequence[str]) -> list[str]:
    """The poolings the logistic probe chooses from: probe.logistic_pooling, of those the data stores (a folder made
    with data.store_last_token=false has only "mean")."""
    kept = [p for p in probe_cfg.logistic_pooling if p in stored]
    if not kept:
        raise TrainingDataError(f"probe.logistic_pooling={list(probe_cfg.logistic_pooling)}, but the data stores only "
                                f"{list(stored)} features (data.store_last_token was false): set "
                                f"probe.logistic_pooling=[{', '.join(stored)}]")
    return kept


def _poolings(plans: Sequence[ProbePlan], probe_cfg, stored: Sequence[str]) -> list[str]:
    if probe_cfg.pooling not in stored:
        raise TrainingDataError(f"probe.pooling={probe_cfg.pooling}, but the data stores only {list(stored)} features "
                                "(data.store_last_token was false): set probe.pooling=mean")
    wanted = [probe_cfg.pooling]
    if any(p.model == "logistic" for p in plans):
        wanted += logistic_poolings(probe_cfg, stored)
    return list(dict.fromkeys(wanted))


def prepare_probes(ds, probe_cfg, models: Sequence[str], split_of: Callable[[np.ndarray], np.ndarray]):
    """Load and check every row set and spec BEFORE training: returns (plans, specs, sets, {skipped: reason}).

    sets[pooling][split][set name] holds the rows; specs[plan] is (spec, stored columns) for an MLP plan and
    the list of candidate readings for a logistic plan."""
    plans = plan_probes(probe_cfg, models)
    names = sorted({n for p in plans for n in p.train_sets + p.eval_sets})
    sets: dict[str, dict[str, dict[str, RowSet]]] = {}
    for pooling in _poolings(plans, probe_cfg, ds.poolings):
        sets[pooling] = {"train": {}, "val": {}, "test": {}}
        for name in names:
            rows = load_row_set(ds, name, pooling)
            sides = split_of(rows.questions)
            for side in sets[pooling]:
                sets[pooling][side][name] = rows.take(sides == side)
    specs, skipped = {}, {}
    for plan in plans:
        engine, kept = ds.manifest["engines"][plan.role], ds.layers(plan.role)
        if plan.kind == "last_layer" and int(engine["num_layers"]) not in kept:
            skipped[plan.name] = f"the data holds no last-layer features (stored rows {kept})"
            continue
        if plan.model == "logistic":
            specs[plan.name] = logistic_candidates(engine, kept, probe_cfg.logistic_layers,
                                                   logistic_poolings(probe_cfg, ds.poolings), plan.role)
        else:
            specs[plan.name] = feature_spec(engine, kept, plan.layers, probe_cfg.combine, probe_cfg.pooling,
                                            plan.role)
    for plan in plans:
        if plan.name not in specs:
            continue
        for pooling in sets:
            hint = f" (for {plan.name}, {pooling} pooling)"
            # a training set needs training and validation rows; held-out rows, and sets only scored, are read
            # after training: any of them that is bad must stop the run now
            for name in dict.fromkeys(plan.train_sets + plan.eval_sets):
                for side, label in (("train", "training"), ("val", "validation"), ("test", "test")):
                    rows = sets[pooling][side][name]
                    if len(rows) or (name in plan.train_sets and side != "test"):
                        check_row_set(rows, label, hint)
        check_labels_vary([sets[probe_cfg.pooling]["train"][n] for n in plan.train_sets], plan)
    return [p for p in plans if p.name in specs], specs, sets, skipped


def train_probes(plans: list[ProbePlan], specs: dict, sets: dict[str, dict[str, dict[str, RowSet]]], probe_cfg,
                 curve: Callable[[str], LogFn] | None = None, device: str = "cpu",
                 out: ProbeResults | None = None, log: Callable[[str], None] | None = None,
                 progress: bool = False) -> ProbeResults:
    """Train every planned probe, the role baselines and the per-set baselines; score them on the validation
    (and test) rows. out: where the results go, filled as each probe finishes (so a caller keeps the finished ones
    when a later one fails); probes already in out.probes (an earlier run's, `TrainedProbe.restore`) are not
    trained again. log: a line as each probe starts; progress: a bar over the logistic probes' readings."""
    cfg = mlp_config(probe_cfg)
    out = out if out is not None else ProbeResults()
    main_sets = sets[probe_cfg.pooling]
    with torch_threads(probe_cfg.num_threads):
        for n, plan in enumerate(plans, start=1):
            if log is not None and plan.name not in out.probes:
                what = (f"logistic, {len(specs[plan.name])} readings x {len(probe_cfg.logistic_l2)} L2"
                        if plan.model == "logistic" else "MLP")
                log(f"probe {n}/{len(plans)}: {plan.name} ({what})")
            if plan.name in out.probes:  # restored
                pass
            elif plan.model == "logistic":
                out.probes[plan.name] = train_logistic(plan, specs[plan.name], sets, probe_cfg.logistic_l2, progress)
            else:
                spec, cols = specs[plan.name]
                train = [main_sets["train"][n] for n in plan.train_sets]
                val = [main_sets["val"][n] for n in plan.train_sets]
                out.probes[plan.name] = train_one(plan, spec, cols, train, val, cfg,
                                                  curve(plan.name) if curve else None, device)
            if plan.kind == "main":
                out.baselines[plan.role] = fit_baselines([main_sets["train"][n] for n in plan.train_sets],
                                                         probe_cfg.logprob_baseline)
        for name in sorted({n for p in plans for n in p.train_sets + p.eval_sets}):
            train_rows = main_sets["train"].get(name)
            if train_rows is not None and len(train_rows):
                out.set_baselines[name] = SetBaselines.fit(train_rows)
        out.metrics = score_probes(out, sets)
    return out


def score_probes(results: ProbeResults, sets: dict[str, dict[str, dict[str, RowSet]]]) -> dict[str, Any]:
    """metrics[main probe][split][eval set] = {probe, <other kind>, variant?, last_layer, logprob, logprob_isotonic,
    constant: report}; every baseline is the eval set's own."""
    metrics: dict[str, Any] = {}
    for name, trained in results.probes.items():
        plan = trained.plan
        if plan.kind not in ("main", "acceptance"):
            continue
        entry: dict[str, Any] = {"role": plan.role, **trained.to_metrics()}
        for other in results.probes.values():
            if plan.kind == "main" and other.plan.role == plan.role and other.plan.kind in ("logistic", "mlp"):
                entry[other.plan.kind] = other.to_metrics()
        for split in ("val", "test"):
            per_set = {}
            for set_name in plan.eval_sets:
                if len(sets[trained.pooling][split].get(set_name, ())) == 0:
                    continue
                per_set[set_name] = _score_set(results, plan, sets, split, set_name)
            if per_set:
                entry[split] = per_set
        metrics[name] = entry
    return metrics


def _score_set(results: ProbeResults, plan: ProbePlan, sets, split: str, set_name: str) -> dict[str, Any]:
    def rows_for(trained: TrainedProbe) -> RowSet:
        return sets[trained.pooling][split][set_name]

    main = results.probes[plan.name]
    scores = {"probe": report(main.predict(rows_for(main)), rows_for(main))}
    for other in results.probes.values():
        if plan.kind == "main" and other.plan.role == plan.role and other.plan.kind not in ("main", "acceptance"):
            scores[other.plan.kind] = report(other.predict(rows_for(other)), rows_for(other))
    rows = next(iter(sets.values()))[split][set_name]  # labels and log-probs do not depend on the pooling
    if set_name in results.set_baselines:
        for label, pred in results.set_baselines[set_name].predict(rows).items():
            scores[label] = report(pred, rows)
    return scores
