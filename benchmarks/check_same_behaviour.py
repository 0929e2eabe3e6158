"""Behaviour check for refactorings (issue 23): run the tiny data stage (the tests' tiny config: real SmolLM2, the
offline embedding judge) and seeded runtime generations (configs/tiny.yaml, Bernoulli verifier, four methods)
into OUT; then compare two such folders (from two checkouts) row for row and tensor for tensor.

    (cd old-checkout && python /path/to/check_same_behaviour.py run /tmp/old)
    python benchmarks/check_same_behaviour.py run /tmp/new
    python benchmarks/check_same_behaviour.py compare /tmp/old /tmp/new
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file


def run(out: Path) -> None:
    sys.path.insert(0, "tests")  # the tests' tiny data config, from the checkout being checked
    from specprobe.data_gen.judges import EmbeddingNumberJudge
    from specprobe.data_gen.pipeline import generate_dataset
    from specprobe.infer import bench
    from specprobe.infer.decoding import decode
    from specprobe.train.config import load_config

    from _data_fixtures import write_config

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    _, cfg = write_config(out, out / "run")
    # checkouts before issue 23 took the whole experiment config; later ones its sections
    job = cfg.data_job() if hasattr(cfg, "data_job") else cfg
    generate_dataset(job, judge=EmbeddingNumberJudge("offline:minilm", threshold=0.8, device="cpu"), progress=False)
    cfg2 = load_config("configs/tiny.yaml", ["bench.num_problems=2", "runtime.max_steps=4",
                                            "sampling.max_step_tokens=24", f"output_dir={out}/bench"])
    env = bench.prepare(cfg2.bench_setup() if hasattr(cfg2, "bench_setup") else cfg2, verifier="bernoulli")
    texts = {}
    for method in ["target", "lr_sync", "semanticspec", "lr_async"]:
        for prob in env.problems:
            r = decode(method, prob.question, env.target, env.draft, env.verifier("bernoulli"), env.opts)
            texts[f"{method}/{prob.id}"] = [[s.text, s.source, s.token_ids] for s in r.steps]
    (out / "runtime.json").write_text(json.dumps(texts, indent=1))


def compare(a: Path, b: Path) -> int:
    da, db = a / "run" / "data", b / "run" / "data"
    fa = sorted(p.relative_to(da) for p in da.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(db) for p in db.rglob("*") if p.is_file())
    diffs = [] if fa == fb else [f"file lists differ: {sorted(set(fa) ^ set(fb))}"]
    for rel in set(fa) & set(fb):
        if rel.suffix == ".parquet" and not pq.read_table(da / rel).equals(pq.read_table(db / rel)):
            diffs.append(str(rel))
        elif rel.suffix == ".safetensors":
            xa, xb = load_file(da / rel), load_file(db / rel)
            if xa.keys() != xb.keys() or not all(torch.equal(xa[k], xb[k]) for k in xa):
                diffs.append(str(rel))
    ra, rb = json.loads((a / "runtime.json").read_text()), json.loads((b / "runtime.json").read_text())
    print(f"data: {len(fa)} files, {len(diffs)} differ {diffs or ''}")
    print(f"runtime: {len(ra)} generations, {'identical' if ra == rb else 'DIFFERENT'}")
    return 0 if not diffs and ra == rb else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        run(Path(sys.argv[2]))
    else:
        raise SystemExit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
