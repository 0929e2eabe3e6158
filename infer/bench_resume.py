"""What a probe-bench run keeps of each problem it finished, so that a run stopped midway (a time limit, a lost
machine, Ctrl-C) goes on with `probe-bench ... --resume` instead of starting over.

`<out>/problems.jsonl` holds a first line naming the run (`run_key`: its config, methods, verifier, checkpoint and
problems) and then one line per finished problem: its place in the run, its id, the seconds it took, the run's
wall time when it finished and every method's results on it (`infer.bench.MethodResult.to_record`). A resumed run takes those problems as they are,
drops the trace records of a problem it had not finished, and decodes the rest; each problem's methods still run
one after the other in one process, so every per-problem ratio pairs latencies measured together.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specprobe.inputs.config import ConfigError, config_diff

PROBLEMS_LOG = "problems.jsonl"


def run_key(config: dict, methods: Sequence[str], verifier: str, checkpoint: str | None, system_speed: bool,
            problems: Sequence[tuple[str, str]]) -> dict:
    """What must match for a run to go on with another's problems: problems are (id, question)."""
    return {"config": config, "methods": list(methods), "verifier": verifier, "checkpoint": checkpoint,
            "system_speed": system_speed,
            "problems": [[pid, hashlib.sha256(question.encode("utf-8")).hexdigest()[:16]]
                         for pid, question in problems]}


@dataclass
class ProblemLog:
    """The finished problems of a run in `folder` (`done`: place -> line), and where the next ones go."""

    path: Path
    done: dict[int, dict] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        """The run's wall time when its last logged problem finished (the report's wall_s goes on from there)."""
        return max((float(line["wall_s"]) for line in self.done.values()), default=0.0)

    def add(self, position: int, problem: str, seconds: float, wall_s: float, results: dict[str, dict]) -> None:
        """Problem `position` finished: `seconds` its decoding took, `wall_s` the run's time so far."""
        line = {"position": position, "problem": problem, "seconds": seconds, "wall_s": wall_s, "results": results}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
            fh.flush()
        self.done[position] = line


def _read(path: Path) -> tuple[dict | None, dict[int, dict]]:
    """(the run's key, its finished problems); a last line cut short by a kill is dropped."""
    key, done = None, {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, text in enumerate(lines, start=1):
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            if n == len(lines):  # written when the run was stopped
                break
            raise ConfigError(f"{path}, line {n}: not JSON; it cannot be resumed. Run without --resume to start "
                              "over, or use another --out") from None
        if n == 1:
            key = line.get("run")
        else:
            done[int(line["position"])] = line
    return key, done


def open_problem_log(out: Path, key: dict, resume: bool, log: Callable[[str], None] = print) -> ProblemLog:
    """The log of the run in `out`: with `resume`, an unfinished run's of the same key (an error naming what
    differs otherwise, so nothing finished is overwritten by mistake); without, or with nothing to resume, a new
    one. On resume, trace records of problems the log does not hold (the one decoding when the run was stopped)
    are dropped from traces/*.jsonl."""
    path = out / PROBLEMS_LOG
    if resume and path.is_file():
        old, done = _read(path)
        if old != key:
            differ = config_diff(old or {}, key)
            raise ConfigError(f"--resume: {out} holds a run with other settings ({'; '.join(differ[:6])}"
                              f"{'; ...' if len(differ) > 6 else ''}). Run the command it was started with, or "
                              "leave out --resume to start over (its results are replaced), or use another --out")
        ids = {line["problem"] for line in done.values()}
        for trace in sorted((out / "traces").glob("*.jsonl")):
            kept = [t for t in trace.read_text(encoding="utf-8").splitlines() if _problem_of(t) in ids]
            trace.write_text("".join(t + "\n" for t in kept), encoding="utf-8")
        log(f"resuming {out}: {len(done)} of {len(key['problems'])} problems finished before, kept as they are")
        return ProblemLog(path, done)
    if resume:
        log(f"--resume: {out} holds no run to resume ({PROBLEMS_LOG} is missing); starting from the first problem")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"run": key}) + "\n", encoding="utf-8")
    return ProblemLog(path)


def _problem_of(trace_line: str) -> str | None:
    try:
        return json.loads(trace_line).get("problem")
    except (json.JSONDecodeError, AttributeError):  # blank, or cut short by the kill
        return None
