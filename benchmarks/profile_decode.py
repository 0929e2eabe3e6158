"""Where a batch-1 decode step's GPU time goes (CUDA): the kernels of the fast path's plain decode forward.

    python benchmarks/profile_decode.py [--model random:qwen2-7b] [--rows 1] [--steps 20] [--fused-norm auto|off|on]

The fast path replays the decode forward as one CUDA graph, so host launches cost nothing there; what remains is
the GPU time of the forward's kernels. This runs the same forward eagerly on a batch's static buffers (the same
kernels the graph holds) under torch.profiler, after a warm-up, and prints the CUDA time per kernel name over
`steps` forwards, with the total per step and per layer, beside the time of one captured replay of the same step.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specprobe.infer.engines import Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.decode_step import DecodeStep
from specprobe.infer.engines.fused_norm import setting_of
from specprobe.infer.engines.hf import HFStepEngine

QUESTION = "A shop sells 53 boxes a day, each holding 12 pencils. How many pencils does it sell in a week?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen2-7b")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks this script (CPU ops instead of kernels)")
    ap.add_argument("--fused-norm", default="auto", choices=("auto", "off", "on"),
                    help="RMSNorm layers as one fused kernel (models.fused_norm; auto: on CUDA only)")
    ap.add_argument("--merged-linear", default="auto", choices=("auto", "off", "on"),
                    help="q/k/v and gate/up as one product each (models.merged_linear; auto: on CUDA only)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine = HFStepEngine(args.model, device=args.device, dtype="bfloat16" if cuda else "float32", decode="fast",
                          fused_norm=setting_of(args.fused_norm),
                          merged_linear=setting_of(args.merged_linear, "merged linear"))
    params = SamplingParams(temperature=0.0, max_step_tokens=16, delimiter="\x00\x00")
    engine.generate([StepRequest(Prefix(QUESTION), args.rows)], params)  # warm-up, fills a pooled buffer
    kv = engine.kv_pool.free[-1]
    eager = DecodeStep(engine.model, "none")
    graphed = engine.decode_step
    layers = engine.info.num_layers
    with torch.inference_mode():
        for _ in range(3):
            eager(kv)
            kv.set_column(kv.col)  # the forward advanced the cache's offset: write the same column again
        sync()
        times = {}
        for name, step in (("eager on static buffers", eager), ("captured replay", graphed)):
            step(kv)
            kv.set_column(kv.col)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(kv)
                kv.set_column(kv.col)
            sync()
            times[name] = (time.perf_counter() - t0) / args.steps * 1e3
        activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(args.steps):
                eager(kv)
                kv.set_column(kv.col)
            sync()
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if own(e) > 0), key=lambda e: -own(e))
    total = sum(own(e) for e in events) / args.steps / 1e3
    print(f"model {args.model}, {args.rows} row(s), {kv.columns} columns, {layers} layers, "
          f"{engine.fused_norms} norm layers fused, {engine.merged_linears} linear groups merged")
    for name, ms in times.items():
        print(f"{name}: {ms:.3f} ms a step (wall, {args.steps} steps)")
    print(f"kernel time (profiled, eager): {total:.3f} ms a step, {total / layers * 1e3:.1f} µs a layer; "
          f"{sum(e.count for e in events) / args.steps:.0f} kernels a step")
    print(f"{'µs/step':>9} {'calls/step':>10}  kernel")
    for e in events[:args.top]:
        print(f"{own(e) / args.steps:9.1f} {e.count / args.steps:10.1f}  {e.key[:110]}")


if __name__ == "__main__":
    main()
