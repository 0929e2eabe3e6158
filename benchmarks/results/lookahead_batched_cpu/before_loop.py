"""n sampled one-step continuations of one context (the data stage's shape), plain vs Lookahead Decoding."""
import json
import statistics
import sys
import time

from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest

try:
    from specprobe.infer.engines.token_spec import LookaheadConfig, TokenSpecConfig
except ImportError:
    from specprobe.infer.engines.lookahead_decoding import LookaheadConfig
    from specprobe.infer.engines.token_spec import TokenSpecConfig
old = sys.argv[1] == "old"
eng = HFStepEngine("offline:smollm2-135m-instruct", device="cpu")
cfg = LookaheadConfig(window=int(sys.argv[2]), ngram=int(sys.argv[3]))
if old:
    from specprobe.infer.engines.lookahead_decoding import LookaheadStepEngine
    la = LookaheadStepEngine(eng, cfg)
else:
    la = eng.with_token_spec(TokenSpecConfig("lookahead", lookahead=cfg))
Q = ["Anna has 12 apples. She buys 5 more and eats 3. How many are left?",
     "A train travels 60 km in 1.5 hours. What is its average speed in km per hour?",
     "What is the sum of the first 10 positive odd numbers?",
     "Tom reads 20 pages a day. How many days does he need for a 340-page book?",
     "A rectangle is 7 cm by 4 cm. What is its area and its perimeter?"]
n = int(sys.argv[4])
params = SamplingParams(temperature=0.6, top_p=0.95, max_step_tokens=48, seed=1)
rows = {"plain": [], "lookahead": []}
for _name, e in (("plain", eng), ("lookahead", la)):  # warm-up on a throwaway problem
    e.generate([StepRequest(Prefix("Warm up: what is 1 + 1?"), n, 0)], params)
for q in Q:
    for name, e in (("plain", eng), ("lookahead", la)):
        eng.clear_prefix_cache()
        t = time.perf_counter()
        g = e.generate([StepRequest(Prefix(q), n, 1)], params)
        dt = time.perf_counter() - t
        rows[name].append({"s": dt, "tokens": g.stats.generated_tokens, "iterations": g.stats.iterations,
                           "row_iterations": g.stats.row_iterations, "accepted": g.stats.spec_accepted})
ratio = [p["s"] / q["s"] for p, q in zip(rows["plain"], rows["lookahead"])]
print(json.dumps({"code": sys.argv[1], "window": cfg.window, "ngram": cfg.ngram, "n": n, "rows": rows,
                  "speedup_per_problem": [round(r, 3) for r in ratio], "median": round(statistics.median(ratio), 3)}))
