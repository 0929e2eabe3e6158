"""The engine interface is the whole interface: no module outside infer/engines/ touches an engine attribute
that `infer.engines.base.StepEngine` does not declare (an AST scan of the modules that take engines), and both
engines declare what they can do (`EngineCapabilities`)."""
from __future__ import annotations

import ast
import copy
import inspect
from dataclasses import replace
from pathlib import Path

import pytest

from specprobe.infer.engines import HFStepEngine
from specprobe.infer.engines.base import EngineCapabilities, Prefix, SamplingParams, StepEngine, StepRequest
from specprobe.infer.engines.seed_decoding import SeedGenerator
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.token_spec import LookaheadConfig, TokenSpecConfig

from _margins import assert_same_greedy

ROOT = Path(__file__).resolve().parents[1]
# modules that receive engines, and the names engines go by there
MODULES = sorted([*ROOT.glob("infer/decoding/*.py"), ROOT / "infer/verifiers.py", ROOT / "infer/bench.py",
                  ROOT / "infer/bench_ray.py", ROOT / "infer/acceptance_estimate.py", ROOT / "data_gen/pipeline.py",
                  ROOT / "infer/engines/seed_decoding.py"])  # SEED drives two engines it is given
ENGINE_NAMES = {"target", "draft", "engine", "target_engine", "draft_engine", "llm_judge_engine", "vllm_engine",
                "judge_engine", "assistant"}
HOLDERS = {"self", "env", "run", "state", "st"}  # objects that hold engines under those names (not steps: node.draft)
def declared() -> set[str]:
    names = set(StepEngine.__annotations__)
    names |= {n for n, v in vars(StepEngine).items() if inspect.isfunction(v) and not n.startswith("_")}
    return names


def is_engine(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ENGINE_NAMES
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # self.target, env.draft, ...
        return node.value.id in HOLDERS and node.attr in ENGINE_NAMES
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):  # self.engines[role]
        return node.value.attr in ("engines", "engine_map")
    return False


def undeclared_uses(source: str, allowed: set[str]) -> list[tuple[int, str]]:
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and is_engine(node.value) and node.attr not in allowed]


def test_callers_use_only_what_the_engine_protocol_declares():
    allowed = declared()
    assert {"generate", "score", "score_chain", "open_stream", "info", "capabilities", "model_name",
            "clear_prefix_cache", "with_token_spec"} <= allowed
    found = []
    for path in MODULES:
        rel = path.relative_to(ROOT).as_posix()
        for line, attr in undeclared_uses(path.read_text(encoding="utf-8"), allowed):
            found.append(f"{rel}:{line} .{attr}")
    assert not found, "engine attributes outside the StepEngine protocol:\n" + "\n".join(found)


def test_the_scan_notices_an_undeclared_attribute():
    source = "def f(target, env):\n    target.generate([])\n    env.draft.secret_cache.clear()\n"
    assert undeclared_uses(source, declared()) == [(3, "secret_cache")]


@pytest.fixture(scope="module")
def tiny():
    return HFStepEngine("random:llama-tiny", device="cpu")


def test_engines_declare_their_capabilities(tiny):
    engine = tiny
    caps = engine.capabilities
    assert isinstance(caps, EngineCapabilities) and caps.kind == "transformers" and caps.raw_model
    assert caps.tree_attention and isinstance(engine.sequence_kv(), SequenceKV)
    assert engine.model is not None and isinstance(engine, StepEngine)
    engine.clear_prefix_cache()
    assert engine.with_token_spec(None) is engine  # nothing to change: the engine itself


def test_lookahead_is_chosen_per_call_like_the_other_proposers(tiny):
    """with_token_spec("lookahead") gives a Lookahead Decoding view on the unchanged engine (the same class, the
    same batches), and it writes the engine's own greedy step."""
    spec = TokenSpecConfig("lookahead", lookahead=LookaheadConfig(window=3, ngram=3))
    view = tiny.with_token_spec(spec)
    assert type(view) is type(tiny) and view.token_spec == spec and view.capabilities == tiny.capabilities
    assert tiny.with_token_spec(spec) is not view and tiny.token_spec is None and view.with_token_spec(None).token_spec is None
    params = SamplingParams(temperature=0.0, max_step_tokens=12, delimiter="\n\n")
    req = [StepRequest(Prefix("Count: 1 2 3"), 1, 0)]
    got, want = view.generate(req, params).steps[0][0], tiny.generate(req, params).steps[0][0]
    assert_same_greedy(tiny.model, tiny.prefix_ids(req[0].prefix), got.token_ids, want.token_ids, at_least=4)


def test_tree_attention_decoders_refuse_engines_without_it(tiny):
    """SEED asks both engines' capabilities, and says what to use instead."""
    no_tree = copy.copy(tiny)
    no_tree.capabilities = replace(tiny.capabilities, kind="vllm", tree_attention=False)
    with pytest.raises(ValueError, match="draft engine \\(vllm\\) has none. Use a transformers engine"):
        SeedGenerator.from_engines(tiny, no_tree, (2, 1))
    with pytest.raises(ValueError, match="SEED verifies token trees with tree attention; the target engine"):
        SeedGenerator.from_engines(no_tree, tiny, (2, 1))
