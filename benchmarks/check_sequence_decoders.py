"""Behaviour check for changes under the one-sequence tree decoders (SEED, the reference LookaheadDecoder): seeded
outputs on SmolLM2 in float32 (greedy and sampled, two tree shapes, two window sizes, with and without the prompt
pool), written as JSON; then two such files (from two checkouts) compared token for token.

    (cd old-checkout && python /path/to/check_sequence_decoders.py run /tmp/old.json)
    python benchmarks/check_sequence_decoders.py run /tmp/new.json
    python benchmarks/check_sequence_decoders.py compare /tmp/old.json /tmp/new.json
"""
from __future__ import annotations

import json
import sys
import time

import torch

PROMPTS = ["Question: What is 17 times 23? Think step by step.\n", "Explain why the sky is blue in two sentences.\n",
           "List three prime numbers greater than 50 and say why."]


def run(path: str) -> None:
    from specprobe.infer.engines import HFStepEngine
    from specprobe.infer.engines.lookahead_decoding import LookaheadDecoder
    from specprobe.infer.engines.seed_decoding import SeedGenerator
    from specprobe.infer.engines.token_spec import LookaheadConfig

    torch.set_num_threads(1)
    engine = HFStepEngine("offline:smollm2-135m-instruct", device="cpu", dtype="float32")
    prompts = [engine.tokenizer.encode(q) for q in PROMPTS]
    out, t0 = {}, time.perf_counter()
    for temperature in (0.0, 0.8):
        for k_config in ((2, 2, 1), (1, 1, 1)):
            seed = SeedGenerator.from_engines(engine, engine, k_config, temperature=temperature, threaded=False)
            res = seed.generate(prompts, [40] * len(prompts), [11, 12, 13])
            out[f"seed/T={temperature}/k={k_config}"] = [[tokens, lp, None] for tokens, lp in res]
    t1 = time.perf_counter()
    for temperature in (0.0, 0.8):
        for window, ngram in ((4, 3), (5, 4)):
            for pool in (False, True):
                dec = LookaheadDecoder(engine.sequence_kv(), LookaheadConfig(window, ngram))
                res = []
                for i, p in enumerate(prompts):
                    tokens, stats = dec.generate(p, 40, temperature=temperature, seed=7 + i, prompt_pool=pool)
                    res.append([tokens, stats.logprob, stats.accepted])
                out[f"lookahead/T={temperature}/W={window},N={ngram}/pool={pool}"] = res
    print(f"SEED {t1 - t0:.1f} s, LookaheadDecoder {time.perf_counter() - t1:.1f} s")
    with open(path, "w") as f:
        json.dump(out, f)


def compare(a: str, b: str) -> int:
    with open(a) as fa, open(b) as fb:
        ra, rb = json.load(fa), json.load(fb)
    bad = 0
    for key in ra:
        pairs = list(zip(ra[key], rb[key]))
        tokens = all(x[0] == y[0] and x[2] == y[2] for x, y in pairs)
        bad += not tokens
        dlp = max(abs(x[1] - y[1]) for x, y in pairs)
        print(f"{key}: {'tokens and accepted counts identical' if tokens else 'DIFFER'}; max |d logprob| {dlp:.1e}")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(sys.argv[2])
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
