"""The data folder layer (no models): atomic shards, manifest as the judge of completeness, the reader's
row alignment, the writer lock, fingerprints and merging parts."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from specprobe.data_gen.datacard import CONTEXT_COLUMNS, PAIR_COLUMNS, SAMPLE_COLUMNS, TENSORS, render_card
from specprobe.data_gen.store import (
    FAMILIES,
    FORMAT,
    JUDGE_CACHE,
    DataFolderError,
    DataMismatchError,
    FolderLock,
    ShardData,
    check_same_data,
    clean_temporaries,
    file_digests,
    fingerprint,
    fingerprint_diff,
    merge_parts,
    open_dataset,
    part_dir,
    read_manifest,
    shard_path,
    write_card,
    write_manifest,
    write_shard,
)
from specprobe.inputs.config import to_dict
from specprobe.train.config import ExperimentConfig

L, H = 3, 5


def _sample(shard: int, ctx: int, model: str, k: int, row: int, draft_row: int) -> dict:
    cid = f"q{shard}-{ctx}@0"
    return dict(sample_id=f"{cid}/{model}/{k}", context_id=cid, question_id=f"q{shard}-{ctx}", domain="math",
                context_j=0, model=model, sample_index=k, text=f"step {k} of {model}", num_tokens=3,
                stop_reason="delimiter", logprob=-1.5, mean_logprob=-0.5, target_logprob=-1.4, target_num_tokens=3,
                cluster_id=0, cluster_size=2, semantic_prob=1.0, num_samples=2, num_empty=0, num_clusters=1,
                semantic_entropy=0.0, target_cluster_id=0 if model == "target" else -1,
                prob_under_target=1.0 if model == "target" else 0.0,
                own_feature_row=row if model == "target" else draft_row, target_feature_row=row)


def _context(shard: int, ctx: int) -> dict:
    return dict(context_id=f"q{shard}-{ctx}@0", question_id=f"q{shard}-{ctx}", domain="math", j=0, question="Q?",
                steps=[], answer="1", context_text="Q?\n\n", num_samples=2, target_seed=1, target_num_clusters=1,
                target_semantic_entropy=0.0, target_num_empty=0, draft_seed=2, draft_num_clusters=1,
                draft_semantic_entropy=0.0, draft_num_empty=0, draft_mass_under_target=0.0)


def make_shard(index: int, contexts: int = 2) -> ShardData:
    """Per context 2 target + 2 draft rows. Feature values encode (view, shard, row) for alignment checks:
    target view row r = 1000*shard + r, draft row r = -(1000*shard + r) - 1."""
    shard = ShardData(index)
    draft_rows = 0
    for c in range(contexts):
        for model in ("target", "draft"):
            for k in range(2):
                row = len(shard.samples)
                shard.samples.append(_sample(index, c, model, k, row, draft_rows))
                draft_rows += model == "draft"
        shard.contexts.append(_context(index, c))
        shard.pairs.append(dict(context_id=f"q{index}-{c}@0", question_id=f"q{index}-{c}", a_text="a", b_text="b",
                                a_model="target", b_model="draft", equivalent=False, source="draft_vs_target",
                                judged=True))
    rows = len(shard.samples)
    target = (1000 * index + torch.arange(rows, dtype=torch.float32))[:, None, None].expand(rows, L, H)
    draft = -(1000 * index + torch.arange(draft_rows, dtype=torch.float32) + 1)[:, None, None].expand(draft_rows, L, H)
    shard.features = {"target.mean": target, "target.last": target + 0.5, "draft.mean": draft, "draft.last": draft - 0.5}
    return shard


def _entry(shard: ShardData, files: dict) -> dict:
    targets = sum(s["model"] == "target" for s in shard.samples)
    return {"index": shard.index, "contexts": [c["context_id"] for c in shard.contexts], "skipped": [],
            "rows": len(shard.samples), "target_feature_rows": len(shard.samples),
            "draft_feature_rows": len(shard.samples) - targets, "pairs": len(shard.pairs), "files": files,
            "stats": {"samples": {"target": targets, "draft": len(shard.samples) - targets},
                      "sum_semantic_prob": {}, "sum_num_clusters": {}, "judge": {"cluster_pairs": 1}}}


def _manifest(num_shards: int, cfg_dict: dict | None = None, part=None) -> dict:
    cfg_dict = cfg_dict or to_dict(ExperimentConfig())
    info = {"model_id": "m", "revision": None, "num_layers": 4, "hidden_size": H, "vocab_size": 10, "name": "m"}
    return {"format": FORMAT, "status": "in_progress", "created": "t", "completed": None,
            "config": cfg_dict, "fingerprint": fingerprint(cfg_dict), "engines": {"target": info, "draft": info},
            "layers": {"target": [2, 3, 4], "draft": [2, 3, 4]}, "store_last_token": True, "num_samples": 2,
            "models": ["target", "draft"], "judge": "j", "plan": {"num_shards": num_shards, "context_ids_sha256": "a source"}, "part": part,
            "shards": []}


def build_folder(folder, indices, num_shards, complete=True, part=None):
    manifest = _manifest(num_shards, part=part)
    for i in indices:
        shard = make_shard(i)
        files = write_shard(folder, shard)
        manifest["shards"].append({**_entry(shard, files), "digests": file_digests(folder, files)})
    if complete:
        manifest["status"] = "complete"
    write_manifest(folder, manifest)
    return manifest


def test_reader_aligns_features_with_rows(tmp_path):
    build_folder(tmp_path, [0, 1], 2)
    ds = open_dataset(tmp_path)
    assert len(ds) == 16 and ds.samples.column("shard").to_pylist() == [0] * 8 + [1] * 8
    tv = ds.target_view_features()
    assert tv.shape == (16, L, H) and tv.dtype == torch.float32
    expected = torch.tensor([1000 * s + r for s in (0, 1) for r in range(8)], dtype=torch.float32)
    assert torch.equal(tv[:, 0, 0], expected) and torch.equal(tv[:, -1, -1], expected)
    assert torch.equal(ds.target_view_features(pooling="last")[:, 1, 2], expected + 0.5)
    # a mask picks rows in table order; the features follow
    mask = np.zeros(16, dtype=bool)
    mask[[3, 9, 14]] = True
    assert ds.target_view_features(mask)[:, 0, 0].tolist() == [3, 1001, 1006]
    assert ds.features("target", rows=[14, 3])[:, 0, 0].tolist() == [1006, 3]
    # own draft features line up with ds.rows("draft")
    draft = ds.own_features("draft")
    rows = ds.rows("draft")
    assert draft.shape == (8, L, H) and (ds.column("model")[rows] == "draft").all()
    assert draft[:, 0, 0].tolist() == [-(1000 * s + r + 1) for s in (0, 1) for r in range(4)]
    sub = ds.own_features("draft", mask=ds.question_mask(["q1-1"]))
    assert sub[:, 0, 0].tolist() == [-1003, -1004]
    assert torch.equal(ds.own_features("target")[:, 0, 0], expected[ds.rows("target")])
    with pytest.raises(ValueError, match="is a target sample"):
        ds.features("draft", rows=[0])
    with pytest.raises(ValueError, match="needs 16 entries"):
        ds.features("target", rows=np.ones(3, dtype=bool))


def test_features_are_float16_on_disk_and_clipped(tmp_path):
    shard = make_shard(0, contexts=1)
    shard.features["target.mean"] = shard.features["target.mean"].clone()
    shard.features["target.mean"][0, 0, 0] = 1e6
    files = write_shard(tmp_path, shard)
    with safe_open(str(tmp_path / files["features"]), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
        big = f.get_tensor("target.mean")[0, 0, 0]
    assert torch.isfinite(big) and float(big) == 65504.0


def test_only_shards_in_the_manifest_count(tmp_path):
    manifest = build_folder(tmp_path, [0], 3, complete=False)
    write_shard(tmp_path, make_shard(1))  # a shard written but not yet recorded (killed before the manifest)
    (tmp_path / shard_path("samples", 2)).write_bytes(b"half a parquet")  # garbage under a final name
    (tmp_path / "shards" / ".samples-00002.parquet.tmp123").write_bytes(b"tmp")
    with pytest.raises(DataFolderError, match=r"incomplete \(1 of 3 shards\)"):
        open_dataset(tmp_path)
    ds = open_dataset(tmp_path, allow_incomplete=True)
    assert set(ds.samples.column("shard").to_pylist()) == {0}
    assert ds.contexts.num_rows == 2 and ds.pairs.num_rows == 2
    assert clean_temporaries(tmp_path) == 1 and not list((tmp_path / "shards").glob(".*"))
    # a listed file that disappeared, or a row count that disagrees, is an error, never silently less data
    manifest["shards"][0]["rows"] = 7
    write_manifest(tmp_path, manifest)
    with pytest.raises(DataFolderError, match="has 8 rows, the manifest says 7"):
        _ = open_dataset(tmp_path, allow_incomplete=True).samples
    (tmp_path / shard_path("pairs", 0)).unlink()
    with pytest.raises(DataFolderError, match="shard 0: .*pairs-00000.parquet is missing.*redoes broken shards"):
        _ = open_dataset(tmp_path, allow_incomplete=True).pairs


def test_a_truncated_or_changed_shard_is_named_never_read(tmp_path):
    build_folder(tmp_path, [0, 1], 2)
    assert open_dataset(tmp_path).samples.num_rows == 16
    path = tmp_path / shard_path("features", 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataFolderError, match=r"shard 1: .*features-00001.safetensors has \d+ bytes, \d+ when it was"):
        open_dataset(tmp_path)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF  # same size, one byte of a float16 feature changed
    path.write_bytes(bytes(flipped))
    with pytest.raises(DataFolderError, match="features-00001.safetensors changed since it was written"):
        open_dataset(tmp_path)
    path.write_bytes(data)
    assert open_dataset(tmp_path).samples.num_rows == 16


def test_reopening_hashes_only_files_changed_since_they_were_checked(tmp_path, monkeypatch):
    import os

    from specprobe.data_gen import store

    build_folder(tmp_path, [0, 1], 2)
    hashed, real = [], store.file_digests
    monkeypatch.setattr(store, "file_digests", lambda folder, files: hashed.extend(files.values()) or real(folder, files))
    open_dataset(tmp_path)
    first = len(hashed)
    assert first == sum(len(s["files"]) for s in json.loads((tmp_path / store.MANIFEST).read_text())["shards"])
    open_dataset(tmp_path)
    assert len(hashed) == first  # unchanged since: a stat each, no read
    path = tmp_path / shard_path("features", 1)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched: hashed again, still good
    open_dataset(tmp_path)
    assert hashed[first:] == [shard_path("features", 1)]
    (tmp_path / store.VERIFIED).write_text("not json")  # a broken record of checks: everything is hashed again
    open_dataset(tmp_path)
    assert len(hashed) == 2 * first + 1
    import shutil

    copy = shutil.copytree(tmp_path, tmp_path.parent / (tmp_path.name + "-copy"))  # mtimes kept, record copied
    open_dataset(copy)
    assert len(hashed) == 3 * first + 1  # other files (inodes): hashed once where they landed


def test_files_hashed_by_the_writer_are_not_hashed_by_readers(tmp_path, monkeypatch):
    from specprobe.data_gen import store

    manifest = _manifest(2)
    seen: dict = {}
    for i in (0, 1):
        files = write_shard(tmp_path, make_shard(i))
        manifest["shards"].append({**_entry(make_shard(i), files), "digests": file_digests(tmp_path, files, seen)})
    manifest["status"] = "complete"
    write_manifest(tmp_path, manifest)
    assert len(seen) == sum(len(s["files"]) for s in manifest["shards"])
    store.remember_verified(tmp_path, seen)
    hashed, real = [], store.file_digests
    monkeypatch.setattr(store, "file_digests", lambda folder, files: hashed.extend(files.values()) or real(folder, files))
    assert open_dataset(tmp_path).samples.num_rows == 16 and hashed == []
    path = tmp_path / manifest["shards"][0]["files"]["samples"]
    path.write_bytes(path.read_bytes()[:-1] + b"x")  # same size, new mtime: hashed, and found changed
    with pytest.raises(DataFolderError, match="SHA-256 differs"):
        open_dataset(tmp_path)


def test_failed_shard_write_leaves_nothing(tmp_path):
    shard = make_shard(0)
    shard.features["draft.mean"] = "not a tensor"
    with pytest.raises((AttributeError, TypeError)):
        write_shard(tmp_path, shard)
    assert not list((tmp_path / "shards").iterdir())
    bad = make_shard(0)
    bad.samples[0]["num_tokens"] = "three"
    with pytest.raises(DataFolderError, match="samples rows do not fit their schema"):
        write_shard(tmp_path, bad)


def test_manifest_is_required_and_checked(tmp_path):
    with pytest.raises(DataFolderError, match="no manifest.json"):
        open_dataset(tmp_path)
    (tmp_path / "manifest.json").write_text("{broken")
    with pytest.raises(DataFolderError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(DataFolderError, match="format 'other/9'"):
        read_manifest(tmp_path)


def test_writer_lock_is_exclusive(tmp_path):
    with FolderLock(tmp_path):
        with pytest.raises(DataFolderError, match="another process is writing"):
            with FolderLock(tmp_path):
                pass
    with FolderLock(tmp_path):  # released on exit
        pass


def test_fingerprint_ignores_where_it_runs_but_not_what_it_makes(tmp_path):
    base = to_dict(ExperimentConfig())
    moved = to_dict(ExperimentConfig())
    moved["models"]["device"], moved["models"]["max_batch_rows"], moved["output_dir"] = "cuda", 4, "elsewhere"
    moved["models"]["draft_device"] = "cuda:1"
    moved["data"]["judge_pairs_per_call"] = 7
    moved["models"]["decode_graph"], moved["models"]["fused_norm"] = "none", False  # how fast, not what
    moved["models"]["vllm"]["gpu_memory_utilization"], moved["models"]["vllm"]["tensor_parallel_size"] = 0.9, 4
    assert fingerprint_diff(fingerprint(base), fingerprint(moved)) == []
    other = to_dict(ExperimentConfig())
    other["models"]["target"], other["data"]["num_samples"] = "org/big-model", 8
    diffs = fingerprint_diff(fingerprint(base), fingerprint(other))
    assert diffs == ["data.num_samples: 20 -> 8", "models.target: 'offline:smollm2-135m-instruct' -> 'org/big-model'"]
    manifest = {"fingerprint": fingerprint(base)}
    check_same_data(tmp_path, manifest, moved)
    # a manifest written while such settings were still in the fingerprint resumes too
    recorded = copy.deepcopy(base["models"])
    check_same_data(tmp_path, {"fingerprint": {**fingerprint(base), "models": recorded}}, moved)
    other_len = copy.deepcopy(base)
    other_len["models"]["vllm"]["max_model_len"] = 1024  # truncates prompts: changes what is made
    assert fingerprint_diff(fingerprint(base), fingerprint(other_len)) == ["models.vllm.max_model_len: 4096 -> 1024"]
    with pytest.raises(DataMismatchError, match=r"(?s)different models:\n  models.target: .*\(also: data.num_samples"):
        check_same_data(tmp_path, manifest, other)
    other["models"]["target"] = base["models"]["target"]
    with pytest.raises(DataMismatchError, match="different settings:\n  data.num_samples: 20 -> 8"):
        check_same_data(tmp_path, manifest, other)
    other["data"]["num_samples"], other["models"]["draft_engine"] = 20, "vllm"  # an engine, not another model
    with pytest.raises(DataMismatchError, match="different settings:\n  models.draft_engine: None -> 'vllm'"):
        check_same_data(tmp_path, manifest, other)


def test_merge_parts_joins_shards_and_judge_caches(tmp_path):
    single = tmp_path / "single"
    build_folder(single, [0, 1, 2], 3)
    data = tmp_path / "data"
    for i, shards in ((0, [0, 2]), (1, [1])):
        folder = part_dir(data, i, 2)
        build_folder(folder, shards, 3, part={"index": i, "count": 2, "shards": shards})
        (folder / JUDGE_CACHE).write_text(f'{{"key": "k{i}", "equivalent": true}}\n'
                                          '{"key": "shared", "equivalent": false}\n')
    merged = merge_parts(data)
    assert merged["status"] == "complete" and [s["index"] for s in merged["shards"]] == [0, 1, 2]
    assert merged["part"] is None
    a, b = open_dataset(data), open_dataset(single)
    assert a.samples.equals(b.samples)
    assert torch.equal(a.target_view_features(), b.target_view_features())
    assert torch.equal(a.own_features("draft", pooling="last"), b.own_features("draft", pooling="last"))
    lines = (data / JUDGE_CACHE).read_text().splitlines()
    assert sorted(lines) == sorted(['{"key": "k0", "equivalent": true}', '{"key": "shared", "equivalent": false}',
                                    '{"key": "k1", "equivalent": true}'])
    assert merge_parts(data)["shards"] == merged["shards"]  # merging again changes nothing
    assert "`target_feature_row`" in (data / "README.md").read_text()


def test_merged_files_keep_the_checks_their_parts_made(tmp_path, monkeypatch):
    """A part's files already hashed (its `VERIFIED` record) are not hashed again in the merged folder when they
    are hard links there; copies (another file system) are hashed once where they landed."""
    import os

    from specprobe.data_gen import store

    hashed, real = [], store.file_digests
    monkeypatch.setattr(store, "file_digests", lambda folder, files: hashed.extend(files.values()) or real(folder, files))
    for linked, data in ((True, tmp_path / "linked"), (False, tmp_path / "copied")):
        for i, shards in ((0, [0, 2]), (1, [1])):
            folder = part_dir(data, i, 2)
            build_folder(folder, shards, 3, part={"index": i, "count": 2, "shards": shards})
            open_dataset(folder)  # hashes the part's files and records them
        if not linked:
            monkeypatch.setattr(os, "link", lambda src, dst: (_ for _ in ()).throw(OSError("cross-device link")))
        hashed.clear()
        merge_parts(data)
        open_dataset(data)
        n_files = sum(len(s["files"]) for s in read_manifest(data)["shards"])
        assert len(hashed) == (0 if linked else n_files)
        open_dataset(data)
        assert len(hashed) == (0 if linked else n_files)  # recorded where they landed
    # an entry that no longer describes the merged file (touched after the merge) is checked again
    path = tmp_path / "linked" / shard_path("features", 1)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    hashed.clear()
    open_dataset(tmp_path / "linked")
    assert hashed == [shard_path("features", 1)]


def test_merge_takes_the_families_from_a_part_that_recorded_them(tmp_path):
    """A part finished before the data stage recorded families has none; the other's cover the whole plan."""
    build_folder(part_dir(tmp_path, 0, 2), [0], 2, part={"index": 0, "count": 2, "shards": [0]})
    later = part_dir(tmp_path, 1, 2)
    manifest = build_folder(later, [1], 2, part={"index": 1, "count": 2, "shards": [1]})
    manifest[FAMILIES] = {"q0": "template-3", "q1": "template-3"}
    write_manifest(later, manifest)
    merged = merge_parts(tmp_path)
    assert merged["status"] == "complete" and merged[FAMILIES] == {"q0": "template-3", "q1": "template-3"}
    assert open_dataset(tmp_path).families_recorded


def test_merge_refuses_parts_made_differently(tmp_path):
    with pytest.raises(DataFolderError, match="nothing to merge"):
        merge_parts(tmp_path)
    build_folder(part_dir(tmp_path, 0, 2), [0], 2, part={"index": 0, "count": 2, "shards": [0]})
    other = part_dir(tmp_path, 1, 2)
    manifest = build_folder(other, [1], 2, part={"index": 1, "count": 2, "shards": [1]})
    manifest["fingerprint"]["data"]["num_samples"] = 99
    write_manifest(other, manifest)
    with pytest.raises(DataMismatchError, match="data.num_samples: 20 -> 99"):
        merge_parts(tmp_path)
    assert not (tmp_path / "manifest.json").exists()
    # the same settings on a source file edited between the parts: shard k means other contexts
    manifest["fingerprint"]["data"]["num_samples"] = 20
    manifest["plan"] = {**manifest["plan"], "context_ids_sha256": "another source"}
    write_manifest(other, manifest)
    with pytest.raises(DataMismatchError, match="different source data"):
        merge_parts(tmp_path)
    assert not (tmp_path / "manifest.json").exists()


def test_datasets_opens_the_folder_through_the_cards_configs(tmp_path):
    import datasets
    import yaml

    folder = tmp_path / "data"
    manifest = build_folder(folder, [0, 1], 3, complete=False)
    (folder / "shards" / "samples-00002.parquet").write_bytes(b"an unfinished write, not in the manifest")
    write_card(folder, manifest)
    header = yaml.safe_load((folder / "README.md").read_text().split("---")[1])
    assert [c["config_name"] for c in header["configs"]] == ["samples", "contexts", "pairs"]
    samples = datasets.load_dataset(str(folder), split="train", cache_dir=str(tmp_path / "hf"))
    assert samples.num_rows == 16 and samples["sample_id"] == open_dataset(folder, allow_incomplete=True).samples.column("sample_id").to_pylist()
    pairs = datasets.load_dataset(str(folder), "pairs", split="train", cache_dir=str(tmp_path / "hf"))
    assert pairs.column_names == [name for name, *_ in PAIR_COLUMNS]


def test_card_documents_every_column_and_tensor():
    card = render_card(_manifest(1))
    for name, *_ in SAMPLE_COLUMNS + CONTEXT_COLUMNS + PAIR_COLUMNS:
        assert f"| `{name}` |" in card
    for name, _ in TENSORS:
        assert f"`{name}`" in card


def test_a_damaged_feature_file_of_an_old_shard_is_named(tmp_path):
    """Shards committed before digests existed are checked for presence only; a damaged features file is
    still named when read (a raw SafetensorError named no file)."""
    from specprobe.probes.io import FileFormatError

    manifest = build_folder(tmp_path, [0], 1)
    del manifest["shards"][0]["digests"]
    write_manifest(tmp_path, manifest)
    path = tmp_path / shard_path("features", 0)
    path.write_bytes(b"\x00" * 8 + path.read_bytes()[8:])  # a header length of 0: not safetensors
    ds = open_dataset(tmp_path)
    with pytest.raises(FileFormatError, match=r"features-00000\.safetensors cannot be read as safetensors.*redoes"):
        ds.features("target", "mean")


def test_a_manifest_whose_hidden_size_was_edited_is_named_not_a_shape_error(tmp_path):
    manifest = build_folder(tmp_path, [0], 1)
    manifest["engines"]["target"]["hidden_size"] = H + 1
    write_manifest(tmp_path, manifest)
    with pytest.raises(DataFolderError, match=rf"'target.mean' holds rows of shape \(3, {H}\), but .* says \(3, {H + 1}\)"):
        open_dataset(tmp_path).features("target", "mean")
