"""Text normalisation and step splitting for reasoning traces.

Two split modes:

* ``"delimiter"``: the normalised text is split on ``delimiter`` (default a blank line, ``"\\n\\n"``).
  Normalisation guarantees that no piece is blank, so
  ``join_steps(split_steps(x, delimiter=d), delimiter=d) == normalise_text(x, delimiter=d)``.
* ``"sentence"``: the text is split at sentence ends (``.``, ``!`` or ``?``, optionally followed by
  closing quotes/brackets, then whitespace), at paragraph breaks (blank lines) and, when the delimiter
  is a visible marker (not only whitespace), at the delimiter. Decimals (``3.5``), common
  abbreviations (``e.g.``, ``Dr.``) and list markers at a line start (``1.``) do not end a sentence.
  Sentence steps are stripped; the whitespace between two sentences is *not* kept. Instead the
  sentence-mode normal form puts ``delimiter`` between sentences:
  ``normalise_text(x, mode="sentence", delimiter=d) == d.join(split_steps(x, mode="sentence", delimiter=d))``.
  With the default ``"\\n\\n"`` delimiter (or any visible marker) that normal form splits back into the
  same sentences; with a plain-space delimiter, paragraphs that end without punctuation merge on a
  second split.

Project convention: in a prefix every step is followed by the delimiter (see ``steps_to_prefix_text``).
"""

from __future__ import annotations

import re

from specprobe.infer.engines.base import DEFAULT_STEP_DELIMITER, with_delimiter

__all__ = ["MODES", "PARAGRAPH_BREAK", "normalise_text", "split_steps", "join_steps", "steps_to_prefix_text"]

MODES = ("delimiter", "sentence")
PARAGRAPH_BREAK = "\n\n"  # what normalised text separates paragraphs with (sentence mode splits there too)

_NEWLINE_RUN = re.compile(r"\n{3,}")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
# Sentence end: one or more of . ! ? then optional closing quotes/brackets, then whitespace.
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*\s+")
_FACTORIAL = re.compile(r"(^|[^A-Za-z])[A-Za-z]!+$|[0-9)}]!+$")
_LIST_MARKER = re.compile(r"^(\d+|[a-zA-Z]|[ivxIVX]+)\.$")
_ABBREVIATIONS = frozenset(
    """e.g. i.e. etc. vs. cf. approx. resp. eq. eqs. fig. figs. no. nos. mr. mrs. ms. dr. prof. st.
    sr. jr. inc. ltd. co. al. viz. ca. ch. sec. thm. def. lem. prop. cor. ex. p. pp. vol. ed.""".split()
)


def _check_mode(mode: str) -> None:
    """Raise ValueError for an unknown split mode."""
    if mode not in MODES:
        raise ValueError(f"unknown step mode {mode!r}; expected one of {MODES}")


def _check_delimiter(delimiter: str) -> None:
    """Raise ValueError for an empty or non-string delimiter."""
    if not isinstance(delimiter, str) or delimiter == "":
        raise ValueError(f"delimiter must be a non-empty string, got {delimiter!r}")


def _basic_normalise(text: str) -> str:
    """Unify newlines, strip trailing whitespace per line, collapse 3+ newlines, strip the text."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _NEWLINE_RUN.sub(PARAGRAPH_BREAK, text).strip()


def _normalise_delimited(text: str, delimiter: str) -> str:
    """Basic normalisation, then drop blank pieces between delimiters until nothing changes."""
    # Removing a blank piece can expose new trailing whitespace or newline runs (and vice versa),
    # so iterate to a fixed point; each changing round shortens the text, so this terminates.
    while True:
        text = _basic_normalise(text)
        pieces = text.split(delimiter)
        joined = delimiter.join(p for p in pieces if p.strip())
        if joined == text:
            return text
        text = joined


def _token_before(paragraph: str, end: int) -> str:
    """The whitespace-free token of ``paragraph`` that ends at index ``end``."""
    start = end
    while start > 0 and not paragraph[start - 1].isspace():
        start -= 1
    return paragraph[start:end]


def _ends_sentence(paragraph: str, match: re.Match) -> bool:
    """Whether a punctuation+whitespace match really ends a sentence."""
    punct_end = match.start() + len(match.group(0).rstrip())
    token = _token_before(paragraph, punct_end)
    if token.lower() in _ABBREVIATIONS:
        return False
    core = token.rstrip("\"'\u201d\u2019)]")
    # "5! ways", "n! = 120", "(n+1)!" are factorials, not exclamations.
    if core.endswith("!") and _FACTORIAL.search(core):
        return False
    word_start = punct_end - len(token)
    line_start = paragraph.rfind("\n", 0, word_start) + 1
    at_line_start = paragraph[line_start:word_start].strip() == ""
    return not (at_line_start and _LIST_MARKER.match(token))


def _split_sentences(paragraph: str) -> list[str]:
    """Split one paragraph at sentence ends; returns stripped, non-empty sentences."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(paragraph):
        if _ends_sentence(paragraph, match):
            sentences.append(paragraph[start:match.start() + len(match.group(0).rstrip())])
            start = match.end()
    sentences.append(paragraph[start:])
    return [s.strip() for s in sentences if s.strip()]


def _sentence_steps(text: str, delimiter: str) -> list[str]:
    """Sentence-mode steps of basic-normalised text."""
    chunks = [text]
    if delimiter.strip():  # a visible marker such as "###" is always a boundary
        chunks = text.split(delimiter)
    steps = []
    for chunk in chunks:
        for paragraph in _PARAGRAPH_BREAK.split(chunk):
            steps.extend(_split_sentences(paragraph))
    return steps


def normalise_text(text: str, mode: str = "delimiter", delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
    """Canonical form of ``text``: the string that ``join_steps(split_steps(text))`` returns."""
    _check_mode(mode)
    _check_delimiter(delimiter)
    if mode == "sentence":
        return delimiter.join(_sentence_steps(_basic_normalise(text), delimiter))
    return _normalise_delimited(text, delimiter)


def split_steps(text: str, mode: str = "delimiter", delimiter: str = DEFAULT_STEP_DELIMITER) -> list[str]:
    """Split ``text`` into non-blank steps (without delimiters) after normalising it."""
    _check_mode(mode)
    _check_delimiter(delimiter)
    if mode == "sentence":
        return _sentence_steps(_basic_normalise(text), delimiter)
    return [p for p in _normalise_delimited(text, delimiter).split(delimiter) if p.strip()]


def join_steps(steps: list[str], mode: str = "delimiter", delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
    """Inverse of ``split_steps``: steps separated by ``delimiter`` (no trailing delimiter)."""
    _check_mode(mode)
    _check_delimiter(delimiter)
    return delimiter.join(steps)


def steps_to_prefix_text(steps: list[str], delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
    """Prefix text for ``steps``: each step followed by the delimiter unless it ends with one, as the engines
    write a prefix (`infer.engines.base.with_delimiter`)."""
    _check_delimiter(delimiter)
    return "".join(with_delimiter(step, delimiter) for step in steps)
