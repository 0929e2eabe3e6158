"""Joining or starting a Ray cluster for scale-out, with clear errors instead of hangs.

Ray is an optional extra (``pip install 'specprobe[ray]'``). ``connect`` starts a local instance when no
address is given, or joins an existing cluster (``ray start --head`` on one node, ``ray start
--address=HOST:6379`` on the others). An address that does not answer within
``ray.connect_timeout_s`` is a ``ClusterError`` (``ray.init`` itself would keep retrying for minutes).
``check_resources`` refuses a plan the cluster cannot hold before any actor is created: an actor
asking for more GPUs or CPUs than any node has would otherwise wait forever.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import dataclass

__all__ = ["ClusterError", "INSTALL_HINT", "import_ray", "split_ray_option", "connect", "ActorDemand", "check_resources",
           "replica_demands", "actor_options", "set_actor_threads", "describe_started"]

INSTALL_HINT = "Ray is not installed: pip install 'specprobe[ray]' (ray==2.60.0)"
DEFAULT_PORT = 6379


class ClusterError(RuntimeError):
    """The Ray cluster cannot be reached or cannot hold the requested actors."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise ClusterError(INSTALL_HINT) from None
    return ray


def split_ray_option(ray: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """The CLIs' `--ray [ADDRESS]` and their key=value overrides, as meant: argparse gives `--ray ray.replicas=2`
    the override as the address; a value with "=" is no Ray address, so it goes back to the overrides (first:
    before overrides given ahead of --ray, which then lose to it on the same key) and Ray starts locally."""
    if ray and "=" in ray:
        return "", [ray, *overrides]
    return ray, list(overrides)


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) to probe for `address`, None for addresses Ray resolves itself (auto, local)."""
    if address in ("auto", "local"):
        return None
    bare = address.split("://", 1)[1] if "://" in address else address
    host, _, port = bare.rpartition(":")
    if not host:  # no port given
        return bare, 10001 if address.startswith("ray://") else DEFAULT_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ClusterError(f"Ray address {address!r}: the port {port!r} is not a number "
                           "(expected HOST:PORT, e.g. 10.0.0.5:6379)") from None


def _probe(address: str, timeout: float) -> None:
    target = _host_port(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout):
            return
    except OSError as err:
        raise ClusterError(f"no Ray cluster answers at {address} ({type(err).__name__}: {err}; waited up to "
                           f"{timeout:g}s). Start one there with `ray start --head --port={target[1]}`, check "
                           "the address and firewall, or drop --ray's address to run on a local instance"
                           ) from None


def connect(ray_cfg, address: str | None = None) -> str:
    """Join the cluster at `address` (else ``ray_cfg.address``), or start a local instance when both
    are empty. Reuses a connection this process already has. Returns a description for logs."""
    ray = import_ray()
    address = address or ray_cfg.address
    if ray.is_initialized():
        return "the Ray instance this process is already connected to"
    # ray.init replaces the SIGTERM handler with a plain exit; the caller's (probe-train keeps finished work on
    # SIGTERM) comes back after it
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        return _init(ray, ray_cfg, address)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _init(ray, ray_cfg, address: str | None) -> str:
    # workers import specprobe as the driver does: from their node's install (README: every node needs it), plus the
    # driver's PYTHONPATH where it sets one (a checkout run without installing, as on the GPU box)
    path = os.environ.get("PYTHONPATH", "")
    runtime_env = {"env_vars": {"PYTHONPATH": path}} if path else None
    if address:
        _probe(address, ray_cfg.connect_timeout_s)
        # something answered, but it may not be Ray: bound Ray's own retries (1 s each, default 20)
        key = "RAY_gcs_server_port_wait_time_s"
        ours = key not in os.environ
        retries = os.environ.setdefault(key, str(max(1, int(ray_cfg.connect_timeout_s))))
        try:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ClusterError(f"could not join the Ray cluster at {address} (tried for about {retries}s): {err}. "
                               "Is `ray start --head` running there, and is this the GCS port it printed?") from None
        finally:
            if ours:
                os.environ.pop(key, None)
        return f"Ray cluster at {address}"
    # "local": a new instance even when `ray start` runs on this machine (joining it needs its address)
    ray.init(address="local", num_cpus=ray_cfg.local_cpus, include_dashboard=False, runtime_env=runtime_env)
    return f"local Ray instance ({ray.cluster_resources().get('CPU', 0):g} CPUs)"


@dataclass(frozen=True)
class ActorDemand:
    """`count` actors of one kind, each asking for `cpus` and `gpus`."""

    what: str
    count: int
    cpus: float
    gpus: float


def replica_demands(ray_cfg, judge_actors: bool = False) -> list[ActorDemand]:
    demands = [ActorDemand("replica", ray_cfg.replicas, ray_cfg.cpus_per_replica, ray_cfg.gpus_per_replica)]
    if judge_actors:
        demands.append(ActorDemand("judge actor", ray_cfg.judge_replicas, ray_cfg.judge_cpus, ray_cfg.judge_gpus))
    return demands


def check_resources(demands: list[ActorDemand], nodes: list[dict] | None = None) -> None:
    """ClusterError when an actor fits on no node, or all of them together exceed the cluster.
    nodes: resource dicts of the live nodes (default: asked from the connected cluster)."""
    if nodes is None:
        ray = import_ray()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    totals = {k: sum(n.get(k, 0.0) for n in nodes) for k in ("CPU", "GPU")}
    need = {"CPU": 0.0, "GPU": 0.0}
    for d in demands:
        for key, amount, setting in (("GPU", d.gpus, "gpus"), ("CPU", d.cpus, "cpus")):
            largest = max((n.get(key, 0.0) for n in nodes), default=0.0)
            if amount > largest:
                knob = {"replica": f"ray.{setting}_per_replica", "judge actor": f"ray.judge_{setting}"}[d.what]
                raise ClusterError(f"a {d.what} asks for {amount:g} {key}s ({knob}) but the largest node of the "
                                   f"cluster has {largest:g} (cluster total {totals[key]:g}); lower {knob}"
                                   + (" or run on a machine with GPUs" if key == "GPU" and not totals[key] else ""))
            need[key] += d.count * amount
    for key in ("CPU", "GPU"):
        if need[key] > totals[key] + 1e-9:
            parts = " + ".join(f"{d.count} {d.what}(s) x {d.gpus if key == 'GPU' else d.cpus:g}" for d in demands)
            raise ClusterError(f"the actors need {need[key]:g} {key}s ({parts}) but the cluster has "
                               f"{totals[key]:g}; lower ray.replicas or the per-replica {key}s")


def actor_options(cpus: float, gpus: float, max_restarts: int) -> dict:
    """Ray options of a restartable actor: a crashed actor is restarted and its running call retried."""
    return {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": max_restarts,
            "max_task_retries": max_restarts}


def set_actor_threads(cpus: float, gpus: float) -> None:
    """In an actor on CPUs only: as many torch threads as the cores Ray reserved for it."""
    if gpus == 0 and cpus >= 1:
        import torch

        torch.set_num_threads(int(cpus))


def describe_started(ray, actors: list, what: str = "a Ray actor") -> list:
    """Each actor's describe(), once its constructor (model loading) finished; a constructor that failed (a model
    missing on its node, out of memory) is a ClusterError that says so."""
    from ray.exceptions import RayActorError

    try:
        return ray.get([a.describe.remote() for a in actors])
    except RayActorError as err:
        raise ClusterError(f"{what} could not start (models missing or not loadable on its node?): {err}") from None
