"""Final-answer grading: thousands separators, and MATH / AIME-style equivalence through math-verify."""
from __future__ import annotations

import threading

import pytest

from specprobe.infer import answers
from specprobe.infer.answers import answers_match, grade, math_equivalent, strip_thousands_separators


@pytest.fixture(autouse=True)
def no_wall_clock(monkeypatch):
    """math-verify's timeout would turn a slow parse on a loaded machine into "not equivalent"."""
    monkeypatch.setattr(answers, "MATH_VERIFY_TIMEOUT_S", None)


@pytest.mark.parametrize("raw, clean", [("1,234", "1234"), ("-$12,345.5", "-$12345.5"), ("1,234,567", "1234567"),
                                        ("(1,2)", "(1,2)"), ("1,2,3", "1,2,3"), ("12,34", "12,34"), ("72", "72")])
def test_thousands_separators(raw, clean):
    assert strip_thousands_separators(raw) == clean


@pytest.mark.parametrize("pred, gold", [
    ("0.5", r"\frac{1}{2}"), (r"\dfrac{1}{2}", "0.5"), (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"),
    (r"\{2, 1\}", r"\{1,2\}"), (r"x = \frac{3}{4}", "0.75"), (r"2\pi", r"\pi \cdot 2"), ("1,234", "1234")])
def test_equivalent_math_answers_match(pred, gold):
    assert answers_match(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("0.6", r"\frac{1}{2}"), (r"\sqrt{3}/2", r"\frac{\sqrt{2}}{2}"), ("(2,1)", "(1,2)"), ("Sirap", "Paris"),
    (r"\frac{1}{3}", "0.33")])
def test_different_answers_do_not_match(pred, gold):
    assert not answers_match(pred, gold)


def test_sqrt_forms_need_math_verify():
    """The plain numeric / string rule cannot see this equivalence; math-verify does."""
    assert math_equivalent(r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2")
    assert grade(r"Hence the answer is $\boxed{\frac{\sqrt{2}}{2}}$.", r"\sqrt{2}/2") == (r"\frac{\sqrt{2}}{2}", True)


def test_grading_works_off_the_main_thread():
    """math-verify's own timeout needs the main thread; the runtime may grade elsewhere."""
    got = []
    worker = threading.Thread(target=lambda: got.append(answers_match(r"\frac{2}{4}", r"\sqrt{1/4}")))
    worker.start()
    worker.join()
    assert got == [True]
