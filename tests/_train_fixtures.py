"""A small synthetic data folder in the data stage's format (written with data_gen.store's own writers),
for training tests that must not wait for a language model.

Features carry a planted signal: the label is a function of a few dims of the last stored layer, so a
probe can learn it while a constant cannot. Pair texts are short sentences whose equivalence follows
the number they state, so a real sentence embedder separates them reasonably.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

from specprobe.data_gen.store import FORMAT, ShardData, fingerprint, write_manifest, write_shard
from specprobe.inputs.config import build, to_dict
from specprobe.train.config import ExperimentConfig, load_config

ENGINES = {
    "target": {"model_id": "toy/target-model", "revision": None, "num_layers": 3, "hidden_size": 8,
               "vocab_size": 100, "name": "toy/target-model"},
    "draft": {"model_id": "toy/draft-model", "revision": None, "num_layers": 2, "hidden_size": 6,
              "vocab_size": 100, "name": "toy/draft-model"},
}

CONFIG = {
    "name": "synthetic",
    "models": {"target": "toy/target-model", "draft": "toy/draft-model", "device": "cpu", "dtype": "float32"},
    "data": {"num_samples": 6, "layers": "all"},
    "probe": {"hidden_dim": 16, "epochs": 40, "patience": 40, "batch_size": 32, "val_fraction": 0.3,
              "dropout": 0.0, "lr": 3e-3},
    "verifiers": {"train": ["probes", "embedding"], "embedding_model": "offline:minilm", "target_precision": 0.8},
}

_SENTENCES = ["So the total is {n} apples.", "Therefore we get {n} apples in all.", "Adding them gives {n} apples.",
              "The result is {n} apples."]


def _signal(x_last: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(2.0 * x_last[:, 0] - 1.5 * x_last[:, 1])


def _label_to_features(y: np.ndarray, num_rows: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """Features whose last row encodes the logit of y in dims 0/1 (plus noise everywhere)."""
    x = torch.randn(len(y), num_rows, hidden, generator=gen)
    logit = torch.logit(torch.as_tensor(y, dtype=torch.float32).clamp(0.02, 0.98))
    x[:, -1, 0] = logit * 0.4 + 0.05 * torch.randn(len(y), generator=gen)
    x[:, -1, 1] = -logit * 0.4 + 0.05 * torch.randn(len(y), generator=gen)
    return x


def _samples(q: int, j: int, model: str, n: int, rng: np.random.Generator) -> list[dict]:
    sizes = rng.multinomial(n, rng.dirichlet(np.ones(3)))
    clusters = [c for c, s in enumerate(sizes) for _ in range(s)]
    rows = []
    for k, c in enumerate(clusters):
        size = int(sizes[c])
        lp = float(np.log(size / n) * 0.5 - 0.3 + rng.normal(0, 0.2))
        rows.append(dict(sample_id=f"q{q}@{j}/{model}/{k}", context_id=f"q{q}@{j}", question_id=f"q{q}",
                         domain="math", context_j=j, model=model, sample_index=k,
                         text=_SENTENCES[k % 4].format(n=10 * q + c), num_tokens=8, stop_reason="delimiter",
                         logprob=lp * 8, mean_logprob=lp, target_logprob=lp * 8 - 1.0, target_num_tokens=8,
                         cluster_id=c, cluster_size=size, semantic_prob=size / n, own_prob=(size - 1) / (n - 1),
                         num_samples=n, num_empty=0,
                         num_clusters=int((sizes > 0).sum()), semantic_entropy=0.5, target_cluster_id=c,
                         prob_under_target=(size - 1) / (n - 1)))
    return rows


def _pairs(q: int, j: int, samples: list[dict]) -> list[dict]:
    out = []
    for i, a in enumerate(samples):
        for b in samples[i + 1:]:
            if a["text"] != b["text"]:
                out.append(dict(context_id=f"q{q}@{j}", question_id=f"q{q}", a_text=a["text"], b_text=b["text"],
                                a_model=a["model"], b_model=b["model"], equivalent=a["cluster_id"] == b["cluster_id"],
                                source="cluster", judged=True))
    return out


def write_synthetic_data(output_dir: Path, questions: int = 10, contexts_per_q: int = 2, seed: int = 0,
                         engines: dict | None = None, edit=None) -> Path:
    """Write ``output_dir/data`` (complete, one shard per question) and return the folder.

    edit(shard): called on every ShardData before it is written (to plant bad input)."""
    engines = engines or ENGINES
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    folder = Path(output_dir) / "data"
    n = CONFIG["data"]["num_samples"]
    cfg_dict = to_dict(build(ExperimentConfig, {"models": CONFIG["models"], "data": CONFIG["data"]}))
    layers = {r: list(range(e["num_layers"] + 1)) for r, e in engines.items()}
    shards = []
    for q in range(questions):
        shard = ShardData(q)
        for j in range(contexts_per_q):
            target, draft = _samples(q, j, "target", n, rng), _samples(q, j, "draft", n, rng)
            base = len(shard.samples)
            for i, row in enumerate(target):
                row.update(own_feature_row=base + i, target_feature_row=base + i)
            d0 = sum(1 for s in shard.samples if s["model"] == "draft")
            for i, row in enumerate(draft):
                row.update(own_feature_row=d0 + i, target_feature_row=base + len(target) + i)
            shard.samples += target + draft
            shard.pairs += _pairs(q, j, target)
            shard.contexts.append(_context(q, j, n))
        rows = shard.samples
        all_y = np.array([r["prob_under_target"] for r in rows])  # target rows: own_prob
        draft_y = np.array([r["own_prob"] for r in rows if r["model"] == "draft"])
        t, d = engines["target"], engines["draft"]
        shard.features = {
            "target.mean": _label_to_features(all_y, t["num_layers"] + 1, t["hidden_size"], gen),
            "target.last": _label_to_features(all_y, t["num_layers"] + 1, t["hidden_size"], gen),
            "draft.mean": _label_to_features(draft_y, d["num_layers"] + 1, d["hidden_size"], gen),
            "draft.last": _label_to_features(draft_y, d["num_layers"] + 1, d["hidden_size"], gen),
        }
        if edit is not None:
            edit(shard)
        files = write_shard(folder, shard)
        shards.append({"index": q, "contexts": [c["context_id"] for c in shard.contexts], "skipped": [],
                       "rows": len(rows), "pairs": len(shard.pairs), "files": files,
                       "stats": {"samples": {"target": len(rows) // 2, "draft": len(rows) // 2}}})
    manifest = {"format": FORMAT, "status": "complete", "config": cfg_dict, "fingerprint": fingerprint(cfg_dict),
                "engines": engines, "layers": layers, "layers_option": "all", "store_last_token": True,
                "feature_dtype": "float16", "num_samples": n, "models": ["target", "draft"], "judge": "synthetic",
                "plan": {"num_shards": questions}, "part": None, "shards": shards}
    write_manifest(folder, manifest)
    return folder


def _context(q: int, j: int, n: int) -> dict:
    return dict(context_id=f"q{q}@{j}", question_id=f"q{q}", domain="math", j=j,
                question=f"Question {q}: how many apples?", steps=[f"step {i}" for i in range(j)], answer=str(q),
                context_text=f"Question {q}: how many apples?" + "".join(f"\n\nstep {i}" for i in range(j)),
                num_samples=n, target_seed=None, target_num_clusters=None, target_semantic_entropy=None,
                target_num_empty=None, draft_seed=None, draft_num_clusters=None, draft_semantic_entropy=None,
                draft_num_empty=None, draft_mass_under_target=None)


def synthetic_config(tmp: Path, output_dir: Path, **sections):
    """The synthetic config (models named like the synthetic data) with section updates, loaded."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in CONFIG.items()}
    for sec, values in sections.items():
        tree[sec] = {**tree.get(sec, {}), **values}
    tree["output_dir"] = str(output_dir)
    path = Path(tmp) / "synthetic.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return load_config(path)
