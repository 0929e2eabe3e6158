"""probe-train: generate training data and train the probes/verifiers of one experiment config.

Usage:
    probe-train --config configs/tiny.yaml                      # all stages
    probe-train --config configs/tiny.yaml --stage data         # training data only (resumable)
    probe-train --config configs/tiny.yaml --stage train        # train the verifiers on existing data
    probe-train --config X --stage data --shard 0/4             # every 4th shard from 0 -> data/part-0-of-4
    probe-train --config X --merge                              # join the part folders into data/
    probe-train --config X --stage data --ray                   # shards over Ray replicas (local instance)
    probe-train --config X --stage data --ray 10.0.0.5:6379     # ... on an existing cluster (ray start --head)
    probe-train --config X --stage data data.num_samples=8 output_dir=runs/mine   # key=value overrides
    probe-train --help-config                                   # every config key with its help

Re-running the same command after an interruption (even kill -9) finishes the same data set; a complete
data folder made with the same settings is reused.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from specprobe.data_gen.contexts import parse_part
from specprobe.data_gen.pipeline import DataGenStats, DataResult, generate_dataset
from specprobe.data_gen.store import merge_parts
from specprobe.infer.ray_cluster import split_ray_option
from specprobe.inputs.config import ConfigError
from specprobe.inputs.signals import Stopped, sigterm_stops
from specprobe.train.config import format_help, load_config
from specprobe.train.pipeline import train_all

STAGES = ("data", "train", "all")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe-train", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="experiment YAML (e.g. configs/tiny.yaml)")
    parser.add_argument("--stage", choices=STAGES, default="all", help="what to run (default: all)")
    parser.add_argument("--shard", metavar="i/n", help="data stage: process part i of n (0-based) into data/part-i-of-n")
    parser.add_argument("--merge", action="store_true", help="join data/part-*-of-n folders into data/ and stop")
    parser.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                        help="data stage: spread the shards over Ray replicas (the ray: config section); "
                             "ADDRESS joins a cluster (else ray.address; none = a local instance)")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its help and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.num_samples=8")
    return parser


def run_data_stage(cfg, shard: str | None, progress: bool, ray_address: str | None = None) -> int:
    """ray_address: None = this process only; "" = Ray at ray.address or a local instance."""

    part = parse_part(shard) if shard else None
    if ray_address is None:
        result = generate_dataset(cfg.data_job(), part=part, progress=progress)
    else:
        from specprobe.data_gen.distributed import generate_dataset_on_ray

        result = generate_dataset_on_ray(cfg.data_job(), address=ray_address or None, part=part, progress=progress)
    print(result.summary())
    if part is not None:
        print(f"part {part[0]} of {part[1]} done; when every part is done: probe-train --config <file> --merge")
    return 0


def run_merge(cfg) -> int:

    manifest = merge_parts(cfg.data_dir)
    print(DataResult(cfg.data_dir, manifest, False, DataGenStats()).summary())
    if manifest["status"] != "complete":
        missing = manifest["plan"]["num_shards"] - len(manifest["shards"])
        print(f"{missing} shard(s) are in no finished part; run the data stage without --shard to finish them")
    return 0


def run_train_stage(cfg, progress: bool = True) -> int:
    """Train every verifier in verifiers.train on <output_dir>/data; prints validation metrics next to
    the baselines and writes <output_dir>/checkpoint."""

    train_all(cfg, progress=progress)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.ray, args.overrides = split_ray_option(args.ray, args.overrides)

    if args.help_config:
        print(format_help())
        return 0
    if not args.config:
        build_parser().error("--config is required (e.g. --config configs/tiny.yaml)")
    if (args.shard or args.merge or args.ray is not None) and args.stage == "train":
        build_parser().error("--shard, --merge and --ray belong to the data stage")
    if args.merge and (args.shard or args.ray is not None):
        build_parser().error("--merge joins the finished part folders; it takes no --shard or --ray")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        with sigterm_stops():
            return _run(args)
    except Stopped:
        print("probe-train: stopped by SIGTERM; what had finished is kept (the data stage's shards, the train "
              "stage's verifiers in <checkpoint>-partial): the same command resumes the data stage and reuses "
              "those verifiers", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (ConfigError, ValueError, RuntimeError, FileNotFoundError) as err:
        notes = "".join(f"\n  ({note})" for note in getattr(err, "__notes__", ()))
        print(f"probe-train: error: {type(err).__name__}: {err}{notes}", file=sys.stderr)
        return 1


def _run(args) -> int:
    """The stages `args` asks for."""
    cfg = load_config(args.config, args.overrides)
    cfg.check_before_loading(sources=args.stage in ("data", "all") and not args.merge, ray=args.ray is not None,
                             training=args.stage in ("train", "all") and not (args.merge or args.shard))
    if args.merge:
        return run_merge(cfg)
    if args.stage in ("data", "all"):
        run_data_stage(cfg, args.shard, progress=not args.no_progress, ray_address=args.ray)
        if args.shard:
            return 0
    if args.stage in ("train", "all"):
        return run_train_stage(cfg, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
