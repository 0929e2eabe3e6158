"""Step-engine throughput on the offline model (issue: foundations).

    python benchmarks/bench_engine.py [--model offline:smollm2-135m-instruct] [--tokens 48] [--repeats 2]

Prints sampling throughput (generated tokens per second) at batch 1, 8 and 20, with the shared prefix
encoded once (KV cache repeated across the batch) and without (the prefix encoded once per row), and
the time of one teacher-forced scoring pass over 20 steps. Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.engines import Prefix, SamplingParams, StepRequest
from infer.engines.hf import HFStepEngine
from infer.engines.hf_kv import ModelRunner

QUESTION = ("A carpenter works for 2 weeks every month and for 6 days every week. He gets paid 195 every day. "
            "How much does he earn if he works for a year? Explain each step.")
STEPS = ["He works 6 days a week for 2 weeks, so 6 * 2 = 12 days a month.",
         "Each day pays 195, so a month pays 12 * 195 = 2340."]


class UnsharedPrefixRunner(ModelRunner):
    """Baseline without prefix reuse: every row of a batch encodes the prefix itself (the cost a
    batch of independent prompts pays), and nothing is kept between calls."""

    rows_hint = 1

    def prefill(self, ids, stats):
        out = self.forward(stats, input_ids=torch.tensor([ids] * self.rows_hint, device=self.device), use_cache=True)
        stats.prefill_tokens += len(ids) * self.rows_hint
        cache = out.past_key_values
        cache.batch_select_indices(torch.tensor([0], device=self.device))  # paid for all rows, keep one
        return cache, out.logits[0, -1].float()


class UnsharedPrefixEngine(HFStepEngine):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.runner = UnsharedPrefixRunner(self.model, self.tokenizer.pad_token_id or 0)


def time_sampling(engine, prefix, batch, tokens, repeats, seed=0):
    rates, seconds = [], []
    for r in range(repeats):
        engine.clear_prefix_cache()
        engine.runner.rows_hint = batch
        start = time.perf_counter()
        params = SamplingParams(seed=seed + r, max_step_tokens=tokens)
        steps = engine.generate([StepRequest(prefix, batch)], params).steps[0]
        elapsed = time.perf_counter() - start
        rates.append(sum(s.num_tokens for s in steps) / elapsed)
        seconds.append(elapsed)
    return statistics.median(rates), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="offline:smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=48, help="step token cap")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    shared = HFStepEngine(args.model, device="cpu")
    unshared = UnsharedPrefixEngine(args.model, model=shared.model, tokenizer=shared.tokenizer)
    prefix = Prefix(QUESTION, tuple(STEPS))
    n_prefix = len(shared.prefix_ids(prefix))
    print(f"model {shared.info.model_id}  threads {torch.get_num_threads()}  prefix {n_prefix} tokens  "
          f"cap {args.tokens} tokens/step")
    time_sampling(shared, prefix, 2, 4, 1)  # warm-up
    print(f"{'batch':>5} {'shared tok/s':>13} {'unshared tok/s':>15} {'shared s':>9} {'unshared s':>11}")
    for batch in (1, 8, 20):
        rate_s, sec_s = time_sampling(shared, prefix, batch, args.tokens, args.repeats)
        rate_u, sec_u = time_sampling(unshared, prefix, batch, args.tokens, args.repeats)
        print(f"{batch:>5} {rate_s:>13.1f} {rate_u:>15.1f} {sec_s:>9.2f} {sec_u:>11.2f}")
    params = SamplingParams(seed=1, max_step_tokens=args.tokens)
    steps = [s.text for s in shared.generate([StepRequest(prefix, 20)], params).steps[0]]
    times = []
    for _ in range(args.repeats + 1):
        shared.clear_prefix_cache()
        start = time.perf_counter()
        shared.score(prefix, steps)
        times.append(time.perf_counter() - start)
    n_tok = sum(shared.count_tokens(s) for s in steps)
    print(f"teacher-forced scoring of 20 steps ({n_tok} tokens, all {shared.info.num_layers + 1} hidden-state "
          f"rows pooled) after a {n_prefix}-token prefix: {statistics.median(times):.3f} s (one batched pass + prefix)")


if __name__ == "__main__":
    main()
