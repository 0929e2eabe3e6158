"""A synthetic data folder in the real on-disk format (data_gen.store) for the probe-eval tests.

No language model runs: cluster labels are drawn at random and the pooled "hidden states" carry the
label along a fixed direction, more strongly in deeper layers (so probes learn something and the
layer sweep has a trend). Step texts come from small sentence pools, one pool per meaning, so the
embedding verifier has real signal. The checkpoint is then trained on it by the real probe-train
training stage (`train.pipeline.train_all`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

from specprobe.data_gen.store import FORMAT, ShardData, fingerprint, write_manifest, write_shard
from specprobe.inputs.config import to_dict
from specprobe.train.config import load_config

NUM_LAYERS, HIDDEN = 4, 16
MEANINGS = [
    ["So we add 3 and 4 to get 7.", "Adding 3 and 4 gives 7.", "3 plus 4 equals 7."],
    ["Next we multiply 7 by 2, which is 14.", "Multiplying 7 by 2 gives 14.", "7 times 2 is 14."],
    ["Let me check the question again.", "I should reread the problem.", "Let's look at the problem again."],
    ["The answer is 21.", "So the final answer is 21.", "Therefore the result is 21."],
    ["Subtract 5 from 20 to get 15.", "20 minus 5 is 15.", "Taking 5 away from 20 leaves 15."],
]


def config_tree(output_dir: Path, **sections) -> dict:
    tree = {
        "name": "eval-synthetic", "output_dir": str(output_dir),
        "models": {"target": "synthetic/target-4l", "draft": "synthetic/draft-4l", "device": "cpu"},
        # (not the default reasoning-gym source: a reasoning-gym folder without families is split with a caveat)
        "source": {"kind": "jsonl", "name": "synthetic/questions"},
        "data": {"num_samples": 6, "judge": "embedding", "layers": "all"},
        "probe": {"hidden_dim": 16, "epochs": 40, "patience": 8, "batch_size": 32, "val_fraction": 0.3,
                  "dropout": 0.0},
        "verifiers": {"train": ["probes", "embedding"], "embedding_model": "offline:minilm",
                      "target_precision": 0.8},
        "eval": {"n_boot": 50, "umap": False, "sweep_epochs": 6, "verifiers": ["embedding"]},
    }
    for sec, values in sections.items():
        tree[sec] = {**tree.get(sec, {}), **values} if isinstance(values, dict) else values
    return tree


def write_config(folder: Path, output_dir: Path, **sections):
    path = Path(folder) / "eval-synthetic.yaml"
    path.write_text(yaml.safe_dump(config_tree(output_dir, **sections), sort_keys=False))
    return path, load_config(path)


def _clusters(rng, n: int) -> np.ndarray:
    k = int(rng.integers(1, 4))
    weights = rng.dirichlet(np.ones(k) * 0.7)
    return rng.choice(k, size=n, p=weights)


def _features(rng, labels: np.ndarray, direction: np.ndarray) -> torch.Tensor:
    depth = np.linspace(0.2, 1.0, NUM_LAYERS + 1)[None, :, None]
    x = rng.normal(size=(len(labels), NUM_LAYERS + 1, HIDDEN)) + 4.0 * depth * (labels[:, None, None] - 0.5) * direction
    return torch.tensor(x, dtype=torch.float32)


def _context_rows(rng, qid: str, j: int, n: int, meanings: list[int]):
    """Sample rows of both models for one context (labels, texts, cluster ids)."""
    ctx_id = f"{qid}@{j}"
    out = {}
    for model in ("target", "draft"):
        ids = _clusters(rng, n)
        sizes = np.bincount(ids, minlength=ids.max() + 1)
        out[model] = (ids, sizes)
    t_ids, t_sizes = out["target"]
    rows = []
    for model in ("target", "draft"):
        ids, sizes = out[model]
        for k, c in enumerate(ids):
            text = MEANINGS[meanings[c]][int(rng.integers(0, 3))]
            target_cluster = int(c) if model == "target" or c < len(t_sizes) else -1
            put = (t_sizes[target_cluster] / n) if target_cluster >= 0 else 0.0
            if model == "target":
                put = (sizes[c] - 1) / (n - 1)  # a target row's label under the target is its own_prob
            lp = float(np.log(sizes[c] / n) * 3 + rng.normal(scale=0.5))
            p = sizes[c] / n
            probs = sizes[sizes > 0] / n
            rows.append({"sample_id": f"{ctx_id}/{model}/{k}", "context_id": ctx_id, "question_id": qid,
                         "domain": "math", "context_j": j, "model": model, "sample_index": k, "text": text,
                         "num_tokens": 8, "stop_reason": "delimiter", "logprob": lp * 8, "mean_logprob": lp,
                         "target_logprob": lp * 8 - 1.0, "target_num_tokens": 8, "cluster_id": int(c),
                         "cluster_size": int(sizes[c]), "semantic_prob": float(p),
                         "own_prob": float((sizes[c] - 1) / (n - 1)), "num_samples": n, "num_empty": 0,
                         "num_clusters": int((sizes > 0).sum()), "semantic_entropy": float(-(probs * np.log(probs)).sum()),
                         "target_cluster_id": target_cluster, "prob_under_target": float(put)})
    return rows


def _pairs(rows: list[dict], meanings: list[int]) -> list[dict]:
    """Cluster pairs within each model and draft-vs-target pairs, labelled by meaning."""
    first = {}
    for r in rows:
        first.setdefault((r["model"], r["cluster_id"]), r)
    pairs = []
    for r in rows:
        for (model, cid), rep in first.items():
            if rep is r:
                continue
            same_model = model == r["model"]
            if not same_model and not (r["model"] == "draft" and model == "target"):
                continue
            source = "cluster" if same_model else "draft_vs_target"
            equivalent = (cid == r["cluster_id"]) if same_model else (cid == r["target_cluster_id"])
            pairs.append({"context_id": r["context_id"], "question_id": r["question_id"], "a_text": rep["text"],
                          "b_text": r["text"], "a_model": model, "b_model": r["model"], "equivalent": bool(equivalent),
                          "source": source, "judged": True})
    return pairs


def make_data(cfg, n_questions: int = 12, contexts: int = 2, seed: int = 0, engines: dict | None = None) -> Path:
    """Write a complete synthetic data folder to cfg.data_dir (one shard per question)."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=HIDDEN)
    direction /= np.linalg.norm(direction)
    folder = Path(cfg.data_dir)
    cfg_dict = to_dict(cfg)
    engines = engines or {role: {"model_id": getattr(cfg.models, role), "revision": None, "num_layers": NUM_LAYERS,
                                 "hidden_size": HIDDEN, "vocab_size": 100, "name": getattr(cfg.models, role)}
                          for role in ("target", "draft")}
    manifest = {"format": FORMAT, "status": "complete", "created": "2026-01-01T00:00:00+00:00", "completed": None,
                "config": cfg_dict, "fingerprint": fingerprint(cfg_dict), "engines": engines,
                "layers": {r: list(range(NUM_LAYERS + 1)) for r in ("target", "draft")}, "layers_option": "all",
                "store_last_token": True, "feature_dtype": "float16", "num_samples": cfg.data.num_samples,
                "models": ["target", "draft"], "judge": "embedding", "versions": {},
                "plan": {"num_contexts": n_questions * contexts, "num_shards": n_questions}, "part": None, "shards": []}
    for q in range(n_questions):
        manifest["shards"].append(_shard(folder, q, contexts, cfg.data.num_samples, rng, direction))
    write_manifest(folder, manifest)
    return folder


def _shard(folder: Path, index: int, contexts: int, n: int, rng, direction: np.ndarray) -> dict:
    qid = f"q{index:03d}"
    shard = ShardData(index)
    for j in range(contexts):
        meanings = list(rng.permutation(len(MEANINGS))[:3])
        rows = _context_rows(rng, qid, j, n, meanings)
        shard.samples.extend(rows)
        shard.pairs.extend(_pairs(rows, meanings))
        shard.contexts.append({"context_id": f"{qid}@{j}", "question_id": qid, "domain": "math", "j": j,
                               "question": f"Question {qid}?", "steps": [], "answer": "21",
                               "context_text": f"Question {qid}? (step {j})", "num_samples": n})
    draft_rows = 0
    for i, r in enumerate(shard.samples):
        r["target_feature_row"] = i
        if r["model"] == "draft":
            r["own_feature_row"] = draft_rows
            draft_rows += 1
        else:
            r["own_feature_row"] = i
    target_labels = np.array([r["own_prob"] if r["model"] == "target" else r["prob_under_target"]
                              for r in shard.samples])
    draft_labels = np.array([r["own_prob"] for r in shard.samples if r["model"] == "draft"])
    tm, dm = _features(rng, target_labels, direction), _features(rng, draft_labels, -direction)
    shard.features = {"target.mean": tm, "target.last": tm + 0.1, "draft.mean": dm, "draft.last": dm + 0.1}
    files = write_shard(folder, shard)
    models = [r["model"] for r in shard.samples]
    return {"index": index, "contexts": [c["context_id"] for c in shard.contexts], "skipped": [],
            "rows": len(shard.samples), "pairs": len(shard.pairs), "files": files,
            "stats": {"samples": {m: models.count(m) for m in ("target", "draft")}}}


def make_checkpoint(tmp: Path, **sections):
    """Synthetic data + a checkpoint trained on it by train.pipeline.train_all: returns (config, checkpoint dir)."""
    from specprobe.train.pipeline import train_all

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, cfg = write_config(tmp, tmp / "run", **sections)
        make_data(cfg)
        train_all(cfg, print_fn=lambda _: None)
    finally:
        torch.set_num_threads(before)
    return cfg, Path(cfg.checkpoint_dir)
