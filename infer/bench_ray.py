"""probe-bench on Ray: `probe-bench --ray [ADDRESS]`.

The problems are dealt round-robin to ``ray.replicas`` actors; each loads its own target, draft and
verifier and decodes ITS problems with EVERY method, interleaved as in a single-process run. So each
speedup (target-only latency / method latency) sums latencies measured on the same hardware in the
same run, whatever the replicas' hardware. Each problem is one call; as each returns, the driver merges the
per-method results (`infer.bench.merge_results`, latencies in the problems' order) into the usual table and
results.json, rewritten after every problem, and appends its traces, so a run stopped midway keeps what it
finished; at the end the traces are rewritten in the problems' order.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specprobe.infer import bench, bench_resume
from specprobe.infer.config import BenchSetup
from specprobe.infer.ray_cluster import (
    ClusterError,
    actor_options,
    check_resources,
    connect,
    describe_started,
    import_ray,
    replica_demands,
    set_actor_threads,
)
from specprobe.inputs.config import ConfigError
from specprobe.inputs.progress import progress_line

__all__ = ["run_benchmark_on_ray", "dealt_positions", "BenchReplica"]


def dealt_positions(problems: int, replicas: int) -> list[list[int]]:
    """The problems' places in their list, dealt round-robin (replica i gets problems i, i + R, ...): [[0, R, 2R,
    ...], [1, R + 1, ...], ...]; no empty shares."""
    count = max(1, min(replicas, problems))
    return [list(range(i, problems, count)) for i in range(count)]


def _log(line: str) -> None:
    """A replica's log line, to its stderr (Ray forwards it to the driver's): the report's table is on stdout."""
    print(line, file=sys.stderr, flush=True)


class BenchReplica:
    """Target, draft and verifier on one actor, decoding problems one call each, with every method."""

    def __init__(self, setup: BenchSetup, checkpoint: str | None, verifier: str | None, problems: list,
                 methods: list[str] | None = None):
        set_actor_threads(setup.ray.cpus_per_replica, setup.ray.gpus_per_replica)
        self.env = bench.prepare(setup, checkpoint=checkpoint, verifier=verifier, problems=problems, methods=methods)
        self.failed: dict[str, str | None] | None = None  # per method, once warmed up: its error, if it failed

    def describe(self) -> dict:
        env = self.env
        return {"target": env.target.model_name, "draft": env.draft.model_name, "verifier": env.verifier_kind,
                "checkpoint": env.checkpoint, "system_speed": env.system_speed}

    def solve(self, specs: list, position: int, skipped: dict[str, str] | None = None,
              ) -> tuple[dict, list[tuple[str, list[dict]]], float]:
        """The problem at `position` with every method: (its results per method, its traces, seconds of decoding).
        The first call warms up first, as does the first after a restart (a crashed actor's call is retried); a
        method that failed here is skipped from then on, as in one process, and so are those in `skipped` (label
        -> error: they failed before this place in an earlier run that a resumed one goes on with)."""
        if self.failed is None:
            self.failed = {label: r.error for label, r in bench.warm_up(self.env, specs, log=_log).items()}
        skipped = skipped or {}
        results = {s.label: bench.MethodResult(s, error=self.failed[s.label] or skipped.get(s.label)) for s in specs}
        traces: list[tuple[str, list[dict]]] = []
        on_trace = (lambda label, recs: traces.append((label, list(recs)))) if self.env.setup.bench.trace else None
        started = time.perf_counter()
        bench.run_problems(self.env, specs, results, log=_log, on_trace=on_trace, only=[position])
        seconds = time.perf_counter() - started
        self.failed = {label: r.error for label, r in results.items()}
        return results, traces, seconds


def _report(env: bench.BenchEnv, parts: list, problems: list, wall_s: float, replicas: int, logged: int) -> dict:
    report = bench.report_so_far(env, bench.merge_results(parts),
                                 [problems[p] for p, _ in sorted(parts, key=lambda part: part[0])], wall_s, logged)
    report["replicas"] = replicas
    return report


@dataclass
class _ModelName:
    """What the report reads of an engine that lives on a replica."""

    model_name: str


def run_benchmark_on_ray(setup: BenchSetup, methods: Sequence[str] | None = None, *, checkpoint: str | None = None,
                         verifier: str | None = None, address: str | None = None,
                         out_dir: str | Path | None = None, log: Callable[[str], None] = print,
                         resume: bool = False) -> dict:
    """`infer.bench.run_benchmark` with the problems spread over Ray replicas; same report, plus
    ``replicas``. `resume`: as in `run_benchmark`, the problems an unfinished run in `out_dir` finished are kept."""
    ray = import_ray()
    where = connect(setup.ray, address)
    check_resources(replica_demands(setup.ray))
    specs = bench.method_specs(methods or setup.bench.methods)
    problems = bench.load_problems(setup.bench.source, setup.bench.num_problems)
    if not problems:
        raise ConfigError("no problems to benchmark")
    # a resumed run starts no replica that would have no problem (its settings are checked once one describes them)
    finished = bench_resume.finished_positions(Path(out_dir)) if resume and out_dir is not None else set()
    left = sum(p not in finished for p in range(len(problems)))
    shares = dealt_positions(max(1, left), setup.ray.replicas)
    log(f"probe-bench on {where}: {len(problems)} problems{f' ({left} left)' if left < len(problems) else ''} "
        f"over {len(shares)} replica(s)")
    rc = setup.ray
    replica_cls = ray.remote(BenchReplica).options(**actor_options(rc.cpus_per_replica, rc.gpus_per_replica,
                                                                    rc.max_restarts))
    replicas = [replica_cls.remote(setup, checkpoint, verifier, problems, [s.label for s in specs]) for _ in shares]
    try:
        # a missing model or bad checkpoint fails here, before any decoding (and before the last report is cleared)
        info = describe_started(ray, replicas, "a bench replica")[0]
        env = bench.BenchEnv(setup, _ModelName(info["target"]), _ModelName(info["draft"]), problems,
                             bench.options_from_config(setup, info["system_speed"]), info["system_speed"],
                             info["verifier"], info["checkpoint"],
                             trained_on=bench.problems_trained_on(
                                 problems, info["checkpoint"] if bench.reads_checkpoint(specs, info["verifier"]) else None,
                                 info["system_speed"]))
        for spec in specs:
            bench.check_method(env, spec)
        out = Path(out_dir) if out_dir is not None else None
        plog = bench.problem_log(env, specs, out, resume, log) if out is not None else None
        parts = bench.logged_parts(plog, specs) if plog is not None else []
        write_traces = bench.start_out_dir(out, specs, resumed=bool(parts)) if out is not None else None
        kept_traces = bench.traces_by_problem(out, specs, problems) if parts and write_traces else []
        todo = [p for p in range(len(problems)) if plog is None or p not in plog.done]
        shares = [[todo[j] for j in share] for share in dealt_positions(len(todo), len(replicas))]
        # one call per problem, queued on its replica, so the report grows as they return (in any order); the
        # methods that failed in an earlier run skip the problems after their failure, as one process would
        failed = bench.first_failures(parts)
        calls = {replica.solve.remote(specs, position, bench.skipped_at(failed, position)): (r, position)
                 for r, (replica, share) in enumerate(zip(replicas, shares)) for position in share}
        seconds, failure = [0.0] * len(replicas), None
        earlier, logged = (plog.wall_s if plog is not None else 0.0), len(parts)
        report = _report(env, parts, problems, earlier, len(replicas), logged) if parts else None
        if report is not None and out is not None:  # the stopped run's report, until a problem returns
            bench.write_report(report, out)
        pending = list(calls)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            r, position = calls[ready[0]]
            try:
                results, traces, took = ray.get(ready[0])
            except Exception as err:  # noqa: BLE001 - a lost replica: the others' problems are still collected
                log(f"problem {problems[position].id} failed on replica {r}: {type(err).__name__}: {err}")
                failure = failure or (position, err)
                continue
            parts.append((position, results))
            kept_traces.append((position, traces))
            seconds[r] += took
            if write_traces is not None:
                for label, records in traces:
                    write_traces(label, records)
            if plog is not None:  # after its traces: a logged problem is whole
                bench.log_problem(plog, position, problems[position], took, earlier + max(seconds), results)
            report = _report(env, parts, problems, earlier + max(seconds), len(replicas), logged)
            if out is not None:
                bench.write_report(report, out)
            # the rate from the replicas' decoding time (their warm-ups left out, as in one process)
            log(f"probe-bench: {progress_line(len(parts), len(problems), len(parts) - logged, max(seconds), 'problems')}")
        if write_traces is not None:  # appended as problems returned: rewritten in the problems' order
            bench.rewrite_traces(out, specs, kept_traces)
    finally:
        for r in replicas:
            ray.kill(r, no_restart=True)
    if failure is not None:
        where = f"; {out / 'results.json'} holds the {len(parts)} that finished" if out is not None and parts else ""
        raise ClusterError(f"problem {problems[failure[0]].id} could not be decoded on Ray "
                           f"({type(failure[1]).__name__}: {failure[1]}){where}") from failure[1]
    return report
