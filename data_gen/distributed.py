"""The data stage on Ray: `probe-train --stage data --ray [ADDRESS]`.

The driver (this process) owns the run folder exactly as a single-process run does: it plans the
contexts and shards, holds the folder lock, writes every shard atomically, updates the manifest and
the judge cache, and resumes. Replicas (Ray actors, each with its own target and draft engines) turn
whole shards into rows with `data_gen.pipeline.process_shard` and send them back; they write nothing.
Since a context's samples depend only on its own seeds (and a cleared prefix cache), the dataset is
the single-process one row for row, whichever replica ran which shard.

The equivalence judge runs beside the models in every replica (``ray.judge: colocated``) or on
``ray.judge_replicas`` actors of its own that the replicas call (``ray.judge: actors``, e.g. a few NLI
judges sharing one GPU). Judge decisions travel back with the rows; the driver appends them to
``judge-cache.jsonl`` and hands the cache to the replicas of a resumed run.

Failures: a replica that dies is restarted by Ray (``ray.max_restarts``) and its unfinished call is
retried there; past its restarts, its shards go to the other replicas. A shard is written once, by
the driver, after its rows arrived; a killed driver loses only unwritten shards, and the same command
again finishes the same dataset.
"""
from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from specprobe.data_gen.config import DataJob
from specprobe.data_gen.contexts import Context
from specprobe.data_gen.judges import CachedJudge, EquivalenceJudge, PairQuery
from specprobe.data_gen.pipeline import (
    DataResult,
    ShardWorkers,
    build_judge,
    engine_info,
    generate_dataset,
    process_shard,
)
from specprobe.infer.engines import build_engine_pair
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

__all__ = ["generate_dataset_on_ray", "RayShardWorkers"]

log = logging.getLogger(__name__)
IN_FLIGHT_PER_REPLICA = 2  # one running, one queued: a replica never waits for the driver


# ----------------------------------------------------------------------------- actors
class _JudgeActor:
    """One equivalence judge model on its own actor (ray.judge: actors)."""

    def __init__(self, job: DataJob):
        set_actor_threads(job.ray.judge_cpus, job.ray.judge_gpus)
        self.judge = build_judge(job.data, None, job.models.resolved_device()).inner

    def describe(self) -> tuple[str, bool]:
        return self.judge.name, bool(getattr(self.judge, "symmetric", False))

    def judge_pairs(self, items: list[PairQuery]) -> tuple[list[bool], int]:
        before = self.judge.model_calls
        decisions = [bool(d) for d in self.judge.judge(items)]
        return decisions, self.judge.model_calls - before


class _RemoteJudge(EquivalenceJudge):
    """A replica's view of the judge actors: calls go round-robin, starting at the replica's own."""

    def __init__(self, handles: list, start: int):
        ray = import_ray()
        self.handles = handles
        self._next = start
        self.name, self.symmetric = ray.get(handles[0].describe.remote())
        self.model_calls = 0

    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        ray = import_ray()
        handle = self.handles[self._next % len(self.handles)]
        self._next += 1
        decisions, calls = ray.get(handle.judge_pairs.remote(list(items)))
        self.model_calls += calls
        return decisions


class _DataReplica:
    """Target and draft engines (and, colocated, the judge) that turn shards into rows."""

    def __init__(self, job: DataJob, judge_handles: list, index: int, known: dict[str, bool]):

        set_actor_threads(job.ray.cpus_per_replica, job.ray.gpus_per_replica)
        self.job = job
        inner = (_RemoteJudge(judge_handles, index) if judge_handles
                 else build_judge(job.data, None, job.models.resolved_device()).inner)
        self.judge = CachedJudge(inner)
        self.judge.merge(known)
        self.engines = dict(zip(("target", "draft"), build_engine_pair(job.models)))

    def describe(self) -> dict:
        return {"engines": {r: engine_info(e) for r, e in self.engines.items()}, "judge": self.judge.name,
                "pid": os.getpid()}

    def run_shard(self, index: int, contexts: list[Context]) -> tuple:
        known = len(self.judge)
        shard, entry = process_shard(self.job, self.engines, self.judge, index, contexts)
        return shard, entry, self.judge.decisions(known)


class _DecisionStore(EquivalenceJudge):
    """The driver's side of the judge cache: it stores the replicas' decisions and judges nothing."""

    name = "decisions made by the replicas"

    def judge(self, items: Sequence[PairQuery]) -> list[bool]:
        raise RuntimeError("the driver does not judge pairs; its replicas do")


# ----------------------------------------------------------------------------- the driver's workers
class RayShardWorkers(ShardWorkers):
    """Shards spread over ``job.ray.replicas`` Ray actors; results come back to this process.

    on_shard(index, replica): called when a shard's rows arrived (tests use it to kill replicas
    mid-run). ``replicas`` holds the actor handles once started.
    """

    def __init__(self, job: DataJob, on_shard: Callable[[int, int], None] | None = None):
        self.job = job
        self.on_shard = on_shard
        self.replicas: list = []
        self.judges: list = []
        self.cache: CachedJudge | None = None
        self.described: list[dict] = []  # per replica: engines, judge name, pid

    def start(self, judge_cache: Path) -> dict:
        ray = import_ray()
        rc = self.job.ray
        self.cache = CachedJudge(_DecisionStore(), judge_cache)
        # held for the run: a restarted replica is rebuilt from its constructor arguments
        self._known = known = ray.put(self.cache.decisions())
        if rc.judge == "actors":
            judge_cls = ray.remote(_JudgeActor).options(**actor_options(rc.judge_cpus, rc.judge_gpus, rc.max_restarts))
            self.judges = [judge_cls.remote(self.job) for _ in range(rc.judge_replicas)]
        replica_cls = ray.remote(_DataReplica).options(
            **actor_options(rc.cpus_per_replica, rc.gpus_per_replica, rc.max_restarts))
        self.replicas = [replica_cls.remote(self.job, self.judges, i, known) for i in range(rc.replicas)]
        described = describe_started(ray, self.replicas + self.judges)[: len(self.replicas)]  # waits for the models
        self.described = described
        first = described[0]
        for i, d in enumerate(described[1:], 1):
            if d["engines"] != first["engines"] or d["judge"] != first["judge"]:
                raise ClusterError(f"replica {i} loaded other models than replica 0 ({d['engines']} vs "
                                   f"{first['engines']}); every node must see the same model files")
        log.info("data stage on %d replica(s)%s", len(self.replicas),
                 f" and {len(self.judges)} judge actor(s)" if self.judges else " (judge beside the models)")
        return {"engines": first["engines"], "judge": first["judge"]}

    def run(self, todo: list[tuple[int, list[Context]]], on_context: Callable[[], None]):
        ray = import_ray()
        from ray.exceptions import RayActorError

        queue = deque(todo)
        in_flight: dict = {}  # ObjectRef -> (replica, (index, contexts))
        alive = set(range(len(self.replicas)))

        def submit(replica: int) -> None:
            if queue and replica in alive:
                item = queue.popleft()
                in_flight[self.replicas[replica].run_shard.remote(*item)] = (replica, item)

        for replica in sorted(alive):
            for _ in range(IN_FLIGHT_PER_REPLICA):
                submit(replica)
        while in_flight:
            (ref,), _ = ray.wait(list(in_flight), num_returns=1)
            replica, item = in_flight.pop(ref)
            try:
                shard, entry, decisions = ray.get(ref)
            except RayActorError as err:  # died past its restarts: its shards go to the others
                alive.discard(replica)
                queue.appendleft(item)
                if not alive:
                    raise ClusterError(f"every replica died (last: {err}); the shards written so far are "
                                       "kept: run the same command again to finish") from None
                log.warning("replica %d is gone (%s); shard %d goes to another replica", replica, err, item[0])
                for other in sorted(alive):
                    submit(other)
                continue
            self.cache.merge(decisions)  # before the shard: a resumed run finds them either way
            for _ in item[1]:
                on_context()
            yield shard, entry
            if self.on_shard is not None:
                self.on_shard(item[0], replica)
            submit(replica)

    def close(self) -> None:
        ray = import_ray()
        for actor in self.replicas + self.judges:
            ray.kill(actor, no_restart=True)
        self.replicas, self.judges = [], []


def generate_dataset_on_ray(job: DataJob, *, address: str | None = None, part: tuple[int, int] | None = None,
                            progress: bool = True, traces: Sequence | None = None,
                            on_shard: Callable[[int, int], None] | None = None) -> DataResult:
    """`generate_dataset` with the shards spread over Ray replicas (``job.ray``); same folder, same
    rows. address: a cluster to join (default ``job.ray.address``; none = a local instance)."""
    where = connect(job.ray, address)
    check_resources(replica_demands(job.ray, judge_actors=job.ray.judge == "actors"))
    log.info("data stage on %s", where)
    workers = RayShardWorkers(job, on_shard=on_shard)
    try:
        return generate_dataset(job, traces=traces, part=part, progress=progress, workers=workers)
    finally:
        workers.close()
