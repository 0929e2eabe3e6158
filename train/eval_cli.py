"""probe-eval: calibration and verifier report of a probe-train checkpoint.

Usage:
    probe-eval --checkpoint runs/tiny/checkpoint                   # held-out questions of its own data
    probe-eval --checkpoint CKPT --data other/data --out reports/x # every question not used in training
    probe-eval --checkpoint CKPT eval.n_boot=200 eval.umap=false   # eval.* overrides
    probe-eval --checkpoint CKPT --wandb                           # also log to wandb (offline: <out>/wandb)
    probe-eval --compare CKPT_A CKPT_B [--data D] --out reports/ab # two checkpoints (or reports) side by side

Writes <out>/metrics.json, <out>/report.md and PNG figures (default out: <output_dir>/report for
<output_dir>/checkpoint). Parts that cannot be evaluated (a probe missing from the checkpoint, data from
another model) are listed as skipped, with the reason; the rest of the report is still written.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from specprobe.infer.config import check_model_option
from specprobe.inputs.config import ConfigError, check_folder
from specprobe.train.report import CheckpointError, compare_checkpoints, evaluate_checkpoint
from specprobe.train.report.runner import data_unread


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe-eval", description=__doc__.split("\n\n")[0],
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="checkpoint folder written by probe-train")
    parser.add_argument("--data", help="data folder to evaluate on (default: the checkpoint's training data)")
    parser.add_argument("--out", help="report folder")
    parser.add_argument("--wandb", action="store_true", help="log metrics and figures to wandb (offline by default)")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two checkpoints or report folders")
    parser.add_argument("--device", help="device of the embedding model and judge (default: theirs)")
    parser.add_argument("--judge-base", help="the base model the judge-LoRA loads instead of the one judge.json "
                                             "names (where this machine has it elsewhere; as "
                                             "runtime.checkpoint_judge_base in probe-bench)")
    parser.add_argument("--embedding-model", help="the embedder the embedding verifier loads instead of the one "
                                                  "embedding_threshold.json names (runtime.checkpoint_embedding_model)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (the sweeps' fits, the judge LoRA's scoring)")
    parser.add_argument("overrides", nargs="*", metavar="eval.key=value", help="eval settings, e.g. eval.n_boot=200")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.checkpoint and not args.compare:
        parser.error("give --checkpoint CKPT or --compare A B")
    if args.checkpoint and args.compare:
        parser.error("--checkpoint and --compare are exclusive")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    try:
        if args.out:
            check_folder(args.out, "--out")
        check_model_option(args.judge_base, "--judge-base")
        check_model_option(args.embedding_model, "--embedding-model")
        if args.data and not Path(args.data).exists():
            raise FileNotFoundError(f"--data {args.data} does not exist (a data folder written by probe-train's "
                                    "data stage; without --data the checkpoint's own training data is read)")
        if args.compare:
            result = compare_checkpoints(*args.compare, data=args.data, out=args.out, overrides=args.overrides,
                                         wandb=args.wandb, device=args.device, judge_base=args.judge_base,
                                         embedding_model=args.embedding_model, progress=not args.no_progress)
            print(f"probe-eval: comparison of {result['a']['name']} and {result['b']['name']} in "
                  f"{args.out or 'probe-eval-comparison'}/comparison.md")
            return 0
        report = evaluate_checkpoint(args.checkpoint, args.data, args.out, overrides=args.overrides,
                                     wandb=args.wandb, device=args.device, judge_base=args.judge_base,
                                     embedding_model=args.embedding_model, progress=not args.no_progress)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError) as err:
        print(f"probe-eval: error: {err}", file=sys.stderr)
        return 1
    for s in report.skipped:
        print(f"  skipped {s['part']}: {s['reason']}", file=sys.stderr)
    if args.data and data_unread(report.metrics) is not None:
        print(f"probe-eval: error: the data folder given (--data {args.data}) could not be read; the report holds "
              "only what needs no data", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
