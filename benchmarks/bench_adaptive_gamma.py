"""gamma=adaptive against every fixed γ (CPU, system-speed): one probe-bench run per scenario and method, same
problems, every method (target-only included) warmed on a throwaway problem first.

Scenarios (runtime.difficulty, the simulated acceptance of `infer.acceptance_estimate`):
  a: constant α = 0.6 (every position alike; the estimate is always 0.6)
  b: a mixture, easy α = 0.9 / hard α = 0.2, half the positions hard, persistence 0.5, a good predictor
     (noise 0.1)
  c: the same mixture with a poor predictor (noise 0.8)

For each run: speedup of every method over target-only (total latency), the fixed γ with the lowest total latency
chosen in hindsight, and adaptive / that best fixed γ as the ratio of total latencies with a 95% bootstrap
interval over problems, beside the per-problem ratios' median. Targets (issue 24): on b adaptive >= 1.10x the best
fixed γ; on a and c >= 0.97x.

    python benchmarks/bench_adaptive_gamma.py --out benchmarks/results/adaptive_gamma
    python benchmarks/bench_adaptive_gamma.py --scenarios b --methods semanticspec --problems 8
    bash benchmarks/gpu_bench.sh adaptive OUT          # on a GPU: 7B target, 1.5B draft, bf16
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from specprobe.infer import bench
from specprobe.train.config import load_config

SCENARIOS = {
    "a": {"runtime.bernoulli_alpha": 0.6, "runtime.difficulty.hard_share": 0.0},
    "b": {"runtime.bernoulli_alpha": 0.9, "runtime.difficulty.hard_alpha": 0.2, "runtime.difficulty.hard_share": 0.5,
          "runtime.difficulty.persistence": 0.5, "runtime.difficulty.noise": 0.1},
    "c": {"runtime.bernoulli_alpha": 0.9, "runtime.difficulty.hard_alpha": 0.2, "runtime.difficulty.hard_share": 0.5,
          "runtime.difficulty.persistence": 0.5, "runtime.difficulty.noise": 0.8},
}
TARGETS = {"a": 0.97, "b": 1.10, "c": 0.97}


def bootstrap_ratio(num: list[float], den: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of sum(num) / sum(den) over problems resampled with replacement."""
    rng = random.Random(seed)
    idx = range(len(num))
    stats = []
    for _ in range(n_boot):
        pick = [rng.choice(idx) for _ in idx]
        stats.append(sum(num[i] for i in pick) / sum(den[i] for i in pick))
    stats.sort()
    return stats[int(0.025 * n_boot)], stats[int(0.975 * n_boot) - 1]


def compare(report: dict, method: str, gammas: list[int]) -> dict:
    rows = {r["method"]: r for r in report["rows"]}
    base = rows["target"]["latencies_s"]
    fixed = {g: rows[f"{method}:gamma={g}"] for g in gammas}
    adaptive = rows[f"{method}:gamma=adaptive"]
    best_g = min(fixed, key=lambda g: sum(fixed[g]["latencies_s"]))
    best = fixed[best_g]["latencies_s"]
    mine = adaptive["latencies_s"]
    per_problem = [b / a for b, a in zip(best, mine)]
    return {
        "speedup_over_target": {label: sum(base) / sum(r["latencies_s"]) for label, r in rows.items()},
        "acceptance": {label: r["acceptance"] for label, r in rows.items()},
        "best_fixed_gamma": best_g,
        "adaptive_over_best_fixed": sum(best) / sum(mine),
        "adaptive_over_best_fixed_ci95": bootstrap_ratio(best, mine),
        "per_problem_median": statistics.median(per_problem),
        "per_problem_range": [min(per_problem), max(per_problem)],
        "adaptive_over_target_per_problem_median": statistics.median(b / a for b, a in zip(base, mine)),
        "adaptive_depth_kept": adaptive["depth_kept"], "adaptive_mean_depth_kept": adaptive["mean_depth_kept"],
        "adaptive_costs": adaptive["depth_policy"],
    }


def table(name: str, method: str, cmp: dict, gammas: list[int], target: float) -> str:
    sp = cmp["speedup_over_target"]
    lo, hi = cmp["adaptive_over_best_fixed_ci95"]
    verdict = "meets" if lo >= target else ("does not meet" if hi < target else "inconclusive for")
    head = "| " + " | ".join([f"γ={g}" for g in gammas] + ["adaptive"]) + " |"
    cells = "| " + " | ".join([f"{sp[f'{method}:gamma={g}']:.2f}" for g in gammas]
                              + [f"{sp[f'{method}:gamma=adaptive']:.2f}"]) + " |"
    return (f"### scenario {name}, {method}\n\nspeedup over target-only (total latency, same run):\n\n{head}\n"
            f"|{'---|' * (len(gammas) + 1)}\n{cells}\n\n"
            f"best fixed γ in hindsight: {cmp['best_fixed_gamma']}; adaptive / best fixed = "
            f"**{cmp['adaptive_over_best_fixed']:.3f}** [{lo:.3f}, {hi:.3f}] (95% bootstrap over problems), per-problem "
            f"median {cmp['per_problem_median']:.3f} (range {cmp['per_problem_range'][0]:.3f}–"
            f"{cmp['per_problem_range'][1]:.3f}); target ≥ {target:.2f}: {verdict} it. Kept depths (count by depth "
            f"0..): {cmp['adaptive_depth_kept']}, mean {cmp['adaptive_mean_depth_kept']:.2f}.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--scenarios", default="a,b,c")
    ap.add_argument("--methods", default="lr_sync,semanticspec")
    ap.add_argument("--gammas", default="1,2,3,4,5,6")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32, help="steps per answer (runtime.max_steps)")
    ap.add_argument("--step-tokens", type=int, default=8)
    ap.add_argument("--target", default="random:llama-20m")
    ap.add_argument("--draft", default="random:llama-tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results/adaptive_gamma")
    ap.add_argument("overrides", nargs="*", help="more config overrides")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    gammas = [int(g) for g in args.gammas.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engines, summary, md = None, {}, []
    for name in args.scenarios.split(","):
        for method in args.methods.split(","):
            overrides = [f"bench.system_target={args.target}", f"bench.system_draft={args.draft}",
                         f"bench.num_problems={args.problems}", f"runtime.max_steps={args.steps}",
                         f"runtime.max_new_tokens={args.steps * args.step_tokens}",
                         f"sampling.max_step_tokens={args.step_tokens}", f"runtime.adaptive.gamma_max={max(gammas)}",
                         "bench.system_speed=true", f"models.device={args.device}", f"models.dtype={args.dtype}"]
            overrides += [f"{k}={v}" for k, v in SCENARIOS[name].items()] + list(args.overrides)
            cfg = load_config(args.config, overrides)
            env = bench.prepare(cfg, engines=engines)
            engines = (env.target, env.draft)
            methods = ["target"] + [f"{method}:gamma={g}" for g in gammas] + [f"{method}:gamma=adaptive"]
            t0 = time.perf_counter()
            report = bench.run_benchmark(env, methods, out_dir=out / f"{name}_{method}")
            cmp = compare(report, method, gammas)
            cmp["wall_s"] = time.perf_counter() - t0
            cmp["scenario"] = SCENARIOS[name]
            cmp["target"] = TARGETS[name]
            summary[f"{name}_{method}"] = cmp
            md.append(table(name, method, cmp, gammas, TARGETS[name]))
            print(md[-1], flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            (out / "summary.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
