"""benchmarks/verdict_changes.py: the verdicts two reports of one checkpoint give differently, and how much wider
the second one's intervals are."""
from __future__ import annotations

import json

import pytest
from _scripts import benchmark_script

vc = benchmark_script("verdict_changes")


def _report(resample, low, high, verdict, estimate=0.01):
    delta = {"estimate": estimate, "low": low, "high": high}
    return {"settings": {"resample": resample},
            "parts": {"probes": {"versus": {"p": {"constant": {"brier_delta": delta, "verdict": verdict}}},
                                 "brier": {"estimate": 0.2, "low": 0.1, "high": 0.3}}}}


def test_a_verdict_that_changes_with_the_resampling(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report("question", 0.002, 0.018, "worse")))
    b.write_text(json.dumps(_report("family", -0.004, 0.024, "no clear difference")))
    got = vc.main(str(a), str(b), str(tmp_path / "out.json"))
    (row,) = got["verdicts_changed"]
    assert (row["comparison"], row["a"], row["b"]) == ("/probes/versus/p/constant", "worse", "no clear difference")
    assert row["a_interval"] == [0.002, 0.018] and row["b_interval"] == [-0.004, 0.024]
    assert (got["a_resample"], got["b_resample"], got["verdicts"]) == ("question", "family", 1)
    assert got["width_ratio_median"] == pytest.approx((0.028 / 0.016 + 1.0) / 2)  # the delta's and the Brier's
    # reports whose estimates differ are not one checkpoint's: no verdict is compared
    b.write_text(json.dumps(_report("family", -0.004, 0.024, "no clear difference", estimate=0.02)))
    with pytest.raises(SystemExit, match="1 estimates differ .*/probes/versus/p/constant/brier_delta"):
        vc.main(str(a), str(b))
