"""Final-answer extraction and comparison for math benchmarks (pass@1).

Extraction order: the last \\boxed{...} (or \\fbox{...}), then a GSM8K-style "#### n" line, then
"the answer is X", then the last number in the text; a number's thousands separators are removed
("1,234" -> "1234"; trace sources clean their reference answers the same way). Comparison: numerically
when both sides parse as numbers (commas, $, %, units of the form "12 apples" and fractions a/b, \\frac{a}{b} are handled), else
as normalised strings (LaTeX spacing, \\left/\\right, \\text{}, dfrac/tfrac, trailing period removed).
"""
from __future__ import annotations

import math
import re

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_GROUPED = re.compile(r"(-?\$?)(\d{1,3}(?:,\d{3})+)(\.\d+)?")


def strip_thousands_separators(answer: str) -> str:
    """'1,234' -> '1234', '-$12,345.5' -> '-$12345.5'; anything that is not one grouped number is kept as is
    (so '(1,2)' or '1,2,3' stay)."""
    match = _GROUPED.fullmatch(answer.strip())
    if match is None:
        return answer
    sign, digits, frac = match.groups()
    return f"{sign}{digits.replace(',', '')}{frac or ''}"


def extract_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} / \\fbox{...}, braces balanced; None when absent or unclosed."""
    best = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[match.end():i - 1]
    return best.strip() if best is not None else None


GSM8K_MARKER = "####"


def split_gsm8k(text: str) -> tuple[str, str] | None:
    """(rationale, final answer) of a GSM8K-style text "... #### <answer>" (split at the last marker, the answer
    stripped), or None without a marker. Gold answers, trace parsing and answer extraction all read it here."""
    body, marker, final = text.rpartition(GSM8K_MARKER)
    return (body, final.strip()) if marker else None


def extract_answer(text: str) -> str | None:
    """The final answer a model wrote (thousands separators removed), or None."""
    answer = _find_answer(text)
    return None if answer is None else strip_thousands_separators(answer)


def _find_answer(text: str) -> str | None:
    if not text:
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    gsm = split_gsm8k(text)
    if gsm is not None and gsm[1]:
        return gsm[1].splitlines()[0].strip()
    said = re.findall(r"answer\s+is\s*:?\s*\$?([^\n$]+)", text, flags=re.IGNORECASE)
    if said:
        return said[-1].strip().rstrip(".")
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\(?:mathrm|mathbf|textbf)\{([^}]*)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "").replace("\\ ", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("^{\\circ}", "")
    return s.rstrip(".").strip()


def to_number(s: str) -> float | None:
    """A float for '1,234', '$5', '50%', '12 apples', '3/4', '\\frac{3}{4}', '-2.5'; else None."""
    s = _strip_latex(s)
    frac = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?)(-?[\d.]+)\s*/\s*(-?[\d.]+)", s)
    if frac:
        try:
            value = float(frac.group(2)) / float(frac.group(3))
            return -value if frac.group(1) else value
        except (ValueError, ZeroDivisionError):
            return None
    s = s.replace("$", "").replace("%", "").strip()
    match = re.fullmatch(rf"({_NUMBER})(?:\s*[a-zA-Z][a-zA-Z ]*)?", s)
    if not match:
        return None
    try:
        return float(match.group(1).replace(",", ""))
    except ValueError:
        return None


def normalize_answer(s: str) -> str:
    return re.sub(r"\s+", "", _strip_latex(s)).lower()


def answers_match(pred: str | None, gold: str | None) -> bool:
    """True when the extracted prediction equals the reference answer: equal as numbers or normalised
    strings, else mathematically equivalent by math-verify (MATH / AIME style: "\\frac{1}{2}" = "0.5",
    "\\sqrt{2}/2" = "\\frac{\\sqrt{2}}{2}", sets, intervals). Answers with no digit and no LaTeX command
    are compared as strings only (math-verify would read "Paris" as the product P*a*r*i*s)."""
    if pred is None or gold is None:
        return False
    a, b = to_number(pred), to_number(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    return _looks_mathematical(pred) and _looks_mathematical(gold) and math_equivalent(pred, gold)


def _looks_mathematical(answer: str) -> bool:
    return bool(re.search(r"\d|\\[a-zA-Z]", answer))


# math-verify's own guard (SIGALRM) against a pathological expression stalling a long benchmark; it answers "not
# equivalent" when it fires. Tests set None: their verdicts must not depend on a machine's load.
MATH_VERIFY_TIMEOUT_S: int | None = 5


def math_equivalent(pred: str, gold: str) -> bool:
    """math-verify's verdict on two final answers, each read as one LaTeX math expression."""
    import logging
    import threading

    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere the short
    # inputs here (one final answer each) are parsed without one.
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # it warns on every call made without a timeout
    try:
        parsed_gold = parse(f"${gold.strip().strip('$')}$", parsing_timeout=timeout)
        parsed_pred = parse(f"${pred.strip().strip('$')}$", parsing_timeout=timeout)
        return bool(parsed_gold and parsed_pred and verify(parsed_gold, parsed_pred, timeout_seconds=timeout))
    finally:
        logging.disable(previous)


def grade(output_text: str, gold: str | None) -> tuple[str | None, bool]:
    """(extracted answer, correct)."""
    pred = extract_answer(output_text)
    return pred, answers_match(pred, gold)
