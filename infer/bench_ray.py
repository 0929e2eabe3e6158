"""probe-bench on Ray: `probe-bench --ray [ADDRESS]`.

The problems are dealt round-robin to ``ray.replicas`` actors; each loads its own target, draft and
verifier and decodes ITS problems with EVERY method, interleaved as in a single-process run. So each
speedup (target-only latency / method latency) sums latencies measured on the same hardware in the
same run, whatever the replicas' hardware. The driver merges the per-method results
(`infer.bench.merge_results`) into the usual table, results.json and traces.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specprobe.infer import bench
from specprobe.infer.config import BenchSetup
from specprobe.infer.ray_cluster import (
    actor_options,
    check_resources,
    connect,
    describe_started,
    import_ray,
    replica_demands,
    set_actor_threads,
)
from specprobe.inputs.config import ConfigError

__all__ = ["run_benchmark_on_ray", "deal_problems"]


def deal_problems(problems: Sequence, replicas: int) -> list[list]:
    """Problems dealt round-robin (replica i gets problems i, i + R, ...); no empty shares."""
    count = max(1, min(replicas, len(problems)))
    return [list(problems[i::count]) for i in range(count)]


class _BenchReplica:
    """Target, draft and verifier on one actor, decoding a share of the problems with every method."""

    def __init__(self, setup: BenchSetup, checkpoint: str | None, verifier: str | None, problems: list):
        set_actor_threads(setup.ray.cpus_per_replica, setup.ray.gpus_per_replica)
        self.env = bench.prepare(setup, checkpoint=checkpoint, verifier=verifier, problems=problems)

    def describe(self) -> dict:
        env = self.env
        return {"target": env.target.model_name, "draft": env.draft.model_name, "verifier": env.verifier_kind,
                "checkpoint": env.checkpoint, "system_speed": env.system_speed}

    def run(self, specs: list) -> tuple[dict, list[tuple[str, list[dict]]], float]:
        """(results per method, traces, seconds of decoding after the warm-up)."""
        traces: list[tuple[str, list[dict]]] = []
        results = bench.warm_up(self.env, specs, log=print)
        on_trace = (lambda label, recs: traces.append((label, list(recs)))) if self.env.setup.bench.trace else None
        started = time.perf_counter()
        bench.run_problems(self.env, specs, results, log=print, on_trace=on_trace)
        return results, traces, time.perf_counter() - started


@dataclass
class _ModelName:
    """What the report reads of an engine that lives on a replica."""

    model_name: str


def run_benchmark_on_ray(setup: BenchSetup, methods: Sequence[str] | None = None, *, checkpoint: str | None = None,
                         verifier: str | None = None, address: str | None = None,
                         out_dir: str | Path | None = None, log: Callable[[str], None] = print) -> dict:
    """`infer.bench.run_benchmark` with the problems spread over Ray replicas; same report, plus
    ``replicas``."""
    ray = import_ray()
    where = connect(setup.ray, address)
    check_resources(replica_demands(setup.ray))
    specs = bench.method_specs(methods or setup.bench.methods)
    problems = bench.load_problems(setup.bench.source, setup.bench.num_problems)
    if not problems:
        raise ConfigError("no problems to benchmark")
    shares = deal_problems(problems, setup.ray.replicas)
    log(f"probe-bench on {where}: {len(problems)} problems over {len(shares)} replica(s)")
    rc = setup.ray
    replica_cls = ray.remote(_BenchReplica).options(**actor_options(rc.cpus_per_replica, rc.gpus_per_replica,
                                                                    rc.max_restarts))
    replicas = [replica_cls.remote(setup, checkpoint, verifier, share) for share in shares]
    try:
        # a missing model or bad checkpoint fails here, before any decoding
        info = describe_started(ray, replicas, "a bench replica")[0]
        parts = ray.get([r.run.remote(specs) for r in replicas])
    finally:
        for r in replicas:
            ray.kill(r, no_restart=True)
    env = bench.BenchEnv(setup, _ModelName(info["target"]), _ModelName(info["draft"]), problems,
                         bench.options_from_config(setup, info["system_speed"]), info["system_speed"],
                         info["verifier"], info["checkpoint"])
    report = bench.summarize(env, bench.merge_results([results for results, _, _ in parts]))
    report.update(wall_s=max(seconds for _, _, seconds in parts), replicas=len(shares))
    if out_dir is not None:
        out = Path(out_dir)
        write = bench.trace_files(out, specs)
        for _, traces, _ in parts:
            for label, records in traces:
                write(label, records)
        bench.write_report(report, out)
    return report
