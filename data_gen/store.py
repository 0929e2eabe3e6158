"""On-disk layout of generated training data: shards, manifest, lock, merge, and the reader.

    <output_dir>/data/
        manifest.json                     what is complete (only shards listed here count)
        README.md                         data card (data_gen.datacard)
        judge-cache.jsonl                 equivalence decisions, reused on resume
        shards/samples-XXXXX.parquet      one row per sample (no features)
        shards/features-XXXXX.safetensors pooled hidden states, float16
        shards/contexts-XXXXX.parquet     one row per context
        shards/pairs-XXXXX.parquet        step pairs with equivalence labels
        part-i-of-n/                      the same layout, written by `--shard i/n`; `--merge` joins

Crash safety: a shard's four files are written under temporary names, flushed, and renamed into place;
only then is the shard added to the manifest (itself replaced atomically). A shard missing from the
manifest is redone from scratch, whatever files of it exist. One writer per folder (an flock on
``.lock``, released by the kernel when the process dies, even by kill -9).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from specprobe.data_gen.config import stored_poolings
from specprobe.data_gen.datacard import CONTEXT_COLUMNS, PAIR_COLUMNS, SAMPLE_COLUMNS, render_card, schema
from specprobe.inputs.config import config_diff
from specprobe.inputs.versions import utc_now
from specprobe.probes.io import open_tensors, stage_file, write_text

__all__ = ["FORMAT", "DataFolderError", "DataMismatchError", "ShardData", "FolderLock", "shard_path", "file_digests",
           "remember_verified", "shard_problem", "verify_shards", "clean_temporaries", "remove_unlisted_shards",
           "check_same_data", "check_same_judge", "check_same_assignment", "draft_assignment", "check_some_contexts",
           "plan_changes", "part_dir", "read_manifest", "write_manifest", "write_shard", "write_card", "to_float16",
           "fingerprint", "fingerprint_diff", "summarize_shards", "shards_digest", "stored_poolings", "ProbeDataset",
           "open_dataset", "merge_parts", "SAMPLES_SCHEMA", "CONTEXTS_SCHEMA", "PAIRS_SCHEMA", "FAMILIES"]

FORMAT = "specprobe-data/2"  # 2: own_prob, the leave-one-out label of a model's own steps
MANIFEST = "manifest.json"
CARD = "README.md"
SHARDS = "shards"
JUDGE_CACHE = "judge-cache.jsonl"
# manifest key: question id -> family, for questions that share one (a template); absent: each its own
FAMILIES = "question_families"
LOCK = ".lock"
# shard files whose SHA-256 was checked, by path: [bytes, mtime_ns, inode, device, sha256]; the same file unchanged
# since (same size, modification time, inode and device) is not hashed again, so reopening a large folder costs a
# stat per file, not a read; a copied or restored folder is hashed once where it lands
VERIFIED = ".verified.json"
SAMPLES_SCHEMA = schema(SAMPLE_COLUMNS)
CONTEXTS_SCHEMA = schema(CONTEXT_COLUMNS)
PAIRS_SCHEMA = schema(PAIR_COLUMNS)
_FP16_MAX = float(torch.finfo(torch.float16).max)


class DataFolderError(RuntimeError):
    """A data folder is missing, unreadable, incomplete or inconsistent."""


class DataMismatchError(DataFolderError):
    """A data folder was made with another config (models, source, sampling or data settings)."""


def shard_path(kind: str, index: int) -> str:
    """Path of one shard file relative to its data folder."""
    ext = "safetensors" if kind == "features" else "parquet"
    return f"{SHARDS}/{kind}-{index:05d}.{ext}"


def part_dir(data_dir: str | os.PathLike, part: int, parts: int) -> Path:
    return Path(data_dir) / f"part-{part}-of-{parts}"


# ----------------------------------------------------------------------------- manifest
def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The manifest of a data folder, or None when there is none yet."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataFolderError(f"{path} is not valid JSON ({err}); it is written atomically, so this file "
                              "was changed by hand or the disk is damaged") from None
    if manifest.get("format") != FORMAT:
        raise DataFolderError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def write_manifest(folder: str | os.PathLike, manifest: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest["updated"] = utc_now()
    manifest["counts"] = summarize_shards(manifest.get("shards", []))
    text = json.dumps(manifest, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    write_text(folder / MANIFEST, text)


def write_card(folder: str | os.PathLike, manifest: dict) -> None:
    write_text(Path(folder) / CARD, render_card(manifest))


def summarize_shards(shards: Iterable[dict]) -> dict:
    """Totals over complete shards (what the manifest's `counts` holds)."""
    counts: dict[str, Any] = {"shards": 0, "contexts": 0, "skipped_contexts": 0, "samples": {}, "rows": 0,
                              "pairs": 0, "sum_num_clusters": {}, "sum_semantic_prob": {}, "judge": {}, "capped": {}}
    for shard in shards:
        counts["shards"] += 1
        counts["contexts"] += len(shard["contexts"])
        counts["skipped_contexts"] += len(shard["skipped"])
        counts["rows"] += shard["rows"]
        counts["pairs"] += shard["pairs"]
        for key in ("samples", "sum_num_clusters", "sum_semantic_prob", "judge", "capped"):
            for name, value in shard["stats"].get(key, {}).items():
                counts[key][name] = counts[key].get(name, 0) + value
    return counts


# ----------------------------------------------------------------------------- fingerprint
# Settings that do not change what is generated: where it runs, how work is batched, how fast it decodes (the
# decode path, graphs, fused kernels, vLLM's memory and parallelism). Changing one and resuming continues the
# same data; like a move to another device, it may round the remaining draws differently, not change their law.
_NOT_IN_FINGERPRINT = {
    "models": {"device", "draft_device", "cache_dir", "max_batch_rows", "decode", "decode_graph",
               "draft_decode_graph", "capture_joins", "target_stream_priority", "fused_norm", "merged_linear"},
    "models.vllm": {"tensor_parallel_size", "gpu_memory_utilization", "kv_cache_gib", "enforce_eager", "block_size",
                    "enable_lora", "max_lora_rank", "chunked_prefill"},
    "data": {"nli_batch_size", "judge_pairs_per_call", "pilot_contexts", "max_capped_share", "skip_failing_contexts"}}
_FINGERPRINT_SECTIONS = ("models", "source", "sampling", "data")


def _generating(settings: dict, path: str) -> dict:
    """`settings` (the section at `path`) without the keys that do not change what is generated."""
    drop = _NOT_IN_FINGERPRINT.get(path, set())
    return {k: _generating(v, f"{path}.{k}") if isinstance(v, dict) else v
            for k, v in settings.items() if k not in drop}


def fingerprint(cfg_dict: dict) -> dict:
    """The parts of a config (as a dict) that decide the generated data."""
    return {sec: _generating(cfg_dict[sec], sec) for sec in _FINGERPRINT_SECTIONS}


def fingerprint_diff(old: dict, new: dict) -> list[str]:
    """`section.key: old -> new` for every setting that differs between two fingerprints, speed-only settings left
    out on both sides (a manifest written before one became speed-only still records it)."""
    def generating(fp: dict) -> dict:
        return {sec: _generating(v, sec) if isinstance(v, dict) else v for sec, v in fp.items()}
    return config_diff(generating(old), generating(new))


def check_same_data(folder: Path, manifest: dict, cfg_dict: dict) -> None:
    """DataMismatchError when `folder` was made with other models or data settings than `cfg_dict`."""
    old, new = manifest["fingerprint"], fingerprint(cfg_dict)
    diffs = fingerprint_diff(old, new)
    if not diffs:
        return
    models = [d for d in diffs if d.split(":")[0] in ("models.target", "models.draft")]
    what = "different models" if models else "different settings"
    raise DataMismatchError(
        f"the data folder {folder} was made with {what}:\n  " + "\n  ".join(models or diffs)
        + ("\n  (also: " + "; ".join(d for d in diffs if d not in models) + ")" if models and len(diffs) > len(models) else "")
        + f"\nUse another output_dir, or delete {folder} to generate it again.")


def draft_assignment(manifest: dict) -> str:
    """How the folder placed draft steps among the target's clusters (`cluster.DRAFT_ASSIGNMENT`); folders that
    do not record it used the first match."""
    return manifest.get("draft_assignment") or "first_match"


def check_same_assignment(folder, manifest: dict, expected: str, what: str = "this run") -> None:
    """DataMismatchError when `folder`'s draft labels follow another placement rule than `expected`: continuing
    or merging would mix two rules in one data set."""
    have = draft_assignment(manifest)
    if have != expected:
        raise DataMismatchError(
            f"{folder} placed draft steps among the target's clusters by the {have} rule, {what} by the {expected} "
            "rule (specprobe changed it: the reference scheme now takes the last match, as get_semantic_ids "
            "does); one data set cannot mix them. Use another output_dir, or delete the folder to generate it again")


def settings_diff(manifest: dict, cfg_dict: dict) -> list[str]:
    """`section.key: data's -> config's` for each data setting (source, sampling, data; not models) in which the
    config differs from the one the folder was made with. Keys the manifest lacks (settings added since it was
    made) do not count."""
    old = {sec: v for sec, v in (manifest.get("fingerprint") or {}).items() if sec != "models"}
    new = fingerprint(cfg_dict)
    return fingerprint_diff(old, {sec: {k: v for k, v in new.get(sec, {}).items() if k in keys}
                                  for sec, keys in old.items()})


def check_same_judge(folder: Path, manifest: dict, judge_name: str) -> None:
    """DataMismatchError when `folder`'s clusters were made by another judge than `judge_name` (a judge object
    passed in from code is not in the settings' fingerprint; its name says what it decides)."""
    old = manifest.get("judge")
    if old is not None and old != judge_name:
        raise DataMismatchError(f"the data folder {folder} was clustered by the judge {old!r}, not by {judge_name!r}: "
                                "its labels would mix two judges' clusters. Pass the same judge, use another "
                                f"output_dir, or delete {folder} to generate it again.")


def check_some_contexts(folder: Path, manifest: dict) -> None:
    """A finished data set whose every context was skipped has nothing to train on: an error, not "complete"."""
    if manifest["status"] != "complete" or any(s["contexts"] for s in manifest["shards"]):
        return
    skipped = [x for s in manifest["shards"] for x in s["skipped"]]
    first = f" First: {skipped[0]['context_id']}: {skipped[0]['reason']}." if skipped else ""
    raise DataFolderError(f"{folder}: all {len(skipped)} contexts were skipped, so the data set is empty.{first} "
                          "Fix the source records or the limits named there (see the warnings above)")


# ----------------------------------------------------------------------------- lock
class FolderLock:
    """Exclusive writer lock on a data folder (flock; released automatically when the process dies)."""

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / LOCK
        self._fd: int | None = None

    def __enter__(self) -> FolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, single writer assumed
            return self
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise DataFolderError(f"another process is writing {self.path.parent} (it holds {self.path}); "
                                  "wait for it or stop it first") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None


# ----------------------------------------------------------------------------- shards
@dataclass
class ShardData:
    """Everything one shard holds, before it is written."""

    index: int
    samples: list[dict] = field(default_factory=list)
    contexts: list[dict] = field(default_factory=list)
    pairs: list[dict] = field(default_factory=list)
    features: dict[str, torch.Tensor] = field(default_factory=dict)


def to_float16(t: torch.Tensor) -> torch.Tensor:
    """float16 copy, values beyond the float16 range clipped (instead of becoming inf)."""
    return t.float().clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).contiguous()


def _table(rows: list[dict], sch: pa.Schema, what: str) -> pa.Table:
    try:
        return pa.Table.from_pylist(rows, schema=sch)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as err:
        raise DataFolderError(f"{what} rows do not fit their schema: {err}") from None


def write_shard(folder: str | os.PathLike, shard: ShardData, metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Write a shard's four files atomically (temporary names, fsync, rename); returns their paths
    relative to `folder`. The caller adds the shard to the manifest afterwards."""
    folder = Path(folder)
    (folder / SHARDS).mkdir(parents=True, exist_ok=True)
    tables = {"samples": _table(shard.samples, SAMPLES_SCHEMA, "samples"),
              "contexts": _table(shard.contexts, CONTEXTS_SCHEMA, "contexts"),
              "pairs": _table(shard.pairs, PAIRS_SCHEMA, "pairs")}
    files = {kind: shard_path(kind, shard.index) for kind in ("samples", "contexts", "pairs", "features")}
    tmps = []
    try:
        for kind, table in tables.items():
            tmps.append((stage_file(folder / files[kind], lambda p, t=table: pq.write_table(t, p)),
                         folder / files[kind]))
        tensors = {k: to_float16(v) for k, v in shard.features.items()}
        tmps.append((stage_file(folder / files["features"],
                                lambda p: save_file(tensors, str(p), metadata=metadata or {})),
                     folder / files["features"]))
    except BaseException:
        for tmp, _ in tmps:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in tmps:
        os.replace(tmp, final)
    return files


def _stamp(stat: os.stat_result, sha256: str) -> list:
    # the inode and device too: a copy (cp -a, rsync -a) keeps mtimes and would carry the record along
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev, sha256]


def file_digests(folder: str | os.PathLike, files: dict[str, str], verified: dict | None = None) -> dict[str, dict]:
    """Size and SHA-256 of each of a shard's files (recorded in the manifest when the shard is committed).
    verified: a dict that gets each file unchanged while it was hashed, as `VERIFIED` records it (the writer's
    hashing then spares the readers theirs; see `remember_verified`)."""
    import hashlib

    out = {}
    for kind, rel in files.items():
        path = Path(folder) / rel
        before = path.stat()
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        out[kind] = {"bytes": before.st_size, "sha256": digest.hexdigest()}
        if verified is not None and _stamp(path.stat(), "") == _stamp(before, ""):
            verified[rel] = _stamp(before, out[kind]["sha256"])
    return out


def shard_problem(folder: str | os.PathLike, shard: dict, verified: dict | None = None) -> str | None:
    """Why a shard the manifest lists as complete cannot be used (a file missing, truncated or changed since
    it was committed), or None. Shards committed before digests were recorded are checked for presence only.
    verified: `VERIFIED`'s entries; a file found there unchanged is not hashed again, and one hashed is added."""
    folder = Path(folder)
    recorded = shard.get("digests")
    stamps = {}
    for kind, rel in shard["files"].items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        if recorded is None:
            continue
        stat = path.stat()
        if stat.st_size != recorded[kind]["bytes"]:
            return (f"{path} has {stat.st_size} bytes, {recorded[kind]['bytes']} when it was written (truncated or "
                    "replaced)")
        stamps[kind] = _stamp(stat, recorded[kind]["sha256"])
    if recorded is None:
        return None
    verified = {} if verified is None else verified
    to_hash = {kind: rel for kind, rel in shard["files"].items() if verified.get(rel) != stamps[kind]}
    now_digests = file_digests(folder, to_hash)
    bad = [kind for kind in to_hash if now_digests[kind]["sha256"] != recorded[kind]["sha256"]]
    if bad:
        return f"{folder / shard['files'][bad[0]]} changed since it was written (SHA-256 differs)"
    verified.update({rel: stamps[kind] for kind, rel in to_hash.items()})
    return None


def _read_verified(folder: Path) -> dict:
    try:
        verified = json.loads((folder / VERIFIED).read_text(encoding="utf-8"))
        return verified if isinstance(verified, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_verified(folder: Path, verified: dict) -> None:
    # Best effort, and without the folder's lock: the file is replaced whole (never half-written), an entry lost to
    # a concurrent reader's write only costs hashing that file again, and a read-only folder is hashed every time.
    try:
        write_text(folder / VERIFIED, json.dumps(verified))
    except OSError:
        pass


def remember_verified(folder: str | os.PathLike, stamps: dict) -> None:
    """Add files just hashed (`file_digests`'s `verified`) to the folder's `VERIFIED` record."""
    if stamps:
        _write_verified(Path(folder), {**_read_verified(Path(folder)), **stamps})


def verify_shards(folder: str | os.PathLike, manifest: dict) -> dict[int, str]:
    """{shard index: problem} for every complete shard that cannot be used. Files checked before and unchanged
    since (`VERIFIED`) are not hashed again."""
    verified = _read_verified(Path(folder))
    before = dict(verified)
    problems = {s["index"]: shard_problem(folder, s, verified) for s in manifest.get("shards", [])}
    if verified != before:
        _write_verified(Path(folder), verified)
    return {k: v for k, v in problems.items() if v is not None}


def clean_temporaries(folder: str | os.PathLike) -> int:
    """Remove temporary files a killed writer left in `folder/shards` (call while holding the lock)."""
    removed = 0
    shards = Path(folder) / SHARDS
    if shards.is_dir():
        for path in shards.glob(".*.tmp*"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def remove_unlisted_shards(folder: str | os.PathLike, manifest: dict) -> list[str]:
    """Remove shard files in `folder/shards` that no shard of `manifest` lists (a killed or restarted run's; nothing
    reads them, and a later plan would not redo an index it lacks). Call while holding the lock. Returns their names."""
    shards = Path(folder) / SHARDS
    listed = {(Path(folder) / rel).resolve() for s in manifest.get("shards", []) for rel in s["files"].values()}
    removed = []
    if shards.is_dir():
        for path in sorted(shards.glob("*.parquet")) + sorted(shards.glob("*.safetensors")):
            if path.resolve() not in listed:
                path.unlink(missing_ok=True)
                removed.append(path.name)
    return removed


# ----------------------------------------------------------------------------- reader
def _resolve_folder(folder: str | os.PathLike) -> Path:
    folder = Path(folder)
    if (folder / MANIFEST).exists():
        return folder
    if (folder / "data" / MANIFEST).exists():
        return folder / "data"
    raise DataFolderError(f"no {MANIFEST} in {folder} (nor in {folder / 'data'}); generate the data first "
                          "with `probe-train --config <file> --stage data`")


def shards_digest(manifest: dict) -> str:
    """One SHA-256 over a manifest's finished shards (index and each file's digest): what a checkpoint records to
    know later that a folder still holds the shard files it was trained on."""
    import hashlib

    listed = sorted((s["index"], sorted((s.get("digests") or {}).items())) for s in manifest.get("shards", []))
    return hashlib.sha256(json.dumps(listed, sort_keys=True).encode()).hexdigest()


class ProbeDataset:
    """A data folder: tables without features, and features read on demand, row-aligned with them.

    ``samples`` is one pyarrow Table over all complete shards (plus a ``shard`` column). Row masks and
    index arrays below always refer to rows of ``samples``.
    """

    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self._shards = sorted(manifest["shards"], key=lambda s: s["index"])
        self._tables: dict[str, pa.Table] = {}
        self._columns: dict[str, np.ndarray] = {}

    def __repr__(self) -> str:
        c = self.manifest.get("counts", {})
        return (f"ProbeDataset({self.folder}, {c.get('contexts')} contexts, samples {c.get('samples')}, "
                f"status {self.manifest.get('status')})")

    # -- tables
    def _read(self, kind: str, sch: pa.Schema) -> pa.Table:
        if kind not in self._tables:
            parts = []
            for shard in self._shards:
                path = self.folder / shard["files"][kind]
                if not path.exists():
                    raise DataFolderError(f"{path} is listed as complete in {self.folder / MANIFEST} but missing")
                table = pq.read_table(path, schema=sch)
                if kind == "samples":
                    if table.num_rows != shard["rows"]:
                        raise DataFolderError(f"{path} has {table.num_rows} rows, the manifest says {shard['rows']}")
                    table = table.append_column("shard", pa.array([shard["index"]] * table.num_rows, pa.int32()))
                parts.append(table)
            if not parts:
                empty = sch.append(pa.field("shard", pa.int32())) if kind == "samples" else sch
                self._tables[kind] = empty.empty_table()
            else:
                self._tables[kind] = pa.concat_tables(parts)
        return self._tables[kind]

    @property
    def samples(self) -> pa.Table:
        return self._read("samples", SAMPLES_SCHEMA)

    @property
    def contexts(self) -> pa.Table:
        return self._read("contexts", CONTEXTS_SCHEMA)

    @property
    def pairs(self) -> pa.Table:
        return self._read("pairs", PAIRS_SCHEMA)

    def symmetric_pairs(self) -> pa.Table:
        """The pairs in both orientations (a, b) and (b, a), same labels."""
        p = self.pairs
        swapped = p.select(["context_id", "question_id", "b_text", "a_text", "b_model", "a_model",
                            "equivalent", "source", "judged"]).rename_columns(p.column_names)
        return pa.concat_tables([p, swapped])

    def __len__(self) -> int:
        return self.samples.num_rows

    def column(self, name: str) -> np.ndarray:
        if name not in self._columns:
            self._columns[name] = self.samples.column(name).to_numpy(zero_copy_only=False)
        return self._columns[name]

    # -- row selection
    def _indices(self, rows: Any) -> np.ndarray:
        n = len(self)
        if rows is None:
            return np.arange(n)
        arr = np.asarray(rows)
        if arr.dtype == bool:
            if arr.shape != (n,):
                raise ValueError(f"a row mask needs {n} entries (one per sample row), got shape {arr.shape}")
            return np.flatnonzero(arr)
        if arr.size and (arr.min() < -n or arr.max() >= n):
            raise IndexError(f"row indices must be in [0, {n}), got {arr.min()}..{arr.max()}")
        return arr.astype(np.int64).reshape(-1) % max(n, 1)

    def rows(self, model: str | None = None, mask: Any = None) -> np.ndarray:
        """Indices of the sample rows of `model` (None = both) within `mask` (bool array or indices)."""
        idx = self._indices(mask)
        if model is not None:
            if model not in ("target", "draft"):
                raise ValueError(f"model must be 'target' or 'draft', got {model!r}")
            idx = idx[self.column("model")[idx] == model]
        return idx

    def question_mask(self, question_ids: Iterable[str]) -> np.ndarray:
        """Boolean mask of the sample rows whose question id is in `question_ids` (for splits)."""
        return np.isin(self.column("question_id"), np.asarray(list(question_ids), dtype=object))

    def question_ids(self) -> list[str]:
        return sorted(set(self.column("question_id").tolist()))

    @property
    def families_recorded(self) -> bool:
        """Whether the data stage recorded question families (folders made before it did have none)."""
        return FAMILIES in self.manifest

    def question_families(self) -> dict[str, str]:
        """Family of every question (splits keep a family on one side): its template where the source
        recorded one, else the question itself."""
        recorded = self.manifest.get(FAMILIES) or {}
        return {q: str(recorded.get(q, q)) for q in self.question_ids()}

    # -- features
    def layers(self, model: str) -> list[int]:
        return list(self.manifest["layers"][model])

    @property
    def poolings(self) -> tuple[str, ...]:
        """The token poolings whose features this folder stores."""
        return stored_poolings(self.manifest.get("store_last_token", True))

    def _feature_shape(self, view: str) -> tuple[int, int]:
        return len(self.layers(view)), int(self.manifest["engines"][view]["hidden_size"])

    def features(self, view: str = "target", pooling: str = "mean", rows: Any = None) -> torch.Tensor:
        """(len(rows), L_kept, H) float32 features of the selected sample rows.

        view "target": every row's target-view features (target samples, and draft samples
        teacher-forced through the target). view "draft": the draft's own features; every selected row
        must be a draft row. rows: None (all rows valid for the view), a bool mask or row indices.
        """
        if view not in ("target", "draft"):
            raise ValueError(f"view must be 'target' or 'draft', got {view!r}")
        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
        if pooling not in self.poolings:
            raise DataFolderError(f"{self.folder} holds no last-token features (data.store_last_token was false)")
        if rows is None and view == "draft":
            idx = self.rows("draft")
        else:
            idx = self._indices(rows)
        if view == "draft":
            wrong = idx[self.column("model")[idx] != "draft"]
            if wrong.size:
                raise ValueError(f"view 'draft' holds draft samples only, but row {int(wrong[0])} "
                                 f"({self.column('sample_id')[wrong[0]]}) is a target sample; "
                                 "use view='target' or ds.rows('draft', mask)")
        col = "target_feature_row" if view == "target" else "own_feature_row"
        return self._gather(f"{view}.{pooling}", self.column("shard")[idx], self.column(col)[idx],
                            self._feature_shape(view))

    def _gather(self, key: str, shards: np.ndarray, feature_rows: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
        out = torch.empty((len(shards), *shape), dtype=torch.float32)
        files = {s["index"]: self.folder / s["files"]["features"] for s in self._shards}
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            wanted = feature_rows[where]
            with open_tensors(files[int(shard)], "run the same `probe-train --stage data` command again: it redoes "
                                                 "broken shards") as f:
                if key not in f.keys():
                    raise DataFolderError(f"{files[int(shard)]} has no tensor {key!r} (has {sorted(f.keys())})")
                stored = tuple(f.get_slice(key).get_shape()[1:])
                if stored != tuple(shape):
                    raise DataFolderError(
                        f"{files[int(shard)]}: tensor {key!r} holds rows of shape {stored}, but {self.folder / MANIFEST} "
                        f"says {tuple(shape)} (layers x hidden size of the {key.split('.')[0]} model); the manifest "
                        "or the shard was changed. Generate the data again (another output_dir)")
                lo, hi = int(wanted.min()), int(wanted.max()) + 1
                block = f.get_slice(key)[lo:hi]
            out[torch.from_numpy(where)] = block[torch.from_numpy(wanted - lo)].float()
        return out

    def target_view_features(self, mask: Any = None, pooling: str = "mean") -> torch.Tensor:
        """Target-view features of the rows in `mask` (all rows when None), aligned with
        ``samples.filter(mask)``: the target probe's inputs for target AND draft steps."""
        return self.features("target", pooling, mask)

    def own_features(self, model: str, mask: Any = None, pooling: str = "mean") -> torch.Tensor:
        """Features of `model`'s own samples within `mask`, from `model`, aligned with
        ``samples.take(ds.rows(model, mask))``."""
        return self.features(model, pooling, self.rows(model, mask))


def open_dataset(folder: str | os.PathLike, allow_incomplete: bool = False) -> ProbeDataset:
    """Open a data folder (``<output_dir>/data`` or ``<output_dir>``). Only shards the manifest lists
    as complete are read; an unfinished folder is an error unless `allow_incomplete`."""
    path = _resolve_folder(folder)
    manifest = read_manifest(path)
    if manifest.get("status") != "complete" and not allow_incomplete:
        done, total = len(manifest.get("shards", [])), manifest.get("plan", {}).get("num_shards")
        raise DataFolderError(f"{path} is incomplete ({done} of {total} shards); finish it by running the same "
                              "`probe-train --stage data` command again, or pass allow_incomplete=True")
    bad = verify_shards(path, manifest)
    if bad:
        k, why = next(iter(sorted(bad.items())))
        raise DataFolderError(f"{path}: {len(bad)} shard(s) listed as complete cannot be used, first shard {k}: {why}. "
                              "Run the same `probe-train --stage data` command again: it redoes broken shards")
    return ProbeDataset(path, manifest)


# ----------------------------------------------------------------------------- merge
def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)  # shard files are never rewritten in place, so sharing the inode is safe
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _merge_caches(sources: Sequence[Path], target: Path) -> int:
    """Append the decision lines of `sources` missing from `target`; returns how many were added."""
    seen: set[str] = set()
    if target.exists():
        seen.update(line for line in target.read_text(encoding="utf-8", errors="replace").splitlines() if line)
    new = []
    for src in sources:
        if not src.exists():
            continue
        for line in src.read_text(encoding="utf-8", errors="replace").splitlines():
            if line and line not in seen and line.endswith("}"):
                seen.add(line)
                new.append(line)
    if new:
        raw = target.read_bytes() if target.exists() else b""
        with open(target, "a", encoding="utf-8") as f:
            if raw and not raw.endswith(b"\n"):
                f.write("\n")  # a killed writer's partial line: close it (CachedJudge skips it on load)
            f.write("\n".join(new) + "\n")
    return len(new)


def _read_parts(data_dir: Path) -> list[tuple[Path, dict]]:
    parts = []
    for path in sorted(data_dir.glob("part-*-of-*")):
        manifest = read_manifest(path) if path.is_dir() else None
        if manifest is not None:
            parts.append((path, manifest))
    if not parts:
        raise DataFolderError(f"nothing to merge: no part-i-of-n folder with a manifest in {data_dir}; "
                              "run `probe-train --stage data --shard i/n` first")
    counts = {m["part"]["count"] for _, m in parts}
    if len(counts) > 1:
        raise DataFolderError(f"{data_dir} holds parts of different splits (n = {sorted(counts)}); "
                              "remove the stale part folders")
    base = parts[0][1]
    for path, m in parts[1:]:
        diffs = fingerprint_diff(base["fingerprint"], m["fingerprint"])
        if diffs or m["engines"] != base["engines"]:
            raise DataMismatchError(f"{path} was made with other settings than {parts[0][0]}: "
                                    + ("; ".join(diffs) or "different models (engines)"))
        if base.get("judge") is not None:
            check_same_judge(path, m, base["judge"])
        check_same_assignment(path, m, draft_assignment(base), f"{parts[0][0]}")
        _check_same_source(path, m, parts[0][0], base)
    return parts


def plan_changes(old: dict, new: dict) -> list[str]:
    """The fields of two context plans that differ (a field only one records, from an older version, is not
    compared)."""
    return [k for k in sorted(set(old) & set(new)) if old[k] != new[k]]


def _check_same_source(path: Path, manifest: dict, base_path: Path, base: dict) -> None:
    """The same settings read from a source that changed (a local file edited between parts) plan other
    contexts: shard k would mean different contexts in the two folders."""
    if "plan" in manifest and "plan" in base and plan_changes(manifest["plan"], base["plan"]):
        raise DataMismatchError(f"{path} and {base_path} were made from different source data (their plan "
                                "differs): regenerate the stale part folders from the same source")
    if FAMILIES in manifest and FAMILIES in base and manifest[FAMILIES] != base[FAMILIES]:  # (older: none)
        raise DataMismatchError(f"{path} and {base_path} were made from different source data (their {FAMILIES} "
                                "differ): regenerate the stale part folders from the same source")


def merge_parts(data_dir: str | os.PathLike) -> dict:
    """Join the complete shards of every ``part-i-of-n`` folder into `data_dir` (linked, not copied, where the
    file system allows; the parts' record of files hashed goes with them). Returns the main manifest. Shards no
    part finished stay missing: the manifest remains "in_progress" and running the data stage without --shard
    completes it."""
    data_dir = Path(data_dir)
    parts = _read_parts(data_dir)
    base = parts[0][1]
    with FolderLock(data_dir):
        main = read_manifest(data_dir)
        if main is None:
            main = {k: v for k, v in base.items() if k not in ("shards", "part", "counts", FAMILIES)}
            main.update(part=None, shards=[], created=utc_now(), status="in_progress", completed=None)
        elif fingerprint_diff(main["fingerprint"], base["fingerprint"]) or main["engines"] != base["engines"]:
            raise DataMismatchError(f"{data_dir} holds data made with other settings than its part folders: "
                                    + "; ".join(fingerprint_diff(main["fingerprint"], base["fingerprint"])))
        else:
            _check_same_source(data_dir, main, parts[0][0], base)
            if base.get("judge") is not None:
                check_same_judge(data_dir, main, base["judge"])
            check_same_assignment(data_dir, main, draft_assignment(base), f"{parts[0][0]}")
        # every part records the families of the whole plan; a part finished before they were recorded has none
        recorded = [m[FAMILIES] for _, m in parts if FAMILIES in m]
        if recorded and FAMILIES not in main:
            main[FAMILIES] = recorded[0]
        have = {s["index"] for s in main["shards"]}
        carried = {}
        for path, manifest in parts:
            checked = _read_verified(path)
            for shard in manifest["shards"]:
                if shard["index"] in have:
                    continue
                (data_dir / SHARDS).mkdir(parents=True, exist_ok=True)
                for rel in shard["files"].values():
                    _link_or_copy(path / rel, data_dir / rel)
                    if rel in checked:  # a hard link keeps its stamp (inode, mtime), so it is not hashed again;
                        carried[rel] = checked[rel]  # a copy's differs and it is hashed once where it landed
                main["shards"].append(shard)
                have.add(shard["index"])
        remember_verified(data_dir, carried)
        main["shards"].sort(key=lambda s: s["index"])
        _merge_caches([p / JUDGE_CACHE for p, _ in parts], data_dir / JUDGE_CACHE)
        if len(main["shards"]) == main["plan"]["num_shards"]:
            main["status"], main["completed"] = "complete", utc_now()
        write_manifest(data_dir, main)
        write_card(data_dir, main)
    check_some_contexts(data_dir, main)  # (after writing: the joined folder is kept, and says why it is empty)
    return main
