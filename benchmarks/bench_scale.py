"""Benchmark of data-stage scale-out: contexts/min in one process and on 1, 2, ... local Ray replicas.

    python benchmarks/bench_scale.py                              # configs/tiny.yaml, 8 contexts, N = 4
    python benchmarks/bench_scale.py --replicas 1,2,4 --cpus 8 source.size=32
    python benchmarks/bench_scale.py --address 10.0.0.5:6379 --replicas 8 ray.gpus_per_replica=1

Every run generates the same dataset into a fresh temporary folder. Printed per run: model loading
(the single process loads before the clock starts; replicas load in parallel in their actors),
processing time after loading, and contexts/min both after loading and end to end. Ray itself
starts once, before the first replicated run, and is not counted. Each replica gets
ray.cpus_per_replica cores (default 1) and that many torch threads; the single process uses all
cores (torch's default) unless --threads says otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULTS = ["source.size=8", "data.contexts_per_trace=1", "data.num_samples=4", "data.contexts_per_shard=1",
            "sampling.max_step_tokens=16", "data.layers=last"]


class _Timed:
    """Shard workers whose start (model loading) is timed."""

    def __init__(self, workers):
        self.workers, self.load_seconds = workers, 0.0

    def start(self, judge_cache):
        started = time.perf_counter()
        try:
            return self.workers.start(judge_cache)
        finally:
            self.load_seconds = time.perf_counter() - started

    def run(self, todo, on_context):
        return self.workers.run(todo, on_context)


def single_process(cfg) -> tuple[float, float, int]:
    from specprobe.data_gen.pipeline import build_judge, generate_dataset
    from specprobe.infer.engines import build_engine_pair

    started = time.perf_counter()
    engines = build_engine_pair(cfg.models)
    judge = build_judge(cfg.data, None, cfg.models.resolved_device())
    load = time.perf_counter() - started
    result = generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=False)
    return load, result.run.wall_seconds, result.run.contexts


def on_ray(cfg) -> tuple[float, float, int]:
    from specprobe.data_gen.distributed import RayShardWorkers
    from specprobe.data_gen.pipeline import generate_dataset

    workers = _Timed(RayShardWorkers(cfg.data_job()))
    try:
        result = generate_dataset(cfg.data_job(), progress=False, workers=workers)
    finally:
        workers.workers.close()
    return workers.load_seconds, result.run.wall_seconds - workers.load_seconds, result.run.contexts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--replicas", default="1,2", help="comma list of replica counts to run")
    p.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    p.add_argument("--address", default=None, help="an existing Ray cluster instead of a local instance")
    p.add_argument("--no-single", action="store_true", help="skip the single-process run")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the single process (default: torch's, one per core); on a busy "
                        "machine 1 avoids spin-waiting threads")
    p.add_argument("overrides", nargs="*", help="config overrides (after the small defaults)")
    args = p.parse_args()
    import torch

    from specprobe.infer.ray_cluster import check_resources, connect, replica_demands
    from specprobe.train.config import load_config

    print(f"host: {os.cpu_count()} CPUs; config {args.config} + {' '.join(DEFAULTS + args.overrides)}")
    print("| run | replicas | load s | processing s | contexts | contexts/min (after load) | contexts/min (end to end) |")
    print("|---|---|---|---|---|---|---|", flush=True)

    def row(name: str, count: str, load: float, seconds: float, contexts: int) -> None:
        print(f"| {name} | {count} | {load:.1f} | {seconds:.1f} | {contexts} | {60 * contexts / seconds:.2f} | "
              f"{60 * contexts / (load + seconds):.2f} |", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        def config(name: str, extra: list[str]):
            return load_config(args.config, [*DEFAULTS, *args.overrides, f"output_dir={tmp}/{name}", *extra])

        if not args.no_single:
            if args.threads:
                torch.set_num_threads(args.threads)
            row(f"single process ({torch.get_num_threads()} threads)", "-", *single_process(config("single", [])))
        for count in [int(c) for c in args.replicas.split(",") if c.strip()]:
            cfg = config(f"ray{count}", [f"ray.replicas={count}"]
                         + ([f"ray.local_cpus={args.cpus}"] if args.cpus else []))
            connect(cfg.ray, args.address)
            check_resources(replica_demands(cfg.ray, cfg.ray.judge == "actors"))
            row("ray", str(count), *on_ray(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
