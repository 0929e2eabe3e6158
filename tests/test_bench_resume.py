"""bench_resume's rules on a log written by its own API: which folders a run without --resume may start over in."""
import pytest

from specprobe.infer.bench_resume import PROBLEMS_LOG, open_problem_log, refuse_unfinished, run_key
from specprobe.inputs.config import ConfigError


def _log(out, finished: int, problems: int = 3):
    key = run_key({"runtime": {"gamma": 3}}, ["target"], "bernoulli", None, True,
                  [(f"p{i}", f"question {i}") for i in range(problems)])
    log = open_problem_log(out, key, resume=False, log=lambda _: None)
    for i in range(finished):
        log.add(i, f"p{i}", 1.0, 1.0 + i, {"target": {}})


def test_a_stopped_runs_finished_problems_are_not_replaced_unasked(tmp_path):
    refuse_unfinished(tmp_path / "none")  # no folder, no log: a new run
    _log(tmp_path / "fresh", finished=0)
    refuse_unfinished(tmp_path / "fresh")  # nothing finished: nothing to lose
    _log(tmp_path / "done", finished=3)
    refuse_unfinished(tmp_path / "done")  # a finished run is measured anew
    _log(tmp_path / "stopped", finished=2)
    with pytest.raises(ConfigError, match=r"stopped after 2 of 3 problems.*--resume.*--overwrite"):
        refuse_unfinished(tmp_path / "stopped")
    (tmp_path / "stopped" / PROBLEMS_LOG).write_text("not json\n{}\n")  # damaged: it cannot be resumed either
    refuse_unfinished(tmp_path / "stopped")
