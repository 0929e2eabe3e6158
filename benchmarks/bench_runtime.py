"""Runtime benchmark (offline, CPU): speedup of sync and async Lookahead Reasoning over target-only, measured
in the same run, next to the analytic speedup at the α and c measured in that run.

System-speed mode: random-weight models of real shapes (default draft random:llama-20m, target
random:qwen2-0.5b), a Bernoulli(α) verifier, every step max_step_tokens long, greedy decoding. What is
measured is the runtime itself: batching, prefix reuse, drafting, verification bookkeeping, threads.

The formulas assume that k parallel target steps cost one target step (b = 1, true on a GPU far from
saturation). On a CPU they do not, so besides the ideal prediction the report gives one with the batch
cost b measured in the run (one target forward of the method's batch costs b single-row forwards), and a
micro-measurement of b(k) for k = 1..γ+1 rows.

    python benchmarks/bench_runtime.py                      # defaults below, ~5 minutes on 2 busy cores
    python benchmarks/bench_runtime.py --dtype float32      # fp32: small-batch GEMMs cost ~2x one row here
    python benchmarks/bench_runtime.py --alpha 0.8 --methods target,lr_sync,lr_async,semanticspec
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infer import bench  # noqa: E402
from infer.config import load_config  # noqa: E402
from infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest  # noqa: E402


def batch_cost(engine: HFStepEngine, question: str, ks: list[int], tokens: int = 12, repeats: int = 3) -> dict:
    """b(k): time of one step decoded for k rows (each after a different prefix, as in an LR batch) over
    the time for one row. Best of `repeats`, greedy, no delimiter (every row runs `tokens` tokens)."""
    params = SamplingParams(temperature=0.0, max_step_tokens=tokens, delimiter="\x00\x00")
    base = Prefix(question)
    engine.generate([StepRequest(base)], params)
    times = {}
    for k in ks:
        requests = [StepRequest(base.extend(*["step"] * j)) for j in range(k)]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.generate(requests, params)
            best = min(best, time.perf_counter() - t0)
        times[k] = best
    return {k: times[k] / times[ks[0]] for k in ks} | {"seconds_per_row_step": times[ks[0]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="random:qwen2-0.5b")
    p.add_argument("--draft", default="random:llama-20m")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--problems", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--step-tokens", type=int, default=16)
    p.add_argument("--methods", default="target,lr_sync,lr_async")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "runtime"))
    args = p.parse_args(argv)

    load0 = os.getloadavg()
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        "bench.system_speed=true", f"bench.system_target={args.target}", f"bench.system_draft={args.draft}",
        f"models.dtype={args.dtype}", "models.device=cpu", f"runtime.bernoulli_alpha={args.alpha}",
        f"runtime.gamma={args.gamma}", f"runtime.max_steps={args.max_steps}", "runtime.max_new_tokens=100000",
        f"sampling.max_step_tokens={args.step_tokens}", f"bench.num_problems={args.problems}", "bench.warmup=true"])
    env = bench.prepare(cfg)
    print(f"# runtime benchmark: target {args.target}, draft {args.draft}, {args.dtype}, Bernoulli({args.alpha}), "
          f"γ={args.gamma}, {args.problems} problems x {args.max_steps} steps of {args.step_tokens} tokens")
    print(f"# host: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch thread(s), {os.cpu_count()} logical CPUs, load avg {load0[0]:.2f}")

    ks = list(range(1, args.gamma + 2))
    b = batch_cost(env.target, env.problems[0].question, ks)
    print("# target batch cost b(k) = time(k rows) / time(1 row): "
          + ", ".join(f"b({k})={b[k]:.2f}" for k in ks) + f"  (1 row: {b['seconds_per_row_step']:.2f} s/step)")

    report = bench.run_benchmark(env, [m for m in args.methods.split(",") if m], out_dir=args.out,
                                 log=lambda s: print("  " + s, file=sys.stderr))
    print()
    print(bench.format_markdown(report))
    print()
    print("| method | measured speedup | analytic (ideal, b=1) | measured/ideal | analytic (measured b) | "
          "measured/adjusted | α | c | b | k |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = bench._fmt
    for r in report["rows"]:
        if r["method"] == "target" or r["error"]:
            continue
        print(f"| {r['method']} | {fmt(r['speedup'])} | {fmt(r['analytic_ideal'])} | {fmt(r['measured_over_ideal'])} | "
              f"{fmt(r['analytic_adjusted'])} | {fmt(r['measured_over_adjusted'])} | {fmt(r['acceptance'])} | "
              f"{fmt(r['c'], 3)} | {fmt(r['b'])} | {fmt(r['k'])} |")
    load1 = os.getloadavg()
    print(f"\n# load avg at start {load0[0]:.2f}, at end {load1[0]:.2f}; wall {report['wall_s']:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_cost.json").write_text(json.dumps({str(k): v for k, v in b.items()}, indent=2))
    print(f"# results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
