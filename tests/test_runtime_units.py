"""Pure pieces of the runtime: seeds, stats arithmetic, analytic predictions, answers, method parsing."""
from __future__ import annotations

import pytest

from specprobe.infer.answers import answers_match, extract_answer, extract_boxed, grade, to_number
from specprobe.infer.bench import parse_method
from specprobe.infer.decoding.analytic import predict, semanticspec_speedup, token_level_factor
from specprobe.infer.decoding.metrics import RunStats, join_steps, replay_text, stats_from_trace
from specprobe.infer.engines.base import seed_for
from specprobe.inputs.config import ConfigError
from specprobe.probes.speedup import async_speedup, sync_speedup, token_sd_speedup


def test_seed_for_is_stable_and_separates_its_parts():
    assert seed_for(0, "target", "abc", 0) == seed_for(0, "target", "abc", 0)
    seeds = {seed_for(0, "target", "abc", 0), seed_for(1, "target", "abc", 0), seed_for(0, "draft", "abc", 0),
             seed_for(0, "target", "abd", 0), seed_for(0, "target", "abc", 1)}
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)
    assert seed_for(7, "x") == 2500374159468678587  # pinned: a seed must mean the same run on every machine


def test_run_stats_derived_values_and_merge():
    a = RunStats(method="m", problems=1, cycles=2, output_tokens=100, target_tokens=40, latency_s=2.0)
    for pos, ok in [(0, True), (1, False), (0, True), (1, True), (2, False)]:
        a.record_position(pos, ok)
    assert a.judged == 5 and a.accepted == 3 and a.acceptance_rate == 0.6
    assert a.acceptance_by_position == [1.0, 0.5, 0.0] and a.mean_accepted_per_cycle == 1.5
    assert a.ratio == 0.4 and a.tokens_per_second == 50.0
    b = RunStats(problems=1, cycles=1, output_tokens=50, target_tokens=50, latency_s=1.0, stop_reasons={"eos": 1})
    b.record_position(0, False)
    m = a.merge(b)
    assert m.judged_by_position == [3, 2, 1] and m.accepted_by_position == [2, 1, 0]
    assert m.problems == 2 and m.output_tokens == 150 and m.ratio == 0.6 and m.stop_reasons == {"eos": 1}
    assert RunStats().acceptance_rate is None and RunStats().ratio is None


def test_trace_helpers():
    # steps are joined as written: a step cut by the token cap ("b") is continued, no delimiter invented
    assert join_steps(["a\n\n", "b", "c"]) == "a\n\nbc"
    recs = [{"cycle": 0, "positions": [{"position": 0, "accepted": True}],
             "committed": [{"text": "x\n\n", "source": "draft", "tokens": 2}, {"text": "y", "source": "target", "tokens": 3}]}]
    assert replay_text(recs) == "x\n\ny"
    st = stats_from_trace(recs)
    assert (st.cycles, st.accepted, st.output_tokens, st.target_tokens) == (1, 1, 5, 3)


def test_analytic_predictions():
    # the check values of the paper (α = 0.63, c = 0.1, k = 6): f_sync = 1.689, S2 = 2.258
    ideal = predict("lr_sync", 0.63, 0.1, 5)
    assert ideal["k"] == 6 and ideal["ideal"] == pytest.approx(1.689, abs=1e-3) and ideal["adjusted"] is None
    assert predict("lr_async", 0.63, 0.1, 5)["ideal"] == pytest.approx(2.258, abs=1e-3)
    # batch cost b: the target step costs b, the draft still c: f(α, c/b, k) / b
    adj = predict("lr_sync", 0.6, 0.1, 3, b=1.5)["adjusted"]
    assert adj == pytest.approx(sync_speedup(0.6, 0.1 / 1.5, 4) / 1.5)
    assert adj == pytest.approx((1 - 0.6**4) / ((1 - 0.6) * (1.5 + 3 * 0.1)))
    assert predict("lr_async", 0.6, 0.1, 3, b=1.0)["adjusted"] == pytest.approx(async_speedup(0.6, 0.1, 4))
    assert predict("draft", None, 0.25, 3)["ideal"] == 4.0
    assert predict("lr_sync", None, 0.1, 3)["ideal"] is None


def test_semanticspec_formula():
    # α = 1: γ steps per cycle costing γc + τ
    assert semanticspec_speedup(1.0, 0.1, 3, 0.2) == pytest.approx(3 / (0.3 + 0.2))
    # α = 0: one target step per cycle after γ drafts: 1 / (γc + τ + 1)
    assert semanticspec_speedup(0.0, 0.1, 3, 0.0) == pytest.approx(1 / 1.3)
    # direct evaluation of the closed form
    a, c, g, t = 0.6, 0.1, 3, 0.05
    assert semanticspec_speedup(a, c, g, t) == pytest.approx((1 - a**g) / ((1 - a) * (g * c + t + 1 - a**g)))
    with pytest.raises(ValueError):
        semanticspec_speedup(0.5, 0.1, 0)
    assert token_level_factor(0, 0) is None
    assert token_level_factor(8, 2) == pytest.approx(5.0)  # α = 1, 4 tokens per round, c = 0
    # 3 of 8 proposed tokens accepted in 2 rounds: each verifying forward yields 2.5 tokens, as g(α) does at
    # the per-token α whose expected acceptances per round of 4 are 1.5 (not at 3/8, which gives 1.59)
    from scipy.optimize import brentq

    alpha = brentq(lambda a: a * (1 - a ** 4) / (1 - a) - 1.5, 1e-6, 1 - 1e-6)
    assert token_level_factor(3, 2) == pytest.approx(2.5) == pytest.approx(float(token_sd_speedup(alpha, 0.0, 4)))


@pytest.mark.parametrize("alpha,c,gamma,tau", [(0.7, 0.15, 3, 0.2), (0.3, 0.5, 5, 0.0), (0.95, 0.05, 1, 0.4)])
def test_the_adaptive_policy_prices_a_fixed_depth_as_the_papers_formulas_do(alpha, c, gamma, tau):
    """The depth policy's cycle model (probes.adaptive_gamma) and the reported predictions (analytic) are two
    statements of one formula: at a constant α and a fixed depth they agree."""
    from specprobe.probes.adaptive_gamma import CycleCosts, expected_speedup

    ss = expected_speedup([alpha] * gamma, gamma, CycleCosts(c, v=[tau] * gamma, kind="semanticspec"))
    assert ss == pytest.approx(semanticspec_speedup(alpha, c, gamma, tau), rel=1e-12)
    b = [1.0 + 0.05 * k for k in range(gamma + 1)]
    lr = expected_speedup([alpha] * gamma, gamma, CycleCosts(c, b=b))
    assert lr == pytest.approx(predict("lr_sync", alpha, c, gamma, b[gamma])["adjusted"], rel=1e-12)


def test_answer_extraction_and_matching():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{42}") == "42"
    assert extract_boxed(r"\boxed{a{b}c}") == "a{b}c" and extract_boxed(r"\boxed{open") is None
    assert extract_answer("The total is 5 + 3 = 8.\n#### 8") == "8"
    assert extract_answer("Thus, the answer is 1,234.") == "1234"  # thousands separators removed
    assert extract_answer(r"\boxed{12,345,678}") == "12345678" and extract_answer(r"\boxed{(1,2)}") == "(1,2)"
    assert extract_answer("We get 12 then 15 apples") == "15"
    assert extract_answer("") is None and extract_answer("no digits") is None
    assert to_number("$1,234.50") == 1234.5 and to_number("50%") == 50 and to_number("12 apples") == 12
    assert to_number(r"\frac{3}{4}") == 0.75 and to_number("-3/4") == -0.75 and to_number("x+1") is None
    assert answers_match("240", "240.0") and answers_match(r"\text{Paris}", "paris")
    assert not answers_match("241", "240") and not answers_match(None, "1")
    assert grade(r"... so the answer is \boxed{240}.", "240") == ("240", True)


def test_parse_method():
    m = parse_method("lr_sync+ngram:gamma=2:width=2")
    assert (m.base, m.token_spec, m.overrides) == ("lr_sync", "ngram", {"gamma": 2, "width": 2})
    assert parse_method("semanticspec:verifier=bernoulli:alpha=0.3").overrides == {"verifier": "bernoulli", "alpha": 0.3}
    for bad in ("lr_magic", "lr_sync+medusa", "lr_sync:gamma", "lr_sync:beta=2", "lr_sync:gamma=x",
                "lr_sync:verifier=oracle"):
        with pytest.raises(ConfigError):
            parse_method(bad)


def test_the_method_registry_drives_decode_and_the_bench():
    """Every registered method decodes through `decode`, and the bench reads its needs from the registry."""
    from specprobe.infer import bench
    from specprobe.infer.decoding import REGISTRY, Method, decode

    listing = bench.list_methods()
    assert all(name in listing for name in REGISTRY) and "gamma=adaptive" in listing
    with pytest.raises(ValueError, match="unknown decoding method 'warp'"):
        decode("warp", "q", None)
    assert {m.name for m in REGISTRY.values() if m.adaptive} == {"semanticspec", "lr_sync", "lr_async"}
    assert [s.label for s in bench.method_specs(["specs", "lr_sync"])] == ["target", "specs", "lr_sync",
                                                                          "beam_target"]
    calls = []  # a method added to the registry is decodable at once
    REGISTRY["probe_me"] = Method("probe_me", lambda *a: calls.append(a) or "ran", "a test", needs_draft=False,
                                  needs_verifier=False)
    try:
        assert decode("probe_me", "q", "T") == "ran" and calls[0][:2] == ("q", "T")
    finally:
        del REGISTRY["probe_me"]
