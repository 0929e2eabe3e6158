"""Small static buffers for fast-path tests: the column block and margin of `static_kv` made small, so that a short
test compacts and grows its buffers; returns the log of reallocations (True: the columns were compacted or grown,
False: only the slots)."""
from __future__ import annotations

from specprobe.infer.engines import static_kv


def small_static_buffers(monkeypatch, block: int) -> list[bool]:
    log: list[bool] = []
    real = static_kv.StaticKV.copy_to
    monkeypatch.setattr(static_kv, "_COLUMN_BLOCK", block)
    monkeypatch.setattr(static_kv, "_COLUMN_MARGIN", 0)
    monkeypatch.setattr(static_kv.StaticKV, "copy_to",
                        lambda self, new, keep=None: log.append(keep is not None) or real(self, new, keep))
    return log
