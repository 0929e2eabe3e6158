"""The fast path's captured decode step computes what the eager step computes (CUDA only; the CPU tests cannot
capture a graph).

    python benchmarks/check_decode_graph.py [--model random:qwen2-0.5b] [--graph cuda_graph]

On one model in float32: greedy steps of a nested-prefix batch (4 rows, as in a Lookahead Reasoning target
batch) and of n = 4 seeded samples of one prefix, three times in a row (the second and third batches reuse the
pooled buffers and replay their captures), and a chain of 8 greedy one-row steps each continuing the last (as a
Lookahead Reasoning draft writes them: each call starts from the cached prefix, its few new tokens fed by replays of
the decode step or, past 8 tokens, by a chunk forward, its buffer growing past one column block), and a batch of two
questions (each row's own tokens in one chunk forward), decoded by the fast path with the decode step (and its chunk
forwards, padded to their widths) captured,
the fast path eager on the same static buffers, and the reference eager path. Last, the chain decoded by three
captured engines at once from three threads (as async Lookahead Reasoning drives its draft and target engines, each
on its own CUDA stream) must write what the chain wrote alone: two engines sharing the model's weights (a same-model
pair), and one on its own copy of the model, on --second-device when given (e.g. cuda:1, as with
models.draft_device). Every captured engine must replay its captures (decode steps and chunks) without a failure.
Prints, per case, whether the tokens are
identical, the largest step log-probability difference, and the capture counts. Exits 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import copy
import sys
import threading

import torch

from specprobe.infer.engines import Prefix, SamplingParams, StepRequest
from specprobe.infer.engines.hf import HFStepEngine

QUESTION = "A shop sells 53 boxes a day, each holding 12 pencils. How many pencils does it sell in a week?"
OTHER = "A train covers 84 kilometres in 1.5 hours at a steady speed. How far does it go in 4 hours at that speed?"


def run(engine: HFStepEngine, requests, params) -> list:
    out = []
    for _ in range(3):
        engine.clear_prefix_cache()
        out.append([s for steps in engine.generate(requests, params).steps for s in steps])
    return out


def chain(engine: HFStepEngine, steps: int, params) -> list:
    """`steps` greedy steps, each after the prefix the last one ended (the prefix cache kept between calls)."""
    engine.clear_prefix_cache()
    prefix, out = Prefix(QUESTION), []
    for _ in range(steps):
        step = engine.generate([StepRequest(prefix)], params).steps[0][0]
        out.append(step)
        prefix = prefix.extend(step)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:qwen2-0.5b")
    p.add_argument("--graph", default="cuda_graph")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--device", default="cuda", help="cuda; cpu (with --graph none or compile) only checks this script")
    p.add_argument("--second-device", default=None, help="where the two-thread check's second engine loads its "
                                                          "model (default --device)")
    args = p.parse_args()
    base = HFStepEngine(args.model, device=args.device, dtype="float32", decode="eager")
    engines = {name: HFStepEngine(args.model, model=base.model, tokenizer=base.tokenizer, decode=decode,
                                  decode_graph=graph)
               for name, decode, graph in [("captured", "fast", args.graph), ("static eager", "fast", "none"),
                                           ("reference", "eager", "auto")]}
    nested = [StepRequest(Prefix(QUESTION).extend(*["Step."] * j)) for j in range(4)]
    cases = {
        "greedy, 4 nested prefixes": (nested, SamplingParams(temperature=0.0, max_step_tokens=args.tokens,
                                                             delimiter="\x00\x00")),
        "greedy, two questions": ([StepRequest(Prefix(QUESTION)), StepRequest(Prefix(OTHER))],
                                  SamplingParams(temperature=0.0, max_step_tokens=args.tokens)),
        "sampled, n=4, seed 3": ([StepRequest(Prefix(QUESTION), 4, seed=3)],
                                 SamplingParams(temperature=0.8, top_p=0.95, max_step_tokens=args.tokens)),
    }
    chained = SamplingParams(temperature=0.0, max_step_tokens=args.tokens)
    ok = True
    for case, (requests, params) in [*cases.items(), ("greedy, a chain of 8 steps", (None, chained))]:
        got = {name: run(e, requests, params) if requests else [chain(e, 8, params)] for name, e in engines.items()}
        want = got["captured"][0]
        for name, rounds in got.items():
            if name == "reference" and params.temperature > 0:
                continue  # the eager path draws with other generators (same distribution, other numbers)
            same = all([s.token_ids for s in r] == [s.token_ids for s in want] for r in rounds)
            diff = max(abs(a.logprob - b.logprob) for r in rounds for a, b in zip(r, want))
            ok &= same and diff < 1e-3
            print(f"{case:28s} {name:13s} tokens {'identical' if same else 'DIFFER'} in {len(rounds)} round(s), "
                  f"max |Δ step logprob| {diff:.2e}")
    alone = [s.token_ids for s in got["captured"][0]]  # the chain, the last case
    own = copy.deepcopy(base.model).to(args.second_device or args.device)  # the same weights (random: ones depend
    # on the device's generator, so a second load could differ)
    group = [engines["captured"],
             HFStepEngine(args.model, model=base.model, tokenizer=base.tokenizer, decode="fast", decode_graph=args.graph),
             HFStepEngine(args.model, model=own, tokenizer=base.tokenizer, decode="fast", decode_graph=args.graph)]
    each: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: each.update({i: chain(group[i], 8, chained)}))
               for i in range(len(group))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = [[s.token_ids for s in each.get(i, [])] == alone for i in range(len(group))]
    ok &= all(same)
    print(f"{'greedy chain, three threads':28s} shared weights, shared weights, own copy on "
          f"{group[2].runner.device}: tokens {' / '.join('identical' if x else 'DIFFER' for x in same)} to the chain "
          "decoded alone")
    for name, engine in (("captured engine", engines["captured"]), ("shared-weights engine", group[1]),
                         ("own-copy engine", group[2])):
        step = engine.decode_step
        print(f"{name}: mode {step.mode}, {step.captures} captures, {step.replays} replays, failed: {step.failed}; "
              f"chunks: {step.chunk_captures} captures, {step.chunk_replays} replays, failed: {step.chunk_failed}; "
              f"{engine.kv_pool.created} KV buffers allocated")
        ok &= step.failed is None and (step.replays > 0 or not step.capture)
        ok &= step.chunk_failed is None and (step.chunk_replays > 0 or not step.capture)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 compared exactly: no TF32 in either path
    sys.exit(main())
