"""The vLLM engine's wave planner (a pure function: no vLLM needed)."""
import pytest

from specprobe.infer.engines.vllm_engine import prefill_waves


def test_waves_fit_the_step_budget_in_call_order():
    lengths = [150] * 200  # 20 prefixes x 10 seeded samples of ~150 tokens
    waves = prefill_waves(lengths, 4096, 256)
    assert [i for w in waves for i in w] == list(range(200))  # every prompt once, in order
    assert all(sum(lengths[i] for i in w) <= 4096 for w in waves)
    assert [len(w) for w in waves] == [27] * 7 + [11]  # 27 * 150 = 4050 <= 4096 < 28 * 150


def test_waves_respect_the_request_limit_and_refuse_a_prompt_over_budget():
    assert [len(w) for w in prefill_waves([1] * 10, 4096, 4)] == [4, 4, 2]
    assert prefill_waves([4096, 1], 4096, 8) == [[0], [1]]
    with pytest.raises(ValueError, match="prompt 1 has 5000 tokens.*chunked_prefill"):
        prefill_waves([10, 5000], 4096, 8)
