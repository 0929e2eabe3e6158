"""What a probe-bench run keeps of each problem it finished, so that a run stopped midway (a time limit, a lost
machine, Ctrl-C) goes on with `probe-bench ... --resume` instead of starting over.

`<out>/problems.jsonl` holds a first line naming the run (`run_key`: its models, sampling, runtime and bench
settings, methods, verifier, checkpoint, system-speed mode and problems; not the ray section, so a run may go on
with other replicas) and then one line per finished problem: its place in the run, its id, the seconds it took, the
run's wall time when it finished and every method's results on it (`infer.bench.MethodResult.to_record`). A
resumed run takes those problems as they are, drops the trace records of a problem it had not finished, and
decodes the rest (a larger bench.num_problems extends a run: the problems it decoded stay, the new ones follow); each problem's methods still run one after the other in one process, so every per-problem ratio
pairs latencies measured together.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specprobe.inputs.config import ConfigError, config_diff

PROBLEMS_LOG = "problems.jsonl"
KEY_SECTIONS = ("models", "sampling", "runtime", "bench")  # of the config: what decoding and timing read


def run_key(config: dict, methods: Sequence[str], verifier: str, checkpoint: str | None, system_speed: bool,
            problems: Sequence[tuple[str, str]]) -> dict:
    """What must match for a run to go on with another's problems: config holds KEY_SECTIONS (and the step
    delimiter); problems are (id, question)."""
    return {"config": config, "methods": list(methods), "verifier": verifier, "checkpoint": checkpoint,
            "system_speed": system_speed,
            "problems": [[pid, hashlib.sha256(question.encode("utf-8")).hexdigest()[:16]]
                         for pid, question in problems]}


@dataclass
class ProblemLog:
    """The finished problems of a run (`done`: place -> line), and where the next ones go."""

    path: Path
    done: dict[int, dict] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        """The run's wall time when its last logged problem finished (the report's wall_s goes on from there)."""
        return max((float(line["wall_s"]) for line in self.done.values()), default=0.0)

    def add(self, position: int, problem: str, seconds: float, wall_s: float, results: dict[str, dict]) -> None:
        """Problem `position` finished: `seconds` its decoding took, `wall_s` the run's time so far. Call it after
        the problem's traces are written: a problem in the log is taken as whole."""
        line = {"position": position, "problem": problem, "seconds": seconds, "wall_s": wall_s, "results": results}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
        self.done[position] = line


def _read(path: Path) -> tuple[dict | None, dict[int, dict]]:
    """(the run's key, its finished problems); a last line cut short by a kill is left out."""
    key, done = None, {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, text in enumerate(lines, start=1):
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            if n == len(lines):  # being written when the run was stopped
                break
            raise ConfigError(f"{path}, line {n}: not JSON; it cannot be resumed. Leave out --resume to start "
                              "over (with --overwrite), or use another --out") from None
        if n == 1:
            key = line.get("run")
        else:
            done[int(line["position"])] = line
    return key, done


def finished_positions(out: Path) -> set[int]:
    """The places of the problems the run in `out` logged as finished, its settings unchecked (`open_problem_log`
    checks them): how many are left decides how many Ray replicas a resumed run starts."""
    path = out / PROBLEMS_LOG
    return set(_read(path)[1]) if path.is_file() else set()


def logged_problems(out: Path, since: float | None = None) -> int:
    """How many problems the run in `out` logged as finished (0 without a log, or with one last written before
    `since`, a time.time(): an earlier run's)."""
    path = out / PROBLEMS_LOG
    if not path.is_file() or (since is not None and path.stat().st_mtime < since - 1):  # (coarse clocks)
        return 0
    return len(_read(path)[1])


def _replace(path: Path, lines: Sequence[str]) -> None:
    """Write `path` aside and move it into place: a kill meanwhile leaves the old file whole."""
    aside = path.with_name(path.name + ".tmp")
    aside.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(aside, path)


def check_resumable(out: Path, config: dict) -> None:
    """Before any model loads: the run in `out` was made with these settings (config: KEY_SECTIONS), else an error
    naming what differs. Nothing to resume is no error."""
    path = out / PROBLEMS_LOG
    if path.is_file():
        old, _ = _read(path)
        _refuse_other(out, {"config": (old or {}).get("config")}, {"config": config})


def refuse_unfinished(out: Path) -> None:
    """Before any model loads, for a run started without --resume: `out` must not hold a stopped run's finished
    problems (starting over replaces them; after a lost machine, where no hint was printed, that would be hours
    thrown away unasked). A finished run's folder, or one without a log, is no error: it is measured anew."""
    path = out / PROBLEMS_LOG
    if not path.is_file():
        return
    try:
        key, done = _read(path)
    except (ConfigError, ValueError, KeyError, TypeError, AttributeError):  # damaged: nothing to resume
        return
    total = len((key or {}).get("problems") or [])
    if done and len(done) < total:
        raise ConfigError(f"{out} holds a run stopped after {len(done)} of {total} problems. The same command "
                          "with --resume goes on with it; --overwrite starts over (its results are replaced); "
                          "or use another --out")


def _without_count(key: dict) -> dict:
    """The key without bench.num_problems (a run may go on with more problems)."""
    bench = {k: v for k, v in ((key.get("config") or {}).get("bench") or {}).items() if k != "num_problems"}
    return {**key, "config": {**(key.get("config") or {}), "bench": bench}}


def _refuse_other(out: Path, old: dict, new: dict) -> None:
    """An error naming what differs, unless `new` is `old`'s run, or that run with more problems after its own
    (bench.num_problems raised: the ones it decoded stay, the new ones are decoded)."""
    a, b = old.get("problems") or [], new.get("problems") or []
    if old == new or (_without_count({**old, "problems": None}) == _without_count({**new, "problems": None})
                      and len(a) <= len(b) and b[:len(a)] == a):
        return
    differ = config_diff({k: v for k, v in old.items() if k != "problems"},
                         {k: v for k, v in new.items() if k != "problems"})
    if a != b and "problems" in new:  # a list of ids: say how it differs, not the whole of it
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same_length = first < min(len(a), len(b))
        differ.append(f"problems: {len(a)} -> {len(b)}" + (f", problem {first + 1} differs" if same_length else ""))
    raise ConfigError(f"--resume: {out} holds a run with other settings ({'; '.join(differ[:6])}"
                      f"{'; ...' if len(differ) > 6 else ''}). Run the command it was started with, leave out "
                      "--resume and add --overwrite to start over (its results are replaced), or use another --out")


def open_problem_log(out: Path, key: dict, resume: bool, log: Callable[[str], None] = print) -> ProblemLog:
    """The log of the run in `out`: with `resume`, an unfinished run's of the same key (an error naming what
    differs otherwise, so nothing finished is overwritten by mistake); without, or with nothing to resume, a new
    one. On resume, trace records of problems the log does not hold (the one decoding when the run was stopped)
    are dropped from traces/*.jsonl, and so is a log line cut short."""
    path = out / PROBLEMS_LOG
    if resume and path.is_file():
        old, done = _read(path)
        _refuse_other(out, old or {}, key)
        if old != key:  # more problems: the log names the run as it now is
            log(f"--resume: {out} goes on with {len(key['problems'])} problems (it was started with "
                f"{len((old or {}).get('problems') or [])})")
        _replace(path, [json.dumps({"run": key})] + [json.dumps(line) for _, line in sorted(done.items())])
        ids = {line["problem"] for line in done.values()}
        for trace in sorted((out / "traces").glob("*.jsonl")):
            _replace(trace, [t for t in trace.read_text(encoding="utf-8").splitlines() if _problem_of(t) in ids])
        log(f"resuming {out}: {len(done)} of {len(key['problems'])} problems finished before, kept as they are")
        return ProblemLog(path, done)
    if resume:
        log(f"--resume: {out} holds no run to resume ({PROBLEMS_LOG} is missing); starting from the first problem")
    out.mkdir(parents=True, exist_ok=True)
    _replace(path, [json.dumps({"run": key})])
    return ProblemLog(path)


def _problem_of(trace_line: str) -> str | None:
    try:
        return json.loads(trace_line).get("problem")
    except (json.JSONDecodeError, AttributeError):  # blank, or cut short by the kill
        return None
