"""Step-engine throughput on the offline model (issue: foundations).

    python benchmarks/bench_engine.py [--model offline:smollm2-135m-instruct] [--tokens 48] [--repeats 2]
    python benchmarks/bench_engine.py --compare [--tokens 48]     # transformers vs vLLM, side by side

Prints sampling throughput (generated tokens per second) at batch 1, 8 and 20, with the shared prefix
encoded once (KV cache repeated across the batch) and without (the prefix encoded once per row), and
the time of one teacher-forced scoring pass over 20 steps. Each timed request encodes its prefix anew, so
tok/s includes the prefill; beside it, the shared engine's time to the first token and its decode rate
after it (the per-token figure the prefill does not dilute). Run it on an otherwise idle machine.

--compare runs both engines (transformers, vLLM) in one process on the same weights and prints one table:
engine start time; step sampling tokens/s with n = 10 seeded samples (T 0.6, top-p 0.95) for 1, 8 and 20
different prefixes, each with the share of prompt tokens served from a cache (and for one prefix sampled
again, cache warm), with a raw-vLLM column beside specprobe's vLLM engine (the same engine object,
`LLM.generate` with n = 10 and a seed per prefix), so the engine's overhead over vLLM shows;
teacher-forced scoring time of 20 steps without hidden states and with all layers pooled (vLLM hands
the latter to a transformers engine on the same weights, built on first use: that first call is timed
separately).
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from bench_runtime import (  # noqa: E402 - b(k) measured as the runtime benchmark does
    batch_cost,
    describe_decode,
    forward_batch_cost,
)

from specprobe.infer.engines import Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.fused_norm import setting_of
from specprobe.infer.engines.hf import HFStepEngine
from specprobe.infer.engines.hf_kv import ModelRunner, output_cache

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
        cache = output_cache(out)
        cache.batch_select_indices(torch.tensor([0], device=self.device))  # paid for all rows, keep one
        return cache, out.logits[0, -1].float()


class UnsharedPrefixEngine(HFStepEngine):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.runner = UnsharedPrefixRunner(self.model, self.tokenizer.pad_token_id or 0)


def time_sampling(engine, prefix, batch, tokens, repeats, seed=0, greedy=False, first_token=True):
    """Medians over `repeats` of (tokens/s, seconds, seconds to the first token, tokens/s after the first token).
    Each repeat encodes the prefix anew (cache cleared) and generates `tokens` tokens a row; before it (with
    first_token), the same request capped at one token times the prefix's encoding and the first token alone, so
    the decode rate (the tokens after each row's first over the time after the first token) leaves the prefill
    out (nan without first_token, or with one token a row)."""
    rates, seconds, firsts, decode_rates = [], [], [], []
    for r in range(repeats):
        # greedy: every row runs to the cap (no delimiter can end it early), the per-token cost alone
        first = _timed_generate(engine, prefix, batch, 1, seed + r, greedy)[1] if first_token else float("nan")
        steps, elapsed = _timed_generate(engine, prefix, batch, tokens, seed + r, greedy)
        generated = sum(s.num_tokens for s in steps)
        rates.append(generated / elapsed)
        seconds.append(elapsed)
        firsts.append(first)
        if elapsed > first and generated > len(steps):  # false for nan
            decode_rates.append((generated - len(steps)) / (elapsed - first))
    return (statistics.median(rates), statistics.median(seconds), statistics.median(firsts),
            statistics.median(decode_rates) if decode_rates else float("nan"))


def _timed_generate(engine, prefix, batch, tokens, seed, greedy):
    """One step request of `batch` rows after `prefix`, its prefix encoded anew: (steps, seconds)."""
    engine.clear_prefix_cache()
    engine.runner.rows_hint = batch
    params = (SamplingParams(temperature=0.0, max_step_tokens=tokens, delimiter="\x00\x00") if greedy
              else SamplingParams(seed=seed, max_step_tokens=tokens))
    start = time.perf_counter()
    steps = engine.generate([StepRequest(prefix, batch)], params).steps[0]
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    return steps, time.perf_counter() - start


def count_syncs(engine, prefix: Prefix, rows: int, tokens: int) -> list[int]:
    """Host syncs in each plain decode iteration (CUDA only): a greedy stream of `rows` rows (nested prefixes, as
    in a Lookahead Reasoning batch) stepped to the cap, counting the synchronizing CUDA calls that
    `torch.cuda.set_sync_debug_mode` reports inside `step()` alone (the rows' join is not an iteration)."""
    params = SamplingParams(temperature=0.0, max_step_tokens=tokens, delimiter="\x00\x00")
    stream = engine.open_stream(params)
    stream.add([(j, StepRequest(prefix.extend(*["step"] * j))) for j in range(rows)])
    counts = []
    while len(stream):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                stream.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in caught))
    return counts


def bench_path(base: HFStepEngine, decode: str, args, prefix: Prefix, fused_norm: bool | str = "auto",
               merged_linear: bool | str = "auto", capture_joins: bool = True, graph: str = "auto") -> None:
    """The tables of one decode path, on `base`'s weights (their norms fused or not, their linear layers merged or
    not: the engines set it; the joins' forwards captured or not)."""
    swaps = dict(decode=decode, decode_graph=graph, fused_norm=fused_norm, merged_linear=merged_linear,
                 capture_joins=capture_joins)
    shared = HFStepEngine(args.model, model=base.model, tokenizer=base.tokenizer, **swaps)
    unshared = (UnsharedPrefixEngine(args.model, model=base.model, tokenizer=base.tokenizer, **swaps)
                if args.unshared else None)
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    for batch in batches:  # warm-up at every batch shape (kernel choice, graph capture on the fast path)
        for engine in filter(None, (shared, unshared)):
            time_sampling(engine, prefix, batch, 8, 1, greedy=args.greedy)
    print(f"\n## {describe_decode(shared)}: warm-up {time.perf_counter() - t0:.1f} s")
    # tok/s and s: the whole request, the prefix's encoding included (as in every earlier session's tables);
    # first s and decode tok/s: the shared engine's time to the first token, and its rate after it
    print(f"{'batch':>5} {'shared tok/s':>13} {'unshared tok/s':>15} {'shared s':>9} {'unshared s':>11} "
          f"{'first s':>8} {'decode tok/s':>13}")
    for batch in batches:
        rate_s, sec_s, first_s, decode_s = time_sampling(shared, prefix, batch, args.tokens, args.repeats,
                                                         greedy=args.greedy)
        rate_u, sec_u = (time_sampling(unshared, prefix, batch, args.tokens, args.repeats, greedy=args.greedy,
                                       first_token=False)[:2]
                         if unshared else (float("nan"), float("nan")))
        print(f"{batch:>5} {rate_s:>13.1f} {rate_u:>15.1f} {sec_s:>9.2f} {sec_u:>11.2f} {first_s:>8.3f} "
              f"{decode_s:>13.1f}")
    if args.batch_cost:
        ks = [int(k) for k in args.batch_cost.split(",")]
        b = batch_cost(shared, QUESTION, ks, tokens=args.tokens, repeats=5)
        print(f"batch cost (median of 5, {args.tokens}-token greedy steps after nested prefixes): "
              + ", ".join(f"b({k})={b[k]:.3f}" for k in ks) + f"  (1 row: {b['seconds_per_row_step']:.3f} s/step)")
        columns, forwards = 512, 10
        f = forward_batch_cost(shared, ks, columns=columns, forwards=forwards, repeats=5)
        if f is not None:  # the decode forward alone: what the steps' b(k) pays beyond it is the join and the host
            print(f"batch cost of the decode forward alone (median of 5 x {forwards} forwards, {columns} columns): "
                  + ", ".join(f"b({k})={f[k]:.3f}" for k in ks) + f"  (1 row: {1e3 * f['seconds_per_forward']:.2f} ms)")
    if args.syncs and torch.cuda.is_available():
        for rows in (1, 4, 8):
            counts = count_syncs(shared, prefix, rows, args.tokens)
            print(f"host syncs per plain iteration, {rows} row(s): median {statistics.median(counts)}, "
                  f"max {max(counts)} over {len(counts)} iterations (total {sum(counts)})")
    print(f"after timing: {describe_decode(shared)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="offline:smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=48, help="step token cap")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--batches", default="1,8,20", help="batch sizes (samples of one prefix)")
    parser.add_argument("--greedy", action="store_true", help="greedy rows that all run to the cap (tokens/s of "
                                                              "decoding alone, no early stops)")
    parser.add_argument("--decode", default="auto", help="decode path(s), comma-separated, measured one after the "
                                                         "other on the same weights: auto (fast on CUDA), fast, eager")
    parser.add_argument("--graph", default="auto", help="the fast path's decode step(s), comma-separated, measured "
                                                        "one after the other on the same weights: auto (cuda_graph "
                                                        "on CUDA), cuda_graph, compile, none")
    parser.add_argument("--fused-norm", default="auto", choices=("auto", "off", "on", "off,on"),
                        help="RMSNorm layers as one fused kernel (models.fused_norm; auto: on CUDA only); off,on "
                             "measures each decode path both ways, one after the other on the same weights")
    parser.add_argument("--merged-linear", default="auto", choices=("auto", "off", "on", "off,on"),
                        help="q/k/v and gate/up as one product each (models.merged_linear; auto: on CUDA only); "
                             "off,on measures each decode path (and fused-norm setting) both ways")
    parser.add_argument("--capture-joins", default="on", choices=("on", "off", "off,on"),
                        help="capture the forwards of rows joining a batch with the decode step (models."
                             "capture_joins; CUDA with a captured step only); off,on measures both, as above")
    parser.add_argument("--no-unshared", dest="unshared", action="store_false",
                        help="skip the baseline that encodes the prefix once per row")
    parser.add_argument("--batch-cost", default="", help="ks of the batch cost b(k) = time of one step for k rows "
                                                         "(nested prefixes) / time for one row, e.g. 1,2,4,8; on "
                                                         "the fast path also b(k) of the decode forward alone")
    parser.add_argument("--syncs", action="store_true", help="count host syncs per plain decode iteration "
                                                             "(CUDA: torch.cuda.set_sync_debug_mode)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    base = HFStepEngine(args.model, device=args.device, dtype=args.dtype, decode="eager")
    prefix = Prefix(QUESTION, tuple(STEPS))
    n_prefix = len(base.prefix_ids(prefix))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"threads {torch.get_num_threads()}"
    print(f"model {base.info.model_id}  {args.device} {where}  {base.model.dtype}  prefix {n_prefix} tokens  "
          f"cap {args.tokens} tokens/step{' greedy' if args.greedy else ''}  loaded in "
          f"{time.perf_counter() - t0:.1f} s")
    for decode in args.decode.split(","):
        for graph in args.graph.split(",") if decode != "eager" else ["auto"]:  # the eager path has no step graph
            for fused in args.fused_norm.split(","):
                for merged in args.merged_linear.split(","):
                    for joins in args.capture_joins.split(","):
                        bench_path(base, decode, args, prefix, fused_norm=setting_of(fused),
                                   merged_linear=setting_of(merged, "merged linear"), capture_joins=joins == "on",
                                   graph=graph)
    params = SamplingParams(seed=1, max_step_tokens=args.tokens)
    steps = [s.text for s in base.generate([StepRequest(prefix, 20)], params).steps[0]]
    times = []
    for _ in range(args.repeats + 1):
        base.clear_prefix_cache()
        start = time.perf_counter()
        base.score(prefix, steps)
        times.append(time.perf_counter() - start)
    n_tok = sum(base.count_tokens(s) for s in steps)
    print(f"teacher-forced scoring of 20 steps ({n_tok} tokens, all {base.info.num_layers + 1} hidden-state "
          f"rows pooled) after a {n_prefix}-token prefix: {statistics.median(times):.3f} s (one batched pass + prefix; "
          f"{base.fused_norms} norm layers fused, {base.merged_linears} linear groups merged)")


QUESTIONS = [f"{QUESTION} (Case {i}: he also works {i} extra days a year.)" for i in range(20)]


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _start(kind: str, model: str):
    if kind == "hf":
        return HFStepEngine(model, device="cpu", dtype="float32")
    from specprobe.infer.engines.vllm_engine import VLLMSettings, VLLMStepEngine

    settings = VLLMSettings(max_model_len=2048, enforce_eager=True, block_size=32, kv_cache_gib=1.0)
    return VLLMStepEngine(model, device="cpu", dtype="float32", settings=settings)


def _hit_rate(stats) -> float:
    """Share of the prompt tokens the engine served from a cache instead of computing them."""
    return stats.reused_prefix_tokens / max(1, stats.reused_prefix_tokens + stats.prefill_tokens)


def measure(kind: str, model: str, tokens: int) -> dict[str, str]:
    """One engine's column of the comparison table."""
    engine, start_s = _timed(lambda: _start(kind, model))
    col = {"engine start (s)": f"{start_s:.1f}"}
    params = SamplingParams(seed=0, max_step_tokens=tokens)
    engine.generate([StepRequest(Prefix(QUESTIONS[0]), 2)], SamplingParams(max_step_tokens=4))  # warm-up
    for k in (1, 8, 20):
        reqs = [StepRequest(Prefix(q, tuple(STEPS)), 10, seed=i) for i, q in enumerate(QUESTIONS[:k])]
        engine.clear_prefix_cache()
        st = engine.generate(reqs, params).stats
        col[f"sampling tok/s, {k} prefix(es) x n=10"] = f"{st.generated_tokens / max(st.seconds, 1e-9):.1f}"
        col[f"  prompt tokens from a cache, {k} prefix(es)"] = f"{100 * _hit_rate(st):.0f}%"
    again = engine.generate([StepRequest(Prefix(QUESTIONS[0], tuple(STEPS)), 10, seed=0)], params).stats
    col["  the same, 1 prefix again (cache warm)"] = f"{100 * _hit_rate(again):.0f}%"
    prefix = Prefix(QUESTIONS[0], tuple(STEPS))
    steps = [s.text for s in engine.generate([StepRequest(prefix, 20)], params).steps[0]]
    _, first_hidden = _timed(lambda: engine.score(prefix, steps, hidden=True))
    _, light = _timed(lambda: engine.score(prefix, steps, hidden=False))
    _, hidden = _timed(lambda: engine.score(prefix, steps, hidden=True))
    col["score 20 steps, log-probs only (s)"] = f"{light:.2f}"
    col["score 20 steps, + all hidden states (s)"] = f"{hidden:.2f}"
    col["  first such call (s)"] = f"{first_hidden:.2f}"
    col["_engine"] = engine
    return col


def raw_vllm(engine, tokens: int) -> dict[str, str]:
    """vLLM alone on the same engine object: one request per prefix with n = 10 and the prefix's seed."""
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    col = {}
    for k in (1, 8, 20):
        prompts = [TokensPrompt(prompt_token_ids=engine.prefix_ids(Prefix(q, tuple(STEPS)))) for q in QUESTIONS[:k]]
        params = [VSP(n=10, temperature=0.6, top_p=0.95, max_tokens=tokens, stop=["\n\n"], seed=i, logprobs=0)
                  for i in range(k)]
        engine.clear_prefix_cache()
        outs, seconds = _timed(lambda: engine.llm.generate(prompts, params, use_tqdm=False))  # noqa: B023
        generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
        col[f"sampling tok/s, {k} prefix(es) x n=10"] = f"{generated / seconds:.1f}"
    return col


def compare(model: str, tokens: int) -> None:
    cols = {}
    for kind in ("hf", "vllm"):
        cols[kind] = measure(kind, model, tokens)
    cols["raw"] = raw_vllm(cols["vllm"].pop("_engine"), tokens)
    print(f"model {model}  threads {torch.get_num_threads()}  cap {tokens} tokens/step  fp32 CPU")
    print(f"{'':46s} {'transformers':>13s} {'specprobe-vLLM':>15s} {'raw vLLM':>9s}")
    for row in cols["hf"]:
        if row.startswith("_"):
            continue
        print(f"{row:46s} {cols['hf'][row]:>13s} {cols['vllm'][row]:>15s} {cols['raw'].get(row, '–'):>9s}")


if __name__ == "__main__":
    import sys

    if "--compare" in sys.argv:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--compare", action="store_true")
        ap.add_argument("--model", default="offline:smollm2-135m-instruct")
        ap.add_argument("--tokens", type=int, default=48, help="step token cap")
        a = ap.parse_args()
        compare(a.model, a.tokens)
    else:
        main()
