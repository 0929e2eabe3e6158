"""gamma=adaptive in the runtime: the simulated heterogeneous acceptance, the policy's decisions as the loops
take them, losslessness where the method is lossless, the acceptance probe on a real engine, and the bench
suffix. Exact relations run on the toy engines (integer arithmetic); the probe runs on a random-weight Llama."""
from __future__ import annotations

import importlib
import math
from collections import Counter

import pytest
from _toy_engine import ToyEngine

from specprobe.infer.acceptance_estimate import (
    LatentDifficulty,
    SimulatedAcceptance,
    load_acceptance_probe,
)
from specprobe.infer.checkpoint_format import CheckpointError
from specprobe.infer.decoding import DecodeOptions, decode
from specprobe.infer.decoding.depth import AdaptiveDepth
from specprobe.infer.engines import HFStepEngine, Prefix, SamplingParams
from specprobe.infer.engines.base import Step
from specprobe.infer.verifiers import BernoulliVerifier, StepContext, VerifyItem, build_verifier
from specprobe.probes.adaptive_gamma import CycleCosts, drafting_plan, forecast_pays

from _probe_fixtures import make_input_probe

Q = "What is one plus two?"
METHODS = ["lr_sync", "lr_async", "semanticspec"]


class ByPosition:
    """A scripted estimator: the estimate of a draft at answer position i is values[i % len(values)]."""

    name = "scripted"

    def __init__(self, values):
        self.values = list(values)

    def estimate(self, prefix, step):
        return self.values[len(prefix.steps) % len(self.values)]


def options(depth=None, gamma=3, **kw):
    base = dict(gamma=gamma, max_steps=10, max_new_tokens=400, seed=5, depth=depth,
                target_params=SamplingParams(temperature=0.0, max_step_tokens=6))
    base.update(kw)
    return DecodeOptions(**base)


def policy(values, c=0.1, b=(1.0, 1.02, 1.04, 1.06, 1.08), v=(0.05,) * 5):
    return AdaptiveDepth(ByPosition(values), c=c, b=list(b), v=list(v))


# ----------------------------------------------------------------------------- simulated difficulty
def test_latent_difficulty_is_calibrated_reproducible_and_persistent():
    d = LatentDifficulty(easy_alpha=0.9, hard_alpha=0.2, hard_share=0.4, persistence=0.7, noise=0.5, seed=3)
    n = 6000
    alphas = [d.alpha("q", i) for i in range(n)]
    estimates = [d.estimate("q", i) for i in range(n)]
    # calibrated: among positions with the same estimate, the mean true α is that estimate
    for value in set(estimates):
        picked = [a for a, e in zip(alphas, estimates) if e == value]
        sd = math.sqrt(0.7 * 0.7 * 0.25 / len(picked))
        assert abs(sum(picked) / len(picked) - value) < 5 * sd + 1e-9, value
    assert abs(sum(a == 0.2 for a in alphas) / n - 0.4) < 0.06  # the prior is the long-run hard share
    # persistence: the class repeats more often than independent draws would (0.4² + 0.6² = 0.52)
    same = sum(alphas[i] == alphas[i + 1] for i in range(n - 1)) / (n - 1)
    assert same > 0.75
    # the same positions get the same classes in any order, and another question other classes
    again = LatentDifficulty(0.9, 0.2, 0.4, 0.7, 0.5, seed=3)
    assert [again.alpha("q", i) for i in reversed(range(300))] == alphas[:300][::-1]
    assert [d.alpha("other", i) for i in range(300)] != alphas[:300]


def test_latent_difficulty_noise_extremes():
    sharp = LatentDifficulty(0.9, 0.2, 0.5, noise=0.0)
    assert all(sharp.estimate("q", i) == sharp.alpha("q", i) for i in range(200))
    blind = LatentDifficulty(0.9, 0.2, 0.5, noise=1.0)
    assert all(blind.estimate("q", i) == pytest.approx(blind.mean_alpha) for i in range(200))
    with pytest.raises(ValueError, match="noise"):
        LatentDifficulty(noise=1.5)


def test_bernoulli_with_difficulty_accepts_at_each_positions_alpha():
    d = LatentDifficulty(easy_alpha=0.9, hard_alpha=0.1, hard_share=0.5, seed=1)
    verifier = BernoulliVerifier(0.5, d)
    counts = Counter()
    for i in range(400):
        steps = tuple(["s"] * i)
        verdicts = verifier.verify([VerifyItem(StepContext("q", steps), "x", seed=1000 * i + r) for r in range(10)])
        counts[(d.is_hard("q", i), "n")] += 10
        counts[(d.is_hard("q", i), "acc")] += sum(v.accepted for v in verdicts)
    for hard, alpha in ((True, 0.1), (False, 0.9)):
        n = counts[(hard, "n")]
        assert abs(counts[(hard, "acc")] / n - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / n)
    est = SimulatedAcceptance(d)
    assert est.estimate(Prefix("q", ("a", "b")), Step("x", [1], "delimiter", 0.0)) == d.alpha("q", 2)


# ----------------------------------------------------------------------------- the loops
@pytest.mark.parametrize("method", METHODS)
def test_reject_all_with_the_adaptive_depth_is_still_target_only(method):
    target, draft = ToyEngine("target"), ToyEngine("draft")
    base = decode("target", Q, target, None, None, options())
    res = decode(method, Q, target, draft, build_verifier("reject_all"), options(policy([0.95, 0.05, 0.9])))
    assert [s.token_ids for s in res.steps] == [s.token_ids for s in base.steps]
    assert res.stats.depth_kept[0] > 0 and sum(res.stats.depth_kept[1:]) > 0  # some cycles skipped, some drafted
    assert res.stats.judged > 0


@pytest.mark.parametrize("method", METHODS)
def test_certain_acceptance_and_free_batching_draft_to_gamma_max(method):
    """a ≡ 1, b = 1: the policy drafts gamma_max steps each cycle, the fixed-γ output exactly."""
    target, draft = ToyEngine("target"), ToyEngine("draft")
    opts = options(accept_length_cut=True)
    fixed = decode(method, Q, target, draft, build_verifier("accept_all"), opts)
    adaptive = decode(method, Q, target, draft, build_verifier("accept_all"),
                      opts.replace(depth=policy([1.0], b=[1.0], v=[0.05])))
    assert adaptive.text == fixed.text
    assert adaptive.stats.depth_kept[0] == 0
    if method != "lr_async":  # async records each first-position decision instead of cycles
        records = [rec["depth"] for rec in adaptive.trace if "depth" in rec]
        assert records[0]["kept"] == 3 and all(r["kept"] == r["drafted"] for r in records)


@pytest.mark.parametrize("method", ["lr_sync", "semanticspec"])
def test_each_cycle_drafts_and_keeps_what_the_pure_policy_says(method):
    target, draft = ToyEngine("target"), ToyEngine("draft")
    values = [0.95, 0.95, 0.1, 0.9, 0.05, 0.97]
    depth = policy(values, c=0.1, b=[1.0, 1.1, 1.2, 1.3, 1.4], v=[0.1, 0.12, 0.14, 0.16, 0.18])
    res = decode(method, Q, target, draft, build_verifier("bernoulli", alpha=0.7), options(depth, gamma=4,
                                                                                          accept_length_cut=True))
    kind = "lookahead" if method == "lr_sync" else "semanticspec"
    costs = CycleCosts(0.1, b=[1.0, 1.1, 1.2, 1.3, 1.4], v=[0.1, 0.12, 0.14, 0.16, 0.18], kind=kind)
    cycles = [rec for rec in res.trace if "depth" in rec]
    for rec in res.trace:
        start = rec["start_step"]
        g = min(4, 10 - start - (1 if method == "lr_sync" else 0))  # sync LR leaves room for the target's step
        if "depth" not in rec:
            assert g == 0
            continue
        wanted = [values[(start + i) % len(values)] for i in range(g)]
        assert (rec["depth"]["drafted"], rec["depth"]["kept"]) == drafting_plan(wanted, costs, g), rec
        # dropped drafts are never judged nor committed
        assert len(rec["drafts"]) <= rec["depth"]["kept"] and len(rec["positions"]) <= rec["depth"]["kept"]
        assert sum(c["source"] == "draft" for c in rec["committed"]) <= rec["depth"]["kept"]
        if rec["depth"]["kept"] == 0:
            assert [c["source"] for c in rec["committed"]] == ["target"]
    assert sum(res.stats.depth_kept) == len(cycles)


class ByPositionAndText(ByPosition):
    """Like ByPosition, nudged by the step's text: an estimate stored with the wrong draft shows."""

    def estimate(self, prefix, step):
        return max(0.0, super().estimate(prefix, step) - 0.01 * (sum(map(ord, step.text)) % 5))


@pytest.mark.parametrize("skip,whole_steps,budget", [(False, False, 400), (True, False, 400), (False, True, 60),
                                                     (True, True, 60)])
def test_semanticspec_reuses_drafts_past_the_kept_depth_with_the_same_output_and_decisions(monkeypatch, skip,
                                                                                          whole_steps, budget):
    """When every kept draft is accepted, the drafts past the kept depth were written after the next cycle's own
    prefix: reusing them (with their estimates) gives redrafting's output and decisions with fewer draft steps
    generated; with the forecast skip (which decides first and drops them), with drafts cut by the token cap
    refused, and with a token budget that ends the answer."""
    loop = importlib.import_module("specprobe.infer.decoding.semanticspec")  # the package exports the function

    values = [0.95, 0.95, 0.1, 0.9, 0.05, 0.97, 0.95, 0.2, 0.9, 0.9, 0.15]
    depth = AdaptiveDepth(ByPositionAndText(values), c=0.3, b=[1.0] * 5, v=[0.1, 0.12, 0.14, 0.16, 0.18])
    opts = options(depth, gamma=4, max_steps=24, max_new_tokens=budget, accept_length_cut=not whole_steps,
                   forecast_skip=skip, target_params=SamplingParams(temperature=0.0, max_step_tokens=5))

    def run():
        return decode("semanticspec", Q, ToyEngine("target"), ToyEngine("draft"),
                      build_verifier("bernoulli", alpha=0.9), opts)

    reused = run()
    cycle = loop._cycle  # redrafting: every cycle starts with no spare drafts
    monkeypatch.setattr(loop, "_cycle", lambda state, *args: cycle(state, *args[:-1], loop._Spare()))
    redrafted = run()
    assert [s.token_ids for s in reused.steps] == [s.token_ids for s in redrafted.steps]
    assert reused.stop_reason == redrafted.stop_reason == ("max_new_tokens" if budget < 100 else "max_steps")

    def decisions(res):
        return [[{k: v for k, v in r["depth"].items() if k != "reused"}, r["positions"], r["committed"]]
                for r in res.trace]

    assert decisions(reused) == decisions(redrafted)
    n = reused.stats.draft_steps_reused
    # with the skip, the low estimate that ends a chain is the next forecast, so spares are mostly dropped
    assert n >= (0 if skip else 2) and redrafted.stats.draft_steps_reused == 0
    assert reused.stats.draft_steps == redrafted.stats.draft_steps - n
    assert sum(r["depth"].get("reused", 0) for r in reused.trace) == n
    assert any(r["depth"].get("skipped") for r in reused.trace) is skip
    # a reused draft sits where the previous cycle drafted it past its kept depth, after all its kept drafts passed
    for before, after in zip(reused.trace, reused.trace[1:]):
        if after["depth"].get("reused"):
            kept = before["depth"]["kept"]
            assert 0 < kept < before["depth"]["drafted"] and len(before["positions"]) == kept
            assert all(p["accepted"] for p in before["positions"])
            assert after["depth"]["estimates"][:after["depth"]["reused"]] == before["depth"]["estimates"][kept:]


def test_async_skips_a_first_draft_that_does_not_pay_whatever_the_timing():
    target, draft = ToyEngine("target"), ToyEngine("draft")
    values = [0.95, 0.02, 0.95, 0.9, 0.02]
    runs = [decode("lr_async", Q, target, draft, build_verifier("bernoulli", alpha=0.8), options(policy(values)))
            for _ in range(2)]
    assert runs[0].text == runs[1].text
    skipped = [rec for rec in runs[0].trace if rec.get("depth", {}).get("skipped")]
    assert skipped and all(not rec["positions"] for rec in skipped)
    assert all(values[rec["start_step"] % len(values)] == 0.02 for rec in skipped)


def test_async_forecasts_the_drafts_after_the_first_like_the_drafting_rule():
    """Where one more target row costs nearly a step (b(2) = 2), one draft alone never pays but an easy stretch
    does: a first draft estimated 0.9 is judged (the drafts after it are forecast at 0.9, as when drafting), one
    estimated 0.2 is skipped."""
    target, draft = ToyEngine("target"), ToyEngine("draft")
    steep = (1.0, 2.0, 2.2, 2.4, 2.6)
    for value, skip in ((0.9, False), (0.2, True)):
        res = decode("lr_async", Q, target, draft, build_verifier("bernoulli", alpha=0.8),
                     options(policy([value], b=steep)))
        decisions = [rec["depth"]["skipped"] for rec in res.trace
                     if rec.get("depth", {}).get("estimate") == value]  # (a draft the runtime refuses gets 0)
        assert len(decisions) >= 3 and set(decisions) == {skip}, value
        assert any(c["source"] == "draft" for rec in res.trace for c in rec["committed"]) is not skip
    # the first draft exists when it is judged: a dear draft (c ~ 0.5, the H100's 1.5B -> 7B) whose target row alone
    # pays (1.55 / 1.089 > 1) is judged, though drafting it would not have paid ((1.55) / (0.515 + 1.089) < 1)
    res = decode("lr_async", Q, target, draft, build_verifier("bernoulli", alpha=0.8),
                 options(policy([0.55], c=0.515, b=(1.0, 1.089, 1.145, 1.15, 1.25))))
    decisions = [rec["depth"]["skipped"] for rec in res.trace if rec.get("depth", {}).get("estimate") == 0.55]
    assert len(decisions) >= 3 and not any(decisions)


@pytest.mark.parametrize("method,width", [("lr_sync", 1), ("semanticspec", 1), ("lr_sync", 2)])
def test_the_forecast_skip_drafts_nothing_where_the_last_estimate_says_no_draft_pays(method, width):
    """forecast_skip: a cycle drafts nothing exactly when its steps, forecast at the last estimate known (the
    previous cycle's last draft, or the target step a skipped cycle wrote; W = 2: a level's 1 - (1 - a)^2) would
    not pay; the target writes the step and its estimate is the next forecast. Reject-all still writes
    target-only's tokens, with fewer draft calls."""
    target, draft = ToyEngine("target"), ToyEngine("draft")
    values = [0.95, 0.95, 0.02, 0.02, 0.02, 0.95, 0.95, 0.02]
    b, v = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], [0.1, 0.12, 0.14, 0.16, 0.18]
    costs = CycleCosts(0.1, b=b, v=v, kind="lookahead" if method == "lr_sync" else "semanticspec", width=width)
    opts = options(policy(values, b=b, v=v), gamma=4 if width == 1 else 2, max_steps=16, accept_length_cut=True,
                   width=width, draft_params=SamplingParams(temperature=0.8 if width > 1 else 0.0, max_step_tokens=6))
    base = decode("target", Q, target, None, None, opts.replace(depth=None, width=1))
    plain = decode(method, Q, target, draft, build_verifier("reject_all"), opts)
    res = decode(method, Q, target, draft, build_verifier("reject_all"), opts.replace(forecast_skip=True))
    assert [s.token_ids for s in res.steps] == [s.token_ids for s in base.steps]
    left, kinds = None, []  # the forecast each cycle leaves for the next
    for rec in res.trace:
        depth = rec.get("depth")
        if depth is None:
            continue
        forecast, skipped = depth["forecast"], bool(depth.get("skipped"))
        assert forecast == (None if left is None else pytest.approx(left))
        g = min(opts.gamma, 16 - rec["start_step"] - (1 if method == "lr_sync" else 0))
        assert skipped == (forecast is not None and not forecast_pays(forecast, costs, g)), rec
        kinds.append(skipped)
        if not skipped:
            left = depth["estimates"][-1]
            continue
        assert rec["drafts"] == [] and [c["source"] for c in rec["committed"]] == ["target"]
        if "target_estimate" not in depth:  # the answer ended on this step: nothing more to forecast
            assert rec is res.trace[-1]
            continue
        left = depth["target_estimate"]
        assert left == pytest.approx(1 - (1 - values[rec["start_step"] % len(values)]) ** width)  # the target's step
    assert True in kinds and kinds[kinds.index(True):].count(False) > 0  # skips, then drafts again
    assert res.stats.depth_drafted[0] == kinds.count(True)
    assert res.stats.draft_calls < plain.stats.draft_calls and plain.stats.depth_drafted[0] == 0


# ----------------------------------------------------------------------------- the acceptance probe, for real
@pytest.fixture(scope="module")
def tiny_pair():
    engine = HFStepEngine("random:llama-tiny", device="cpu")
    return engine, HFStepEngine("random:llama-tiny", model=engine.model, tokenizer=engine.tokenizer)


def test_acceptance_probe_reads_the_drafts_own_hidden_states(tiny_pair, tmp_path):
    target, draft = tiny_pair
    probe = make_input_probe(draft, bias=0.0, seed=2)
    probe.save(tmp_path, "probe_acceptance")
    est = load_acceptance_probe(tmp_path, draft)
    prefix = Prefix("Tom has 3 apples and buys 2 more.")
    steps = [Step(t, [], "delimiter", 0.0) for t in ("He now has 5 apples.\n\n", "Zebra quantum cheese!\n\n")]
    values = [est.estimate(prefix, s) for s in steps]
    for s, value in zip(steps, values):
        scored = draft.score(prefix, [s.text], hidden=True, layers=list(probe.spec.layers)).steps[0]
        feats = scored.mean_hidden if probe.spec.pooling == "mean" else scored.last_hidden
        assert value == pytest.approx(float(probe.predict_proba(feats.unsqueeze(0))[0]), abs=1e-6)
    assert 0 <= min(values) and max(values) <= 1 and values[0] != pytest.approx(values[1], abs=1e-4)
    # in a run: SemanticSpec with the probe's estimates and measured costs
    res = decode("semanticspec", Q, target, draft, build_verifier("bernoulli", alpha=0.5),
                 options(AdaptiveDepth(est, repeats=1), max_steps=4,
                         target_params=SamplingParams(temperature=0.0, max_step_tokens=4)))
    assert len(res.steps) == 4 and sum(res.stats.depth_kept) == res.stats.cycles
    assert all(0 <= a <= 1 for rec in res.trace for a in rec["depth"]["estimates"])


def test_a_missing_or_mismatched_acceptance_probe_says_what_to_do(tiny_pair, tmp_path):
    _, draft = tiny_pair
    with pytest.raises(CheckpointError, match="probe_acceptance.*run with a fixed gamma"):
        load_acceptance_probe(tmp_path, draft)
    other = HFStepEngine("random:llama-20m", device="cpu")
    make_input_probe(other).save(tmp_path, "probe_acceptance")
    with pytest.raises(CheckpointError, match="draft model"):
        load_acceptance_probe(tmp_path, draft)


def test_multi_branch_levels_use_the_level_acceptance():
    """W = 2: a level's estimate is 1 - (1 - mean)^W; reject-all still writes target-only's tokens, and a level
    whose estimate does not pay is dropped with everything under it."""
    target, draft = ToyEngine("target"), ToyEngine("draft")
    wide = options(policy([0.95, 0.05, 0.9]), width=2, accept_length_cut=True,
                   draft_params=SamplingParams(temperature=0.8, max_step_tokens=6))
    base = decode("target", Q, target, None, None, options())
    res = decode("lr_sync", Q, target, draft, build_verifier("reject_all"), wide)
    assert [s.token_ids for s in res.steps] == [s.token_ids for s in base.steps]
    records = [rec for rec in res.trace if "depth" in rec]
    assert records
    for rec in records:
        depth = rec["depth"]
        first = [0.95, 0.05, 0.9][rec["start_step"] % 3]
        assert depth["estimates"][0] == pytest.approx(1 - (1 - first) ** 2)
        assert all(d["depth"] < depth["kept"] for d in rec["drafts"])  # no draft past the kept depth is judged
        assert len(rec["targets"]) <= 1 + 2 + 4  # rows: the root and at most two levels of two branches


def test_measured_costs_are_kept_per_model_pair_not_per_engine_object():
    depth = AdaptiveDepth(ByPosition([0.9]), repeats=1)
    params = SamplingParams(temperature=0.0, max_step_tokens=4)
    first = depth.costs("lookahead", 1, 2, ToyEngine("target"), ToyEngine("draft"), params)
    again = depth.costs("lookahead", 1, 2, ToyEngine("target"), ToyEngine("draft"), params)  # new objects
    assert again == first and len(depth._measured) == 1
    assert first.c > 0 and len(first.b) == 3 and first.b[0] == 1.0
    depth.costs("semanticspec", 1, 2, ToyEngine("target"), ToyEngine("draft"), params)
    assert len(depth._measured) == 2  # another cycle shape is measured on its own


class ClockedEngine:
    """An engine double whose generate advances a fake clock: `first` seconds on its first call of a batch shape
    (the capture the warm-up pays), then per row `row_s` plus the next of `jitter`; it records the prefixes."""

    def __init__(self, clock, row_s, first=100.0, jitter=(0.0, 0.0, 9.0)):
        self.clock, self.row_s, self.first, self.jitter = clock, row_s, first, list(jitter)
        self.seen, self.calls = set(), []

    def generate(self, requests, params):
        k = len(requests)
        self.calls.append([r.prefix.steps for r in requests])
        jitter = self.jitter[len(self.calls) % len(self.jitter)]
        self.clock[0] += self.first if k not in self.seen else k * self.row_s + jitter
        self.seen.add(k)


def test_batch_cost_is_the_median_step_of_k_nested_rows_over_one_row(monkeypatch):
    """b(k), as gamma=adaptive measures it: k rows after nested prefixes, the warm-up call untimed, the median of the
    timed calls (an outlier left out), over one row's; c the draft's one-row step over the target's."""
    depth_mod = importlib.import_module("specprobe.infer.decoding.depth")
    clock = [0.0]
    monkeypatch.setattr(depth_mod.time, "perf_counter", lambda: clock[0])
    target, draft = ClockedEngine(clock, row_s=2.0), ClockedEngine(clock, row_s=0.5)
    params = SamplingParams(temperature=0.0, max_step_tokens=4)
    c, b, v = depth_mod.measure_costs(target, draft, params, rows=3, chain=0, repeats=3)
    assert b == pytest.approx([1.0, 2.0, 3.0]) and c == pytest.approx(0.25) and v == []
    assert target.calls[-1] == [(), ("Next.",), ("Next.", "Next.")]  # each row's prefix continues the one before
    def sync():  # a device's queued work, timed with the call
        clock[0] += 1.0

    times = depth_mod.nested_step_seconds(target, Prefix(Q), params, [2], repeats=3, filler="step", sync=sync)
    assert times == {2: pytest.approx(4.0 + 1.0)} and target.calls[-1] == [(), ("step",)]


class LengthEngine:
    """Time in proportion to the tokens written; a step ends at the runtime's delimiter after `ends` tokens."""

    def __init__(self, clock, token_s: float, ends: int):
        self.clock, self.token_s, self.ends = clock, token_s, ends

    def generate(self, requests, params):
        tokens = min(self.ends, params.max_step_tokens) if params.delimiter == "\n\n" else params.max_step_tokens
        self.clock[0] += len(requests) * tokens * self.token_s


def test_costs_compare_steps_of_one_length(monkeypatch):
    """A draft that ends its first step after 2 tokens and a target after 8 (each at its own "\n\n") cost 0.25
    and 1 a token: c is 0.25, the ratio of speeds, not 0.0625, the ratio of those two steps' times."""
    depth_mod = importlib.import_module("specprobe.infer.decoding.depth")
    clock = [0.0]
    monkeypatch.setattr(depth_mod.time, "perf_counter", lambda: clock[0])
    target, draft = LengthEngine(clock, 1.0, ends=8), LengthEngine(clock, 0.25, ends=2)
    c, b, _ = depth_mod.measure_costs(target, draft, SamplingParams(temperature=0.0, max_step_tokens=16), rows=2,
                                      chain=0, repeats=3)
    assert c == pytest.approx(0.25) and b == pytest.approx([1.0, 2.0])


# ----------------------------------------------------------------------------- the benchmark's comparison
def test_the_adaptive_benchmark_compares_with_the_fixed_gamma_best_in_hindsight():
    from _scripts import benchmark_script

    script = benchmark_script("bench_adaptive_gamma")

    def row(method, lat):
        return {"method": method, "latencies_s": lat, "acceptance": 0.5, "depth_kept": {}, "mean_depth_kept": 0,
                "depth_policy": {}}

    lat = {"target": [10, 10, 10, 10], "lr_sync:gamma=1": [8, 8, 8, 8], "lr_sync:gamma=2": [6, 7, 6, 7],
           "lr_sync:gamma=3": [7, 7, 7, 7], "lr_sync:gamma=adaptive": [5, 6, 5, 6]}
    got = script.compare({"rows": [row(m, v) for m, v in lat.items()]}, "lr_sync", [1, 2, 3])
    assert got["best_fixed_gamma"] == 2
    assert got["adaptive_over_best_fixed"] == pytest.approx(26 / 22)
    low, high = got["adaptive_over_best_fixed_ci95"]
    assert 7 / 6 <= low <= 26 / 22 <= high <= 6 / 5  # between the per-problem ratios, around the total's
    assert got["speedup_over_target"]["lr_sync:gamma=adaptive"] == pytest.approx(40 / 22)
    assert got["per_problem_median"] == pytest.approx((7 / 6 + 6 / 5) / 2)


def test_pooled_runs_compare_over_all_their_problems(tmp_path):
    import json

    from _scripts import benchmark_script

    script = benchmark_script("bench_adaptive_gamma")

    def report(problems, lat, acc, judged, kept):
        return {"problems": problems,
                "rows": [{"method": m, "latencies_s": v, "acceptance": None if m == "target" else acc,
                          "judged": 0 if m == "target" else judged, "depth_kept": [] if m == "target" else kept,
                          "mean_depth_kept": 0, "depth_policy": {}} for m, v in lat.items()]}

    first = report(["p0", "p1"], {"target": [10, 10], "lr_sync:gamma=1": [8, 8], "lr_sync:gamma=2": [6, 9],
                                  "lr_sync:gamma=adaptive": [5, 7]}, 0.5, 10, [1, 2])
    second = report(["p2", "p3"], {"target": [10, 10], "lr_sync:gamma=1": [7, 7], "lr_sync:gamma=2": [9, 9],
                                   "lr_sync:gamma=adaptive": [6, 6]}, 0.8, 30, [0, 1, 3])
    pooled = script.pool_reports([("one", first), ("two", second)])
    got = script.compare(pooled, "lr_sync", [1, 2])
    # over all four problems γ = 1 is best (30 s against 33 s), though γ = 2 was in the first run alone (15 < 16)
    assert script.compare(first, "lr_sync", [1, 2])["best_fixed_gamma"] == 2
    assert got["best_fixed_gamma"] == 1
    assert got["adaptive_over_best_fixed"] == pytest.approx(30 / 24)
    assert got["per_problem_median"] == pytest.approx(7 / 6)  # of 8/5, 8/7, 7/6, 7/6
    assert got["speedup_over_target"]["lr_sync:gamma=adaptive"] == pytest.approx(40 / 24)
    assert got["acceptance"]["lr_sync:gamma=adaptive"] == pytest.approx((0.5 * 10 + 0.8 * 30) / 40)
    assert got["adaptive_depth_kept"] == [1, 3, 3]
    assert pooled["rows"][-1]["mean_depth_kept"] == pytest.approx((3 + 6) / 7)
    # no families: problems resampled; two runs whose problems come from two templates: whole templates, by
    # probe-bench's rule (the interval then resamples 2 units, not 4)
    assert pooled["families"] is None
    plain = script.ratio_ci95([8, 8, 7, 7], [5, 7, 6, 6])
    assert tuple(got["adaptive_over_best_fixed_ci95"]) == pytest.approx(plain)
    templated = script.pool_reports([("one", dict(first, families={"p0": "t0", "p1": "t0"})),
                                     ("two", dict(second, families={"p2": "t1", "p3": "t1"}))])
    assert templated["families"] == {"p0": "t0", "p1": "t0", "p2": "t1", "p3": "t1"}
    by_family = script.compare(templated, "lr_sync", [1, 2])["adaptive_over_best_fixed_ci95"]
    assert tuple(by_family) == pytest.approx(script.bench.speedup_interval([8, 8, 7, 7], [5, 7, 6, 6],
                                                                            ["t0", "t0", "t1", "t1"])[0])
    assert tuple(by_family) != pytest.approx(plain)
    with pytest.raises(ValueError, match="'p1' was also timed in one"):
        script.pool_reports([("one", first), ("again", report(["p1", "p4"], {}, 0.5, 1, []))])
    other = dict(second, rows=second["rows"][:-1])
    with pytest.raises(ValueError, match="methods"):
        script.pool_reports([("one", first), ("two", other)])
    failed = dict(second, rows=[*second["rows"][:-1], dict(second["rows"][-1], latencies_s=[6], error="OOM")])
    with pytest.raises(ValueError, match="lr_sync:gamma=adaptive has 1 latencies for 2 problems"):
        script.pool_reports([("one", first), ("two", failed)])
    with pytest.raises(ValueError, match="config.runtime differs"):
        script.pool_reports([("one", dict(first, config={"runtime": {"max_steps": 8}})),
                             ("two", dict(second, config={"runtime": {"max_steps": 16}}))])
    # the command line reads the files and writes the pooled table
    files = []
    for name, rep in (("one", first), ("two", second)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(rep))
    assert script.main(["--scenarios", "b", "--methods", "lr_sync", "--gammas", "1,2", "--pool", *map(str, files),
                        "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "pooled.md").read_text()
    assert "Pooled over 4 problems of 2 runs" in text and "best fixed γ in hindsight: 1" in text
    assert json.loads((tmp_path / "out" / "pooled.json").read_text())["problems"] == ["p0", "p1", "p2", "p3"]
