"""Exactness relations of the decoding runtime, bit for bit, on toy engines (tests/_toy_engine.py).

The toy engines decide every token with integer arithmetic, so these relations hold on any machine:
reject-all = target-only (greedy and sampling, every method), accept-all = the draft's chain (+ the
target's bonus step in sync LR), LR's pairing of draft j with the target step after the same prefix,
a capped step continued as written (target-only = plain autoregressive output), the answer ending on
the target's own step (and where the target ends it), and multi-branch drafting refusing a greedy draft.
"""
from __future__ import annotations

import pytest
from _toy_engine import ToyEngine

from specprobe.infer.decoding import DecodeOptions, decode
from specprobe.infer.engines import Prefix, SamplingParams, StepRequest
from specprobe.infer.verifiers import BernoulliVerifier, Verifier, build_verifier

Q = "What is one plus two?"
SPEC = ["lr_sync", "lr_async", "semanticspec"]


def options(temperature=0.0, cap=6, **kw) -> DecodeOptions:
    base = dict(gamma=3, max_steps=8, max_new_tokens=400, seed=5,
                target_params=SamplingParams(temperature=temperature, max_step_tokens=cap))
    base.update(kw)
    return DecodeOptions(**base)


def greedy_step(engine, steps=(), cap=6):
    return engine.generate([StepRequest(Prefix(Q, tuple(steps)))], SamplingParams(temperature=0, max_step_tokens=cap)).steps[0][0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_reject_all_every_method_writes_the_target_only_output(temperature):
    target, draft = ToyEngine("target"), ToyEngine("draft")
    opts = options(temperature)
    base = decode("target", Q, target, None, None, opts)
    assert len(base.steps) == 8
    for method in SPEC:
        res = decode(method, Q, target, draft, build_verifier("reject_all"), opts)
        assert res.text == base.text and res.stats.accepted == 0 and res.stats.judged > 0, method
        assert [s.token_ids for s in res.steps] == [s.token_ids for s in base.steps], method
    wide = opts.replace(width=2, draft_params=SamplingParams(temperature=0.8, max_step_tokens=6))
    assert decode("lr_sync", Q, target, draft, build_verifier("reject_all"), wide).text == base.text


def test_capped_steps_continue_as_written_target_only_is_plain_autoregression():
    """Steps cut by a small cap get no invented delimiter: target-only's tokens are exactly one long
    greedy generation."""
    target = ToyEngine("target", delimiter_weight=45)
    res = decode("target", Q, target, None, None, options(cap=3, max_steps=30, max_new_tokens=40))
    assert {s.stop_reason for s in res.steps} >= {"length", "delimiter"}  # both kinds of step occur
    written = [t for s in res.steps for t in s.token_ids]
    head = target.text.prefix_ids(Prefix(Q))
    assert written == target.continue_ids(head, 40)
    assert res.text == target.tokenizer.decode(written)


def test_accept_all_writes_the_draft_chain():
    target, draft = ToyEngine("target"), ToyEngine("draft")
    opts = options(accept_length_cut=True)
    draft_only = decode("draft", Q, target, draft, None, opts)
    res = decode("semanticspec", Q, target, draft, build_verifier("accept_all"), opts)
    assert res.text == draft_only.text and res.stats.ratio == 0.0
    # async: the draft's chain, but the last step (at max_steps) is the target's own after it, as in sync LR
    res = decode("lr_async", Q, target, draft, build_verifier("accept_all"), opts)
    assert res.step_texts[:-1] == draft_only.step_texts[:-1] and len(res.steps) == opts.max_steps
    assert [s.source for s in res.steps] == ["draft"] * (opts.max_steps - 1) + ["target"]
    chain = []
    for _ in range(opts.max_steps - 1):
        chain.append(greedy_step(draft, chain))
    assert [s.text for s in chain] == draft_only.step_texts[:-1]
    assert res.step_texts[-1] == greedy_step(target, chain).text != draft_only.step_texts[-1]
    # sync: gamma drafts, then the target's step after them (the bonus), then the next cycle
    res = decode("lr_sync", Q, target, draft, build_verifier("accept_all"), opts)
    chain = []
    for _ in range(3):
        chain.append(greedy_step(draft, chain))
    bonus = greedy_step(target, chain)
    assert res.step_texts[:4] == [s.text for s in chain] + [bonus.text]
    assert [s.source for s in res.steps][:4] == ["draft"] * 3 + ["target"]


class AcceptFirstPosition(Verifier):
    """Accepts the draft at lookahead position 0 only."""
    name = "first_only"

    def _score(self, items):
        return [(float(it.meta["position"] == 0),) * 2 + ({},) for it in items]


def test_lr_pairs_each_draft_with_the_target_step_after_the_same_prefix():
    # draft = target (same model, greedy): every draft equals the target's step at its position
    target, same = ToyEngine("target"), ToyEngine("target")
    opts = options(accept_length_cut=True)
    base = decode("target", Q, target, None, None, opts)
    for method in ("lr_sync", "lr_async"):
        res = decode(method, Q, target, same, build_verifier("exact"), opts)
        assert res.stats.acceptance_rate == 1.0 and res.text == base.text, method
    # accepting position 0 only: d0, then the target's step after d0 (not after x, not after d0 d1)
    draft = ToyEngine("draft")
    for method in ("lr_sync", "lr_async"):
        res = decode(method, Q, target, draft, AcceptFirstPosition(), options(accept_length_cut=True, max_steps=2))
        d0 = greedy_step(draft)
        t1 = greedy_step(target, [d0])
        assert res.step_texts == [d0.text, t1.text] and [s.source for s in res.steps] == ["draft", "target"], method


class AcceptPositions(Verifier):
    """Accepts the drafts at the given lookahead positions and records every position it was asked about."""
    name = "positions"

    def __init__(self, accept):
        self.accept, self.asked = set(accept), []

    def _score(self, items):
        self.asked += [it.meta["position"] for it in items]
        return [(float(it.meta["position"] in self.accept),) * 2 + ({},) for it in items]


def test_semanticspec_keeps_the_drafts_before_the_first_rejection_then_the_targets_step():
    """Accepting positions 0 and 2: d0, then the target's step after d0 in place of d1; d2 is never judged (its
    prefix held d1), and the next cycle drafts after [d0, t1]."""
    target, draft = ToyEngine("target"), ToyEngine("draft")
    verifier = AcceptPositions({0, 2})
    res = decode("semanticspec", Q, target, draft, verifier, options(accept_length_cut=True, max_steps=3))
    d0 = greedy_step(draft)
    t1 = greedy_step(target, [d0])
    d2 = greedy_step(draft, [d0, t1])  # the second cycle's position 0, accepted
    assert greedy_step(draft, [d0]).text != t1.text  # d1 differs from the target's step: the rejection shows
    assert res.step_texts == [d0.text, t1.text, d2.text]
    assert [s.source for s in res.steps] == ["draft", "target", "draft"]
    assert verifier.asked[:3] == [0, 1, 0]  # the first cycle stopped at its rejection
    assert (res.stats.accepted, res.stats.judged) == (2, 3)


def test_the_answer_ends_on_the_targets_own_step():
    """A draft step that ends the answer (EOS) is never accepted, whatever the verifier says: the
    target's step at that position is committed instead, and only it can end the answer."""
    target = ToyEngine("target", eos_weight=41)
    draft = ToyEngine("draft", eos_weight=60)  # the draft ends the answer early
    opts = options(accept_length_cut=True, max_steps=40)
    base = decode("target", Q, target, None, None, opts)
    assert base.stop_reason == "eos"
    for method in SPEC:
        res = decode(method, Q, target, draft, build_verifier("accept_all"), opts)
        drafts = [s for s in res.steps if s.source == "draft"]
        assert res.steps[-1].source == "target", method
        assert all(s.stop_reason != "eos" for s in drafts), method
        reasons = {d["verdict"]["reason"] for c in res.trace for d in c["drafts"]
                   if d["verdict"] and "reason" in d["verdict"]}
        assert "ends answer" in reasons, method
    # draft = target: the EOS step the draft proposes is the target's own, so the output is target-only's
    same = decode("lr_sync", Q, target, ToyEngine("target", eos_weight=41), build_verifier("accept_all"), opts)
    assert same.text == base.text and same.stop_reason == "eos"


def _positions_judged_after_target_eos(res) -> int:
    """Positions of `res`'s trace whose drafts were judged although the target's step there ended the answer."""
    judged = 0
    for cycle in res.trace:
        targets = cycle["targets"]
        if "depth" not in targets[0]:  # async: one target row, the step at the cycle's judged position
            judged += sum(1 for _ in cycle["positions"]) if targets[0]["stop"] == "eos" else 0
            continue
        path: list[int] = []  # sync: the walk's branches so far name the node (and its target row) at each position
        for p in cycle["positions"]:
            row = next(t for t in targets if t["depth"] == p["position"] and t["path"] == path)
            judged += row["stop"] == "eos"
            if p["accepted"]:
                path = path + [p["branch"]]
    return judged


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_target_step_that_ends_the_answer_is_never_replaced_by_a_draft(temperature):
    """Where the target's step ends the answer (EOS), it is committed and the answer ends, whatever the verifier
    would say of the drafts there (LR's public run_problem stops on the target's EOS before reading a verdict).
    With accept-all, judging them let a draft replace the target's last step and the answer go on."""
    target, draft = ToyEngine("target", eos_weight=50), ToyEngine("draft")
    opts = options(temperature, accept_length_cut=True, max_steps=40, seed=1)
    wide = opts.replace(width=2, draft_params=SamplingParams(temperature=0.8, max_step_tokens=6))
    for method, o in (("lr_sync", opts), ("lr_async", opts), ("lr_sync", wide)):
        res = decode(method, Q, target, draft, build_verifier("accept_all"), o)
        assert _positions_judged_after_target_eos(res) == 0, method
        eos_rows = [t for c in res.trace for t in c["targets"] if t["stop"] == "eos"]
        assert res.stop_reason == "eos" and eos_rows, method  # the target ended it, and the answer ended
        assert res.steps[-1].source == "target" and res.steps[-1].stop_reason == "eos", method


def test_multi_branch_needs_a_sampling_draft():
    target, draft = ToyEngine("target"), ToyEngine("draft")
    with pytest.raises(ValueError, match="width=2.*temperature"):
        options(width=2)  # greedy draft: both branches would be the same step
    opts = options(width=2, gamma=2, draft_params=SamplingParams(temperature=0.8, max_step_tokens=6))
    res = decode("lr_sync", Q, target, draft, BernoulliVerifier(0.3), opts)
    first = [d["text"] for d in res.trace[0]["drafts"] if d["depth"] == 0]
    assert len(first) == 2 and first[0] != first[1]


def test_async_output_does_not_depend_on_lookahead_depth():
    """Every generation and draw is keyed by its prefix: γ changes how far the draft runs ahead, not
    what is written."""
    target, draft = ToyEngine("target"), ToyEngine("draft")
    outs = {decode("lr_async", Q, target, draft, BernoulliVerifier(0.5), options(0.8, gamma=g)).text for g in (1, 2, 4)}
    assert len(outs) == 1


@pytest.mark.parametrize("method", SPEC)
def test_no_draft_is_judged_after_a_cut_step_unless_asked(method):
    """LR's public rule (ignore_half_sentence): after a committed step cut by the token cap, the next draft
    is refused before the verifier; judge_after_cut=True judges (and here accepts) such drafts."""
    target = ToyEngine("target", delimiter_weight=45)
    draft = ToyEngine("draft", delimiter_weight=45)
    opts = options(cap=3, max_steps=30, max_new_tokens=120)
    res = decode(method, Q, target, draft, build_verifier("accept_all"), opts)
    after_cut = [i for i in range(1, len(res.steps)) if res.steps[i - 1].stop_reason == "length"]
    assert after_cut and all(res.steps[i].source == "target" for i in after_cut)
    reasons = {d["verdict"]["reason"] for c in res.trace for d in c["drafts"] if d["verdict"] and "reason" in d["verdict"]}
    assert "after cut step" in reasons
    loose = decode(method, Q, target, draft, build_verifier("accept_all"), opts.replace(judge_after_cut=True))
    assert any(loose.steps[i].source == "draft" for i in range(1, len(loose.steps))
               if loose.steps[i - 1].stop_reason == "length")


def test_boxed_drafts_are_refused_only_when_asked():
    from specprobe.infer.decoding.common import GenState
    from specprobe.infer.engines.base import Step

    target, draft = ToyEngine("target"), ToyEngine("draft")
    boxed = Step("so the answer is \\boxed{3}\n\n", [1, 2, 3], "delimiter", -1.0)
    plain = Step("one plus two\n\n", [1, 2], "delimiter", -1.0)
    assert GenState(Q, target, draft, options(), "lr_sync").unacceptable(boxed) is None
    strict = GenState(Q, target, draft, options(refuse_boxed=True), "lr_sync")
    assert strict.unacceptable(boxed) == "boxed answer" and strict.unacceptable(plain) is None


@pytest.mark.parametrize("method", SPEC)
def test_each_judged_draft_carries_the_features_of_its_own_step(method):
    """A probe verifier reads, for each draft it judges, the hidden states of that draft's own tokens under both
    models (not a neighbour's: the toy's features are its step's length and token sum mod 7, so a shifted
    attachment shows)."""
    from specprobe.infer.verifiers import ProbePairVerifier

    from _probe_fixtures import make_input_probe

    target, draft = ToyEngine("target"), ToyEngine("draft")
    seen = []

    class Spy(ProbePairVerifier):
        def _score(self, items):
            seen.extend(items)
            return super()._score(items)

    verifier = Spy(make_input_probe(target, 0.0, 1), make_input_probe(draft, 0.5, 2))
    decode(method, Q, target, draft, verifier, options(0.8, cap=12, max_steps=10, accept_length_cut=True))
    assert len(seen) >= 5
    own = set()
    for item in seen:
        ids = target.text.text_ids(item.draft)
        want = [float(sum(ids) % 7), float(len(ids))]
        assert item.target_features[0, :2].tolist() == want == item.draft_features[0, :2].tolist(), item.draft
        own.add(tuple(want))
    assert len(own) > 1  # the drafts' features differ, so a draft given another's would be seen


@pytest.mark.parametrize("method", ["target", *SPEC])
@pytest.mark.parametrize("window", ["target", "draft"])
def test_an_answer_that_fills_a_context_window_ends_there(method, window):
    """A window smaller than the prompt plus max_new_tokens: the answer ends with stop reason max_length when a
    model's window is full, every engine call fits (the toy raises PromptTooLongError otherwise), and the output
    up to there is the unlimited run's (greedy: the caps only shorten the last step)."""
    prompt = len(ToyEngine().prefix_ids(Prefix(Q)))
    engines = {"target": ToyEngine("target"), "draft": ToyEngine("draft")}
    windowed = {**engines, window: ToyEngine(window, max_length=prompt + 40)}
    opts = options(0.0, max_steps=40, accept_length_cut=True)

    def run(pair):
        if method == "target":
            return decode("target", Q, pair["target"], None, None, opts)
        return decode(method, Q, pair["target"], pair["draft"], BernoulliVerifier(0.5), opts)

    res, unlimited = run(windowed), run(engines)
    assert unlimited.stop_reason == "max_steps" and unlimited.stats.output_tokens > 60
    if method == "target" and window == "draft":  # the draft takes no part
        assert res.text == unlimited.text
        return
    assert res.stop_reason == "max_length" and prompt + res.stats.output_tokens == prompt + 40
    assert unlimited.text.startswith(res.text)


def test_a_thought_search_stays_inside_the_context_window():
    """Tree of thoughts caps each beam's next thought by its own room in the window, and the answer it commits
    ends at max_length (a thought past the window raised PromptTooLongError)."""
    prompt = len(ToyEngine().prefix_ids(Prefix(Q)))
    target = ToyEngine("target", max_length=prompt + 20)
    res = decode("tot_target", Q, target, None, BernoulliVerifier(0.5), options(0.8, max_steps=10,
                                                                               accept_length_cut=True))
    assert res.stop_reason == "max_length" and res.stats.output_tokens == 20
