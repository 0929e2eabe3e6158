"""The join of a Lookahead batch's nested rows on the fast decode path, before and after 2026-11-26's change (CPU).

Four rows (the question, then one, two, three 48-token draft steps after it), the question's KV cached as after
the previous cycle, 4-token steps (so the join dominates). "before": the base is the rows' common prefix and one
forward encodes every row's tail (all slots x the longest tail); "after": `FastDecodeBatch._new_base` encodes the
longest row once in one row (`ModelRunner.prefill_ends`). The eager path (waves) beside them. Same engine and
weights, alternating, 5 calls each per round, two rounds; the median counts. Run from the repository root:

    python benchmarks/results/nested_join_2026-11-26/measure.py
"""
import statistics
import time

import torch

from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.hf_kv import common_prefix_len
from specprobe.infer.engines.static_kv import _JOIN_SHARED_MAX, FastDecodeBatch

torch.set_num_threads(1)

def old_new_base(self, ids_list):  # the code before the change
    lcp = common_prefix_len(ids_list)
    self.base_ids, self.base_cache, self.base_logits = [], None, {}
    if lcp:
        leave = lcp if len(ids_list) == 1 else _JOIN_SHARED_MAX
        self.base_cache, missing, _ = self.runner.start(ids_list[0][:lcp], self.stats, leave)
        self.base_ids = list(ids_list[0][:lcp - len(missing)])

new_new_base = FastDecodeBatch._new_base
e = HFStepEngine("random:qwen2-0.5b", decode="fast")
eager = HFStepEngine("random:qwen2-0.5b", model=e.model, tokenizer=e.tokenizer, decode="eager")
draft_step = " ".join(["word"] * 47)
q = "Question: what is 12 times 13? Think step by step."
prefixes = [Prefix(q, tuple([draft_step] * j)) for j in range(4)]
params = SamplingParams(temperature=0.0, max_step_tokens=4, delimiter="\x00\x00")
reqs = [StepRequest(p) for p in prefixes]
print("tokens per prefix", [len(e.prefix_ids(p)) for p in prefixes])
res = {}
for name, fn in [("fast, before", old_new_base), ("fast, after", new_new_base), ("eager", None)] * 2:
    FastDecodeBatch._new_base = fn or new_new_base
    engine = eager if fn is None else e
    times = []
    for _ in range(5):
        engine.clear_prefix_cache()
        engine.generate([StepRequest(prefixes[0])], params)  # the question cached, as after the last cycle
        t = time.perf_counter()
        g = engine.generate(reqs, params)
        times.append(time.perf_counter() - t)
    res.setdefault(name, []).extend(times)
    print(f"{name:>12}: median {statistics.median(times):.3f} s", "prefill tokens", g.stats.prefill_tokens, "forwards", g.stats.forward_passes)
print("medians over both rounds (s):", {k: round(statistics.median(v), 3) for k, v in res.items()})
