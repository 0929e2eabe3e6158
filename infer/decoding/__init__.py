"""Step-level speculative decoding: SemanticSpec, Lookahead Reasoning (sync, async, multi-branch) and the
target-only / draft-only baselines, all with the same options, metrics and per-cycle trace.

    from specprobe.infer.decoding import DecodeOptions, decode
    result = decode("lr_sync", question, target, draft, verifier, DecodeOptions(gamma=3))
    result.text, result.stop_reason, result.stats.acceptance_rate, result.trace
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from specprobe.infer.decoding.common import DecodeOptions, GenerationResult, OutputStep
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
from specprobe.infer.engines.base import seed_for


@dataclass(frozen=True)
class Method:
    """One decoding method as callers see it: how it runs and what it needs.

    run(question, target, draft, verifier, opts, settings) -> GenerationResult. baseline: the method whose
    latency its paper measures the speedup against (target-only, or a search method's own target search).
    settings: the runtime section that configures it (specs: SpecSConfig, tree: SeedConfig). adaptive: whether
    gamma=adaptive applies. prediction: the analytic formula probe-bench prints beside its speedup."""

    name: str
    run: Callable[..., GenerationResult]
    summary: str
    needs_draft: bool = True
    needs_verifier: bool = True
    baseline: str = "target"
    settings: str | None = None
    adaptive: bool = False
    prediction: str | None = None


def _search(kind: str, beam: bool = False) -> Callable[..., GenerationResult]:
    def run(question, target, draft, verifier, opts, settings):
        if verifier is None:
            raise ValueError(f"{kind} scores steps with a reward: pass a verifier (probe, bernoulli, ...)")
        reward = reward_from_verifier(verifier)
        if kind == "specs":
            cfg = settings or SpecSConfig()
            if beam:  # τ above every reward in [0, 1]: the target writes every round
                cfg = replace(cfg, tau=float("inf"))
            return run_specs(question, target, draft, reward, opts, cfg, method="beam_target" if beam else "specs")
        return tot_search(question, target, draft, reward, opts, settings or SeedConfig(),
                          method="tot_target" if beam else "seed_tot")
    return run


def _draft_only(question, target, draft, verifier, opts, settings):
    if draft is None:
        raise ValueError("draft-only decoding needs a draft engine")
    return draft_only(question, draft, opts)


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("target", lambda q, t, d, v, o, s: target_only(q, t, o), "the target writes every step (the baseline)",
           needs_draft=False, needs_verifier=False, baseline="target"),
    Method("draft", _draft_only, "the draft writes every step", needs_verifier=False, prediction="draft"),
    Method("semanticspec", lambda q, t, d, v, o, s: semanticspec(q, t, d, v, o),
           "SemanticSpec: probes accept drafts with min(1, p/q), the target rewrites a rejected step",
           adaptive=True, prediction="semanticspec"),
    Method("lr_sync", lambda q, t, d, v, o, s: lookahead_sync(q, t, d, v, o),
           "Lookahead Reasoning, sync: γ drafts and γ+1 target steps per cycle (width W: multi-branch)",
           adaptive=True, prediction="lr_sync"),
    Method("lr_async", lambda q, t, d, v, o, s: lookahead_async(q, t, d, v, o),
           "Lookahead Reasoning, async: drafting, target steps and verification overlap", adaptive=True,
           prediction="lr_async"),
    Method("specs", _search("specs"), "SpecS: soft verification of n candidates and switching (runtime.specs)",
           baseline="beam_target", settings="specs"),
    Method("beam_target", _search("specs", beam=True), "target beam search, SpecS's baseline",
           needs_draft=False, baseline="beam_target", settings="specs"),
    Method("seed_tot", _search("seed"), "SEED: tree of thoughts decoded by scheduled speculation (runtime.tree)",
           baseline="tot_target", settings="tree"),
    Method("tot_target", _search("seed", beam=True), "target-only tree of thoughts, SEED's baseline",
           needs_draft=False, baseline="tot_target", settings="tree"),
)}
METHODS = tuple(REGISTRY)

__all__ = ["DecodeOptions", "GenerationResult", "OutputStep", "RunStats", "METHODS", "REGISTRY", "Method", "decode",
           "seed_for", "fast_thread_switching", "target_only", "draft_only", "lookahead_sync", "lookahead_async",
           "semanticspec", "write_trace", "read_trace", "replay_text", "stats_from_trace"]


def decode(method: str, question: str, target, draft=None, verifier=None,
           opts: DecodeOptions | None = None, settings=None) -> GenerationResult:
    """Generate an answer to `question` with one of METHODS (`REGISTRY`). `settings`: SpecSConfig for specs /
    beam_target, SeedConfig for seed_tot / tot_target (None: the papers' defaults). SpecS and the tree
    searches use the verifier as a step reward (`infer.decoding.specs.reward_from_verifier`)."""
    if method not in REGISTRY:
        raise ValueError(f"unknown decoding method {method!r}; choose one of {', '.join(METHODS)}")
    return REGISTRY[method].run(question, target, draft, verifier, opts or DecodeOptions(), settings)
