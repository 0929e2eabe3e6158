"""Tests for data_gen.sources: every reader on small fixtures (or the real offline packages) and bad input."""

import json
import shutil
import warnings
from pathlib import Path

import pytest

from specprobe.data_gen.sources import KINDS, InvalidRecord, SourceWarning, Trace, iter_traces, load_traces

DATA = Path(__file__).parent / "data"


def _core(trace: Trace) -> tuple:
    """The source-independent part of a trace (everything but meta)."""
    return trace.id, trace.domain, trace.question, trace.steps, trace.answer


def _to_parquet(jsonl: Path, target: Path) -> Path:
    """Write the records of a jsonl fixture to a parquet file with pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(rows), target)
    return target


def _write_lines(path: Path, lines: list) -> Path:
    """Write raw lines (dicts become JSON, bytes stay as they are) to a jsonl file."""
    with open(path, "wb") as f:
        for line in lines:
            data = line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode()
            f.write(data + b"\n")
    return path


def _messages(record) -> list[str]:
    """Messages of the SourceWarnings caught in ``record``."""
    return [str(w.message) for w in record if issubclass(w.category, SourceWarning)]


# ------------------------------------------------------------------ Trace and helpers


def test_trace_validates_question_and_steps():
    with pytest.raises(InvalidRecord, match="question"):
        Trace("t", "math", "  ", ["a step"], "1")
    with pytest.raises(InvalidRecord, match="steps"):
        Trace("t", "math", "Q?", [], "1")
    with pytest.raises(InvalidRecord, match=r"steps\[1\]"):
        Trace("t", "math", "Q?", ["ok", " "], "1")
    trace = Trace("t", "math", "Q?", ["a", "b"], "1", {"k": 1})
    assert Trace.from_dict(trace.to_dict()) == trace


def test_trace_from_a_hand_written_dict():
    # only id, question and steps are needed; a missing or malformed one is named
    trace = Trace.from_dict({"id": "q1", "question": "Q?", "steps": ("a", "b")})
    assert (trace.domain, trace.answer, trace.steps, trace.family) == ("unknown", "", ["a", "b"], None)
    with pytest.raises(InvalidRecord, match="'question': missing"):
        Trace.from_dict({"id": "q1", "steps": ["a"]})
    with pytest.raises(InvalidRecord, match="'steps': expected a list of strings, got str"):
        Trace.from_dict({"id": "q1", "question": "Q?", "steps": "a"})


# ------------------------------------------------------------------ s1K


def test_s1k_v1_jsonl():
    traces = load_traces("s1k", path=str(DATA / "s1k.jsonl"))
    assert [t.id for t in traces] == ["s1k-0", "s1k-1", "s1k-2"]
    first, second, third = traces
    # The list of trajectories is joined, then split; blank-line runs collapse.
    assert first.steps == ["Let me add the numbers.", "First, 1+2 = 3.", "Then 3+3 = 6.", "So the answer is 6."]
    assert (first.answer, first.domain, first.question) == ("6", "math", "What is $1+2+3$?")
    assert first.meta["attempt"].startswith("1+2+3 = 6")
    assert first.meta["steps_field"] == "thinking_trajectories"
    # CRLF and trailing spaces are normalised away.
    assert second.steps == ["Standard pressure is 1 atm.", "At 1 atm, water boils at 100 C.", "That is the answer."]
    assert second.domain == "science"
    assert second.answer == "Water boils at 100 degrees Celsius at sea level."  # no \boxed: whole solution
    assert third.answer == r"\frac{3}{4}"


def test_s1k_v11_trajectory_choice():
    deepseek = load_traces("s1k", path=str(DATA / "s1k-1.1.jsonl"))
    gemini = load_traces("s1k", path=str(DATA / "s1k-1.1.jsonl"), trajectory="gemini")
    assert deepseek[0].steps == ["Okay, so I need 2^10.", "2^5 = 32.", "Then 32^2 = 1024.", "So the answer is 1024."]
    assert gemini[0].steps == ["Powers of two: 2, 4, 8, 16, 32.", "Continue: 64, 128, 256, 512, 1024."]
    assert deepseek[0].answer == gemini[0].answer == "1024"
    assert deepseek[0].meta["attempt"] == "**Answer:** $\\boxed{1024}$"
    assert gemini[1].meta["attempt"] == "Yes."
    assert deepseek[1].meta["steps_field"] == "deepseek_thinking_trajectory"
    with pytest.raises(ValueError, match="trajectory"):
        load_traces("s1k", path=str(DATA / "s1k-1.1.jsonl"), trajectory="claude")


@pytest.mark.parametrize("fixture", ["s1k.jsonl", "s1k-1.1.jsonl"])
def test_s1k_parquet_matches_jsonl(tmp_path, fixture):
    parquet = _to_parquet(DATA / fixture, tmp_path / fixture.replace(".jsonl", ".parquet"))
    from_jsonl = load_traces("s1k", path=str(DATA / fixture))
    from_parquet = load_traces("s1k", path=str(parquet))
    assert [_core(t) for t in from_parquet] == [_core(t) for t in from_jsonl]
    assert from_parquet[0].meta["source"] == f"{parquet} row 0"


def test_s1k_sentence_mode_domains_and_limit():
    traces = load_traces("s1k", path=str(DATA / "s1k-1.1.jsonl"), step_mode="sentence")
    assert traces[1].steps == ["Hmm, check divisors of 7.", "2 does not divide 7.", "3 does not divide 7.",
                               "So 7 is prime."]
    science = load_traces("s1k", path=str(DATA / "s1k.jsonl"), domains=["science"])
    assert [t.id for t in science] == ["s1k-1"]
    assert [t.id for t in load_traces("s1k", path=str(DATA / "s1k.jsonl"), limit=2)] == ["s1k-0", "s1k-1"]
    assert load_traces("s1k", path=str(DATA / "s1k.jsonl"), limit=0) == []
    with pytest.warns(SourceWarning, match=r"source.domains=\['maths'\] kept none of \d+ traces; their domains: .*math \("):
        assert load_traces("s1k", path=str(DATA / "s1k.jsonl"), domains=["maths"]) == []  # a typo: said, not silent


@pytest.mark.parametrize("fields, kind, pattern", [
    ({"question": "prompt", "steps": ["reasoning"]}, "jsonl", r"source.fields.steps: \['reasoning'\] is not a field name"),
    ({"question": 5}, "jsonl", r"source.fields.question: 5 is not a field name"),
    ({"question": "prompt"}, "s1k", r"source.fields rename the fields of jsonl records; s1k records"),
])
def test_source_fields_that_name_no_field_are_config_errors(fields, kind, pattern):
    from specprobe.inputs.config import ConfigError
    from specprobe.inputs.records import BenchSourceConfig, SourceConfig

    with pytest.raises(ConfigError, match=pattern):
        SourceConfig(kind=kind, path="x.jsonl", fields=fields)
    if kind == "jsonl":  # the bench's section says its own name
        with pytest.raises(ConfigError, match="bench." + pattern):
            BenchSourceConfig(kind=kind, path="x.jsonl", fields=fields)
    assert BenchSourceConfig(kind="gsm8k", path="x.jsonl", fields={"question": "q", "answer": None}).fields


def test_s1k_bad_records_warn_and_reading_continues(tmp_path):
    good = json.loads((DATA / "s1k-1.1.jsonl").read_text().splitlines()[0])
    no_trajectory = {k: v for k, v in good.items() if k != "deepseek_thinking_trajectory"}
    no_trajectory["gemini_thinking_trajectory"] = "only gemini"
    empty = {**good, "deepseek_thinking_trajectory": " \n\n \r\n"}
    no_question = {k: v for k, v in good.items() if k != "question"}
    path = _write_lines(tmp_path / "s1k_bad.jsonl", [no_trajectory, empty, no_question, good])
    with pytest.warns(SourceWarning) as record:
        traces = load_traces("s1k", path=str(path))
    assert [t.id for t in traces] == ["s1k_bad-3"]
    assert traces[0].steps[-1] == "So the answer is 1024."
    msgs = _messages(record)
    assert len(msgs) == 3
    assert f"{path}:1" in msgs[0] and "'s1k_bad-0'" in msgs[0] and "'deepseek_thinking_trajectory'" in msgs[0]
    assert f"{path}:2" in msgs[1] and "empty" in msgs[1] and "'deepseek_thinking_trajectory'" in msgs[1]
    assert f"{path}:3" in msgs[2] and "'question'" in msgs[2] and "missing" in msgs[2]


# ------------------------------------------------------------------ GSM8K


def test_gsm8k_jsonl_lines_annotations_and_answer():
    traces = load_traces("gsm8k", path=str(DATA / "gsm8k.jsonl"))
    assert [t.id for t in traces] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert traces[0].steps == ["Natalia sold 48/2 = 24 clips in May.",
                               "Natalia sold 48+24 = 72 clips altogether in April and May."]
    assert [t.answer for t in traces] == ["72", "10", "5"]
    assert len(traces[2].steps) == 3  # the blank line inside the rationale is not a step
    assert all(t.domain == "math" and "####" not in "".join(t.steps) for t in traces)
    raw = load_traces("gsm8k", path=str(DATA / "gsm8k.jsonl"), strip_calculator=False)
    assert raw[0].steps[0] == "Natalia sold 48/2 = <<48/2=24>>24 clips in May."


def test_final_answers_lose_thousands_separators(tmp_path):
    path = _write_lines(tmp_path / "gsm.jsonl", [
        {"question": "Q1?", "answer": "It costs 1,000 + 234.\n#### 1,234"},
        {"question": "Q2?", "answer": "Pay it.\n#### $12,000.50"},
        {"question": "Q3?", "answer": "A point.\n#### (1,2)"}])
    assert [t.answer for t in load_traces("gsm8k", path=str(path))] == ["1234", "$12000.50", "(1,2)"]
    s1k = _write_lines(tmp_path / "s1k.jsonl", [
        {"question": "Q?", "thinking_trajectories": ["a\n\nb"], "solution": r"so \boxed{2,048}"}])
    assert load_traces("s1k", path=str(s1k))[0].answer == "2048"


def test_strip_calculator_is_set_from_the_config():
    from specprobe.data_gen.pipeline import load_source_traces
    from specprobe.inputs.records import SourceConfig
    from specprobe.train.config import field_help, load_config

    kept = load_config(None, ["source.kind=gsm8k", f"source.path={DATA / 'gsm8k.jsonl'}",
                              "source.strip_calculator=false"]).source
    assert kept.strip_calculator is False
    assert load_source_traces(kept)[0].steps[0] == "Natalia sold 48/2 = <<48/2=24>>24 clips in May."
    stripped = SourceConfig(kind="gsm8k", path=str(DATA / "gsm8k.jsonl"))
    assert load_source_traces(stripped)[0].steps[0] == "Natalia sold 48/2 = 24 clips in May."
    assert any(key == "source.strip_calculator" and "<<" in text for key, text, _ in field_help())


@pytest.mark.parametrize("content", [b"", b"\n\n", b"not json\n"])
def test_a_file_with_no_records_warns_naming_it(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.warns(SourceWarning) as record:
        assert load_traces("jsonl", path=str(path)) == []
    assert any("empty.jsonl: no records read" in m for m in _messages(record))


def test_gsm8k_bad_lines_warn_with_file_line_and_field(tmp_path):
    good = json.loads((DATA / "gsm8k.jsonl").read_text().splitlines()[0])
    lines = [
        good,                                                   # line 1
        {"question": "Where is the answer?"},                   # line 2: missing field
        {"question": "Empty?", "answer": "\n \n#### 5"},        # line 3: empty trace
        b'{"question": "caf\xe9 \xff", "answer": "x\\n#### 1"}',  # line 4: not UTF-8
        '{"question": "broken", "answer": ',                    # line 5: invalid JSON
        "",                                                     # line 6: blank, silently skipped
        {"question": "No marker", "answer": "Just text."},      # line 7: no ####
        good,                                                   # line 8
    ]
    path = _write_lines(tmp_path / "gsm_bad.jsonl", lines)
    with pytest.warns(SourceWarning) as record:
        traces = load_traces("gsm8k", path=str(path))
    # The good record after the bad ones is still read; its id keeps its line position.
    assert [t.id for t in traces] == ["gsm_bad-0", "gsm_bad-7"]
    assert traces[1].steps == traces[0].steps
    msgs = _messages(record)
    assert len(msgs) == 5
    assert f"{path}:2" in msgs[0] and "'gsm_bad-1'" in msgs[0] and "field 'answer': missing" in msgs[0]
    assert f"{path}:3" in msgs[1] and "field 'answer'" in msgs[1] and "empty trace" in msgs[1]
    assert f"{path}:4" in msgs[2] and "UTF-8" in msgs[2]
    assert f"{path}:5" in msgs[3] and "invalid JSON" in msgs[3]
    assert f"{path}:7" in msgs[4] and "####" in msgs[4]


def test_max_step_chars_skips_long_steps_with_warning():
    with pytest.warns(SourceWarning) as record:
        traces = load_traces("gsm8k", path=str(DATA / "gsm8k.jsonl"), max_step_chars=50)
    # Longest steps: record 0 has 58 characters, record 1 has 46, record 2 has 53.
    assert [t.id for t in traces] == ["gsm8k-1"]
    msgs = _messages(record)
    assert len(msgs) == 2
    assert "gsm8k.jsonl:1" in msgs[0] and "'gsm8k-0'" in msgs[0] and "field 'answer'" in msgs[0]
    assert "step 1 has 58 characters" in msgs[0] and "max_step_chars=50" in msgs[0]
    assert "gsm8k.jsonl:3" in msgs[1] and "'gsm8k-2'" in msgs[1]


# ------------------------------------------------------------------ reasoning-gym and CHAMP (real packages)


def test_reasoning_gym_gsm_symbolic_real():
    traces = load_traces("reasoning_gym", size=3, seed=0)
    assert [t.id for t in traces] == ["gsm_symbolic-0-0", "gsm_symbolic-0-1", "gsm_symbolic-0-2"]
    for t in traces:
        assert t.domain == "math" and t.steps and t.question.strip()
        assert all("####" not in s and "\n" not in s for s in t.steps)
        assert t.answer == t.meta["cot_answer"]
    again = load_traces("reasoning_gym", size=3, seed=0)
    assert [_core(t) for t in again] == [_core(t) for t in traces]
    other = load_traces("reasoning_gym", size=3, seed=1)
    assert [t.id for t in other][0] == "gsm_symbolic-1-0"
    assert [t.question for t in other] != [t.question for t in traces]


def test_reasoning_gym_items_of_one_template_share_a_family():
    import reasoning_gym

    traces = load_traces("reasoning_gym", size=64, seed=0)
    templates = reasoning_gym.create_dataset("gsm_symbolic", size=64, seed=0).task_indices
    assert [t.family for t in traces] == [f"gsm_symbolic/template-{k}" for k in templates]
    # the ids and families committed data and results were made with (a checkpoint's split names them)
    assert [(t.id, t.family) for t in (traces[0], traces[12])] == [("gsm_symbolic-0-0", "gsm_symbolic/template-81"),
                                                                    ("gsm_symbolic-0-12", "gsm_symbolic/template-23")]
    first, again = next((i, j) for i in range(64) for j in range(i + 1, 64) if templates[i] == templates[j])
    assert traces[first].family == traces[again].family and traces[first].id != traces[again].id
    assert len({t.family for t in traces}) == len(set(templates)) < 64  # gsm_symbolic draws with replacement
    other_seed = load_traces("reasoning_gym", size=8, seed=1)  # a template is a family whatever the seed
    assert {t.family for t in other_seed} <= {f"gsm_symbolic/template-{k}" for k in range(100)}


def test_champ_real():
    traces = load_traces("champ", limit=3)
    assert [t.id for t in traces] == ["champ-P_Combinatorics_1", "champ-P_Combinatorics_2", "champ-P_Combinatorics_3"]
    first = traces[0]
    assert first.question.startswith("Let a string consist of digit 1, 2, 3.")
    assert (first.answer, first.domain, first.meta["category"]) == ("239", "math", "Combinatorics")
    assert len(first.steps) == 6
    assert first.steps[0] == "Let x_n, y_n, z_n be the number of length-n strings that end with digit 1, 2, 3 respectively."
    assert first.steps[-1] == "Thus, in total, there are x_6+y_6+z_6=70+99+70=239 such strings."
    assert all("@@" not in s for t in traces for s in t.steps)  # CHAMP's concept markup is removed


# ------------------------------------------------------------------ generic jsonl


FIELDS = {"id": "uid", "question": "problem", "steps": "reasoning", "text": "cot", "answer": "final",
          "domain": "topic"}


def test_generic_jsonl_with_field_mapping():
    traces = load_traces("jsonl", path=str(DATA / "generic.jsonl"), fields=FIELDS, step_mode="sentence")
    assert [t.id for t in traces] == ["g-1", "g-2"]
    assert traces[0].steps == ["Two plus two.", "That makes 4."]  # blank list item dropped
    assert traces[1].steps == ["Primary colours are red, yellow and blue.", "Red is one."]  # text field split
    assert [(t.answer, t.domain) for t in traces] == [("4", "math"), ("red", "art")]
    with pytest.raises(ValueError, match="unknown keys in fields"):
        load_traces("jsonl", path=str(DATA / "generic.jsonl"), fields={"prompt": "problem"})
    assert [t.family for t in traces] == [None, None]  # no family field: each question is its own


def test_jsonl_answer_is_optional_but_checked_when_given(tmp_path):
    records = [{"id": "a", "question": "Q1", "steps": ["s1"]}, {"id": "b", "question": "Q2", "steps": ["s2"],
               "answer": 42}, {"id": "c", "question": "Q3", "steps": ["s3"], "answer": {"x": 1}}]
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    with pytest.warns(SourceWarning) as record:
        traces = load_traces("jsonl", path=str(path))
    assert [(t.id, t.answer) for t in traces] == [("a", ""), ("b", "42")]
    assert any("'c'" in m and "field 'answer': expected a string, got dict" in m for m in _messages(record))


def test_jsonl_reads_a_family_only_where_fields_maps_it(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps({"id": "a", "question": "Q", "steps": ["s"], "answer": "1", "family": ["any"]}))
    assert [t.family for t in load_traces("jsonl", path=str(path))] == [None]  # a column of that name is data


def test_jsonl_family_field_groups_questions(tmp_path):
    records = [{"id": "a", "question": "Q1", "steps": ["s1"], "answer": "1", "template": 7},
               {"id": "b", "question": "Q2", "steps": ["s2"], "answer": "1", "template": "7"},
               {"id": "c", "question": "Q3", "steps": ["s3"], "answer": "1"},
               {"id": "d", "question": "Q4", "steps": ["s4"], "answer": "1", "template": ["bad"]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records), encoding="utf-8")
    with pytest.warns(SourceWarning) as record:
        traces = load_traces("jsonl", path=str(path), fields={"family": "template"})
    assert [(t.id, t.split_group) for t in traces] == [("a", "7"), ("b", "7"), ("c", "c")]
    assert any("'d'" in m and "field 'family'" in m for m in _messages(record))
    assert Trace.from_dict(traces[0].to_dict()).family == "7"


def test_generic_json_array_duplicates_and_missing_steps(tmp_path):
    records = [{"id": "a", "question": "Q1", "steps": ["s1"], "answer": "1"},
               {"id": "a", "question": "Q2", "steps": ["s2"], "answer": "2"},
               {"id": "b", "question": "Q3", "answer": "3"},
               {"id": "c", "question": "Q4", "text": "one\n\ntwo", "answer": "4"}]
    path = tmp_path / "arr.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    with pytest.warns(SourceWarning) as record:
        traces = load_traces("jsonl", path=str(path))
    assert [t.id for t in traces] == ["a", "a-dup1", "c"]
    assert traces[1].meta["original_id"] == "a" and traces[2].steps == ["one", "two"]
    # a repeated record stays with its original in the split
    assert [t.split_group for t in traces] == ["a", "a", "c"]
    msgs = _messages(record)
    assert any(f"{path}[2]" in m and "'b'" in m and "'steps'" in m and "missing" in m for m in msgs)
    assert any("duplicate record id 'a'" in m and "'a-dup1'" in m for m in msgs)


# ------------------------------------------------------------------ errors


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    for kind in ("s1k", "gsm8k", "jsonl", "champ"):
        with pytest.raises(FileNotFoundError, match="nope.jsonl"):
            load_traces(kind, path=str(missing))


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(ValueError) as info:
        load_traces("mmlu")
    assert all(kind in str(info.value) for kind in KINDS)


def test_unsupported_extension(tmp_path):
    path = tmp_path / "traces.csv"
    shutil.copy(DATA / "gsm8k.jsonl", path)
    with pytest.raises(ValueError, match=r"unsupported file type '\.csv'"):
        load_traces("gsm8k", path=str(path))


def test_iter_traces_is_lazy_and_stops_at_limit(tmp_path):
    path = _write_lines(tmp_path / "g.jsonl", [json.loads(line) for line in (DATA / "gsm8k.jsonl").read_text().splitlines()]
                        + ["{bad json"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceWarning)  # the bad last line is never reached
        assert [t.id for t in iter_traces("gsm8k", path=str(path), limit=3)] == ["g-0", "g-1", "g-2"]


def test_hub_dataset_without_network_gives_clear_error():
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE, "tests/conftest.py sets HF_HUB_OFFLINE before any import"
    with pytest.raises(RuntimeError) as info:
        load_traces("s1k", name="specprobe-test/no-such-dataset")
    message = str(info.value)
    assert "'specprobe-test/no-such-dataset'" in message and "split 'train'" in message
    assert "path=" in message and "load_dataset" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.slow
def test_a_hub_style_data_set_loads_through_the_real_datasets_library(tmp_path):
    """name= goes through datasets.load_dataset (here a local data set folder, which it reads offline as it reads a
    cached hub repo): the split is chosen, each row becomes a record, and a missing split is an error naming it."""
    folder = tmp_path / "my-gsm"
    folder.mkdir()
    rows = [json.loads(line) for line in (DATA / "gsm8k.jsonl").read_text().splitlines()]
    _write_lines(folder / "train.jsonl", rows)
    _write_lines(folder / "test.jsonl", rows[:1])
    from_hub = load_traces("gsm8k", name=str(folder), split="train")
    from_file = load_traces("gsm8k", path=str(DATA / "gsm8k.jsonl"))
    assert [(t.question, t.steps, t.answer) for t in from_hub] == [(t.question, t.steps, t.answer) for t in from_file]
    assert len(load_traces("gsm8k", name=str(folder), split="test")) == 1
    with pytest.raises(RuntimeError, match="validation"):
        load_traces("gsm8k", name=str(folder), split="validation")
