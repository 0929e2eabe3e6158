"""Scale-out on Ray, on a local instance with 2 CPUs: the data stage spread over replicas writes the
single-process dataset row for row, also when a replica or the driver is killed mid-run; bad cluster
settings are quick, clear errors."""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specprobe.infer.ray_cluster import INSTALL_HINT, ActorDemand, ClusterError, check_resources

# skipped only where Ray is not installed; `.ci/run` installs it and fails first if it cannot import it
ray = pytest.importorskip("ray", reason=INSTALL_HINT)

from specprobe.data_gen.pipeline import generate_dataset  # noqa: E402
from specprobe.data_gen.store import read_manifest  # noqa: E402

from _data_fixtures import assert_same_data, dataset_arrays, write_config  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("one_thread")]
# 4 problems x 1 context, N = 4, one context per shard: 4 shards to spread, kill and resume between
SMALL = {"source": {"size": 4}, "sampling": {"max_step_tokens": 10}}


def small_config(folder: Path, **ray_settings):
    return write_config(folder, folder / "run", **SMALL, ray={"local_cpus": 2, **ray_settings})


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- fast: bad cluster input
def test_resource_check_names_the_setting_before_any_actor_exists():
    node = {"CPU": 2.0, "GPU": 0.0}
    with pytest.raises(ClusterError, match=r"asks for 1 GPUs \(ray.gpus_per_replica\).*largest node .* has 0"):
        check_resources([ActorDemand("replica", 1, 1.0, 1.0)], nodes=[node])
    with pytest.raises(ClusterError, match=r"need 3 CPUs .* cluster has 2"):
        check_resources([ActorDemand("replica", 2, 1.0, 0.0), ActorDemand("judge actor", 1, 1.0, 0.0)], nodes=[node])
    with pytest.raises(ClusterError, match=r"ray.judge_gpus"):
        check_resources([ActorDemand("judge actor", 1, 1.0, 0.5)], nodes=[node])
    # fits: two nodes of 1 GPU hold two 1-GPU replicas, and half-GPU replicas share one
    check_resources([ActorDemand("replica", 2, 1.0, 1.0)], nodes=[{"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1}])
    check_resources([ActorDemand("replica", 2, 1.0, 0.5)], nodes=[{"CPU": 4, "GPU": 1}])
    with pytest.raises(ClusterError, match="largest node"):  # 2 GPUs in total, but not on one node
        check_resources([ActorDemand("replica", 1, 1.0, 2.0)], nodes=[{"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1}])


def test_unreachable_address_is_a_quick_clear_cli_error(tmp_path):
    path, _ = small_config(tmp_path, connect_timeout_s=2)
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "specprobe.train.cli", "--config", str(path), "--stage", "data",
                           "--ray", address], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"no Ray cluster answers at {address}" in proc.stderr and "ray start --head" in proc.stderr
    assert not (tmp_path / "run" / "data" / "manifest.json").exists()


# ----------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def local_ray():
    import signal

    from specprobe.infer.config import RayConfig
    from specprobe.infer.ray_cluster import connect

    def marker(signum, frame):  # probe-train's handler stands here
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, marker)
    try:
        connect(RayConfig(local_cpus=2))
        # ray.init replaces SIGTERM's handler with a plain exit; connect gives the caller's back
        assert signal.getsignal(signal.SIGTERM) is marker
    finally:
        signal.signal(signal.SIGTERM, before)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of the small config (real SmolLM2 + MiniLM judge)."""
    folder = tmp_path_factory.mktemp("single")
    _, cfg = small_config(folder)
    result = generate_dataset(cfg.data_job(), progress=False)
    assert result.complete and len(result.manifest["shards"]) == 4
    return result


def _cache_keys(data_dir: Path) -> set[str]:
    import json

    return {json.loads(line)["key"] for line in (data_dir / "judge-cache.jsonl").read_text().splitlines()}


@pytest.mark.slow
def test_too_many_gpus_is_refused_before_loading_anything(local_ray, tmp_path):
    from specprobe.data_gen.distributed import generate_dataset_on_ray

    _, cfg = small_config(tmp_path, gpus_per_replica=1)
    with pytest.raises(ClusterError, match=r"1 GPUs \(ray.gpus_per_replica\).* has 0"):
        generate_dataset_on_ray(cfg.data_job(), progress=False)
    assert not cfg.data_dir.exists()


@pytest.mark.slow
def test_a_replica_that_cannot_load_its_model_is_a_clear_error(local_ray, tmp_path):
    from specprobe.data_gen.distributed import generate_dataset_on_ray

    # an existing folder without config.json: it passes the config's path check, and only loading fails
    (tmp_path / "empty-model-folder").mkdir()
    _, cfg = write_config(tmp_path, tmp_path / "run", **SMALL, ray={"local_cpus": 2},
                          models={"target": str(tmp_path / "empty-model-folder")})
    with pytest.raises(ClusterError, match=r"(?s)could not start.*ModelUnavailableError.*empty-model-folder"):
        generate_dataset_on_ray(cfg.data_job(), progress=False)
    manifest = read_manifest(cfg.data_dir)
    assert manifest is None  # nothing was planned into the folder


@pytest.mark.slow
def test_two_replicas_write_the_single_process_dataset(local_ray, reference, tmp_path):
    from specprobe.data_gen.distributed import generate_dataset_on_ray

    _, cfg = small_config(tmp_path, replicas=2)
    result = generate_dataset_on_ray(cfg.data_job(), progress=False)
    assert result.complete and result.run.contexts == 4
    assert_same_data(dataset_arrays(result.data_dir), dataset_arrays(reference.data_dir))
    assert result.manifest["judge"] == reference.manifest["judge"]
    # the replicas' judge decisions reached the driver's cache: the same pairs as the single run
    assert _cache_keys(result.data_dir) == _cache_keys(reference.data_dir)


@pytest.mark.slow
def test_replica_killed_mid_run_is_restarted_and_nothing_is_lost(local_ray, reference, tmp_path):
    """One replica, the judge on its own actor; the replica is killed while it holds unfinished shards."""
    from specprobe.data_gen.distributed import RayShardWorkers

    _, cfg = small_config(tmp_path, replicas=1, judge="actors", judge_replicas=1)
    killed = []

    def kill_after_first(index: int, replica: int) -> None:
        if not killed:
            killed.append((index, workers.described[replica]["pid"]))
            ray.kill(workers.replicas[replica], no_restart=False)  # Ray restarts it (ray.max_restarts)

    workers = RayShardWorkers(cfg.data_job(), on_shard=kill_after_first)
    written = []
    try:
        result = generate_dataset(cfg.data_job(), progress=False, workers=_Recording(workers, written))
        new_pid = ray.get(workers.replicas[0].describe.remote())["pid"]
    finally:
        workers.close()
    assert killed and new_pid != killed[0][1], "the replica was not restarted"
    assert sorted(written) == [0, 1, 2, 3]  # every shard written exactly once
    assert result.complete
    assert_same_data(dataset_arrays(result.data_dir), dataset_arrays(reference.data_dir))


class _Recording:
    """Passes through to the workers and records which shard indices reached the writer."""

    def __init__(self, workers, written: list):
        self.workers, self.written = workers, written

    def start(self, judge_cache):
        return self.workers.start(judge_cache)

    def run(self, todo, on_context):
        for shard, entry in self.workers.run(todo, on_context):
            self.written.append(shard.index)
            yield shard, entry


@pytest.mark.slow
def test_driver_killed_mid_run_then_the_same_command_finishes(reference, tmp_path):
    path, cfg = small_config(tmp_path, replicas=2)
    command = [sys.executable, "-m", "specprobe.train.cli", "--config", str(path), "--stage", "data", "--ray", "--no-progress"]
    data_dir = cfg.data_dir
    with open(tmp_path / "killed.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: the local Ray processes go with it
        try:
            deadline = time.time() + 400
            while time.time() < deadline and proc.poll() is None:
                manifest = read_manifest(data_dir) if (data_dir / "manifest.json").exists() else None
                if manifest and manifest["shards"]:
                    break
                time.sleep(0.05)
            alive = proc.poll() is None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert alive, "the run ended before it could be killed:\n" + (tmp_path / "killed.log").read_text()[-3000:]
    before = read_manifest(data_dir)
    assert before["status"] == "in_progress" and 1 <= len(before["shards"]) < 4
    again = subprocess.run(command, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=500,
                           start_new_session=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    after = read_manifest(data_dir)
    assert after["status"] == "complete" and [s["index"] for s in after["shards"]] == [0, 1, 2, 3]
    for entry in before["shards"]:  # what the killed driver wrote was kept, not redone
        assert after["shards"][entry["index"]] == entry
    assert_same_data(dataset_arrays(data_dir), dataset_arrays(reference.data_dir))


# ----------------------------------------------------------------------------- probe-bench --ray
def test_problems_are_dealt_round_robin_and_results_merge():
    from specprobe.infer.bench import MethodResult, ProblemCounts, merge_results, parse_method
    from specprobe.infer.bench_ray import dealt_positions
    from specprobe.infer.decoding import RunStats

    assert dealt_positions(5, 2) == [[0, 2, 4], [1, 3]]
    assert dealt_positions(2, 4) == [[0], [1]]  # no idle replica holds an empty share
    lr, target = parse_method("lr_sync"), parse_method("target")

    def timed(spec, latency, correct=1):
        return MethodResult(spec, RunStats(problems=1, output_tokens=10), correct=correct, answered=1,
                            latencies=[latency], counts=[ProblemCounts(int(latency), 20, 0, 0, f"t{int(latency) % 2}")])

    def failed(spec):
        return MethodResult(spec, error="RuntimeError: boom")

    # one problem per part, as replicas return them (in any order); target fails at problem 2 on replica 0 and is
    # skipped there at 4, while replica 1 still times it at 3
    parts = [(1, {"lr_sync": timed(lr, 11.0, 0), "target": timed(target, 21.0)}),
             (0, {"lr_sync": timed(lr, 10.0), "target": timed(target, 20.0)}),
             (3, {"lr_sync": timed(lr, 13.0), "target": timed(target, 23.0)}),
             (2, {"lr_sync": timed(lr, 12.0), "target": failed(target)}),
             (4, {"lr_sync": timed(lr, 14.0), "target": failed(target)})]
    merged = merge_results(parts)
    assert merged["lr_sync"].latencies == [10.0, 11.0, 12.0, 13.0, 14.0]  # the problems' order
    # α's per-problem counts likewise, each with its problem's family
    assert [(c.accepted, c.family) for c in merged["lr_sync"].counts] == [(10, "t0"), (11, "t1"), (12, "t0"),
                                                                           (13, "t1"), (14, "t0")]
    assert (merged["lr_sync"].correct, merged["lr_sync"].answered, merged["lr_sync"].stats.problems) == (4, 5, 5)
    assert merged["lr_sync"].stats.output_tokens == 50 and merged["lr_sync"].error is None
    # as in one process: the problems before the first failure, and its error
    assert merged["target"].latencies == [20.0, 21.0] and merged["target"].answered == 2
    assert merged["target"].error == "RuntimeError: boom"


def test_traces_are_rewritten_in_the_problems_order(tmp_path):
    import json

    from specprobe.infer.bench import parse_method, rewrite_traces, start_out_dir

    specs = [parse_method("target"), parse_method("lr_sync")]
    start_out_dir(tmp_path, specs)("lr_sync", [{"problem": "stale"}])
    # problems as replicas returned them: 2, 0, 1
    parts = [(p, [("target", [{"problem": p}]), ("lr_sync", [{"problem": p, "cycle": c} for c in range(2)])])
             for p in (2, 0, 1)]
    rewrite_traces(tmp_path, specs, parts)
    read = {s.label: [json.loads(line) for line in (tmp_path / "traces" / f"{s.label}.jsonl").open()] for s in specs}
    assert [r["problem"] for r in read["target"]] == [0, 1, 2]
    assert [(r["problem"], r["cycle"]) for r in read["lr_sync"]] == [(p, c) for p in range(3) for c in range(2)]
    assert not list((tmp_path / "traces").glob("*.tmp"))  # moved into place


def _descendants_titled(word: str) -> list[int]:
    """The pids of this process's descendants (the local Ray instance's workers) whose command line contains `word`
    (Ray titles an actor's process ray::<class>...)."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
        return False

    return [pid for pid, title in titles.items() if word in title and descends(pid)]


BENCH = ["models.target=random:llama-20m", "models.draft=random:llama-tiny", "models.device=cpu",
         "runtime.max_steps=3", "sampling.max_step_tokens=6", "runtime.accept_length_cut=true",
         "bench.num_problems=2", "bench.warmup=false", "ray.local_cpus=2"]


@pytest.mark.slow
def test_bench_on_two_replicas_gives_the_single_process_table(local_ray, tmp_path, capsys, monkeypatch):
    import json

    from specprobe.infer import bench
    from specprobe.infer.bench_cli import main

    methods = ["--methods", "target,lr_sync,semanticspec", "--verifier", "bernoulli"]
    assert main(["--config", "configs/tiny.yaml", *methods, "--out", str(tmp_path / "single"), *BENCH]) == 0
    written = []  # the driver's reports, as each problem returns
    write = bench.write_report
    monkeypatch.setattr(bench, "write_report", lambda report, out: (written.append(report), write(report, out)))
    assert main(["--config", "configs/tiny.yaml", *methods, "--out", str(tmp_path / "ray"), "--ray",
                 *BENCH, "ray.replicas=2"]) == 0
    first, last = written
    assert first["finished"] == "1 of 2 problems" and len(first["problems"]) == 1 and "finished" not in last
    assert all(len(r["latencies_s"]) == 1 for r in first["rows"]) and first["replicas"] == 2
    assert "| lr_sync |" in capsys.readouterr().out
    single = json.loads((tmp_path / "single" / "results.json").read_text())
    spread = json.loads((tmp_path / "ray" / "results.json").read_text())
    assert spread["replicas"] == 2 and spread["problems"] == single["problems"]
    assert spread["models"] == single["models"] and single["models"]["target"] == "random:llama-20m"
    assert [r["method"] for r in spread["rows"]] == ["target", "lr_sync", "semanticspec"]
    for a, b in zip(spread["rows"], single["rows"]):
        # every problem decoded by every method, with the same seeded draws as in one process
        assert a["problems"] == 2 and not a["error"]
        assert (a["output_tokens"], a["judged"], a["correct"]) == (b["output_tokens"], b["judged"], b["correct"])
        assert a["speedup"] is not None and a["speedup"] > 0
        # α's interval from the per-problem counts, merged in the problems' order: a bootstrap over the 2 problems
        assert (a["acceptance_ci95"], a["acceptance_ci95_resamples"]) == (b["acceptance_ci95"],
                                                                          b["acceptance_ci95_resamples"])
        assert a["acceptance_ci95_resamples"] == (None if a["method"] == "target" else "problems")
    def traced(run):  # the problem of each trace record, in the file's order
        return [json.loads(line)["problem"] for line in (tmp_path / run / "traces" / "lr_sync.jsonl").open()]

    # every problem's records, in the problems' order (as one process writes them), whichever replica finished first
    assert set(traced("ray")) == set(single["problems"]) and traced("ray") == traced("single")


@pytest.mark.slow
@pytest.mark.parametrize("restarts", [3, 0])
def test_bench_replica_killed_mid_run(local_ray, tmp_path, monkeypatch, capsys, restarts):
    """One replica, killed once the first problem's report is written. With restarts, Ray restarts it, it warms up
    again (its first call after the restart) and decodes the problem it was on (or had queued): the report has
    every problem and no method failed. Without, the run is a clear error (exit 2) and the report keeps the
    problem that finished, marked as such."""
    import json

    from specprobe.infer import bench
    from specprobe.infer.bench_cli import main

    killed, write = [], bench.write_report

    def write_then_kill(report, out):
        write(report, out)
        if not killed:
            killed.extend(_descendants_titled("ray::BenchReplica"))
            for pid in killed:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile
                    pass

    monkeypatch.setattr(bench, "write_report", write_then_kill)
    rc = main(["--config", "configs/tiny.yaml", "--methods", "target,lr_sync", "--verifier", "bernoulli",
               "--out", str(tmp_path / "ray"), "--ray", *BENCH, "ray.replicas=1", f"ray.max_restarts={restarts}",
               "bench.warmup=true"])
    assert killed, "no replica process was found to kill"  # (a finished test's replica may linger, killed too)
    report = json.loads((tmp_path / "ray" / "results.json").read_text())
    if restarts:
        assert rc == 0 and "finished" not in report and len(report["problems"]) == 2
        assert all(not r["error"] and len(r["latencies_s"]) == 2 for r in report["rows"])
    else:
        assert rc == 2 and "could not be decoded on Ray" in capsys.readouterr().err
        assert report["finished"] == "1 of 2 problems" and len(report["problems"]) == 1
        assert all(not r["error"] and len(r["latencies_s"]) == 1 for r in report["rows"])
        # the same command with --resume decodes the other problem only (with two replicas asked for: one problem
        # is left, so one starts); a method the earlier run saw fail (made so in its log) is not decoded again
        log = tmp_path / "ray" / "problems.jsonl"
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        lines[1]["results"]["lr_sync"]["error"] = "RuntimeError: out of memory"
        log.write_text("".join(json.dumps(line) + "\n" for line in lines))
        monkeypatch.setattr(bench, "write_report", write)
        assert main(["--config", "configs/tiny.yaml", "--methods", "target,lr_sync", "--verifier", "bernoulli",
                     "--out", str(tmp_path / "ray"), "--ray", *BENCH, "ray.replicas=2", "ray.max_restarts=0",
                     "bench.warmup=true", "--resume", "--keep-going"]) == 0
        err = capsys.readouterr().err
        assert "2 problems (1 left) over 1 replica(s)" in err and "probe-bench: 2 of 2 problems, " in err
        done = json.loads((tmp_path / "ray" / "results.json").read_text())
        assert done["resumed"] == "1 of 2 problems decoded by an earlier run of this command"
        assert "finished" not in done and done["problems"] == [*report["problems"], *done["problems"][1:]]
        rows = {r["method"]: r for r in done["rows"]}
        assert not rows["target"]["error"] and len(rows["target"]["latencies_s"]) == 2
        assert rows["lr_sync"]["error"] == "RuntimeError: out of memory"
        for method, decoded in (("target", done["problems"]), ("lr_sync", done["problems"][:1])):
            traced = [json.loads(line)["problem"] for line in (tmp_path / "ray" / "traces" / f"{method}.jsonl").open()]
            assert [problem for problem, _ in itertools.groupby(traced)] == decoded  # once each, in order


def test_a_replica_skips_the_methods_an_earlier_run_saw_fail():
    """A resumed Ray run tells each replica which methods failed before the problem it sends (`first_failures`,
    `skipped_at`): those decode nothing there, as in one process; the others decode as usual."""
    import torch

    from specprobe.infer import bench
    from specprobe.infer.bench_ray import BenchReplica
    from specprobe.train.config import load_config

    ok = bench.MethodResult(bench.parse_method("target"))
    bad = bench.MethodResult(bench.parse_method("lr_sync"), error="RuntimeError: out of memory")
    parts = [(3, {"target": ok, "lr_sync": bad}), (1, {"target": ok, "lr_sync": ok}), (5, {"lr_sync": bad})]
    failed = bench.first_failures(parts)
    assert failed == {"lr_sync": (3, "RuntimeError: out of memory")}
    assert (bench.skipped_at(failed, 3), bench.skipped_at(failed, 4)) == ({}, {"lr_sync": "RuntimeError: out of memory"})

    setup = load_config("configs/tiny.yaml", BENCH).bench_setup()
    threads = torch.get_num_threads()
    try:
        replica = BenchReplica(setup, None, "bernoulli", None, ["target", "lr_sync"])
        specs = bench.method_specs(["target", "lr_sync"])
        results, _, _ = replica.solve(specs, 1, {"lr_sync": "RuntimeError: out of memory"})
        assert results["lr_sync"].error == "RuntimeError: out of memory" and not results["lr_sync"].latencies
        assert not results["target"].error and len(results["target"].latencies) == 1
        fresh = BenchReplica(setup, None, "bernoulli", None, ["target", "lr_sync"])
        results, _, _ = fresh.solve(specs, 1)
        assert not results["lr_sync"].error and len(results["lr_sync"].latencies) == 1
    finally:
        torch.set_num_threads(threads)
