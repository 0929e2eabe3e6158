"""What a probe costs at run time next to what a target step costs, and how long the probes take to train.

    python benchmarks/bench_probe.py [--config configs/tiny.yaml] [--repeats 20] [--data <output_dir>/data]
                                     [--out result.json] [key=value overrides]

1. Probe scoring: p and q (the config's probe shape, e.g. all 31 layers x 576 concatenated for the tiny
   config) on a batch of 8 steps' pooled hidden states, CPU, at 1 thread and at torch's default; the
   checkpoint's probes when ``<output_dir>/checkpoint`` exists, else fresh ones of the same shape (the
   cost does not depend on the weights).
2. One target step: the config's target model decoding one step (``engine.sample``, batch 1, the
   config's step token cap), plus the teacher-forced scoring pass with hidden states that the probes
   need (8 steps after one prefix).
3. Training on the config's data (when it exists): probes (all of them, with the last-layer baselines)
   and the embedding threshold, as `probe-train --stage train` runs them; the judge LoRA with --judge.
Run it on an otherwise idle machine; numbers on a shared machine are upper bounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specprobe.infer.checkpoint_format import Checkpoint, probe_name
from specprobe.infer.decoding.depth import median_seconds
from specprobe.probes.features import FeatureSpec, layers_from_option
from specprobe.probes.mlp import SemanticProbe
from specprobe.train.config import load_config
from specprobe.train.probes_train import mlp_config, torch_threads

QUESTION = ("A carpenter works for 2 weeks every month and for 6 days every week. He gets paid 195 every day. "
            "How much does he earn if he works for a year? Explain each step.")
STEPS = ["He works 6 days a week for 2 weeks, so 6 * 2 = 12 days a month."]


def probe_pair(cfg, info) -> tuple[SemanticProbe, SemanticProbe, str]:
    if Path(cfg.checkpoint_dir).is_dir():
        ckpt = Checkpoint(cfg.checkpoint_dir, strict=False)
        if ckpt.has_probe(probe_name("target")) and ckpt.has_probe(probe_name("draft")):
            return ckpt.probe(probe_name("target")), ckpt.probe(probe_name("draft")), str(ckpt.folder)
    probes = []
    for _role in ("target", "draft"):
        spec = FeatureSpec(model_id=info.model_id, num_layers=info.num_layers, hidden_size=info.hidden_size,
                           layers=layers_from_option(cfg.probe.features, info.num_layers), combine=cfg.probe.combine,
                           pooling=cfg.probe.pooling)
        probes.append(SemanticProbe(spec, mlp_config(cfg.probe)).eval())
    return probes[0], probes[1], "fresh (untrained) probes of the config's shape"


def bench_probes(cfg, info, repeats: int) -> dict:
    p_probe, q_probe, source = probe_pair(cfg, info)
    x_p = torch.randn(8, info.num_layers + 1, info.hidden_size)
    x_q = torch.randn(8, q_probe.spec.num_layers + 1, q_probe.spec.hidden_size)

    def score() -> None:
        p_probe.predict_proba(x_p)
        q_probe.predict_proba(x_q)

    out = {"source": source, "input": list(x_p.shape), "layers": len(p_probe.spec.layers),
           "input_dim": p_probe.spec.input_dim}
    for threads in sorted({1, torch.get_num_threads()}):
        with torch_threads(threads):
            seconds = median_seconds(score, repeats, warmup=2)
        out[f"threads_{threads}"] = {"batch8_seconds": seconds, "per_step_seconds": seconds / 8}
    return out


def bench_target_step(cfg, engine, repeats: int) -> dict:
    from specprobe.infer.engines import Prefix, SamplingParams, StepRequest

    prefix = Prefix(QUESTION, tuple(STEPS))
    params = dict(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                  max_step_tokens=cfg.sampling.max_step_tokens)
    tokens, times = [], []
    for r in range(repeats):
        engine.clear_prefix_cache()
        start = time.perf_counter()
        step = engine.generate([StepRequest(prefix)], SamplingParams(seed=r, **params)).steps[0][0]
        times.append(time.perf_counter() - start)
        tokens.append(step.num_tokens)
    drafts = [s.text for s in engine.generate([StepRequest(prefix, 8)], SamplingParams(seed=99, **params)).steps[0]
              if s.text.strip()]
    layers = layers_from_option(cfg.probe.features, engine.info.num_layers)
    score = median_seconds(lambda: engine.score(prefix, drafts, hidden=True, layers=layers), max(1, repeats // 2), 1)
    return {"model": cfg.models.target, "step_seconds": statistics.median(times),
            "step_tokens": statistics.median(tokens), "token_cap": cfg.sampling.max_step_tokens,
            "score_8_steps_hidden_seconds": score, "scored_steps": len(drafts)}


def bench_training(cfg, data: str | None, judge: bool) -> dict | None:
    from specprobe.data_gen.store import DataFolderError, open_dataset
    from specprobe.train import pair_verifiers, pipeline, probes_train

    try:
        ds = open_dataset(data or cfg.data_dir)
    except DataFolderError as err:
        return {"skipped": str(err).splitlines()[0]}
    split = pipeline.QuestionSplit.of_data(ds, cfg.probe)
    start = time.perf_counter()
    prepared = pipeline.prepare(ds, cfg, split)
    out = {"data": str(ds.folder), "samples": len(ds), "load_seconds": time.perf_counter() - start}
    if prepared.plans:
        start = time.perf_counter()
        result = probes_train.train_probes(prepared.plans, prepared.specs, prepared.sets, cfg.probe)
        out["probes_seconds"] = time.perf_counter() - start
        out["per_probe"] = {name: {"seconds": t.seconds, "epochs": t.history.epochs_run, "rows": t.n_train}
                            for name, t in result.probes.items()}
    if prepared.pairs:
        start = time.perf_counter()
        pair_verifiers.train_embedding(prepared.pairs["train"], prepared.pairs["val"], cfg.verifiers, "cpu")
        out["embedding_seconds"] = time.perf_counter() - start
        if judge:
            start = time.perf_counter()
            pair_verifiers.train_judge(prepared.pairs["train"], prepared.pairs["val"], cfg.verifiers, "cpu")
            out["judge_seconds"] = time.perf_counter() - start
    return out


def report(result: dict) -> str:
    p, t = result["probe_scoring"], result["target_step"]
    lines = [f"probe scoring ({p['source']}; input {p['input']}, {p['layers']} layers -> {p['input_dim']} dims):"]
    for key, v in p.items():
        if key.startswith("threads_"):
            lines.append(f"  p + q on 8 steps, {key.replace('_', ' ')}: {v['batch8_seconds'] * 1e3:.2f} ms "
                         f"({v['per_step_seconds'] * 1e3:.3f} ms per step)")
    lines.append(f"one target step ({t['model']}, batch 1, median {t['step_tokens']} tokens, cap {t['token_cap']}): "
                 f"{t['step_seconds'] * 1e3:.0f} ms")
    lines.append(f"teacher-forced scoring of {t['scored_steps']} steps with hidden states: "
                 f"{t['score_8_steps_hidden_seconds'] * 1e3:.0f} ms")
    best = min(v["per_step_seconds"] for k, v in p.items() if k.startswith("threads_"))
    lines.append(f"probe cost per step / target step time: {best / t['step_seconds']:.2e}")
    tr = result.get("training")
    if tr and "skipped" not in tr:
        lines.append(f"training on {tr['data']} ({tr['samples']} samples): load {tr['load_seconds']:.1f} s, "
                     f"probes {tr.get('probes_seconds', 0):.1f} s, embedding {tr.get('embedding_seconds', 0):.1f} s"
                     + (f", judge {tr['judge_seconds']:.1f} s" if "judge_seconds" in tr else ""))
        for name, v in tr.get("per_probe", {}).items():
            lines.append(f"  {name}: {v['seconds']:.1f} s, {v['epochs']} epochs, {v['rows']} rows")
    elif tr:
        lines.append(f"training: skipped ({tr['skipped']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--step-repeats", type=int, default=5)
    parser.add_argument("--data", help="data folder to time training on (default <output_dir>/data)")
    parser.add_argument("--judge", action="store_true", help="also time the judge LoRA training")
    parser.add_argument("--out", help="write the numbers as JSON here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    from specprobe.infer.engines.hf import HFStepEngine

    engine = HFStepEngine(cfg.models.target, device="cpu", dtype="float32")
    result = {"torch_threads": torch.get_num_threads(),
              "probe_scoring": bench_probes(cfg, engine.info, args.repeats),
              "target_step": bench_target_step(cfg, engine, args.step_repeats),
              "training": bench_training(cfg, args.data, args.judge)}
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
