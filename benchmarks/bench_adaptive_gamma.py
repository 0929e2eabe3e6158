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
    python benchmarks/bench_adaptive_gamma.py --forecast-skip --out OUT   # also gamma=adaptive:forecast_skip=true
    python benchmarks/bench_adaptive_gamma.py --simulate   # the pure policy alone, no models (simulation.md)
    python benchmarks/bench_adaptive_gamma.py --scenarios b --methods lr_sync --pool RUN1/b_lr_sync/results.json \
        RUN2/b_lr_sync/results.json --out OUT   # several runs' problems compared as one set
    bash benchmarks/gpu_bench.sh adaptive OUT          # on a GPU: 7B target, 1.5B draft, bf16
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from itertools import zip_longest
from pathlib import Path

import torch

from specprobe.infer import bench
from specprobe.infer.acceptance_estimate import LatentDifficulty
from specprobe.infer.decoding import RunStats
from specprobe.probes.adaptive_gamma import CycleCosts, batch_cost, drafting_plan, forecast_pays
from specprobe.probes.metrics import bootstrap_ci
from specprobe.train.config import load_config

SCENARIOS = {
    "a": {"runtime.bernoulli_alpha": 0.6, "runtime.difficulty.hard_share": 0.0},
    "b": {"runtime.bernoulli_alpha": 0.9, "runtime.difficulty.hard_alpha": 0.2, "runtime.difficulty.hard_share": 0.5,
          "runtime.difficulty.persistence": 0.5, "runtime.difficulty.noise": 0.1},
    "c": {"runtime.bernoulli_alpha": 0.9, "runtime.difficulty.hard_alpha": 0.2, "runtime.difficulty.hard_share": 0.5,
          "runtime.difficulty.persistence": 0.5, "runtime.difficulty.noise": 0.8},
    # not in the issue: b with an exact predictor (noise 0), the most any estimate can give the policy
    "b0": {"runtime.bernoulli_alpha": 0.9, "runtime.difficulty.hard_alpha": 0.2, "runtime.difficulty.hard_share": 0.5,
           "runtime.difficulty.persistence": 0.5, "runtime.difficulty.noise": 0.0},
}
TARGETS = {"a": 0.97, "b": 1.10, "c": 0.97, "b0": 1.10}


def ratio_ci95(num: list[float], den: list[float], families: list[str | None] | None = None) -> tuple[float, float]:
    """95% percentile bootstrap interval of sum(num) / sum(den), each problem's two latencies drawn together: whole
    families (templates) where problems share one, by probe-bench's rule (`bench.speedup_interval`; NaNs with one
    family only); where none does, problems with replacement (this form draws the committed runs' intervals again
    exactly, none of which had families)."""
    if families is not None and any(f is not None for f in families):
        ci95, _ = bench.speedup_interval(num, den, families)
        return ci95 if ci95 is not None else (float("nan"), float("nan"))
    ci = bootstrap_ci(lambda n, d: n.sum() / d.sum(), num, den, n_boot=bench.INTERVAL_RESAMPLES, alpha=0.05)
    return ci.low, ci.high


def compare(report: dict, method: str, gammas: list[int], skip: bool = False) -> dict:
    """The adaptive method against the best fixed γ; skip: also `gamma=adaptive:forecast_skip=true` against the
    best fixed γ and against adaptive without it, all in the same run."""
    rows = {r["method"]: r for r in report["rows"]}
    base = rows["target"]["latencies_s"]
    fixed = {g: rows[f"{method}:gamma={g}"] for g in gammas}
    adaptive = rows[f"{method}:gamma=adaptive"]
    best_g = min(fixed, key=lambda g: sum(fixed[g]["latencies_s"]))
    best = fixed[best_g]["latencies_s"]
    mine = adaptive["latencies_s"]
    per_problem = [b / a for b, a in zip(best, mine)]
    families = [(report.get("families") or {}).get(p) for p in report.get("problems") or []] or None
    extra = {}
    if skip:
        row = rows[f"{method}:gamma=adaptive:forecast_skip=true"]
        lat = row["latencies_s"]
        extra = {"skip_over_best_fixed": sum(best) / sum(lat), "skip_over_best_fixed_ci95": ratio_ci95(best, lat, families),
                 "skip_over_adaptive": sum(mine) / sum(lat), "skip_over_adaptive_ci95": ratio_ci95(mine, lat, families),
                 "skip_per_problem_median": statistics.median(b / a for b, a in zip(best, lat)),
                 "skip_depth_drafted": row["depth_drafted"], "skip_depth_kept": row["depth_kept"]}
    return {
        "speedup_over_target": {label: sum(base) / sum(r["latencies_s"]) for label, r in rows.items()},
        "acceptance": {label: r["acceptance"] for label, r in rows.items()},
        "best_fixed_gamma": best_g,
        "adaptive_over_best_fixed": sum(best) / sum(mine),
        "adaptive_over_best_fixed_ci95": ratio_ci95(best, mine, families),
        "per_problem_median": statistics.median(per_problem),
        "per_problem_range": [min(per_problem), max(per_problem)],
        "adaptive_over_target_per_problem_median": statistics.median(b / a for b, a in zip(base, mine)),
        "adaptive_depth_kept": adaptive["depth_kept"], "adaptive_mean_depth_kept": adaptive["mean_depth_kept"],
        "adaptive_drafts_reused": adaptive.get("draft_steps_reused", 0),
        "adaptive_costs": adaptive["depth_policy"], **extra,
    }


def pool_reports(reports: list[tuple[str, dict]]) -> dict:
    """One report of several runs' `results.json` (name, report) over disjoint problems (a run stopped midway
    counts the problems it finished, `bench.run_benchmark`): each method's per-problem
    latencies in the runs' order, its acceptance weighted by the positions each run judged, its kept depths summed.
    Every ratio stays a same-run one (each run timed its own target-only baseline after its own warm-up); pooling
    adds problems, so that `compare` chooses the best fixed γ and bootstraps over all of them."""
    seen: dict[str, str] = {}
    methods = None
    first = reports[0][1]
    for name, report in reports:
        for key in POOLED_ALIKE:  # the same experiment in every run, its problems aside
            if _part(report, key) != _part(first, key):
                raise ValueError(f"{name}: {'.'.join(key)} differs from {reports[0][0]}'s; only runs of one "
                                 "configuration pool")
        for r in report["rows"]:
            if r.get("error") or len(r["latencies_s"]) != len(report["problems"]):
                raise ValueError(f"{name}: method {r['method']} has {len(r['latencies_s'])} latencies for "
                                 f"{len(report['problems'])} problems ({r.get('error') or 'no error recorded'}); "
                                 "its problems cannot be paired with the other methods'")
        for pid in report["problems"]:
            if pid in seen:
                raise ValueError(f"{name}: problem {pid!r} was also timed in {seen[pid]}; pooled runs need disjoint "
                                 "problems (run the next one on other questions, e.g. QUESTIONS=<the file's later lines>)")
            seen[pid] = name
        labels = [r["method"] for r in report["rows"]]
        if methods is not None and labels != methods:
            raise ValueError(f"{name}: methods {labels} differ from the first run's {methods}")
        methods = labels
    rows = []
    for i, label in enumerate(methods):
        each = [report["rows"][i] for _, report in reports]
        judged = [(r["acceptance"], r.get("judged") or 0) for r in each if r["acceptance"] is not None]
        n = sum(j for _, j in judged)
        kept = [sum(c) for c in zip_longest(*[r.get("depth_kept") or [] for r in each], fillvalue=0)]
        rows.append({"method": label, "latencies_s": [t for r in each for t in r["latencies_s"]],
                     "acceptance": sum(a * j for a, j in judged) / n if n else None, "judged": n, "depth_kept": kept,
                     "mean_depth_kept": RunStats(depth_kept=kept).mean_depth_kept,
                     "draft_steps_reused": sum(r.get("draft_steps_reused", 0) for r in each),
                     "depth_policy": [r.get("depth_policy") for r in each]})
    runs = [name + (f" ({report['finished']})" if report.get("finished") else "") for name, report in reports]
    families = {p: f for _, report in reports for p, f in (report.get("families") or {}).items()}
    return {"rows": rows, "problems": list(seen), "runs": runs, "families": families or None}


# what pooled runs must share: the models and the configuration that shapes a cycle (not bench.*: the problems' file)
POOLED_ALIKE = (("models",), ("config", "models"), ("config", "runtime"), ("config", "sampling"))


def _part(report: dict, key: tuple[str, ...]):
    for k in key:
        report = report.get(k) if isinstance(report, dict) else None
    return report


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
            f"0..): {cmp['adaptive_depth_kept']}, mean {cmp['adaptive_mean_depth_kept']:.2f}; drafts past a kept depth "
            f"reused: {cmp['adaptive_drafts_reused']}.\n" + _skip_line(cmp, method))


def _skip_line(cmp: dict, method: str) -> str:
    if "skip_over_best_fixed" not in cmp:
        return ""
    lo, hi = cmp["skip_over_best_fixed_ci95"]
    alo, ahi = cmp["skip_over_adaptive_ci95"]
    return (f"\nWith the forecast skip ({method}:gamma=adaptive:forecast_skip=true): speedup over target-only "
            f"{cmp['speedup_over_target'][method + ':gamma=adaptive:forecast_skip=true']:.2f}; / best fixed = "
            f"**{cmp['skip_over_best_fixed']:.3f}** [{lo:.3f}, {hi:.3f}], per-problem median "
            f"{cmp['skip_per_problem_median']:.3f}; / adaptive without it = **{cmp['skip_over_adaptive']:.3f}** "
            f"[{alo:.3f}, {ahi:.3f}]. Drafted depths (count by depth 0..; 0 = skipped): {cmp['skip_depth_drafted']}; "
            f"kept: {cmp['skip_depth_kept']}.\n")


def simulate(kind: str, name: str, policy, c: float, b: list[float], v: list[float], gamma_max: int = 6,
             skip: bool = False, reuse: bool = True, positions: int = 3000, seed: int = 1) -> float:
    """Steps per unit of target time of one policy on one scenario, from the pure functions alone (no models): a
    renewal simulation of the cycles with the costs given. policy: a fixed γ or "adaptive"; skip: the adaptive
    policy also skips drafting when the previous cycle's last estimate forecasts that a_1 will not pay (the runtime's
    forecast_skip; its target step is then scored by the draft for the next forecast, cost neglected); reuse:
    SemanticSpec reuses the drafts past its kept depth when every kept draft passed (the runtime does; False: the
    policy before it did); a skipped cycle drops them."""
    sc = SCENARIOS[name]
    easy = sc["runtime.bernoulli_alpha"]
    share = sc["runtime.difficulty.hard_share"]
    d = LatentDifficulty(easy, sc.get("runtime.difficulty.hard_alpha", easy) if share > 0 else easy, share,
                         sc.get("runtime.difficulty.persistence", 0.0), sc.get("runtime.difficulty.noise", 0.0), 0)
    costs = CycleCosts(c, b=b, v=v, kind="lookahead" if kind == "lr_sync" else "semanticspec")
    rng, pos, cost, prior, spare = random.Random(seed), 0, 0.0, None, 0
    while pos < positions:
        if policy == "adaptive":
            if skip and prior is not None and not forecast_pays(prior, costs, gamma_max):
                cost, prior, pos, spare = cost + 1.0, d.estimate("q", pos), pos + 1, 0
                continue
            est = [d.estimate("q", pos + i) for i in range(gamma_max)]
            drafted, k = drafting_plan(est, costs, gamma_max)
            prior = est[drafted - 1]
        else:
            drafted = k = policy
        paid, spare = max(0, drafted - spare) * c, 0
        if k == 0:
            cost, pos = cost + paid + 1.0, pos + 1
            continue
        accepted = next((i for i in range(k) if rng.random() >= d.alpha("q", pos + i)), k)
        if costs.kind == "lookahead":
            cost, pos = cost + paid + batch_cost(b, k + 1), pos + accepted + 1
        else:
            rejected = accepted < k
            cost, pos = cost + paid + v[k - 1] + rejected, pos + accepted + rejected
            spare = drafted - k if reuse and not rejected else 0
    return pos / cost


# (c, b(1..7), v(1..6)) in target steps. cpu: the first CPU run's calibration. gpu-7b: the H100 run's calibration
# (1.5B draft, 7B target; ../results/gpu_h100/joinstream_2026-11-25/adaptive_gamma/summary.json). gpu-32b: c from
# the 1.5B -> 32B runtime run (runtime_summary.md there), b(1, 2, 4, 8) from fast_2026-11-25/engine_qwen2-32b.txt
# with b(3), b(5..7) interpolated. v was not measured on the GPU: 0.1 is an assumption (a teacher-forced pass over
# a few steps, against a 32-token target step), so the GPU semanticspec rows are a guess.
B_32B = [1.0, 1.025, 1.043, 1.061, 1.085, 1.108, 1.132]  # the 32B target's b(k), k = 1..7, on an H100
SIMULATED_COSTS = {
    "cpu": (0.14, [1.0, 1.6, 2.4, 1.75, 1.9, 2.1, 2.4], [0.21, 0.21, 0.21, 0.22, 0.23, 0.24]),
    "gpu-7b": (0.515, [1.0, 1.089, 1.145, 1.150, 1.250, 1.255, 1.267], [0.1] * 6),
    "gpu-32b": (0.15, B_32B, [0.1] * 6),
    # the same target with the draft compiled (models.draft_decode_graph=compile; ../gpu_h100/compiled_draft_*)
    "gpu-32b-compiled-draft": (0.094, B_32B, [0.1] * 6),
}


def simulation_table(c: float, b: list[float], v: list[float], scenarios=("a", "b", "c")) -> str:
    lines = [f"pure-policy simulation, c = {c}, b = {b}, v = {v}: adaptive / best fixed γ (1..6)",
             "| run | best fixed γ: speedup | adaptive / best fixed | adaptive + forecast skip / best fixed |", "|---|---|---|---|"]
    for name in scenarios:
        for kind in ("lr_sync", "semanticspec"):
            best = max(simulate(kind, name, g, c, b, v) for g in range(1, 7))
            ad = simulate(kind, name, "adaptive", c, b, v)
            skip = simulate(kind, name, "adaptive", c, b, v, skip=True)
            lines.append(f"| {name}, {kind} | {best:.3f} | {ad / best:.3f} | {skip / best:.3f} |")
    return "\n".join(lines)


def pooled(args) -> int:
    """`--pool`: `compare` over the problems of several runs' results.json (`pool_reports`)."""
    if len(args.scenarios.split(",")) != 1 or len(args.methods.split(",")) != 1:
        raise SystemExit("--pool compares one scenario and one method: give --scenarios and --methods one each")
    if args.forecast_skip:
        raise SystemExit("--pool compares gamma=adaptive with the fixed γ; it does not pool the forecast-skip rows")
    name, method = args.scenarios, args.methods
    gammas = [int(g) for g in args.gammas.split(",")]
    report = pool_reports([(f, json.loads(Path(f).read_text())) for f in args.pool])
    cmp = compare(report, method, gammas)
    cmp["runs"], cmp["problems"], cmp["target"] = report["runs"], report["problems"], TARGETS[name]
    text = (f"Pooled over {len(report['problems'])} problems of {len(report['runs'])} runs "
            f"({', '.join(report['runs'])}); each run's ratios against its own target-only baseline.\n\n"
            + table(name, method, cmp, gammas, TARGETS[name]))
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pooled.json").write_text(json.dumps(cmp, indent=1))
    (out / "pooled.md").write_text(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--scenarios", default="a,b,c", help=f"of {', '.join(SCENARIOS)} (b0: b with an exact predictor)")
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
    ap.add_argument("--simulate", action="store_true", help="only the pure-policy simulation (no models)")
    ap.add_argument("--costs", choices=sorted(SIMULATED_COSTS), default="cpu",
                    help="--simulate's costs: this CPU's, or those measured on an H100 (SIMULATED_COSTS)")
    ap.add_argument("--forecast-skip", action="store_true",
                    help="also run gamma=adaptive:forecast_skip=true (lr_sync, semanticspec) in the same runs")
    ap.add_argument("--accept-draws", choices=["prefix", "position"], default="prefix",
                    help="runtime.accept_draws: position gives every method the same Bernoulli draw at each answer "
                         "position (common random numbers); prefix (every run before 2026-11-28) keys each draw by "
                         "the method's own text. On the CPU (scenario b, 8 problems) position did not narrow the "
                         "interval: ../results/adaptive_gamma/common_draws/")
    ap.add_argument("--pool", nargs="+", metavar="RESULTS_JSON",
                    help="no runs: pool these runs' results.json (one scenario and method each, disjoint problems, "
                         "e.g. two GPU sessions' <out>/b_lr_sync/results.json) and compare over all their problems; "
                         "writes <out>/pooled.md and pooled.json")
    ap.add_argument("overrides", nargs="*", help="more config overrides")
    args = ap.parse_args(argv)
    if args.pool:
        return pooled(args)
    if args.simulate:
        print(simulation_table(*SIMULATED_COSTS[args.costs], scenarios=args.scenarios.split(",")))
        return 0
    if any(o.startswith("runtime.adaptive.forecast_skip") for o in args.overrides):
        ap.error("the plain gamma=adaptive rows run without the forecast skip; use --forecast-skip to add it")
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
                         "bench.system_speed=true", f"models.device={args.device}", f"models.dtype={args.dtype}",
                         f"runtime.accept_draws={args.accept_draws}"]
            overrides += [f"{k}={v}" for k, v in SCENARIOS[name].items()] + list(args.overrides)
            cfg = load_config(args.config, overrides)
            env = bench.prepare(cfg.bench_setup(), engines=engines)
            engines = (env.target, env.draft)
            methods = ["target"] + [f"{method}:gamma={g}" for g in gammas] + [f"{method}:gamma=adaptive"]
            skip = args.forecast_skip and method in bench.FORECAST_SKIP_METHODS
            methods += [f"{method}:gamma=adaptive:forecast_skip=true"] if skip else []
            t0 = time.perf_counter()
            report = bench.run_benchmark(env, methods, out_dir=out / f"{name}_{method}")
            cmp = compare(report, method, gammas, skip=skip)
            cmp["wall_s"] = time.perf_counter() - t0
            cmp["scenario"] = SCENARIOS[name]
            cmp["target"] = TARGETS[name]
            cmp["accept_draws"] = cfg.runtime.accept_draws
            summary[f"{name}_{method}"] = cmp
            md.append(table(name, method, cmp, gammas, TARGETS[name])
                      + f"Acceptance draws keyed by {cmp['accept_draws']} (runtime.accept_draws).\n")
            print(md[-1], flush=True)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            (out / "summary.md").write_text("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
