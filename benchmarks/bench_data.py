"""Benchmark of the data stage: throughput, judge cost against all-pairs, where the time goes.

    python benchmarks/bench_data.py                                  # configs/tiny.yaml
    python benchmarks/bench_data.py --config X source.size=3 data.num_samples=8

Always generates into a fresh temporary output folder (a reused folder would measure nothing) unless
--output-dir is given. Prints contexts per minute; judge pairs per context next to the all-pairs count
N(N-1)/2 per model (and N(N-1), the directed NLI evaluations that pairwise bidirectional entailment would
take); judge pairs per context of both clustering schemes side by side (the reference last-match
scheme and first-match, re-clustering the stored samples through the folder's judge cache, so only
pairs the run did not ask reach the judge model); the share of time in sampling, clustering,
hidden-state recording and writing; and the forward
passes per context and model spent recording hidden states (the design: one batched pass per context
and model, the prefix's KV cache reused from sampling instead of encoding it again).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def report(result, load_seconds: float) -> str:
    run, manifest = result.run, result.manifest
    contexts = max(run.contexts, 1)
    n = manifest["num_samples"]
    models = manifest["models"]
    judge = manifest["counts"]["judge"]
    all_pairs = n * (n - 1) // 2
    total = sum(run.seconds.values()) or 1.0
    lines = [
        f"config: N = {n}, models {models}, layers {manifest['layers_option']} "
        f"({len(manifest['layers']['target'])} rows), judge {manifest['judge']}, "
        f"clustering {manifest.get('config', {}).get('data', {}).get('cluster_scheme', '?')}",
        f"contexts: {run.contexts} done ({run.skipped} skipped) in {run.wall_seconds:.1f}s "
        f"(+ {load_seconds:.1f}s loading models and judge) -> {60 * run.contexts / max(run.wall_seconds, 1e-9):.2f} "
        "contexts/min",
        f"judge pairs per context: clustering {judge.get('cluster_pairs', 0) / contexts:.1f}"
        f" ({judge.get('cluster_pairs', 0) / contexts / len(models):.1f} per model) + draft-vs-target "
        f"{judge.get('assign_pairs', 0) / contexts:.1f}; reached the judge model {judge.get('model_calls', 0) / contexts:.1f}",
        f"  all pairs per model and context: N(N-1)/2 = {all_pairs}  (N(N-1) = {2 * all_pairs} directed NLI calls)",
        "time: " + ", ".join(f"{k} {v:.1f}s ({100 * v / total:.0f}%)" for k, v in run.seconds.items()),
    ]
    for role in ("target", "draft"):
        calls = run.recording_calls.get(role, 0)
        if calls:
            lines.append(f"recording {role}: {run.recording_passes[role] / contexts:.2f} forward passes per context "
                         f"in {calls / contexts:.2f} score call(s); prefix KV reused from sampling in "
                         f"{run.prefix_reused[role]} of {calls} calls (else +1 prefix encode)")
    return "\n".join(lines)


class _PairCounter:
    """Counts the pairs a clustering asks (cache hits included), passing them to the cached judge."""

    def __init__(self, judge):
        self.judge_, self.pairs = judge, 0

    def judge(self, items):
        self.pairs += len(items)
        return self.judge_.judge(items)


def scheme_comparison(data_dir, inner_judge) -> str:
    """Judge pairs per context of the reference and first-match schemes on the stored samples."""
    from collections import defaultdict

    from specprobe.data_gen.cluster import SCHEMES, cluster_many
    from specprobe.data_gen.judges import CachedJudge
    from specprobe.data_gen.store import JUDGE_CACHE, open_dataset

    ds = open_dataset(data_dir)
    context_text = {r["context_id"]: r["context_text"] for r in ds.contexts.to_pylist()}
    groups = defaultdict(list)
    for r in ds.samples.to_pylist():
        groups[(r["context_id"], r["model"])].append((int(r["sample_id"].rsplit("/", 1)[1]), r["text"]))
    keys = sorted(groups)
    contexts = [context_text[c] for c, _ in keys]
    texts = [[t for _, t in sorted(groups[k])] for k in keys]
    cached = CachedJudge(inner_judge, Path(data_dir) / JUDGE_CACHE)
    lines, ids = [], {}
    num_contexts = max(len(context_text), 1)
    for scheme in SCHEMES:
        counter, calls_before = _PairCounter(cached), cached.misses
        ids[scheme] = [c.cluster_ids for c in cluster_many(contexts, texts, counter, scheme=scheme)]
        lines.append(f"  {scheme}: {counter.pairs / num_contexts:.1f} judge pairs per context "
                     f"({cached.misses - calls_before} not in the run's cache)")
    differ = sum(a != b for a, b in zip(ids["reference"], ids["first_match"]))
    return ("clustering schemes on the stored samples (all models):\n" + "\n".join(lines)
            + f"\n  clusters differ in {differ} of {len(keys)} (context, model) groups")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"))
    parser.add_argument("--output-dir", help="where to generate (default: a fresh temporary folder)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)

    import torch

    from specprobe.data_gen.pipeline import build_judge, generate_dataset
    from specprobe.infer.engines import build_engine_pair
    from specprobe.train.config import load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.output_dir or tempfile.mkdtemp(prefix="bench-data-")
    cfg = load_config(args.config, [*args.overrides, f"output_dir={out}"])
    start = time.perf_counter()
    engines = build_engine_pair(cfg.models)
    judge = build_judge(cfg.data, None, cfg.models.resolved_device()).inner
    load_seconds = time.perf_counter() - start
    result = generate_dataset(cfg.data_job(), engines=engines, judge=judge, progress=True)
    if result.reused:
        print(f"{result.data_dir} already held complete data: nothing measured (use a fresh --output-dir)")
        return 1
    print(f"output: {result.data_dir}")
    print(report(result, load_seconds))
    print(scheme_comparison(result.data_dir, judge))
    return 0


if __name__ == "__main__":
    sys.exit(main())
