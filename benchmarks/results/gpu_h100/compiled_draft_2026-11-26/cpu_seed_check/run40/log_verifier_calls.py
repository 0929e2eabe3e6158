"""The runtime benchmark on 40 problems (lr_sync, seed 0) with every verifier call logged to verifier_calls.csv:
seed, verdict, position, the number of steps before it, the question's first 25 characters.

    SPECPROBE_RANDOM_TOKENIZER=.gpu/tok python benchmarks/results/gpu_h100/compiled_draft_2026-11-26/cpu_seed_check/run40/log_verifier_calls.py

As run on 2026-11-26 from the repository root (log.txt, results.json); that run pickled the calls and wrote the
CSV from the pickle afterwards, in the same columns."""
import csv
import runpy
import sys
from pathlib import Path

from specprobe.infer import verifiers

calls = []
verify = verifiers.Verifier.verify


def logged(self, items):
    out = verify(self, items)
    for it, v in zip(items, out):
        calls.append((it.context.question[:25], len(it.context.steps), it.meta.get("position"), int(v.accepted), it.seed))
    return out


verifiers.Verifier.verify = logged
sys.argv = ["bench_runtime.py", "--target", "random:llama-20m", "--draft", "random:llama-tiny", "--dtype", "float32",
            "--problems", "40", "--max-steps", "16", "--step-tokens", "32", "--methods", "lr_sync", "--decode", "fast",
            "--out", "/tmp/alpha_b2", "--set", "bench.source.kind=jsonl", "bench.source.path=.gpu/questions.jsonl"]
try:
    runpy.run_path("benchmarks/bench_runtime.py", run_name="__main__")
except SystemExit:
    pass
with open(Path(__file__).with_name("verifier_calls.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["call", "question", "context_steps", "position", "accepted", "seed"])
    w.writerows((i, *c) for i, c in enumerate(calls))
