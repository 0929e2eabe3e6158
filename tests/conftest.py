"""Shared fixtures. Tests never reach a hub: HF_HUB_OFFLINE is set before anything imports transformers."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402

SMOL = "offline:smollm2-135m-instruct"


@pytest.fixture(scope="session", autouse=True)
def in_the_repository():
    """Tests name the shipped configs by repository paths (configs/tiny.yaml): run them from the repository root
    wherever pytest was started."""
    from pathlib import Path

    before = os.getcwd()
    os.chdir(Path(__file__).resolve().parents[1])
    yield
    os.chdir(before)


@pytest.fixture(scope="session")
def smol_engine():
    """The real offline SmolLM2-135M-Instruct behind the step engine (loaded once per session)."""
    from specprobe.infer.engines.hf import HFStepEngine

    return HFStepEngine(SMOL, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def gsm_question():
    return ("A baker makes 12 muffins per tray and bakes 4 trays. She sells 30 muffins. "
            "How many muffins are left? Think step by step.")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on 2 cores shared with other jobs, torch's spin-waiting
    threads made small-model tests ~20x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- vLLM in CI
# `.ci/run` installs the CPU build of vLLM and sets SPECPROBE_REQUIRE_VLLM=1: there a skipped (or absent)
# `vllm`-marked test fails the run instead of passing quietly.
_vllm_outcomes: dict[str, int] = {"passed": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    if "vllm" in report.keywords and (report.when == "call" or report.skipped):
        if report.skipped:
            _vllm_outcomes["skipped"] += 1
        elif report.passed:
            _vllm_outcomes["passed"] += 1


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("SPECPROBE_REQUIRE_VLLM") != "1" or session.config.option.collectonly:
        return
    if _vllm_outcomes["skipped"] or not _vllm_outcomes["passed"]:
        session.config.get_terminal_writer().line(
            f"SPECPROBE_REQUIRE_VLLM=1: {_vllm_outcomes['skipped']} vllm test(s) skipped, "
            f"{_vllm_outcomes['passed']} passed; vLLM must be installed and its tests must run here", red=True)
        session.exitstatus = 1
