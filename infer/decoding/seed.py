"""SEED: scheduled speculative decoding for tree-of-thoughts search.

Token level: `infer.engines.seed_decoding.SeedGenerator` (draft trees on the draft engine, verified in one
tree-attention forward of the target, scheduled first come first served; lossless per sequence).

Search level (`tot_search`). Breadth-first tree of thoughts (the paper's Alg. 1): every kept state gets n
thoughts (one step each), every new state is scored by a step reward (a specprobe probe or verifier via
`infer.decoding.specs.reward_from_verifier`), the best b are kept, for at most T levels; the answer is the
best state's chain. `seed_tot` writes the thoughts with SeedGenerator, `tot_target` (the baseline) with
the target alone through the engine interface.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specprobe.infer.decoding.common import GenState
from specprobe.infer.engines.base import StepRequest, seed_for
from specprobe.infer.engines.seed_decoding import SeedGenerator, SeedStats
from specprobe.probes.speedup import token_sd_speedup


@dataclass(frozen=True)
class SeedConfig:
    """Tree search (n thoughts per state, best b kept, depth T) and the token tree of each draft round."""

    thoughts: int = 3  # n
    keep: int = 1  # b
    depth: int = 4  # T (the paper: 4 levels for GSM8K)
    k_config: tuple[int, ...] = (2, 2, 1)  # the paper's tree-attention setting; (1, 1, 1) is its base
    threaded: bool = True  # draft in a thread while the target verifies

    def __post_init__(self) -> None:
        for name in ("thoughts", "keep", "depth"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"seed {name} must be an int >= 1, got {getattr(self, name)!r}")
        if not self.k_config or any((not isinstance(k, int)) or k < 1 for k in self.k_config):
            raise ValueError(f"seed k_config must be a non-empty list of ints >= 1, got {self.k_config!r}")


# ----------------------------------------------------------------------------- tree-of-thoughts search
def _seed_thoughts(target, draft, cfg: SeedConfig, opts, generator_box: dict):
    """Thought writer backed by SeedGenerator on the two engines (tree attention, one vocabulary)."""
    tp, dp = opts.target_params, opts.draft_params
    gen = SeedGenerator.from_engines(target, draft, cfg.k_config, temperature=tp.temperature,
                                     draft_temperature=dp.temperature, top_p=tp.top_p, threaded=cfg.threaded)
    generator_box["seed"] = gen

    def write(prefixes, n, caps, seeds):
        return gen.generate_steps(target, prefixes, n, caps, seeds, tp.delimiter)

    return write


def _target_thoughts(target, opts):

    def write(prefixes, n, caps, seeds):
        out = target.generate([StepRequest(p, n, sd, c) for p, sd, c in zip(prefixes, seeds, caps)],
                              opts.target_params)
        write.stats = out.stats
        return out.steps

    return write


def tot_search(question: str, target, draft, reward, opts, cfg: SeedConfig | None = None,
               method: str = "seed_tot"):
    """Breadth-first tree of thoughts; thoughts by SEED (method seed_tot) or the target (tot_target)."""

    cfg = cfg or SeedConfig()
    use_seed = method == "seed_tot"
    if use_seed and draft is None:
        raise ValueError("seed_tot needs a draft engine (or run tot_target)")
    state = GenState(question, target, draft, opts, method)
    box: dict = {}
    write = _seed_thoughts(target, draft, cfg, opts, box) if use_seed else _target_thoughts(target, opts)
    beams: list[tuple[list, int, float]] = [([], 0, 0.0)]  # (steps, tokens, value)
    depth = min(cfg.depth, opts.max_steps)
    for level in range(depth):
        def cap(beam) -> int:  # the step cap, what is left of max_new_tokens and of the context windows
            room = state.room(state.prefix(beam[0]))
            left = min(opts.target_params.max_step_tokens, opts.max_new_tokens - beam[1])
            return left if room is None else min(left, room)

        open_beams = [b for b in beams if not (b[0] and b[0][-1].stop_reason == "eos") and cap(b) > 0]
        if not open_beams:
            break
        prefixes = [state.prefix(b[0]) for b in open_beams]
        caps = [cap(b) for b in open_beams]
        seeds = [seed_for(opts.seed, "thought", state.key(p)) for p in prefixes]
        thoughts = write(prefixes, cfg.thoughts, caps, seeds)
        if not use_seed:
            state.book("target", write.stats, len(prefixes) * cfg.thoughts, calls=1)
        children = []
        for b, pre, group in zip(open_beams, prefixes, thoughts):
            values = _evaluate(state, target, reward, pre, group, seed_for(opts.seed, "value", state.key(pre)))
            children += [(b[0] + [t], b[1] + t.num_tokens, v) for t, v in zip(group, values)]
        closed = [b for b in beams if b not in open_beams]
        pool = closed + children
        order = sorted(range(len(pool)), key=lambda i: -pool[i][2])  # stable: ties keep generation order
        beams = [pool[i] for i in order[:cfg.keep]]
        state.stats.cycles += 1
        state.add_trace({"cycle": level, "values": [c[2] for c in children],
                         "kept": [[s.text for s in b[0]] for b in beams]})
    best = beams[0]
    for step in best[0]:
        if state.done:
            break
        state.commit(step, "target", step.num_tokens)  # SEED is lossless: every token is the target's
    if state.stop_reason is None:
        state.stop_reason = "max_steps"
    if use_seed:
        _book_seed(state, box["seed"].stats)
    return state.finish(method)


def _evaluate(state, target, reward, prefix, steps, seed: int) -> list[float]:
    texts = [s.text for s in steps]
    full = [i for i, t in enumerate(texts) if t]
    scored: list = [None] * len(steps)
    if reward.layers is not None and full:
        got = state.score(target, "target", prefix, [texts[i] for i in full], hidden=True, layers=reward.layers)
        for i, s in zip(full, got):
            scored[i] = s
    t0 = time.perf_counter()
    values = reward.rewards(prefix, steps, scored, seed)
    state.stats.verify_time_s += time.perf_counter() - t0
    return values


def _book_seed(state, st: SeedStats) -> None:
    """SEED's token-level work in RunStats: draft/target forward passes and the token acceptance."""
    rs = state.stats
    rs.draft_time_s += st.draft_s
    rs.target_time_s += st.target_s  # verification passes (drafting overlaps them when threaded)
    rs.draft_calls += st.rounds
    rs.target_calls += st.rounds
    rs.target_rows += st.rounds
    rs.target_forward_passes += st.target_forward_passes
    rs.draft_forward_passes += st.draft_forward_passes
    rs.target_iterations += st.rounds  # one verification forward per round (prefills are not iterations)
    rs.spec_rounds += st.rounds
    rs.spec_proposed += st.positions
    rs.spec_accepted += st.accepted
    depth = st.positions // st.rounds if st.rounds else 0
    for a in st.accepted_per_round:  # α by tree depth: position i judged when the first i were accepted
        for i in range(min(a + 1, depth)):
            rs.record_position(i, i < a)


def seed_predicted_speedup(stats, k_config: Sequence[int]) -> dict:
    """Token SD's g(k) = (1 − α^{k+1}) / ((1 − α)(1 + c·k)) at SEED's measured per-position acceptance α
    (accepted / judged tree positions, a position being judged when all before it were accepted) and c = one draft forward / one target verification pass,
    k = tree depth: the speedup of one sequence's thoughts over target decoding, before the overlap of
    drafting and verification that the scheduler adds (the SEED paper gives no formula; its Table 2 pairs
    α = 0.37 / 0.41 with 1.32x / 1.51x)."""

    out = {"ideal": None, "adjusted": None, "k": len(k_config), "formula": "g(k) token SD vs tot_target"}
    if stats.acceptance_rate is None or not stats.draft_forward_passes or not stats.target_forward_passes:
        return out
    alpha = min(stats.acceptance_rate, 1.0)
    k = len(k_config)
    c = (stats.draft_time_s / stats.draft_forward_passes) / (stats.target_time_s / stats.target_forward_passes) \
        if stats.target_time_s > 0 else None
    if c is not None:
        out["ideal"] = float(token_sd_speedup(alpha, c, k))
    return out
