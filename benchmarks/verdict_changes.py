"""Which verdicts of a probe-eval report change in another report of the same checkpoint: every paired comparison
("better" / "worse" / "no clear difference") side by side, with its difference interval in each, and how much wider
the other report's intervals are (made to see what drawing whole families instead of questions changes).

Usage: python benchmarks/verdict_changes.py A/metrics.json B/metrics.json [OUT.json]

Both reports must hold the same estimates (the same checkpoint, data and held-out questions); the script stops
when one differs, since then a changed verdict would not be the resampling's doing.
"""
import json
import statistics
import sys
from pathlib import Path


def entries(metrics: dict, key: str) -> dict[str, dict]:
    """Every dict under the report's parts that holds `key`, by its path."""
    found = {}

    def walk(node, path):
        if isinstance(node, dict):
            if key in node:
                found[path] = node
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
    walk(metrics["parts"], "")
    return found


def main(a_path: str, b_path: str, out: str | None = None) -> dict:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    ia, ib = entries(a, "estimate"), entries(b, "estimate")
    same = [p for p in ia if p in ib]
    moved = [p for p in same if ia[p]["estimate"] != ib[p]["estimate"]
             and not (ia[p]["estimate"] is not None and ib[p]["estimate"] is not None
                      and abs(ia[p]["estimate"] - ib[p]["estimate"]) <= 1e-9 * max(1.0, abs(ia[p]["estimate"])))]
    if moved:
        raise SystemExit(f"{len(moved)} estimates differ (first: {moved[0]}): not the same checkpoint and data")
    widths = [(ib[p]["high"] - ib[p]["low"]) / (ia[p]["high"] - ia[p]["low"]) for p in same
              if None not in (ia[p].get("low"), ia[p].get("high"), ib[p].get("low"), ib[p].get("high"))
              and ia[p]["high"] > ia[p]["low"]]
    va, vb = entries(a, "verdict"), entries(b, "verdict")
    rows = []
    for path in sorted(p for p in va if p in vb):
        diff = "brier_delta" if "brier_delta" in va[path] else next((k for k in va[path] if k.endswith("delta")), None)
        rows.append({"comparison": path, "a": va[path]["verdict"], "b": vb[path]["verdict"],
                     "a_interval": _interval(va[path].get(diff)), "b_interval": _interval(vb[path].get(diff)),
                     "estimate": (va[path].get(diff) or {}).get("estimate")})
    changed = [r for r in rows if r["a"] != r["b"]]
    withheld = sum(1 for p in same if ia[p].get("low") is not None and ib[p].get("low") is None)
    result = {"a": a_path, "b": b_path, "a_resample": a["settings"].get("resample", "question"),
              "b_resample": b["settings"].get("resample", "question"),
              "intervals_compared": len(widths), "intervals_withheld_in_b_only": withheld,
              "width_ratio_median": statistics.median(widths) if widths else None,
              "width_ratio_range": [min(widths), max(widths)] if widths else None,
              "verdicts": len(rows), "verdicts_changed": changed}
    print(f"{len(widths)} intervals in both: b's width / a's, median {result['width_ratio_median']:.2f} "
          f"(range {min(widths):.2f}–{max(widths):.2f}); {withheld} withheld in b only")
    print(f"{len(changed)} of {len(rows)} verdicts change ({result['a_resample']} -> {result['b_resample']}):")
    for r in changed:
        print(f"  {r['comparison']}: {r['a']} {r['a_interval']} -> {r['b']} {r['b_interval']}")
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _interval(entry: dict | None) -> list | None:
    return None if not entry or entry.get("low") is None else [entry["low"], entry["high"]]


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
