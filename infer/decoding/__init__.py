"""Step-level speculative decoding: SemanticSpec, Lookahead Reasoning (sync, async, multi-branch) and the
target-only / draft-only baselines, all with the same options, metrics and per-cycle trace.

    from infer.decoding import DecodeOptions, decode
    result = decode("lr_sync", question, target, draft, verifier, DecodeOptions(gamma=3))
    result.text, result.stop_reason, result.stats.acceptance_rate, result.trace
"""
from __future__ import annotations

from infer.decoding.common import DecodeOptions, GenerationResult, OutputStep, seed_for
from infer.decoding.lookahead import draft_only, fast_thread_switching, lookahead_async, lookahead_sync, target_only
from infer.decoding.metrics import RunStats, read_trace, replay_text, stats_from_trace, write_trace
from infer.decoding.semanticspec import semanticspec

METHODS = ("target", "draft", "semanticspec", "lr_sync", "lr_async")

__all__ = ["DecodeOptions", "GenerationResult", "OutputStep", "RunStats", "METHODS", "decode", "seed_for",
           "fast_thread_switching", "target_only", "draft_only", "lookahead_sync", "lookahead_async", "semanticspec",
           "write_trace", "read_trace", "replay_text", "stats_from_trace"]


def decode(method: str, question: str, target, draft=None, verifier=None,
           opts: DecodeOptions | None = None) -> GenerationResult:
    """Generate an answer to `question` with one of METHODS."""
    opts = opts or DecodeOptions()
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
