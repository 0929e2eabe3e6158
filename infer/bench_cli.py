"""probe-bench: decode benchmark problems with several methods in one run and print the table.

Usage:
    probe-bench --config configs/tiny.yaml --verifier bernoulli
    probe-bench --config configs/tiny.yaml --checkpoint runs/tiny/checkpoint --methods target,semanticspec,lr_sync
    probe-bench --config configs/tiny.yaml --system-speed --methods target,lr_sync,lr_async runtime.gamma=3
    probe-bench --config configs/r1-1.5b-32b.yaml --methods target,lr_sync,lr_sync+ngram --out runs/bench

Arguments:
    --config PATH        experiment YAML (default: built-in defaults); probe-bench reads its inference
                         sections (models, source, sampling, runtime, bench, ray) and skips the others
    --checkpoint DIR     probe-train checkpoint with the trained verifiers (probe, embedding, judge)
    --methods LIST       comma list of target, draft, semanticspec, lr_sync, lr_async, specs (SpecS soft
                         verification + switching; runtime.specs), beam_target (its target beam search),
                         seed_tot (SEED scheduled speculative tree of thoughts; runtime.tree), tot_target
                         (target-only tree of thoughts), each optionally with +ngram / +assistant /
                         +lookahead (Lookahead Decoding inside steps; runtime.lookahead) and :key=value
                         overrides (lr_sync:width=2:gamma=2); target-only is always run, as the baseline
                         of every speedup, and beam_target / tot_target with specs / seed_tot
    --verifier KIND      probe | embedding | judge | llm_judge | exact | accept_all | reject_all | bernoulli
    --system-speed       random-weight models of bench.system_target / bench.system_draft and a Bernoulli
                         verifier (runtime.bernoulli_alpha): the runtime's own overhead and scaling
    --num-problems N     shorthand for bench.num_problems=N
    --out DIR            results.json, results.md, speedup.png (each method's speedup per problem, the pooled
                         one and its interval), traces/<method>.jsonl and problems.jsonl (each finished
                         problem's results, what --resume reads) (default <output_dir>/bench)
    --ray [ADDRESS]      spread the problems over ray.replicas Ray actors, each running every method on
                         its problems; ADDRESS joins a cluster (else ray.address; none = a local instance)
    --resume             go on with the run in --out that was stopped midway (a time limit, a lost machine):
                         the problems it finished are kept as they are, the others decoded; the settings
                         must be those it was started with (else an error names what differs; the ray
                         section may change, and a larger --num-problems adds problems to a run)
    --overwrite          start over in --out although it holds a stopped run's finished problems (they
                         are replaced; with neither it nor --resume such a folder is refused before the models
                         load; not with --resume)
    --keep-going         exit 0 even when a method could not run (its row carries the error; else exit 3)
                         (Ctrl-C and SIGTERM stop a run with exit 130 and 143, the finished problems kept)
    --help-config        list every config key with its help text
    --list-methods       list the registered decoding methods (and what each needs)
    key=value ...        config overrides, e.g. runtime.gamma=2 sampling.temperature=0

The library behind it is `infer.bench` (prepare, run_benchmark, format_markdown).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from specprobe.infer import bench
from specprobe.infer.bench_plot import write_speedup_figure
from specprobe.infer.bench_resume import check_resumable, logged_problems, refuse_unfinished
from specprobe.infer.config import InferenceConfig, load_inference_config
from specprobe.infer.models import ModelUnavailableError
from specprobe.infer.ray_cluster import split_ray_option
from specprobe.inputs.config import ConfigError, check_folder, format_help
from specprobe.inputs.signals import Stopped, exit_code, sigterm_stops


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="probe-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="experiment YAML")
    p.add_argument("--checkpoint", help="checkpoint folder with trained verifiers")
    p.add_argument("--methods", help="comma-separated methods (default: bench.methods)")
    p.add_argument("--verifier", help="verifier kind (default: runtime.verifier)")
    p.add_argument("--system-speed", action="store_true", help="random-weight models + Bernoulli verifier")
    p.add_argument("--num-problems", type=int, help="problems per method")
    p.add_argument("--out", help="output folder (default <output_dir>/bench)")
    p.add_argument("--ray", nargs="?", const="", metavar="ADDRESS",
                   help="problems over Ray replicas (the ray: config section); ADDRESS joins a cluster")
    p.add_argument("--resume", action="store_true",
                   help="go on with the stopped run in --out (same command), decoding only the problems it had not finished")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in --out even when it holds a stopped run's finished problems (replaced)")
    p.add_argument("--keep-going", action="store_true",
                   help="exit 0 even when a method could not run (its row carries the error)")
    p.add_argument("--help-config", action="store_true", help="list every config key")
    p.add_argument("--list-methods", action="store_true", help="list the registered decoding methods")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.ray, args.overrides = split_ray_option(args.ray, args.overrides)
    if args.help_config:
        print(format_help(InferenceConfig))
        return 0
    if args.list_methods:
        print(bench.list_methods())
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    if args.num_problems is not None:
        overrides.append(f"bench.num_problems={args.num_problems}")
    if args.system_speed:
        overrides.append("bench.system_speed=true")

    out, started = None, time.time()
    try:
        cfg = load_inference_config(args.config, overrides)
        cfg.check_before_loading(sources=False, ray=args.ray is not None)
        if args.out:
            check_folder(args.out, "--out")
        methods = [m for m in args.methods.split(",") if m.strip()] if args.methods else None
        cfg.bench.source.check_available("bench.source")
        cfg.runtime.check_available()
        out = Path(args.out) if args.out else cfg.bench_out_dir
        if args.resume and args.overwrite:
            raise ConfigError("--resume goes on with the run in --out and --overwrite starts it over: pass one")
        if args.resume:  # other settings are refused before the models load
            check_resumable(out, bench.resume_config(cfg.bench_setup()))
        elif not args.overwrite:  # a stopped run's finished problems are not replaced unasked
            refuse_unfinished(out)
        with sigterm_stops():
            report = _run(cfg, args, methods, out)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM (a scheduler's time limit)
        # (without --resume, a log older than this command is an earlier run's)
        done = logged_problems(out, None if args.resume else started) if out is not None else 0
        print(f"probe-bench: stopped ({'SIGTERM' if isinstance(err, Stopped) else 'Ctrl-C'}); "
              + (f"the {done} problems it finished are in {out / 'results.json'}; the same command with --resume "
                 "goes on with the others" if done else "no problem had finished"), file=sys.stderr)
        return exit_code(err)
    except (ConfigError, ValueError, FileNotFoundError, ModelUnavailableError, RuntimeError) as err:
        print(f"probe-bench: error: {err}", file=sys.stderr)
        return 2
    print(bench.format_markdown(report))
    try:
        figure = write_speedup_figure(report, out)
    except Exception as err:  # noqa: BLE001 (the results are written: a figure that fails loses nothing)
        figure = None
        print(f"probe-bench: the speedup figure was not drawn ({type(err).__name__}: {err})", file=sys.stderr)
    print(f"\nwrote {out / 'results.md'}, {out / 'results.json'}{f', {figure}' if figure else ''} and traces in "
          f"{out / 'traces'}", file=sys.stderr)
    failed = [(r["method"], r["error"]) for r in report["rows"] if r.get("error")]
    if failed and not args.keep_going:
        for method, error in failed:
            print(f"probe-bench: error: method {method} could not run: {error}", file=sys.stderr)
        print("probe-bench: the other methods' results are written; pass --keep-going to exit 0 with failed methods",
              file=sys.stderr)
        return 3
    return 0


def _run(cfg: InferenceConfig, args, methods: list[str] | None, out: Path) -> dict:
    if args.ray is not None:
        from specprobe.infer.bench_ray import run_benchmark_on_ray

        return run_benchmark_on_ray(cfg.bench_setup(), methods, checkpoint=args.checkpoint, verifier=args.verifier,
                                    address=args.ray or None, out_dir=out, resume=args.resume,
                                    log=lambda s: print(s, file=sys.stderr))
    env = bench.prepare(cfg.bench_setup(), checkpoint=args.checkpoint, verifier=args.verifier, methods=methods)
    return bench.run_benchmark(env, methods, out_dir=out, log=lambda s: print(s, file=sys.stderr),
                               resume=args.resume)


if __name__ == "__main__":
    sys.exit(main())
