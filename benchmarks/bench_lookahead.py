"""Lookahead Decoding inside steps against plain decoding, in the data stage's shape: n sampled one-step
continuations of each context, decoded as one batch (each row its own Jacobi window and n-gram pool).

    python benchmarks/bench_lookahead.py [--model offline:smollm2-135m-instruct] [--window 5] [--ngram 4] [--n 8]

Both are warmed on a throwaway context first; every context then runs plain, then +lookahead, each with the
engine's prefix cache emptied. Prints one JSON line per context (seconds, tokens, batch iterations, row
iterations, accepted proposal tokens) and the per-context speedup (plain seconds / lookahead seconds) with its
median and range. Run it on an otherwise idle machine. `--decode` picks the transformers decode path of both
(auto: the fast one on CUDA, the eager one on CPU, as users get them). With random weights
(`random:qwen2-7b`, `benchmarks/gpu_bench.sh lookahead`) the outputs repeat tokens, so acceptance is not that
of real text; the batch iteration cost against plain decoding is the system fact.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.token_spec import LookaheadConfig, TokenSpecConfig

QUESTIONS = ["Anna has 12 apples. She buys 5 more and eats 3. How many are left?",
             "A train travels 60 km in 1.5 hours. What is its average speed in km per hour?",
             "What is the sum of the first 10 positive odd numbers?",
             "Tom reads 20 pages a day. How many days does he need for a 340-page book?",
             "A rectangle is 7 cm by 4 cm. What is its area and its perimeter?"]


def run(engine, prefix: Prefix, n: int, params: SamplingParams) -> dict:
    engine.clear_prefix_cache()
    t0 = time.perf_counter()
    out = engine.generate([StepRequest(prefix, n, params.seed)], params)
    st = out.stats
    return {"s": round(time.perf_counter() - t0, 4), "tokens": st.generated_tokens, "iterations": st.iterations,
            "row_iterations": st.row_iterations, "accepted": st.spec_accepted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="offline:smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--window", type=int, default=5, help="W (the paper: 15 on an A100)")
    ap.add_argument("--ngram", type=int, default=4, help="N (the paper: 5)")
    ap.add_argument("--n", type=int, default=8, help="samples per context (rows of one batch)")
    ap.add_argument("--tokens", type=int, default=48, help="step token cap")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--decode", default="auto", choices=["auto", "fast", "eager"], help="the decode path of both")
    ap.add_argument("--graph", default="auto", help="the fast path's decode step: auto, cuda_graph, compile, none")
    args = ap.parse_args()
    engine = HFStepEngine(args.model, device=args.device, dtype=args.dtype, decode=args.decode,
                          decode_graph=args.graph)
    spec = TokenSpecConfig("lookahead", lookahead=LookaheadConfig(window=args.window, ngram=args.ngram))
    methods = {"plain": engine, "lookahead": engine.with_token_spec(spec)}
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_step_tokens=args.tokens, seed=1)
    for e in methods.values():  # warm-up, baseline included
        run(e, Prefix("Warm up: what is 1 + 1?"), args.n, params)
    speedups = []
    for i, q in enumerate(QUESTIONS):
        row = {name: run(e, Prefix(q), args.n, params) for name, e in methods.items()}
        speedups.append(row["plain"]["s"] / row["lookahead"]["s"])
        print(json.dumps({"context": i, **row, "speedup": round(speedups[-1], 3)}), flush=True)
    print(f"model {args.model} ({engine.decode} decode path), W={args.window}, N={args.ngram}, n={args.n}, "
          f"{args.tokens} tokens per step: "
          f"lookahead / plain speedup median {statistics.median(speedups):.3f} "
          f"(range {min(speedups):.3f}-{max(speedups):.3f} over {len(speedups)} contexts)")


if __name__ == "__main__":
    main()
