"""Step-level speculative decoding: SemanticSpec, Lookahead Reasoning (sync, async, multi-branch) and the
target-only / draft-only baselines, all with the same options, metrics and per-cycle trace.

    from specprobe.infer.decoding import DecodeOptions, decode
    result = decode("lr_sync", question, target, draft, verifier, DecodeOptions(gamma=3))
    result.text, result.stop_reason, result.stats.acceptance_rate, result.trace
"""
from __future__ import annotations

from dataclasses import replace

from specprobe.infer.decoding.common import DecodeOptions, GenerationResult, OutputStep, seed_for
from specprobe.infer.decoding.lookahead import (
    draft_only,
    fast_thread_switching,
    lookahead_async,
    lookahead_sync,
    target_only,
)
from specprobe.infer.decoding.metrics import RunStats, read_trace, replay_text, stats_from_trace, write_trace
from specprobe.infer.decoding.seed import SeedConfig, tot_search
from specprobe.infer.decoding.semanticspec import semanticspec
from specprobe.infer.decoding.specs import SpecSConfig, reward_from_verifier
from specprobe.infer.decoding.specs import specs as run_specs  # the name `specs` stays the submodule's

METHODS = ("target", "draft", "semanticspec", "lr_sync", "lr_async", "specs", "beam_target", "seed_tot", "tot_target")

__all__ = ["DecodeOptions", "GenerationResult", "OutputStep", "RunStats", "METHODS", "decode", "seed_for",
           "fast_thread_switching", "target_only", "draft_only", "lookahead_sync", "lookahead_async", "semanticspec",
           "write_trace", "read_trace", "replay_text", "stats_from_trace"]


def decode(method: str, question: str, target, draft=None, verifier=None,
           opts: DecodeOptions | None = None, settings=None) -> GenerationResult:
    """Generate an answer to `question` with one of METHODS. `settings`: SpecSConfig for specs /
    beam_target, SeedConfig for seed_tot / tot_target (None: the papers' defaults). SpecS and the tree
    searches use the verifier as a step reward (`infer.decoding.specs.reward_from_verifier`)."""
    opts = opts or DecodeOptions()
    if method in ("specs", "beam_target", "seed_tot", "tot_target"):
        return _search_method(method, question, target, draft, verifier, opts, settings)
    if method == "target":
        return target_only(question, target, opts)
    if method == "draft":
        if draft is None:
            raise ValueError("draft-only decoding needs a draft engine")
        return draft_only(question, draft, opts)
    if method == "semanticspec":
        return semanticspec(question, target, draft, verifier, opts)
    if method == "lr_sync":
        return lookahead_sync(question, target, draft, verifier, opts)
    if method == "lr_async":
        return lookahead_async(question, target, draft, verifier, opts)
    raise ValueError(f"unknown decoding method {method!r}; choose one of {', '.join(METHODS)}")


def _search_method(method, question, target, draft, verifier, opts, settings) -> GenerationResult:
    if verifier is None:
        raise ValueError(f"{method} scores steps with a reward: pass a verifier (probe, bernoulli, ...)")
    reward = reward_from_verifier(verifier)
    if method in ("specs", "beam_target"):
        cfg = settings or SpecSConfig()
        if method == "beam_target":  # τ above every reward in [0, 1]: the target writes every round
            cfg = replace(cfg, tau=float("inf"))
        return run_specs(question, target, draft, reward, opts, cfg, method=method)
    return tot_search(question, target, draft, reward, opts, settings or SeedConfig(), method=method)
