"""Tests for data_gen.steps: normalisation, splitting modes and the split/join round trip."""

import random

import pytest

from specprobe.data_gen.steps import join_steps, normalise_text, split_steps, steps_to_prefix_text

# Pieces chosen to hit the awkward cases: CR/CRLF, stray spaces and tabs, runs of blank lines,
# whitespace-only lines, sentence punctuation, decimals, abbreviations, list markers, markers.
_ATOMS = ["word", "x", "3.5", "e.g.", "Dr.", "5!", "1.", "end.", "why?", "wow!", "\"q.\"", "###", "(a).",
          " ", "  ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r", "\r\n\r\n", " \n ", "\n \t \n", "\u00a0", "é"]
_DELIMITERS = ["\n\n", "\n", "###", " ", "\n---\n"]


def _random_texts(n: int, seed: int = 1234):
    """Yield ``n`` random strings assembled from awkward atoms."""
    rng = random.Random(seed)
    for _ in range(n):
        yield "".join(rng.choice(_ATOMS) for _ in range(rng.randint(0, 40)))


def test_normalise_text_rules():
    raw = "  \r\nFirst line   \r\nsecond\t\r\r\r\rthird  \n\n\n\n\nfourth \n \n"
    assert normalise_text(raw) == "First line\nsecond\n\nthird\n\nfourth"


def test_normalise_is_idempotent_and_clean():
    for text in _random_texts(500):
        norm = normalise_text(text)
        assert normalise_text(norm) == norm
        assert "\r" not in norm and "\n\n\n" not in norm
        assert norm == norm.strip()
        assert all(line == line.rstrip() for line in norm.split("\n"))


@pytest.mark.parametrize("delimiter", _DELIMITERS)
def test_delimiter_round_trip_on_random_strings(delimiter):
    for text in _random_texts(400, seed=_DELIMITERS.index(delimiter)):
        steps = split_steps(text, delimiter=delimiter)
        assert all(s.strip() for s in steps), (text, steps)
        assert all(delimiter not in s for s in steps)
        assert join_steps(steps, delimiter=delimiter) == normalise_text(text, delimiter=delimiter)
        assert split_steps(join_steps(steps, delimiter=delimiter), delimiter=delimiter) == steps


@pytest.mark.parametrize("delimiter", ["\n\n", "###"])
def test_sentence_round_trip_on_random_strings(delimiter):
    for text in _random_texts(400, seed=7):
        steps = split_steps(text, mode="sentence", delimiter=delimiter)
        assert all(s.strip() and s == s.strip() for s in steps), (text, steps)
        norm = normalise_text(text, mode="sentence", delimiter=delimiter)
        assert join_steps(steps, mode="sentence", delimiter=delimiter) == norm
        # The normal form splits back into the same sentences.
        assert split_steps(norm, mode="sentence", delimiter=delimiter) == steps


def test_default_round_trip_examples():
    text = "Step one.\r\n\r\n\r\n  \r\nStep two   \nstill two\n\n\n\n\nStep three"
    steps = split_steps(text)
    assert steps == ["Step one.", "Step two\nstill two", "Step three"]
    assert join_steps(steps) == normalise_text(text) == "Step one.\n\nStep two\nstill two\n\nStep three"


def test_the_source_config_splits_on_the_delimiter_the_models_stop_at():
    """The source section (inputs, which imports no other package) writes the default delimiter out; it must stay
    the engines' default, which ends sampled steps."""
    from specprobe.infer.engines import DEFAULT_STEP_DELIMITER
    from specprobe.inputs.records import SourceConfig

    assert SourceConfig().delimiter == DEFAULT_STEP_DELIMITER


def test_no_steps_from_blank_text():
    for text in ["", "   ", "\n\n\n", "\r\n \t\r\n"]:
        assert split_steps(text) == []
        assert split_steps(text, mode="sentence") == []
        assert normalise_text(text) == ""


def test_single_newline_delimiter_drops_blank_lines():
    assert split_steps("a = 1\n\n\nb = 2\n  \nc = 3\n", delimiter="\n") == ["a = 1", "b = 2", "c = 3"]


def test_sentence_mode_keeps_decimals_abbreviations_and_list_markers():
    text = ("The mass is 3.5 kg, e.g. roughly a brick. Dr. Smith agrees! Is it 7? "
            "Then 5! = 120 ways.\n1. First item here.\n2. Second item")
    assert split_steps(text, mode="sentence") == [
        "The mass is 3.5 kg, e.g. roughly a brick.",
        "Dr. Smith agrees!",
        "Is it 7?",
        "Then 5! = 120 ways.",
        "1. First item here.",
        "2. Second item",
    ]


def test_sentence_mode_splits_paragraphs_and_keeps_closing_quotes():
    text = 'He said "stop." Then left\n\nA heading\n\nLast one.'
    assert split_steps(text, mode="sentence") == ['He said "stop."', "Then left", "A heading", "Last one."]
    assert normalise_text(text, mode="sentence") == 'He said "stop."\n\nThen left\n\nA heading\n\nLast one.'


def test_prefix_text_follows_each_step_with_the_delimiter():
    assert steps_to_prefix_text(["a", "b"]) == "a\n\nb\n\n"
    assert steps_to_prefix_text(["a", "b"], "\n") == "a\nb\n"
    assert steps_to_prefix_text([]) == ""
    assert steps_to_prefix_text(["a\n\n", "b"]) == "a\n\nb\n\n"  # as the engines write a prefix: not doubled
    text = "one\n\ntwo\n\nthree"
    steps = split_steps(text)
    for j in range(len(steps)):
        # A prefix of j steps plus the remaining steps rebuilds the normalised text.
        assert steps_to_prefix_text(steps[:j]) + join_steps(steps[j:]) == normalise_text(text)


@pytest.mark.parametrize("call", [
    lambda: split_steps("a", mode="words"),
    lambda: split_steps("a", delimiter=""),
    lambda: join_steps(["a"], mode="bogus"),
    lambda: normalise_text("a", mode="nope"),
    lambda: steps_to_prefix_text(["a"], ""),
])
def test_bad_options_raise(call):
    with pytest.raises(ValueError):
        call()
