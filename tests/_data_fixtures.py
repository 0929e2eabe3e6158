"""Helpers for the data-pipeline tests: a very small real config, an engine wrapper that empties
chosen samples, and comparison of two data folders."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

from specprobe.data_gen.store import open_dataset
from specprobe.infer.engines import EngineStats, Generation, PromptTooLongError, Step
from specprobe.train.config import load_config

# 3 reasoning-gym problems x 1 context, N = 4 per model, short steps, 4 layers; one context per
# shard so that a run has 3 shards to kill and resume between.
TINY = {
    "name": "tiny-test",
    "models": {"target": "offline:smollm2-135m-instruct", "draft": "offline:smollm2-135m-instruct",
               "device": "cpu", "dtype": "float32"},
    "source": {"kind": "reasoning_gym", "task": "gsm_symbolic", "size": 3, "seed": 0},
    "sampling": {"temperature": 0.6, "top_p": 0.95, "max_step_tokens": 14, "draft_temperature": 1.0, "seed": 0},
    "data": {"contexts_per_trace": 1, "num_samples": 4, "judge": "embedding", "embedding_model": "offline:minilm",
             "layers": "range:27-30", "contexts_per_shard": 1},
}
LAYERS = [27, 28, 29, 30]
HIDDEN = 576


def write_config(folder: Path, output_dir: Path, **sections) -> tuple[Path, object]:
    """The tiny config with section updates (e.g. data={"num_samples": 3}), as a YAML file and loaded."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    for sec, values in sections.items():
        tree[sec] = {**tree.get(sec, {}), **values}
    tree["output_dir"] = str(output_dir)
    path = Path(folder) / "tiny-test.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path, load_config(path)


class BlankingEngine:
    """A real engine whose samples are blanked for prompts holding a marker: "EMPTY-ALL" gives N empty
    steps (the model is not called), "EMPTY-HALF" blanks the first half of the real samples; scoring after a
    prompt holding "SCORE-TOO-LONG" fails as a step re-encoded past the context window would."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, params):
        out = []
        stats = EngineStats()
        for req in requests:
            eos = next(iter(self.engine.eos_ids))
            question, n = req.prefix.question, req.n
            if "EMPTY-ALL" in question:
                out.append([Step("", [eos], "eos", -0.5) for _ in range(n)])
                continue
            got = self.engine.generate([req], params)
            stats += got.stats
            steps = got.steps[0]
            if "EMPTY-HALF" in question:
                steps = [Step("  ", [eos], "eos", -0.5) if k < n // 2 else s for k, s in enumerate(steps)]
            out.append(steps)
        return Generation(out, stats)

    def score(self, prefix, steps, **kw):
        if "SCORE-TOO-LONG" in prefix.question:
            raise PromptTooLongError(f"prompt of {prefix.question[:20]!r}... plus its longest step exceeds the window")
        return self.engine.score(prefix, steps, **kw)


def dataset_arrays(folder) -> dict:
    """Everything of a complete data folder that a resumed or merged run must reproduce."""
    ds = open_dataset(folder)
    samples = ds.samples.drop_columns(["shard"]).to_pylist()
    return {
        "samples": samples,
        "contexts": ds.contexts.to_pylist(),
        "pairs": ds.pairs.to_pylist(),
        "target.mean": ds.target_view_features(),
        "target.last": ds.target_view_features(pooling="last"),
        "draft.mean": ds.own_features("draft"),
        # model_calls depends on what the judge cache already held (a resumed run finds decisions of the
        # killed one), everything else must match
        "counts": {k: ({n: c for n, c in v.items() if n != "model_calls"} if k == "judge" else v)
                   for k, v in ds.manifest["counts"].items()},
    }


def assert_same_data(got: dict, want: dict) -> None:
    assert [r["sample_id"] for r in got["samples"]] == [r["sample_id"] for r in want["samples"]]
    float_cols = {"logprob", "mean_logprob", "target_logprob"}
    for a, b in zip(got["samples"], want["samples"]):
        assert {k: v for k, v in a.items() if k not in float_cols} == {k: v for k, v in b.items() if k not in float_cols}
        for k in float_cols:
            assert abs(a[k] - b[k]) < 1e-3, (a["sample_id"], k, a[k], b[k])
    assert got["contexts"] == want["contexts"]
    assert got["pairs"] == want["pairs"]
    for key in ("target.mean", "target.last", "draft.mean"):
        assert got[key].shape == want[key].shape
        torch.testing.assert_close(got[key], want[key], rtol=2e-3, atol=2e-3)
    assert got["counts"] == want["counts"]


def recount(values) -> dict:
    keys, counts = np.unique(np.asarray(values), return_counts=True)
    return dict(zip(keys.tolist(), counts.tolist()))
