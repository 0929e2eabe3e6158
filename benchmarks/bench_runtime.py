"""Runtime benchmark (offline, CPU): speedup of sync and async Lookahead Reasoning over target-only, measured
in the same run, next to the analytic speedup at the α and c measured in that run.

System-speed mode: random-weight models of real shapes (default draft random:llama-20m, target
random:qwen2-0.5b), a Bernoulli(α) verifier, every step max_step_tokens long, greedy decoding. What is
measured is the runtime itself: batching, prefix reuse, drafting, verification bookkeeping, threads.

How the numbers explain themselves:
- The formulas assume that k parallel target steps cost one target step (b = 1, true on a GPU far from
  saturation). On a CPU they do not, so the script first measures the batch cost b(k) on its own (one
  step decoded for k rows / for one row, k = 1..γ+1) and predicts each LR method with b = b(γ+1): the
  paper's formula f(α, c/b, k) / b. The ratio measured / that prediction is what the runtime loses (or
  wins) beyond the batch cost; measured / ideal (b = 1) is shown beside it. The b the method's own
  iterations imply is printed for reference only (it would absorb the very overheads under test).
  SemanticSpec's prediction uses τ (its teacher-forced target pass) as timed in its own run.
- α (accepted / judged positions) comes with the run's own 95% interval (infer.bench.acceptance_interval: a
  bootstrap over problems, or their families, or Wilson over one problem's positions; Wilson over positions for
  reports written before it). By default the number of problems is computed so that a Wilson interval over
  the judged positions (independent draws for the Bernoulli α set) would be at most --alpha-half-width (0.05)
  wide on each side, from the positions a sync cycle judges per committed step, (1 − α^γ) / (1 − α^(γ+1)).
- Every method starts each problem with empty prompt-prefix caches (infer.bench), so none reuses a
  prefill that another method paid for.
- A method that failed mid-run gets no speedup (neither do the others when the baseline failed).
- Per-cycle traces are written under <out>/traces/.

    python benchmarks/bench_runtime.py                      # defaults below
    python benchmarks/bench_runtime.py --dtype float32      # fp32: small-batch GEMMs cost ~2x one row here
    python benchmarks/bench_runtime.py --alpha 0.8 --methods target,lr_sync,lr_async,semanticspec
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specprobe.infer import bench
from specprobe.infer.decoding.analytic import predict
from specprobe.infer.decoding.depth import nested_step_seconds
from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams
from specprobe.infer.engines.static_kv import slot_bucket
from specprobe.probes.metrics import Z95, wilson_interval
from specprobe.probes.speedup import geometric_sum
from specprobe.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def positions_needed(alpha: float, half_width: float, z: float = Z95) -> int:
    """Judged positions for a 95% interval of half-width `half_width` around α (normal approximation)."""
    if not 0 < half_width < 1:
        raise ValueError(f"half_width must be in (0, 1), got {half_width}")
    return max(1, math.ceil(z * z * alpha * (1 - alpha) / half_width ** 2))


def judged_per_step(alpha: float, gamma: int) -> float:
    """Positions a sync LR cycle judges per committed step: E[judged] / E[committed] =
    Σ_{i<γ} α^i / Σ_{i≤γ} α^i (async judges about one per step, so this is the smaller)."""
    return geometric_sum(alpha, gamma) / geometric_sum(alpha, gamma + 1)


def problems_needed(alpha: float, gamma: int, steps_per_problem: int, half_width: float) -> int:
    per_problem = judged_per_step(alpha, gamma) * steps_per_problem
    return max(1, math.ceil(positions_needed(alpha, half_width) / per_problem))


def predict_with_batch_cost(row: dict, gamma: int, b_of_k: dict) -> float | None:
    """The paper's formula at the run's α and c with the target batch costing the independently
    measured b(γ+1) (LR methods); SemanticSpec's own τ-adjusted prediction; None otherwise."""
    method = row["method"]
    if method.startswith("semanticspec"):
        return row.get("analytic_adjusted")
    if not method.startswith(("lr_sync", "lr_async")) or row.get("acceptance") is None or row.get("c") is None:
        return None
    kind = "lr_sync" if method.startswith("lr_sync") else "lr_async"
    return predict(kind, row["acceptance"], row["c"], gamma, b_of_k.get(gamma + 1))["adjusted"]


def explained_rows(report: dict, gamma: int, b_of_k: dict) -> list[dict]:
    """One row per non-baseline method: speedups, predictions, ratios and α's interval; failed
    methods (or every method when the baseline failed) carry their error and no speedup."""
    base_error = next((r["error"] for r in report["rows"] if r["method"] == "target"), None)
    out = []
    for r in report["rows"]:
        if r["method"] == "target":
            continue
        error = r["error"] or (f"baseline failed: {base_error}" if base_error else None)
        judged = r.get("judged") or 0
        accepted = (r.get("stats") or {}).get("accepted", round((r.get("acceptance") or 0.0) * judged))
        row = {"method": r["method"], "error": error, "alpha": r.get("acceptance"), "judged": judged,
               # the run's own interval (infer.bench.acceptance_interval: by problem or family when two or more judged),
               # so both tables give one α one interval; Wilson over positions for reports written before it
               "alpha_ci": r["acceptance_ci95"] if "acceptance_ci95" in r else wilson_interval(accepted, judged),
               "c": r.get("c"), "b_in_run": r.get("b"),
               "k": r.get("k"), "speedup": None, "ideal": r.get("analytic_ideal"),
               "predicted_b_k": predict_with_batch_cost(r, gamma, b_of_k)}
        if not error:
            row["speedup"] = r.get("speedup")
        row["over_ideal"] = bench.ratio(row["speedup"], row["ideal"])
        row["over_b_k"] = bench.ratio(row["speedup"], row["predicted_b_k"])
        out.append(row)
    return out


def format_explained(rows: list[dict], gamma: int, b_of_k: dict) -> str:
    fmt = bench.fmt
    head = (f"| method | measured speedup | analytic ideal (b=1) | measured/ideal | analytic with b({gamma + 1})="
            f"{fmt(b_of_k.get(gamma + 1))} | measured/that | α [95% CI] | judged | c | b in run (info) |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['method']} | failed: {r['error'][:120]} |" + " |" * 8)
            continue
        ci = r["alpha_ci"]
        alpha = "–" if r["alpha"] is None else (f"{r['alpha']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""))
        lines.append(f"| {r['method']} | {fmt(r['speedup'])} | {fmt(r['ideal'])} | {fmt(r['over_ideal'])} | "
                     f"{fmt(r['predicted_b_k'])} | {fmt(r['over_b_k'])} | {alpha} | {r['judged']} | "
                     f"{fmt(r['c'], 3)} | {fmt(r['b_in_run'])} |")
    return "\n".join(lines)


def describe_decode(engine) -> str:
    """The engine's decode path and, on the fast path, its decode step's mode, captures and replays (or why it fell
    back to eager), and its join chunks' where they are captured; on CUDA its stream's priority as the device took it (`models.target_stream_priority`); how many
    norm layers run fused (`models.fused_norm`) and how many groups of linear layers merged (`models.merged_linear`)."""
    stream = getattr(engine, "stream", None)
    where = "" if stream is None else f", stream priority {engine.stream_priority} ({stream.priority} on the device)"
    fused = getattr(engine, "fused_norms", 0)  # (a vLLM engine has none of its own)
    where += f", {fused} norm layers fused" if fused else ""
    merged = getattr(engine, "merged_linears", 0)
    where += f", {merged} linear groups merged" if merged else ""
    step = getattr(engine, "decode_step", None)
    if step is None:
        return f"decode {getattr(engine, 'decode', 'eager')}{where}"
    state = f"failed: {step.failed}" if step.failed else f"{step.captures} captures, {step.replays} replays"
    if step.bucket_chunks:  # join chunks padded to their widths (captured on CUDA)
        state += (f"; chunks failed: {step.chunk_failed}" if step.chunk_failed else
                  f"; chunks {step.chunk_captures} captures, {step.chunk_replays} replays")
    elif step.capture:  # models.capture_joins off
        state += "; joins eager"
    return f"decode {engine.decode} ({step.mode}: {state}; {engine.kv_pool.created} KV buffers allocated){where}"


def batch_cost(engine: HFStepEngine, question: str, ks: list[int], tokens: int = 12, repeats: int = 5) -> dict:
    """b(k): time of one step decoded for k rows (each after a different prefix, as in an LR batch) over
    the time for one row (`depth.nested_step_seconds`, as the runtime's gamma=adaptive measures it): every k
    warmed once first (kernel choice, graph capture), then timed `repeats` times (at least 5); the median counts.
    Greedy, no delimiter (every row runs `tokens` tokens)."""
    params = SamplingParams(temperature=0.0, max_step_tokens=tokens, delimiter="\x00\x00")
    times = nested_step_seconds(engine, Prefix(question), params, ks, max(5, repeats), filler="step",
                                sync=lambda: _sync(engine.runner.device))
    return {k: times[k] / times[ks[0]] for k in ks} | {"seconds_per_row_step": times[ks[0]]}


def forward_batch_cost(engine: HFStepEngine, ks: list[int], columns: int = 512, forwards: int = 10,
                       repeats: int = 5) -> dict | None:
    """b(k) of the plain decode forward alone (issue 20's definition): the time of one decode step (the engine's
    `DecodeStep`, captured where the engine captures) on a buffer of k rows and `columns` columns, over that of one
    row. `batch_cost` times whole steps instead, which also pay the rows' join (an eager forward of their differing
    tails) and the host's per-token work; the two together say where a step's batch cost goes. Each k runs its
    buffer's first step (the capture or compilation) untimed, then `repeats` (at least 5) runs of `forwards` steps
    between two syncs; the median counts. k rows take the slots of their bucket (`slot_bucket`, as a batch does),
    so k = 3 times the 4-slot step. None on the eager path (no such step)."""
    step, pool = getattr(engine, "decode_step", None), getattr(engine, "kv_pool", None)
    if step is None or pool is None:
        return None
    repeats = max(5, repeats)
    start = columns - 1 - repeats * forwards  # the steps write columns start.. (the buffer never grows)
    if start < 1:
        raise ValueError(f"{columns} columns cannot hold {1 + repeats * forwards} timed decode steps")
    device = engine.runner.device
    times = {}
    for k in ks:
        # as a batch runs its steps: no autograd (a grad-recording step would keep its activations, compile another
        # graph, and leave the pooled buffer unusable for the batches that take it next)
        with torch.inference_mode(), engine.on_stream():
            kv = pool.take(slot_bucket(k), columns)
            # every slot sees every column: the attention reads all of a buffer's columns whatever the mask says,
            # so only the shape counts; this also covers the write column a batch opens before each step
            kv.mask.fill_(1)
            kv.set_column(start)
            step(kv)  # the buffer's first step: its capture (or compilation), untimed
            runs = []
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(forwards):
                    step(kv)
                _sync(device)
                runs.append((time.perf_counter() - t0) / forwards)
            pool.give(kv)
        times[k] = statistics.median(runs)
    return {k: times[k] / times[ks[0]] for k in ks} | {"seconds_per_forward": times[ks[0]]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the engine's own card, not the current one


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="random:qwen2-0.5b")
    p.add_argument("--draft", default="random:llama-20m")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--problems", type=int, default=None,
                   help="problems to run (default: enough for a 95%% interval of α within ±--alpha-half-width)")
    p.add_argument("--alpha-half-width", type=float, default=0.05)
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--step-tokens", type=int, default=16)
    p.add_argument("--methods", default="target,lr_sync,lr_async")
    p.add_argument("--decode", default="auto", help="transformers decode path: auto (fast on CUDA), fast or eager")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "runtime"))
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides, e.g. bench.source.kind=jsonl bench.source.path=q.jsonl")
    args = p.parse_args(argv)
    started = time.perf_counter()  # the loads and b(k) are timed too: a run cut by its limit says where it was

    needed = problems_needed(args.alpha, args.gamma, args.max_steps, args.alpha_half_width)
    problems = args.problems or needed
    load0 = os.getloadavg()
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [
        "bench.system_speed=true", f"bench.system_target={args.target}", f"bench.system_draft={args.draft}",
        f"models.dtype={args.dtype}", f"models.device={args.device}", f"models.decode={args.decode}",
        f"runtime.bernoulli_alpha={args.alpha}",
        f"runtime.gamma={args.gamma}", f"runtime.max_steps={args.max_steps}", "runtime.max_new_tokens=100000",
        f"sampling.max_step_tokens={args.step_tokens}", f"bench.num_problems={problems}", "bench.warmup=true",
        "bench.trace=true", *args.set])
    env = bench.prepare(cfg.bench_setup())
    print(f"# runtime benchmark: target {args.target}, draft {args.draft}, {args.dtype}, Bernoulli({args.alpha}), "
          f"γ={args.gamma}, {len(env.problems)} problems x {args.max_steps} steps of {args.step_tokens} tokens")
    print(f"# problems for α within ±{args.alpha_half_width} (95%): {needed} "
          f"({positions_needed(args.alpha, args.alpha_half_width)} judged positions at "
          f"{judged_per_step(args.alpha, args.gamma):.2f} per step); running {len(env.problems)}")
    gpu = f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""
    print(f"# host: {platform.processor() or platform.machine()}{gpu}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} torch thread(s), {os.cpu_count()} logical CPUs, load avg {load0[0]:.2f}")

    print(f"# target {describe_decode(env.target)}; draft {describe_decode(env.draft)}")

    ks = list(range(1, args.gamma + 2))
    b = batch_cost(env.target, env.problems[0].question, ks)
    print("# target batch cost b(k) = time(k rows) / time(1 row), measured on its own: "
          + ", ".join(f"b({k})={b[k]:.2f}" for k in ks) + f"  (1 row: {b['seconds_per_row_step']:.2f} s/step)")
    setup_s = time.perf_counter() - started
    print(f"# loads and b(k) took {setup_s:.0f} s")

    report = bench.run_benchmark(env, [m for m in args.methods.split(",") if m], out_dir=args.out,
                                 log=lambda s: print("  " + s, file=sys.stderr))
    rows = explained_rows(report, args.gamma, b)
    print()
    print(bench.format_markdown(report))
    print("(Its batch-adj. columns take b from each method's own iterations, which absorbs the runtime's "
          "overheads; the table below predicts with the b(k) measured on its own.)")
    print()
    explained = format_explained(rows, args.gamma, b)
    print(explained)
    load1 = os.getloadavg()
    print(f"\n# after the run: target {describe_decode(env.target)}; draft {describe_decode(env.draft)}")
    print(f"# load avg at start {load0[0]:.2f}, at end {load1[0]:.2f}; wall {report['wall_s']:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_cost.json").write_text(json.dumps({str(k): v for k, v in b.items()}, indent=2))
    (out / "explained.json").write_text(json.dumps({"problems_needed": needed, "rows": rows}, indent=2))
    (out / "explained.md").write_text(explained + "\n")
    total = time.perf_counter() - started
    print(f"# results in {out} (traces in {out / 'traces'}); {total:.0f} s since the start: loads and b(k) "
          f"{setup_s:.0f}, the timed run {report['wall_s']:.0f}, warm-up and the rest {total - setup_s - report['wall_s']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
