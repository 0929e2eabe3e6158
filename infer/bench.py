"""probe-bench as a library: run several decoding methods over the same problems in ONE run and report
pass@1, latency, speedup over target-only (measured in the same run), acceptance, Ratio, and next to each
measured speedup the analytic one at the α and c measured in that run (`infer.decoding.analytic`).

    from specprobe.train.config import load_config
    from specprobe.infer import bench
    cfg = load_config("configs/tiny.yaml", ["bench.num_problems=2"])
    env = bench.prepare(cfg.bench_setup(), verifier="bernoulli")
    report = bench.run_benchmark(env, ["target", "lr_sync", "lr_async"])
    print(bench.format_markdown(report))

Problems and methods are interleaved (problem 1 with every method, then problem 2, ...), so a change of
machine load during the run hits every method alike. Methods: target, draft, semanticspec, lr_sync,
lr_async, specs / beam_target (SpecS and its target beam-search baseline), seed_tot / tot_target (SEED
tree of thoughts and its target-only baseline), with optional "+ngram" / "+assistant" / "+lookahead"
(token speculation inside target steps; lookahead = Lookahead Decoding) and ":key=value" options overrides
(gamma, width, max_steps, max_new_tokens, seed, verifier, alpha, forecast_skip), e.g.
"lr_sync:width=2:gamma=2" or "semanticspec:verifier=probe"; "gamma=adaptive" lets each cycle of semanticspec /
lr_sync / lr_async draft as far as predicted acceptance pays (`infer.decoding.depth`, runtime.adaptive), and
"forecast_skip=true" beside it (or runtime.adaptive.forecast_skip) lets a cycle of lr_sync / semanticspec draft
nothing when the last estimate says no draft pays.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from specprobe.infer.acceptance_estimate import LatentDifficulty, SimulatedAcceptance, load_acceptance_probe
from specprobe.infer.answers import extract_boxed, grade, split_gsm8k, strip_thousands_separators
from specprobe.infer.bench_plot import FIGURE
from specprobe.infer.bench_resume import KEY_SECTIONS, ProblemLog, open_problem_log, run_key
from specprobe.infer.checkpoint_format import CheckpointError, read_metrics
from specprobe.infer.config import BenchSetup
from specprobe.infer.decoding import (
    METHODS,
    REGISTRY,
    DecodeOptions,
    RunStats,
    decode,
    fast_thread_switching,
    read_trace,
    write_trace,
)
from specprobe.infer.decoding.analytic import predict, token_level_factor
from specprobe.infer.decoding.depth import AdaptiveDepth
from specprobe.infer.decoding.seed import SeedConfig, seed_predicted_speedup
from specprobe.infer.decoding.specs import SpecSConfig, specs_predicted_speedup
from specprobe.infer.engines import build_engine_pair, sampling_params
from specprobe.infer.engines.token_spec import LookaheadConfig, TokenSpecConfig
from specprobe.infer.verifiers import CHECKPOINT_KINDS, VERIFIER_KINDS, build_verifier, check_checkpoint
from specprobe.inputs.config import ConfigError, to_dict
from specprobe.inputs.progress import progress_line
from specprobe.inputs.records import (
    HUB_NAMES,
    BenchSourceConfig,
    family_value,
    field_value,
    iter_reasoning_gym_items,
    iter_records,
    question_digest,
    record_id,
    source_stem,
)
from specprobe.probes.io import write_text
from specprobe.probes.metrics import bootstrap_ci, wilson_interval

# benchmark sets by short name (kind: jsonl, name: <short name>; the hub ids are inputs.records.HUB_NAMES),
# reachable when a hub or a datasets cache exists, and the split each is read from
BENCH_SPLITS = {"gsm8k": "test", "math500": "test", "aime24": "train", "amc23": "test"}
QUESTION_KEYS = ("question", "problem", "prompt", "input", "Question", "Problem")
ANSWER_KEYS = ("answer", "final_answer", "target", "expected_answer", "Answer", "solution")


# ----------------------------------------------------------------------------- problems
@dataclass
class Problem:
    id: str
    question: str
    answer: str | None
    family: str | None = None  # the template it was drawn from (the intervals draw whole families)


def _gold(record: dict) -> str | None:
    answer = _find_gold(record)
    return None if answer is None else strip_thousands_separators(answer)


def _find_gold(record: dict) -> str | None:
    for key in ANSWER_KEYS:
        value = record.get(key)
        if value is None:
            continue
        text = str(value)
        gsm = split_gsm8k(text)
        if gsm is not None:  # GSM8K rationale
            return gsm[1]
        if key == "solution":
            return extract_boxed(text) or text.strip()
        return text.strip()
    return None


def _renamed(rec, fields: dict | None) -> dict:
    """A record read through bench.source.fields ({question: query, ...}: the canonical name and the record's, a
    dotted name walking nested fields, null: not mapped), as the data stage reads a jsonl source: a mapped question
    the record lacks is an error naming both; another mapped field it lacks reads as absent."""
    mapped = {canon: name for canon, name in (fields or {}).items() if name}
    if not mapped:
        return rec.record
    if "question" in mapped and field_value(rec.record, mapped["question"]) is None:
        raise ConfigError(f"{rec.where}: no field {mapped['question']!r} (bench.source.fields.question); the record "
                          f"has {sorted(rec.record)}")
    renamed = {k: v for k, v in rec.record.items() if k not in mapped}
    return {**renamed, **{canon: field_value(rec.record, name) for canon, name in mapped.items()}}


def _from_records(records, stem: str, limit: int, fields: dict | None = None,
                  domains: Sequence[str] | None = None) -> list[Problem]:
    problems = []
    wanted = None if domains is None else {d.lower() for d in domains}
    for rec in records:
        record = _renamed(rec, fields)
        if wanted is not None and str(record.get("domain") or "unknown").lower() not in wanted:
            continue
        question = next((record[k] for k in QUESTION_KEYS if isinstance(record.get(k), str) and record[k].strip()),
                        None)
        if question is None:
            raise ConfigError(f"{rec.where}: no question field (looked for {list(QUESTION_KEYS)})")
        # ids as the data stage reads them (inputs.records), MATH-500's unique_id before the numbered default
        pid = record_id(record.get("id")) or record_id(record.get("unique_id")) or f"{stem}-{rec.index}"
        problems.append(Problem(pid, question, _gold(record), _family(record, rec.where)))
        if len(problems) >= limit:
            break
    return problems


def _family(record: dict, where: str) -> str | None:
    """A record's `family` field (as probe-train's test questions carry it; `inputs.records.family_value`), or an
    error naming the record."""
    try:
        return family_value(record.get("family"))
    except ValueError as err:
        raise ConfigError(f"{where}: field 'family' {err} (the problem's template, whose problems the intervals "
                          "draw together); fix or drop it") from None


def _records(path: str | None, name: str | None, config: str | None, split: str):
    try:
        return iter_records(path, name, config, split)
    except (FileNotFoundError, RuntimeError) as err:
        raise ConfigError(f"bench.source: {err}\nWith no hub access, point bench.source.path at a local "
                          ".jsonl/.parquet file (kind: jsonl).") from None


def load_problems(src: BenchSourceConfig, limit: int) -> list[Problem]:
    """Problems for the benchmark: reasoning-gym (offline), GSM8K, or any jsonl/parquet/hub data set. Problems
    without a reference answer are timed but not graded, and a warning says how many (pass@1 leaves them out)."""
    problems = _load_problems(src, limit)
    ungraded = [p.id for p in problems if p.answer is None]
    if ungraded:
        mapped = (src.fields or {}).get("answer")
        logging.getLogger(__name__).warning(
            "%d of %d problems have no reference answer (%s; first: %s): pass@1 %s", len(ungraded), len(problems),
            f"bench.source.fields.answer={mapped!r}" if mapped else f"looked for {list(ANSWER_KEYS)}",
            ungraded[0], "is n/a" if len(ungraded) == len(problems) else "is over the others")
    return problems


def _load_problems(src: BenchSourceConfig, limit: int) -> list[Problem]:
    if src.kind == "reasoning_gym":
        items = iter_reasoning_gym_items(src.task, max(src.size, limit), src.seed)
        # the reference answer read as from any other record (and as the data stage reads it): stripped, without
        # thousands separators
        return [Problem(it.id, it.raw.record["question"], _gold({"answer": it.raw.record["answer"]}), it.family)
                for it in itertools.islice(items, limit)]
    if src.kind in ("gsm8k", "jsonl"):
        if src.path:
            return _from_records(_records(src.path, None, None, src.split or "train"), source_stem(src.path, None),
                                 limit, src.fields, src.domains)
        name = src.name or "gsm8k"  # (the config refuses kind jsonl with neither a path nor a name)
        split = src.split or _bench_split(name, "train")  # a split set in the config wins
        return _from_records(_records(None, name, None, split), source_stem(None, name), limit, src.fields,
                             src.domains)
    raise ConfigError(f"probe-bench reads reasoning_gym, gsm8k or jsonl problems, not {src.kind!r} "
                      f"(MATH-500 / AIME24 / AMC23: kind jsonl with a local path or name {sorted(BENCH_SPLITS)})")


def _bench_split(name: str, default: str) -> str:
    """The split a benchmark set is read from unless the config names one, the set named by its short name or its
    hub id (openai/gsm8k is gsm8k)."""
    by_hub = {HUB_NAMES[k].lower(): v for k, v in BENCH_SPLITS.items() if k in HUB_NAMES}
    return BENCH_SPLITS.get(name) or by_hub.get(name.rstrip("/").lower(), default)


# ----------------------------------------------------------------------------- methods
@dataclass
class MethodSpec:
    label: str
    base: str
    token_spec: str = "none"  # none | ngram | assistant | lookahead
    overrides: dict = field(default_factory=dict)


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")


FORECAST_SKIP_METHODS = ("lr_sync", "semanticspec")  # the sync cycles DecodeOptions.forecast_skip applies to
_OVERRIDE_TYPES = {"gamma": int, "width": int, "max_steps": int, "max_new_tokens": int, "seed": int,
                   "verifier": str, "alpha": float, "forecast_skip": _flag}


def parse_method(text: str) -> MethodSpec:
    """'lr_sync+ngram:gamma=2:width=2' -> MethodSpec (options separated by ':')."""
    label = text.strip()
    head, _, opts = label.partition(":")
    base, *mods = head.split("+")
    if base not in METHODS:
        raise ConfigError(f"unknown method {base!r} in {text!r}; methods: {', '.join(METHODS)} "
                          "(optionally +ngram / +assistant / +lookahead and :key=value...)")
    token_spec = "none"
    for mod in mods:
        if mod not in ("ngram", "assistant", "lookahead"):
            raise ConfigError(f"unknown method suffix +{mod} in {text!r}; use +ngram, +assistant or +lookahead")
        token_spec = mod
    overrides: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in opts.split(":"))):
        key, eq, value = part.partition("=")
        if key == "gamma" and value == "adaptive":  # each cycle's depth from predicted acceptance
            overrides["gamma_policy"] = "adaptive"
            continue
        if not eq or key not in _OVERRIDE_TYPES:
            raise ConfigError(f"bad method option {part!r} in {text!r}; options: {sorted(_OVERRIDE_TYPES)}")
        try:
            overrides[key] = _OVERRIDE_TYPES[key](value)
        except ValueError:
            kind = "true or false" if _OVERRIDE_TYPES[key] is _flag else _OVERRIDE_TYPES[key].__name__
            raise ConfigError(f"method option {key} in {text!r} must be {kind}") from None
    if "forecast_skip" in overrides and base not in FORECAST_SKIP_METHODS:
        raise ConfigError(f"forecast_skip in {text!r} applies to {' and '.join(FORECAST_SKIP_METHODS)} with "
                          "gamma=adaptive (lr_async judges its first pending draft's estimate instead)")
    if overrides.get("verifier") is not None and overrides["verifier"] not in VERIFIER_KINDS:
        raise ConfigError(f"unknown verifier {overrides['verifier']!r} in {text!r}")
    small = [k for k in ("gamma", "width", "max_steps", "max_new_tokens") if k in overrides and overrides[k] < 1]
    if small:
        raise ConfigError(f"method option {small[0]} in {text!r} must be >= 1, got {overrides[small[0]]}")
    return MethodSpec(label, base, token_spec, overrides)


def options_from_config(setup: BenchSetup, system_speed: bool = False) -> DecodeOptions:
    """DecodeOptions from the runtime and sampling sections. System-speed runs decode greedily: random
    weights give near-uniform distributions whose top-p nucleus is the whole vocabulary, so sampling
    would cost a full-vocabulary sort per token, which no real model pays."""
    rt, delimiter, sampling = setup.runtime, setup.delimiter, setup.sampling
    if system_speed:
        sampling = replace(sampling, temperature=0.0, draft_temperature=None)
    return DecodeOptions(
        gamma=rt.gamma, width=rt.width, max_new_tokens=rt.max_new_tokens, max_steps=rt.max_steps, seed=rt.seed,
        accept_length_cut=rt.accept_length_cut or system_speed, judge_after_cut=rt.judge_after_cut,
        refuse_boxed=rt.refuse_boxed, accept_draws=rt.accept_draws,
        target_params=sampling_params(sampling, "target", delimiter, seed=rt.seed),
        draft_params=sampling_params(sampling, "draft", delimiter, seed=rt.seed),
        forecast_skip=rt.adaptive.forecast_skip)


# ----------------------------------------------------------------------------- setup
@dataclass
class BenchEnv:
    setup: BenchSetup
    target: Any
    draft: Any
    problems: list[Problem]
    opts: DecodeOptions
    system_speed: bool
    verifier_kind: str
    checkpoint: str | None
    _verifiers: dict = field(default_factory=dict)
    _depth: dict = field(default_factory=dict)
    trained_on: list[str] = field(default_factory=list)  # problems the checkpoint trained or validated on

    def difficulty(self, alpha: float | None = None) -> LatentDifficulty:
        """The Bernoulli verifier's acceptance by answer position (runtime.difficulty; easy α: alpha)."""
        rt = self.setup.runtime
        d = rt.difficulty
        easy = d.easy_alpha if d.easy_alpha is not None else (rt.bernoulli_alpha if alpha is None else alpha)
        return LatentDifficulty(easy, d.hard_alpha if d.hard_share > 0 else easy, d.hard_share, d.persistence,
                                d.noise, rt.seed)

    def depth_policy(self, verifier_kind: str | None = None, alpha: float | None = None) -> AdaptiveDepth:
        """gamma=adaptive's policy: a Bernoulli verifier's simulated acceptance probe, else the checkpoint's
        acceptance probe on the draft; one per verifier, so the costs are measured once."""
        kind = verifier_kind or self.verifier_kind
        key = (kind, alpha if kind == "bernoulli" else None)
        if key not in self._depth:
            if kind == "bernoulli":
                estimator = SimulatedAcceptance(self.difficulty(alpha))
            else:
                if self.checkpoint is None:
                    raise ConfigError("gamma=adaptive reads the checkpoint's acceptance probe: pass --checkpoint "
                                      "(or runtime.checkpoint), or use the bernoulli verifier")
                estimator = load_acceptance_probe(self.checkpoint, self.draft,
                                                  device=self.setup.models.resolved_device("draft"),
                                                  allow_model_mismatch=self.setup.runtime.allow_model_mismatch)
            ad = self.setup.runtime.adaptive
            self._depth[key] = AdaptiveDepth(estimator, ad.c, ad.b, ad.v)
        return self._depth[key]

    def verifier(self, kind: str | None = None, alpha: float | None = None):
        kind = kind or self.verifier_kind
        rt = self.setup.runtime
        alpha = rt.bernoulli_alpha if alpha is None else alpha
        key = (kind, alpha if kind == "bernoulli" else None)
        if key not in self._verifiers:
            judge_engine = self.target if rt.llm_judge_model == "target" else None
            self._verifiers[key] = build_verifier(
                kind, checkpoint=self.checkpoint, target_engine=self.target, draft_engine=self.draft, alpha=alpha,
                llm_judge_model=None if judge_engine is not None else rt.llm_judge_model,
                llm_judge_engine=judge_engine, device=self.setup.models.resolved_device(), eps=rt.probe_eps,
                threshold=rt.judge_threshold, allow_model_mismatch=rt.allow_model_mismatch,
                judge_base=rt.checkpoint_judge_base, embedding_model=rt.checkpoint_embedding_model,
                difficulty=self.difficulty(alpha) if kind == "bernoulli" and rt.difficulty.hard_share > 0 else None)
        return self._verifiers[key]


def prepare(setup: BenchSetup, *, checkpoint: str | None = None, verifier: str | None = None,
            system_speed: bool | None = None, engines: tuple | None = None,
            problems: Sequence[Problem] | None = None, methods: Sequence[str] | None = None) -> BenchEnv:
    """Load models, problems and the verifier a benchmark needs (engines=(target, draft) reuses loaded ones).
    methods: what will run (default bench.methods): the run's verifier is checked and loaded only when one of them
    judges with it (target and draft alone need none)."""
    system = setup.bench.system_speed if system_speed is None else system_speed
    # what fails without a model is checked before the models load (minutes for a 32B)
    if system and verifier not in (None, "bernoulli"):
        raise ConfigError(f"--system-speed judges with the Bernoulli verifier (runtime.bernoulli_alpha), not "
                          f"{verifier!r}: drop --verifier, or run without --system-speed")
    kind = "bernoulli" if system else (verifier or setup.runtime.verifier)
    if kind not in VERIFIER_KINDS:
        raise ConfigError(f"unknown verifier {kind!r}; choose one of {', '.join(VERIFIER_KINDS)}")
    ckpt = checkpoint or setup.runtime.checkpoint
    if ckpt is None and setup.checkpoint_dir is not None and Path(setup.checkpoint_dir).is_dir():
        ckpt = str(setup.checkpoint_dir)
    specs = method_specs(methods or setup.bench.methods)
    judges = any(REGISTRY[s.base].needs_verifier and "verifier" not in s.overrides for s in specs)
    # every kind a method judges with, the ones it names itself (`:verifier=probe`) too: a mistyped --checkpoint
    # fails here, not after target and draft decoded every problem
    for used in sorted(verifier_kinds(specs, kind)):
        check_checkpoint(used, ckpt)
    probs = list(problems) if problems is not None else load_problems(setup.bench.source, setup.bench.num_problems)
    if not probs:
        raise ConfigError("no problems to benchmark")
    if engines is not None:
        target, draft = engines
    else:
        models = setup.models
        names = (setup.bench.system_target, setup.bench.system_draft) if system else (models.target, models.draft)
        target, draft = build_engine_pair(models, names, token_spec=start_token_spec(setup.runtime),
                                          stop_at_eos=not system)
    env = BenchEnv(setup, target, draft, probs, options_from_config(setup, system), system, kind, ckpt,
                   trained_on=problems_trained_on(probs, ckpt if reads_checkpoint(specs, kind) else None, system))
    if judges and (kind != "bernoulli" or system):
        env.verifier()  # load now: a missing or mismatched checkpoint fails before any decoding
    return env


def verifier_kinds(specs: Sequence[MethodSpec], kind: str) -> set[str]:
    """The verifier kinds the methods judge with: the run's `kind`, or the one a method names (`:verifier=`)."""
    return {s.overrides.get("verifier") or kind for s in specs if REGISTRY[s.base].needs_verifier}


def reads_checkpoint(specs: Sequence[MethodSpec], kind: str) -> bool:
    """Does a method judge with a verifier loaded from the checkpoint (probe, embedding, judge)?"""
    return bool(verifier_kinds(specs, kind) & set(CHECKPOINT_KINDS))


def problems_trained_on(problems: Sequence[Problem], checkpoint: str | Path | None,
                        system_speed: bool = False) -> list[str]:
    """The problems whose question (by its text: ids differ between files) or family (template) the checkpoint's
    probe-train run trained or validated on (its metrics.json split), with a warning: a verifier's acceptance there
    is not a held-out figure. probe-train writes <output_dir>/test_questions.jsonl for a clean benchmark. Empty
    without a checkpoint, or in system-speed mode (random weights: nothing was trained on them)."""
    if checkpoint is None or system_speed:
        return []
    try:
        split = read_metrics(checkpoint).get("split") or {}
    except CheckpointError:  # (a damaged metrics.json: the verifier's loading says so)
        return []
    digests = {d for side in ("train", "val") for d in (split.get("question_digests") or {}).get(side) or []}
    families = {f for side in ("train", "val") for f in (split.get("families") or {}).get(side) or []}
    seen = [p.id for p in problems
            if question_digest(p.question) in digests or (p.family is not None and p.family in families)]
    if seen:
        logging.getLogger(__name__).warning(
            "%d of %d problems were trained or validated on by %s (their question or template; first: %s): the "
            "verifiers' acceptance on them is not held out; bench on <output_dir>/test_questions.jsonl for a clean "
            "figure", len(seen), len(problems), checkpoint, seen[0])
    return seen


# ----------------------------------------------------------------------------- running
@dataclass
class MethodResult:
    spec: MethodSpec
    stats: RunStats = field(default_factory=RunStats)
    correct: int = 0
    answered: int = 0
    latencies: list[float] = field(default_factory=list)
    error: str | None = None
    counts: list[ProblemCounts] = field(default_factory=list)  # each problem's, in the problems' order

    def to_record(self) -> dict:
        """JSON-ready: what `from_record` rebuilds (the spec is the caller's: a record keeps its label only)."""
        return {"label": self.spec.label, "stats": asdict(self.stats), "correct": self.correct,
                "answered": self.answered, "latencies": list(self.latencies), "error": self.error,
                "counts": [list(c) for c in self.counts]}

    @classmethod
    def from_record(cls, spec: MethodSpec, record: dict) -> MethodResult:
        known = {f.name for f in fields(RunStats)}
        stats = RunStats(**{k: v for k, v in record["stats"].items() if k in known})
        return cls(spec, stats, int(record["correct"]), int(record["answered"]), [float(x) for x in record["latencies"]],
                   record.get("error"), [ProblemCounts(*c) for c in record["counts"]])


class ProblemCounts(NamedTuple):
    """One problem's judged positions and acceptances, which α's interval resamples (`acceptance_interval`)."""
    accepted: int
    judged: int
    decided_accepted: int
    decided: int
    family: str | None = None  # the problem's family (template); None: it is its own
    correct: int = 0  # 1 when the method answered the problem correctly
    graded: int = 1  # 0: the problem has no reference answer, and pass@1 leaves it out


# probe-bench's intervals: 95% (the tables and the figure say so), percentile bootstraps of this many resamples
INTERVAL_RESAMPLES = 2000


def family_units(families: Sequence[str | None] | None, n: int) -> list[int]:
    """Each problem's resampling unit: its family's (problems of one template rise and fall together), or, for a
    problem without one, its own."""
    families = [None] * n if families is None else list(families)
    if len(families) != n:
        raise ValueError(f"{len(families)} families for {n} problems")
    code: dict[str, int] = {}
    return [code.setdefault(f, len(code)) if f is not None else -1 - i for i, f in enumerate(families)]


def speedup_interval(base: Sequence[float], mine: Sequence[float], families: Sequence[str | None] | None = None,
                     ) -> tuple[tuple[float, float] | None, str | None]:
    """95% interval of the pooled speedup sum(base) / sum(mine) (the target-only and the method's latency on each
    problem of one run) and what it resamples: a percentile bootstrap that draws each problem's two latencies
    together (paired: a long problem is long for both), whole families where problems share one. None with fewer
    than two units."""
    if len(base) != len(mine):
        raise ValueError(f"{len(base)} baseline latencies for {len(mine)} problems")
    units = family_units(families, len(base))
    kinds = len(set(units))
    if kinds < 2:
        return None, ("none: every problem is of one family" if len(base) > 1 else None)
    ci = bootstrap_ci(lambda b, m: b.sum() / m.sum(), np.asarray(base, dtype=float), np.asarray(mine, dtype=float),
                      n_boot=INTERVAL_RESAMPLES, alpha=0.05, groups=units)
    return (ci.low, ci.high), "families" if kinds < len(units) else "problems"


def per_problem_speedups(base: Sequence[float], mine: Sequence[float], families: Sequence[str | None] | None = None,
                         ) -> dict[str, Any] | None:
    """The speedup on each problem alone (target-only latency / the method's, same problem, same run): the ratios,
    in the problems' order, their median with its 95% interval (a percentile bootstrap over problems, whole families
    where they share one; None with fewer than two units), min and max (None without problems)."""
    if len(base) != len(mine):
        return None
    kept = [i for i, m in enumerate(mine) if m > 0]
    ratios = [base[i] / mine[i] for i in kept]
    if not ratios:
        return None
    units = family_units(None if families is None else [families[i] for i in kept], len(kept))
    median_ci = None
    if len(set(units)) >= 2:
        ci = bootstrap_ci(np.median, np.asarray(ratios), n_boot=INTERVAL_RESAMPLES, alpha=0.05, groups=units)
        median_ci = (ci.low, ci.high)
    return {"median": float(np.median(ratios)), "median_ci95": median_ci, "min": min(ratios), "max": max(ratios),
            "ratios": ratios}


def acceptance_interval(counts: Sequence[tuple[int, int]], families: Sequence[str | None] | None = None,
                        ) -> tuple[tuple[float, float] | None, str | None]:
    """95% interval of the pooled acceptance sum(accepted) / sum(judged) from per-problem (accepted, judged), and
    what it resamples. Positions within one problem are not independent draws (a probe's or a judge's verdicts
    follow the problem's difficulty; a position is judged only after the one before it passed), nor are problems
    drawn from one template (`families`, per problem; None: its own), so the percentile bootstrap resamples
    whole families ("families") or, where no two problems share one, problems ("problems"). With one problem
    only the Wilson interval over its judged positions is left ("positions": exact for the system-speed Bernoulli
    verifier, too narrow for a real one); several problems of one family give none (resampling one unit). Where
    every unit accepted the same share (none, all, or one rate) no resample can differ and the percentile interval
    collapses to a point; the Wilson interval over the units (each one trial at that rate) is given instead."""
    families = [None] * len(counts) if families is None else list(families)
    if len(families) != len(counts):
        raise ValueError(f"{len(families)} families for {len(counts)} problems")
    kept = [i for i, (_, j) in enumerate(counts) if j > 0]  # units numbered among the judged problems only
    judged = [(*counts[i], u) for i, u in zip(kept, family_units([families[i] for i in kept], len(kept)))]
    if not judged:
        return None, None
    if len(judged) == 1:
        return wilson_interval(*judged[0][:2]), "positions"
    acc = np.array([a for a, _, _ in judged], dtype=float)
    jud = np.array([j for _, j, _ in judged], dtype=float)
    units = np.array([u for _, _, u in judged])
    kinds = np.unique(units)
    if kinds.size == 1:
        return None, "none: every problem is of one family"
    over = "families" if kinds.size < len(judged) else "problems"
    ci = bootstrap_ci(lambda a, j: a.sum() / j.sum(), acc, jud, n_boot=INTERVAL_RESAMPLES, alpha=0.05, groups=units,
                      share=True)
    return (ci.low, ci.high), over + (" (Wilson: one rate in every unit)" if ci.wilson_units else "")


def pass_interval(counts: Sequence[ProblemCounts]) -> tuple[tuple[float, float] | None, str | None]:
    """95% interval of pass@1 and what it drew: Wilson over problems where each is its own (independent
    Bernoulli trials); where problems share a family (template), `acceptance_interval`'s draw of whole families
    over their (correct, 1) counts, as a template's problems are solved or missed together."""
    counts = [c for c in counts if c.graded]
    families = [c.family for c in counts]
    shared = len({f for f in families if f is not None}) + families.count(None) < len(counts)
    if not shared:
        return wilson_interval(sum(c.correct for c in counts), len(counts)), "problems" if counts else None
    return acceptance_interval([(c.correct, 1) for c in counts], families)


def is_adaptive(env: BenchEnv, spec: MethodSpec) -> bool:
    """Does this method choose its depth per cycle (:gamma=adaptive, or runtime.gamma_policy adaptive)?"""
    policy = spec.overrides.get("gamma_policy", env.setup.runtime.gamma_policy)
    if policy == "adaptive" and not REGISTRY[spec.base].adaptive:
        if "gamma_policy" in spec.overrides:
            raise ConfigError(f"{spec.label}: gamma=adaptive applies to "
                              f"{', '.join(m.name for m in REGISTRY.values() if m.adaptive)}")
        return False  # the config-wide policy leaves the other methods alone
    return policy == "adaptive"


def check_method(env: BenchEnv, spec: MethodSpec) -> None:
    """Refuse, before any decoding, options this method cannot use with this config."""
    if "forecast_skip" in spec.overrides and not is_adaptive(env, spec):
        raise ConfigError(f"{spec.label}: forecast_skip applies with gamma=adaptive (add :gamma=adaptive, or set "
                          "runtime.gamma_policy: adaptive)")


def forecast_skips(env: BenchEnv, spec: MethodSpec) -> bool:
    """Does this method's adaptive policy skip drafting on the forecast (option, else runtime.adaptive)?"""
    return (spec.base in FORECAST_SKIP_METHODS and is_adaptive(env, spec)
            and spec.overrides.get("forecast_skip", env.opts.forecast_skip))


def _method_options(env: BenchEnv, spec: MethodSpec, policy: bool = True) -> DecodeOptions:
    """The method's DecodeOptions; policy=False leaves out the adaptive depth policy (loaded on first use)."""
    ov = {k: v for k, v in spec.overrides.items() if k in ("gamma", "width", "max_steps", "max_new_tokens", "seed")}
    ov["forecast_skip"] = forecast_skips(env, spec)
    if is_adaptive(env, spec):
        ov["gamma"] = env.setup.runtime.adaptive.gamma_max
        if policy:
            ov["depth"] = env.depth_policy(spec.overrides.get("verifier"), spec.overrides.get("alpha"))
    return env.opts.replace(**ov)


def start_token_spec(rt) -> TokenSpecConfig | None:
    """Token speculation an engine must be started with (vLLM fixes it at start): runtime.token_spec ngram."""
    return _token_spec(rt, "ngram") if rt.token_spec == "ngram" else None


def _token_spec(rt, mode: str) -> TokenSpecConfig:
    la = rt.lookahead
    window = LookaheadConfig(la.window, la.ngram, la.max_verify, rt.seed) if mode == "lookahead" else None
    return TokenSpecConfig(mode, rt.num_speculative_tokens, rt.ngram_size, lookahead=window)


def _same_cache_state(env: BenchEnv) -> None:
    """Empty both engines' prompt-prefix caches, so every method (the baseline included) starts each
    problem cold and pays its own prompt prefill; otherwise a method run after another on the same
    question reuses the prefill that the earlier one paid for."""
    for engine in (env.target, env.draft):
        engine.clear_prefix_cache()


def _engines(env: BenchEnv, spec: MethodSpec) -> tuple:
    """(target, draft) for one generation, with the method's token-level speculation in the engine that writes
    the steps (the draft for draft-only, else the target) as a view of it (`with_token_spec`: the shared engines
    are never changed); +lookahead's rows each start a fresh window and pool."""
    rt = env.setup.runtime
    mode = spec.token_spec if spec.token_spec != "none" else rt.token_spec
    target, draft = env.target, env.draft
    writes = draft if spec.base == "draft" else target
    writer = writes.with_token_spec(None if mode == "none" else _token_spec(rt, mode),
                                    assistant=draft if mode == "assistant" else None)
    return (target, writer) if spec.base == "draft" else (writer, draft)


def _settings(env: BenchEnv, spec: MethodSpec):
    """SpecSConfig / SeedConfig of the search methods from runtime.specs / runtime.tree."""
    rt = env.setup.runtime
    section = REGISTRY[spec.base].settings
    if section == "specs":
        return SpecSConfig(rt.specs.n, rt.specs.beta, rt.specs.tau)
    if section == "tree":
        t = rt.tree
        return SeedConfig(t.thoughts, t.keep, t.depth, tuple(int(k) for k in t.k_config), t.threaded)
    return None


def decode_question(env: BenchEnv, spec: MethodSpec, question: str):
    """One question decoded by one method as the benchmark times it (its options, verifier, engines and cache
    state); returns the generation."""
    opts = _method_options(env, spec)
    verifier = None
    if REGISTRY[spec.base].needs_verifier:
        verifier = env.verifier(spec.overrides.get("verifier"), spec.overrides.get("alpha"))
    _same_cache_state(env)
    target, draft = _engines(env, spec)
    settings = _settings(env, spec)
    if spec.base == "lr_async":  # shorter GIL hand-overs between the draft and target threads
        with fast_thread_switching():
            return decode(spec.base, question, target, draft, verifier, opts)
    if settings is not None:
        return decode(spec.base, question, target, draft, verifier, opts, settings)
    return decode(spec.base, question, target, draft, verifier, opts)


def list_methods() -> str:
    """The registered decoding methods, one line each (probe-bench --list-methods)."""
    lines = []
    for m in REGISTRY.values():
        tags = [t for t, on in (("needs a draft", m.needs_draft), ("a verifier", m.needs_verifier),
                                (f"baseline {m.baseline}", m.baseline != "target"),
                                (f"runtime.{m.settings}", m.settings), ("gamma=adaptive", m.adaptive)) if on]
        lines.append(f"{m.name:13s} {m.summary}" + (f" [{'; '.join(tags)}]" if tags else ""))
    lines.append("suffixes: +ngram / +assistant / +lookahead (token speculation inside steps); options :key=value "
                 f"({', '.join(sorted(_OVERRIDE_TYPES))}; gamma=adaptive)")
    return "\n".join(lines)


def method_specs(methods: Sequence[str]) -> list[MethodSpec]:
    """The parsed methods, target-only first when missing: the baseline of every speedup, measured in
    the same run."""
    specs = [parse_method(m) for m in methods]
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"methods listed twice: {labels}")
    if "target" not in labels:
        specs.insert(0, parse_method("target"))
    own = {REGISTRY[s.base].baseline for s in specs} - {"target"}
    for base in sorted(own - set(labels)):
        specs.append(parse_method(base))  # and a search method against its paper's baseline
    return specs


# A throwaway problem for the warm-up: no timed problem is ever decoded before its timed run.
WARMUP_QUESTION = "Warm-up (not timed): a shop sells 3 pens for 4 dollars. How much do 12 pens cost?"


def warm_up(env: BenchEnv, specs: Sequence[MethodSpec], log: Callable[[str], None] = print) -> dict[str, MethodResult]:
    """Fresh results per method; with bench.warmup, each method first decodes a throwaway problem, untimed, as
    long as a timed one can be (max_steps, or max_new_tokens first: EOS does not end its steps, see
    `_eos_ignored`): every batch shape a cycle uses (1 to γ + 1 target rows) and every buffer length the context
    grows through meets its lazy initialisation, kernel choice and, on the fast path, graph capture there, the
    baseline's included (a method failing there is marked and skipped). A shorter warm-up left the longer
    buffers' captures to the first timed problem (on an H100 its target-only run took 7.4 s against 5.4 s for
    the next ones), and to the baseline above all, which is timed first."""
    results = {s.label: MethodResult(s) for s in specs}
    if env.setup.bench.warmup:
        with _eos_ignored(env):
            for i, s in enumerate(specs):
                started = time.perf_counter()
                try:  # the options too: gamma=adaptive loads its acceptance probe there
                    decode_question(env, s, WARMUP_QUESTION + env.setup.bench.prompt_suffix)
                except (ValueError, RuntimeError) as err:
                    results[s.label].error = f"{type(err).__name__}: {err}"
                    log(f"[{s.label}] skipped: {results[s.label].error}")
                else:  # (a full-length decode per method: minutes for a large model before the first problem)
                    log(f"  warm-up {i + 1}/{len(specs)} {s.label}: {time.perf_counter() - started:.1f}s (not timed)")
    return results


@contextmanager
def _eos_ignored(env: BenchEnv):
    """Both engines' steps run past EOS (their `text.stop_at_eos` off, as in system-speed runs) until the block
    ends: a real model answers the short warm-up question in a few steps, which would leave the longer buffers
    unwarmed."""
    texts = {id(e.text): e.text for e in (env.target, env.draft) if e is not None}.values()
    before = [(t, t.stop_at_eos) for t in texts]
    try:
        for t, _ in before:
            t.stop_at_eos = False
        yield
    finally:
        for t, stop in before:
            t.stop_at_eos = stop


def run_problems(env: BenchEnv, specs: Sequence[MethodSpec], results: dict[str, MethodResult],
                 log: Callable[[str], None] = print,
                 on_trace: Callable[[str, Iterable[dict]], None] | None = None,
                 only: Sequence[int] | None = None) -> None:
    """Decode every problem of `env` (or those at the places `only` names) with every method, adding to `results`;
    on_trace(label, records) receives each generation's per-cycle trace."""
    suffix = env.setup.bench.prompt_suffix
    for i in range(len(env.problems)) if only is None else only:
        prob = env.problems[i]
        for s in specs:
            res = results[s.label]
            if res.error:
                continue
            try:
                gen = decode_question(env, s, prob.question + suffix)
            except (ValueError, RuntimeError) as err:
                res.error = f"{type(err).__name__}: {err}"
                log(f"[{s.label}] failed on {prob.id}: {res.error}")
                continue
            try:
                pred, ok = grade(gen.text, prob.answer)
            except Exception as err:  # noqa: BLE001 - a grader's failure must not lose the timings measured so far
                pred, ok = None, False
                log(f"[{s.label}] could not grade {prob.id} ({type(err).__name__}: {err}); counted as not correct")
            res.stats = res.stats.merge(gen.stats) if res.stats.problems else gen.stats
            res.correct += int(ok)
            res.answered += 1
            res.latencies.append(gen.stats.latency_s)
            st = gen.stats
            res.counts.append(ProblemCounts(st.accepted, st.judged, st.decided_accepted, st.decided, prob.family,
                                            int(ok), int(prob.answer is not None)))
            log(f"[{i + 1}/{len(env.problems)}] {s.label:22s} {gen.stats.latency_s:7.2f}s "
                f"{gen.stats.output_tokens:5d} tok  stop={gen.stop_reason:14s} answer={pred!r} gold={prob.answer!r}"
                + (f"  accept={gen.stats.acceptance_rate:.2f}" if gen.stats.acceptance_rate is not None else ""))
            if on_trace is not None:
                on_trace(s.label, ({"problem": prob.id, "method": s.label, **rec} for rec in gen.trace))


def first_failures(parts: Sequence[tuple[int, dict[str, MethodResult]]]) -> dict[str, tuple[int, str]]:
    """Where each method first failed among the results of single problems (with their places; a warm-up's at
    -1), and its error: label -> (place, error)."""
    failed: dict[str, tuple[int, str]] = {}
    for position, part in sorted(parts, key=lambda part: part[0]):
        for label, res in part.items():
            if res.error and label not in failed:
                failed[label] = (position, res.error)
    return failed


def skipped_at(failed: dict[str, tuple[int, str]], position: int) -> dict[str, str]:
    """The methods that failed before `position` (`first_failures`), with their errors: as in one run, they
    decode nothing there."""
    return {label: error for label, (place, error) in failed.items() if place < position}


def merge_results(parts: Sequence[tuple[int, dict[str, MethodResult]]]) -> dict[str, MethodResult]:
    """One result per method from the results of single problems, each with its problem's place in the run (Ray
    replicas return them in any order): counts and stats add up and the latencies come out in the problems' order,
    so they pair with the report's problems as in one process. A method that failed (on that problem, or on its
    replica before it) counts only the problems before the first place it failed, where one process stops it,
    and keeps that error."""
    first_failure = first_failures(parts)
    merged: dict[str, MethodResult] = {}
    for position, part in sorted(parts, key=lambda part: part[0]):
        for label, res in part.items():
            out = merged.setdefault(label, MethodResult(res.spec))
            failed = first_failure.get(label)
            if failed is not None:
                out.error = failed[1]
                if position >= failed[0]:
                    continue
            if res.stats.problems:
                out.stats = out.stats.merge(res.stats) if out.stats.problems else res.stats
            out.correct += res.correct
            out.answered += res.answered
            out.latencies += res.latencies
            out.counts += res.counts
    return merged


def start_out_dir(out: Path, specs: Sequence[MethodSpec], resumed: bool = False,
                  ) -> Callable[[str, Iterable[dict]], None]:
    """`out` for a new run: an earlier run's report removed (it would pass for this one's until this one writes)
    and empty traces/<method>.jsonl (`resumed`: the traces kept, see `bench_resume`); returns the writer that
    appends to them."""
    for old in ("results.json", "results.md", FIGURE):
        (out / old).unlink(missing_ok=True)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    for s in specs:
        path = trace_file(out, s.label)
        if not (resumed and path.exists()):
            path.write_text("")
    return lambda label, records: write_trace(trace_file(out, label), records, mode="a")


def resume_config(setup: BenchSetup) -> dict:
    """The settings a resumed run must share with the stopped one (`bench_resume.KEY_SECTIONS`, the step
    delimiter), as JSON reads them back."""
    sections = {**to_dict(setup, KEY_SECTIONS), "delimiter": setup.delimiter}
    sections["bench"].pop("out_dir", None)  # (--out names it: where the run is, not how)
    return json.loads(json.dumps(sections, default=_json_default))


def problem_log(env: BenchEnv, specs: Sequence[MethodSpec], out: Path, resume: bool,
                log: Callable[[str], None] = print) -> ProblemLog:
    """The run's `bench_resume.ProblemLog` in `out` (with `resume`, an unfinished run's of the same settings)."""
    key = run_key(resume_config(env.setup), [s.label for s in specs], env.verifier_kind, env.checkpoint,
                  env.system_speed, [(p.id, p.question) for p in env.problems])
    return open_problem_log(out, key, resume, log)  # (its parts are JSON values already)


def log_problem(plog: ProblemLog, position: int, problem: Problem, seconds: float, wall_s: float,
                results: dict[str, MethodResult]) -> None:
    """One finished problem's results into the run's log (after its traces are written)."""
    plog.add(position, problem.id, seconds, wall_s, {label: res.to_record() for label, res in results.items()})


def logged_parts(plog: ProblemLog, specs: Sequence[MethodSpec]) -> list[tuple[int, dict[str, MethodResult]]]:
    """A log's finished problems as `merge_results` takes them."""
    by_label = {s.label: s for s in specs}
    return [(position, {label: MethodResult.from_record(by_label[label], rec)
                        for label, rec in line["results"].items()})
            for position, line in sorted(plog.done.items())]


def trace_file(out: Path, label: str) -> Path:
    """Where a run in `out` writes one method's per-cycle trace records (jsonl)."""
    return out / "traces" / f"{_safe(label)}.jsonl"


def rewrite_traces(out: Path, specs: Sequence[MethodSpec],
                   parts: Sequence[tuple[int, Sequence[tuple[str, Iterable[dict]]]]]) -> None:
    """Replace traces/<method>.jsonl in `out` with the traces of single problems, each with its problem's place in
    the run ((position, [(label, records), ...]), in any order, as Ray replicas return them): written in the
    problems' order, each file aside first and moved into place, so that an interrupted rewrite leaves the old
    file whole."""
    by_label: dict[str, list[dict]] = {s.label: [] for s in specs}
    for _, traces in sorted(parts, key=lambda part: part[0]):
        for label, recs in traces:
            by_label[label].extend(recs)
    for label, recs in by_label.items():
        path = trace_file(out, label)
        aside = path.with_name(path.name + ".tmp")
        write_trace(aside, recs)
        os.replace(aside, path)


def report_so_far(env: BenchEnv, results: dict[str, MethodResult], done: Sequence[Problem], wall_s: float,
                  resumed: int = 0) -> dict:
    """The report of the problems decoded so far (`summarize`); when they are fewer than env's, `finished` says how
    many, so a run stopped midway (a time limit, a lost machine) keeps what it finished, marked as such. resumed:
    how many of them an earlier run of the same command decoded (`--resume`)."""
    report = summarize(env, results, done)
    report["wall_s"] = wall_s
    if len(done) < len(env.problems):
        report["finished"] = f"{len(done)} of {len(env.problems)} problems"
    if resumed:
        report["resumed"] = f"{resumed} of {len(env.problems)} problems decoded by an earlier run of this command"
    return report


def write_report(report: dict, out: Path) -> None:
    """results.json and results.md, each written aside and moved into place (a stop meanwhile leaves the last)."""
    write_text(out / "results.json", json.dumps(report, indent=2, default=_json_default))
    write_text(out / "results.md", format_markdown(report) + "\n")


def run_benchmark(env: BenchEnv, methods: Sequence[str] | None = None, out_dir: str | Path | None = None,
                  log: Callable[[str], None] = print, resume: bool = False) -> dict:
    """Decode every problem with every method; returns the report (see `format_markdown`). With `out_dir`, each
    finished problem is logged there, and `resume` goes on with an unfinished run's problems (`bench_resume`)."""
    specs = method_specs(methods or env.setup.bench.methods)
    for spec in specs:
        check_method(env, spec)
    out = Path(out_dir) if out_dir else None
    plog = problem_log(env, specs, out, resume, log) if out is not None else None
    parts = logged_parts(plog, specs) if plog is not None else []
    on_trace = start_out_dir(out, specs, resumed=bool(parts)) if out is not None else None
    logged, total = len(parts), len(env.problems)
    earlier, started = (plog.wall_s if plog is not None else 0.0), time.perf_counter()

    def report_of() -> dict:
        return report_so_far(env, merge_results(parts), [env.problems[p] for p, _ in parts],
                             earlier + time.perf_counter() - started, logged)

    if logged and out is not None:  # the stopped run's report, until this one's first problem
        write_report(report_of(), out)
    todo = [i for i in range(total) if plog is None or i not in plog.done]
    if todo:
        # where each method first failed (warm-up: -1): as in one run, it decodes no problem after that place
        warmed = warm_up(env, specs, log)
        started = time.perf_counter()
        for i in todo:
            begun = time.perf_counter()
            skipped = skipped_at(first_failures([(-1, warmed), *parts]), i)
            results = {s.label: MethodResult(s, error=skipped.get(s.label)) for s in specs}
            run_problems(env, specs, results, log, on_trace if env.setup.bench.trace else None, only=[i])
            parts.append((i, results))
            parts.sort(key=lambda part: part[0])
            if plog is not None:
                log_problem(plog, i, env.problems[i], time.perf_counter() - begun,
                            earlier + time.perf_counter() - started, results)
            if out is not None and len(parts) < total:
                write_report(report_of(), out)
            fresh, elapsed = len(parts) - logged, time.perf_counter() - started
            log(f"probe-bench: {progress_line(len(parts), total, fresh, elapsed, 'problems')}")
    report = report_of()
    if out is not None:
        if logged and env.setup.bench.trace:  # appended after the earlier run's: in the problems' order again
            rewrite_traces(out, specs, traces_by_problem(out, specs, env.problems))
        write_report(report, out)
    return report


def traces_by_problem(out: Path, specs: Sequence[MethodSpec], problems: Sequence[Problem]):
    """The trace records in `out`, as `rewrite_traces` takes them: (place, [(label, records)])."""
    place = {p.id: i for i, p in enumerate(problems)}
    parts: dict[int, list[tuple[str, list[dict]]]] = {}
    for s in specs:
        path = trace_file(out, s.label)
        records = read_trace(path) if path.exists() else []
        for pid, recs in itertools.groupby(records, key=lambda r: r.get("problem")):
            parts.setdefault(place[pid], []).append((s.label, list(recs)))
    return sorted(parts.items())


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in label)


def _json_default(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    return str(obj)


# ----------------------------------------------------------------------------- summary
def ratio(a, b):
    """a / b, or None when either is missing or b is 0 (a table cell that cannot be computed)."""
    return a / b if a is not None and b else None


def summarize(env: BenchEnv, results: dict[str, MethodResult], problems: Sequence[Problem] | None = None) -> dict:
    """Every method's row: what was measured (speedup over the target-only baseline, acceptance, passes, depths)
    beside what the analytic formula predicts from the run's own α, c, b and τ; `problems`: the ones decoded so far
    (default: all of env's)."""
    base = results["target"]
    rows = []
    for label, res in results.items():
        row = _measured(env, label, res, base)
        row.update(_predicted(env, results, label, row["speedup"]))
        rows.append(row)
    problems = env.problems if problems is None else problems
    return {"rows": rows, "system_speed": env.system_speed, "verifier": env.verifier_kind,
            "checkpoint": env.checkpoint, "warmup": env.setup.bench.warmup,
            "trained_on": [p.id for p in problems if p.id in env.trained_on] or None,
            "models": {"target": env.target.model_name, "draft": env.draft.model_name},
            "problems": [p.id for p in problems],
            # what the intervals draw whole (absent: every problem is its own)
            "families": {p.id: p.family for p in problems if p.family is not None} or None,
            "config": env.setup.config_record(),
            "host": {"platform": platform.platform(), "python": platform.python_version()}}


def _measured(env: BenchEnv, label: str, res: MethodResult, base: MethodResult) -> dict:
    """One method's measured figures; its speedup over the target-only baseline's total latency."""
    st, spec = res.stats, res.spec
    opts = _method_options(env, spec, policy=False)
    adaptive = is_adaptive(env, spec)
    method = REGISTRY[spec.base]
    latency = sum(res.latencies) if res.latencies else None
    base_latency = sum(base.latencies) if base.latencies else None
    families = [c.family for c in res.counts]
    alpha_ci, alpha_over = acceptance_interval([(c.accepted, c.judged) for c in res.counts], families)
    decided_ci, decided_over = acceptance_interval([(c.decided_accepted, c.decided) for c in res.counts], families)
    pass_ci, pass_over = pass_interval(res.counts)
    timed = (latency and not res.error and not base.error and res is not base
             and len(base.latencies) == len(res.latencies) == len(families))
    speedup_ci, speedup_over = speedup_interval(base.latencies, res.latencies, families) if timed else (None, None)
    return {"method": label, "problems": res.answered, "error": res.error,
           # over the problems with a reference answer (a file without one has no pass@1: n/a, not 0)
           "pass@1": ratio(res.correct, sum(c.graded for c in res.counts)), "correct": res.correct,
           "graded": sum(c.graded for c in res.counts),
           "pass@1_ci95": pass_ci, "pass@1_ci95_resamples": pass_over,
           "latency_total_s": latency, "latency_mean_s": ratio(latency, res.answered),
           # a method (or baseline) that failed mid-run timed fewer problems: no speedup
           "speedup": ratio(base_latency, latency) if latency and not res.error and not base.error else None,
           "speedup_ci95": speedup_ci, "speedup_ci95_resamples": speedup_over,
           "speedup_per_problem": per_problem_speedups(base.latencies, res.latencies, families) if timed else None,
           "output_tokens": st.output_tokens, "tokens_per_s": st.tokens_per_second,
           "acceptance": st.acceptance_rate, "acceptance_by_position": st.acceptance_by_position,
           "acceptance_ci95": alpha_ci, "acceptance_ci95_resamples": alpha_over,
           "judged": st.judged, "mean_accepted_per_cycle": st.mean_accepted_per_cycle, "ratio": st.ratio,
           # steps the verifier itself ruled on (not refused for the cap or emptiness) and their acceptance
           "decided": st.decided, "refused": st.refused, "decided_acceptance": ratio(st.decided_accepted, st.decided),
           "decided_acceptance_ci95": decided_ci, "decided_acceptance_ci95_resamples": decided_over,
           "target_forward_passes": st.target_forward_passes, "draft_forward_passes": st.draft_forward_passes,
           "mean_target_rows": st.mean_target_rows, "mean_rows_per_forward": st.mean_rows_per_forward,
           "spec_acceptance": st.spec_acceptance,
           "stop_reasons": st.stop_reasons, "width": opts.width, "latencies_s": list(res.latencies),
           "gamma": f"adaptive<={opts.gamma}" if adaptive else opts.gamma,
           "mean_depth_kept": st.mean_depth_kept, "depth_kept": st.depth_kept,
           "depth_drafted": st.depth_drafted, "draft_steps_reused": st.draft_steps_reused,
           "forecast_skip": forecast_skips(env, spec),
           "depth_policy": _policy_record(env, spec) if adaptive else None,
           "verifier": spec.overrides.get("verifier", env.verifier_kind) if method.needs_verifier else None}


def _predicted(env: BenchEnv, results: dict[str, MethodResult], label: str, speedup: float | None) -> dict:
    """The analytic prediction for one method (`infer.decoding.analytic`), from its measured α and costs relative
    to the baseline's target step: c (a draft step), b (a batched target iteration), τ (scoring per cycle).
    `speedup`: the measured one over target-only, which a search method's own baseline replaces in the ratios."""
    res, bst = results[label], results["target"].stats
    st, spec = res.stats, res.spec
    opts = _method_options(env, spec, policy=False)
    method = REGISTRY[spec.base]
    t_step = ratio(bst.target_time_s, bst.target_rows)  # target time per step, batch of 1
    t_iter = ratio(bst.target_time_s, bst.target_iterations)
    extra = {}  # a search method's own baseline and its speedup over it, which its ratios read
    c = ratio(ratio(st.draft_time_s, st.draft_calls), t_step)
    b = ratio(ratio(st.target_time_s, st.target_iterations), t_iter)
    tau = ratio(ratio(st.score_time_s, st.cycles), t_step)
    kind = spec.base
    if kind == "target":
        pred = {"ideal": None, "adjusted": None, "k": None, "formula": "baseline"}
    elif method.baseline == kind:
        pred = {"ideal": None, "adjusted": None, "k": None, "formula": "search baseline"}
    elif method.baseline != "target":
        pred = _search_prediction(env, kind, st)
        extra["baseline"] = method.baseline
        extra.update(_search_speedup(results, label, method.baseline))
    elif is_adaptive(env, spec):  # no fixed-γ formula applies; the kept depths are in depth_kept
        pred = {"ideal": None, "adjusted": None, "k": None, "formula": "adaptive γ"}
    else:
        pred = predict(method.prediction, st.acceptance_rate, c, opts.gamma, b, tau)
    if spec.token_spec == "lookahead":  # the paper's step compression S = tokens / decoding steps of a row
        comp = ratio(st.target_generated_tokens if kind != "draft" else st.draft_generated_tokens,
                     st.target_row_iterations if kind != "draft" else st.draft_row_iterations)
        pred = {**pred, "ideal": comp, "adjusted": ratio(comp, b) if kind == "target" else None,
                "formula": "S (lookahead compression)"}
    elif spec.token_spec != "none":  # token level: multiply by g at the measured token acceptance
        g = token_level_factor(st.spec_accepted, st.spec_rounds)
        step_level = 1.0 if kind == "target" else pred["ideal"]
        pred = {**pred, "ideal": step_level * g if g and step_level else None, "adjusted": None,
                "formula": ("" if kind == "target" else f"{pred['formula']} x ") + "g_token"}
    speedup = extra.get("speedup_vs_baseline", speedup)
    return {**extra, "c": c, "b": b, "tau": tau, "k": pred.get("k"), "formula": pred.get("formula"),
            "analytic_ideal": pred.get("ideal"), "analytic_adjusted": pred.get("adjusted"),
            "measured_over_ideal": ratio(speedup, pred.get("ideal")),
            "measured_over_adjusted": ratio(speedup, pred.get("adjusted")), "stats": st.to_dict()}


def _policy_record(env: BenchEnv, spec: MethodSpec) -> dict | None:
    """The adaptive policy's estimator and costs (measured ones included) when it was built."""
    kind = spec.overrides.get("verifier") or env.verifier_kind
    policy = env._depth.get((kind, spec.overrides.get("alpha") if kind == "bernoulli" else None))
    return None if policy is None else policy.describe()


def _search_speedup(results: dict, label: str, baseline: str) -> dict:
    """Latency of the baseline search (same problems, same run) over the method's: pooled, with its interval and
    each problem's own ratio, as the speedup over target-only has them."""
    mine, base = results[label], results.get(baseline)
    keys = ("speedup_vs_baseline", "speedup_vs_baseline_ci95", "speedup_vs_baseline_ci95_resamples",
            "speedup_vs_baseline_per_problem")
    if (base is None or base.error or mine.error or not mine.latencies or not base.latencies
            or len(base.latencies) != len(mine.latencies)):
        return dict.fromkeys(keys)
    families = [c.family for c in mine.counts] if len(mine.counts) == len(mine.latencies) else None
    ci, over = speedup_interval(base.latencies, mine.latencies, families)
    return dict(zip(keys, (ratio(sum(base.latencies), sum(mine.latencies)), ci, over,
                           per_problem_speedups(base.latencies, mine.latencies, families))))


def _search_prediction(env: BenchEnv, kind: str, st: RunStats) -> dict:
    """SpecS: its latency model over target beam search at the measured share of draft rounds; SEED:
    token SD's g(k) at the measured per-position acceptance and draft/target forward cost."""
    if kind == "specs":
        return specs_predicted_speedup(st)
    return seed_predicted_speedup(st, env.setup.runtime.tree.k_config)


def fmt(value, digits: int = 2) -> str:
    """A table cell: floats to `digits` places, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _interval_note(report: dict) -> str:
    """What the table's 95% intervals draw: whole families (templates) where problems share one, else problems."""
    families = report.get("families") or {}
    units = len(set(families.values())) + len(report["problems"]) - len(families)
    rest = ("where every unit has one rate, Wilson over the units; α with one problem: Wilson over its judged "
            "positions; problems of one family only: none")
    if units < len(report["problems"]):
        return (f"95% intervals draw whole families ({units} units for {len(report['problems'])} problems: a "
                "template's problems rise and fall together; a problem without one is its own): pass@1, α, α "
                f"over decided and speedup by bootstrap ({rest}).")
    return (f"95% intervals: pass@1 Wilson over problems; α, α over decided and speedup a bootstrap over problems "
            f"({rest}).")


def _ci(interval) -> str:
    return f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else ""


def _per_problem(spread: dict | None) -> str:
    """median [its 95% interval] (min–max)."""
    if not spread:
        return "–"
    return f"{spread['median']:.2f}{_ci(spread.get('median_ci95'))} ({spread['min']:.2f}–{spread['max']:.2f})"


def format_markdown(report: dict) -> str:
    head = ("| method | pass@1 | latency s | speedup | per problem | analytic | meas/analytic | analytic (batch-adj.) | "
            "meas/adj. | α | α by position | decided (refused) | α over decided | acc/cycle | Ratio | c | b | TPS | "
            "stop |")
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for r in report["rows"]:
        if r["error"]:
            lines.append(f"| {r['method']} | error: {r['error'][:120]} |" + " |" * (columns - 2))
            continue
        by_pos = "/".join(fmt(a) for a in (r["acceptance_by_position"] or [])[:6]) or "–"
        stops = ",".join(f"{k}:{v}" for k, v in (r["stop_reasons"] or {}).items())
        lines.append(
            f"| {r['method']} | {fmt(r['pass@1'])}{_ci(r.get('pass@1_ci95'))} | {fmt(r['latency_mean_s'])} | "
            f"{fmt(r['speedup'])}{_ci(r.get('speedup_ci95'))} | {_per_problem(r.get('speedup_per_problem'))} | "
            f"{fmt(r['analytic_ideal'])} | {fmt(r['measured_over_ideal'])} | {fmt(r['analytic_adjusted'])} | "
            f"{fmt(r['measured_over_adjusted'])} | {fmt(r['acceptance'])}{_ci(r.get('acceptance_ci95'))} | {by_pos} | "
            f"{r.get('decided', 0)} ({r.get('refused', 0)}) | "
            f"{fmt(r.get('decided_acceptance'))}{_ci(r.get('decided_acceptance_ci95'))} | "
            f"{fmt(r['mean_accepted_per_cycle'])} | {fmt(r['ratio'])} | {fmt(r['c'], 3)} | {fmt(r['b'])} | "
            f"{fmt(r['tokens_per_s'], 1)} | {stops} |")
    notes = [
        "",
        f"models: target {report['models']['target']}, draft {report['models']['draft']}; verifier "
        f"{report['verifier']}{' (system-speed mode: random weights)' if report['system_speed'] else ''}; "
        f"{len(report['problems'])} problems"
        + (f" (stopped midway: {report['finished']})." if report.get("finished") else "."),
        "specs / seed_tot: meas/analytic compares their speedup over their own search baseline "
        "(beam_target / tot_target, same run) with the prediction; +lookahead: analytic = tokens per decoding "
        "iteration of a row (the paper's compression S). "
        f"{_interval_note(report)} decided = draft steps the "
        "verifier ruled on; refused = rejected before it was asked (cut by the token cap, empty); α over decided "
        "= accepted / decided, what the verifier itself did. "
        "speedup = target-only latency / method latency, same run, over all problems (its interval draws each "
        "problem's two latencies together); per problem = each problem's own ratio: median [its 95% interval, drawn as the speedup's] (min–max). analytic = the paper's formula at the "
        "measured α and c (f_sync(k=γ+1) for lr_sync, S₁/S₂ for lr_async, S_ss for semanticspec, 1/c for "
        "draft); batch-adj. = same formula with one target forward of the method's batch costing b target "
        "steps (b measured; the formulas assume b = 1). c = draft time per drafted position / target step "
        "time; Ratio = share of output tokens written by the target.",
    ]
    drew = [f"{r['method']} {r['acceptance_ci95_resamples']}" for r in report["rows"]
            if r.get("acceptance_ci95_resamples")]
    if drew:
        notes.append(f"α's intervals drew: {'; '.join(drew)}.")
    if report.get("trained_on"):
        notes.append(f"{len(report['trained_on'])} of {len(report['problems'])} problems were trained or validated "
                     "on by the checkpoint (their question or template): acceptance and speedups on them are not "
                     "held-out figures; bench on <output_dir>/test_questions.jsonl (probe-train's test split).")
    if report.get("warmup") is False:  # (reports written before the key: not known, not said)
        notes.append("No warm-up (bench.warmup=false): the first problem's timings include each method's lazy "
                     "initialisation (allocations, kernel choice, graph capture), the target-only baseline's first; "
                     "read the per-problem ratios, and warm up for a speedup to quote.")
    for r in report["rows"]:
        if r.get("baseline") and r.get("speedup_vs_baseline") is not None:  # (the table's speedup: over target-only)
            each = r.get("speedup_vs_baseline_per_problem") or {}
            notes.append(f"{r['method']} over its own baseline {r['baseline']} (same run): "
                         f"{fmt(r['speedup_vs_baseline'])}×{_ci(r.get('speedup_vs_baseline_ci95'))}"
                         + (f", per problem {_per_problem(each)}" if each else "") + ".")
    ungraded = [f"{r['method']} {r['graded']} of {r['problems']}" for r in report["rows"]
                if r.get("graded") is not None and r["graded"] < r["problems"]]
    if ungraded:  # (a problem without a reference answer is timed, not graded)
        notes.append(f"pass@1 is over the problems with a reference answer: {'; '.join(ungraded)}.")
    if report.get("families"):
        notes.append("pass@1's intervals drew: " + "; ".join(f"{r['method']} {r.get('pass@1_ci95_resamples')}"
                                                             for r in report["rows"]) + ".")
    for r in report["rows"]:
        if r.get("depth_kept"):  # gamma=adaptive: no fixed-γ formula; how deep its cycles went instead
            reused = f"; {r['draft_steps_reused']} drafts past a kept depth reused" if r.get("draft_steps_reused") else ""
            # async LR decides at every position it verifies (`_depth_decision`), not once a cycle
            unit = "verified positions" if parse_method(r["method"]).base == "lr_async" else "cycles"
            notes.append(f"{r['method']}: {unit} by kept depth 0.. {r['depth_kept']} (mean {fmt(r['mean_depth_kept'])}; "
                         f"0 = the draft was dropped and the target wrote the step{reused}).")
    return "\n".join(lines + notes)
