"""StepEngine on transformers (CPU and CUDA).

`HFStepEngine` turns interface calls into token ids (`infer.engines.tokens.StepTokenizer`) and hands
them to `infer.engines.hf_kv` (the model call, KV cache, prefix reuse and batched decoding). Optional
token-level speculation inside each step (`with_token_spec`: prompt-lookup n-grams, an assistant model with
the same tokenizer, or Lookahead Decoding) is exact under greedy decoding and lossless under sampling.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Hashable, Iterator, Sequence

import torch

from specprobe.infer.engines.base import (
    EngineCapabilities,
    EngineInfo,
    EngineStats,
    Generation,
    Prefix,
    SamplingParams,
    Scoring,
    Step,
    StepRequest,
    sample_seed,
)
from specprobe.infer.engines.decode_step import DecodeStep
from specprobe.infer.engines.fused_norm import fused_norm_count, set_fused_norms, wants_fused_norms
from specprobe.infer.engines.hf_kv import DecodeBatch, ModelRunner, RowSpec, check_plain_attention, packing_pays
from specprobe.infer.engines.lookahead_decoding import JacobiProposer
from specprobe.infer.engines.merged_linear import merged_linear_count, set_merged_linear, wants_merged_linear
from specprobe.infer.engines.sequence_kv import SequenceKV
from specprobe.infer.engines.static_kv import FastDecodeBatch, StaticKVPool, static_cache_supported
from specprobe.infer.engines.token_spec import AssistantProposer, LookaheadConfig, NgramProposer, TokenSpecConfig
from specprobe.infer.engines.tokens import StepTokenizer, TokenizedText, eos_token_ids
from specprobe.infer.models import describe_source, load_model, load_model_config

log = logging.getLogger(__name__)

# An engine's CUDA stream priority, in torch's numbers (lower is more urgent; torch clamps -100 to the most urgent
# level it supports). "high" is for a target whose draft decodes beside it on the same GPU (async Lookahead
# Reasoning): when both have blocks ready to start, the scheduler starts the target's first, so the draft may run
# more in the SMs the target's small per-layer kernels leave idle and slow its steps less. Running blocks are not
# preempted and both share the memory bandwidth, so how much that gives is to be measured (issue 20). Graph replays
# run at the priority of the stream they are launched on (a buffer's first step and capture run on `DecodeStep`'s own
# stream).
STREAM_PRIORITIES = {"normal": 0, "high": -100}


def check_stream_priority(priority: str) -> None:
    if priority not in STREAM_PRIORITIES:
        raise ValueError(f"stream_priority must be one of {tuple(STREAM_PRIORITIES)}, got {priority!r}")


def engine_stream(device: torch.device, priority: str = "normal") -> torch.cuda.Stream | None:
    """An engine's own CUDA stream at `priority` (`STREAM_PRIORITIES`); None off CUDA."""
    check_stream_priority(priority)
    return torch.cuda.Stream(device, priority=STREAM_PRIORITIES[priority]) if device.type == "cuda" else None


def _on_engine_stream(method):
    """Run an engine call's GPU work on the engine's own stream (`HFStepEngine.on_stream`)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        engine = self if isinstance(self, HFStepEngine) else self.engine
        with engine.on_stream():
            return method(self, *args, **kwargs)
    return wrapped


class HFStepEngine(TokenizedText):
    """A causal LM from transformers behind the StepEngine interface (see `infer.engines.base`)."""

    def __init__(
        self,
        model_name: str,
        *,
        device: str | None = None,
        dtype: str | None = None,
        cache_dir: str | None = None,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        max_batch_rows: int = 64,
        prefix_cache_size: int = 4,
        model=None,
        tokenizer=None,
        stop_at_eos: bool = True,
        decode: str = "auto",
        decode_graph: str = "auto",
        stream_priority: str = "normal",
        fused_norm: bool | str = "auto",
        merged_linear: bool | str = "auto",
        capture_joins: bool = True,
    ):
        """decode: "fast" (static KV buffers, device-side sampling, one host sync per plain iteration:
        `infer.engines.static_kv`), "eager" (the reference `hf_kv.DecodeBatch`) or "auto" (fast on CUDA,
        eager on CPU, where the eager path is faster: benchmarks/results/fast_spec_cpu). decode_graph: how the
        fast path runs its plain decode step (`decode_step.DecodeStep`): "cuda_graph" (captured once per buffer,
        replayed), "compile" (inductor's fused kernels, captured the same way on CUDA), "none" (eager), "auto" (cuda_graph on CUDA).
        stream_priority: "normal" or "high", the priority of the engine's own CUDA stream (`STREAM_PRIORITIES`).
        fused_norm: run the model's RMSNorm layers as one fused kernel each (`fused_norm.set_fused_norms`; the
        setting holds for every engine sharing these weights): True, False, or "auto" (on where the weights sit on
        CUDA: `fused_norm.wants_fused_norms`). merged_linear: run the linear layers that read one input (q/k/v, gate/up)
        as one product each (`merged_linear.set_merged_linear`; True, False or "auto", on CUDA), likewise shared.
        capture_joins: with a captured decode step, also capture the joining rows' forwards (`DecodeStep.chunk`)."""
        if decode not in ("auto", "fast", "eager"):
            raise ValueError(f"decode must be 'auto', 'fast' or 'eager', got {decode!r}")
        check_stream_priority(stream_priority)  # before the model loads
        early = load_model_config(model_name, cache_dir) if model is None else None
        if early is not None:
            check_plain_attention(early, model_name)  # before the weights load
        if model is None:
            model, tokenizer = load_model(model_name, device=device, dtype=dtype, cache_dir=cache_dir)
        if early is None:
            check_plain_attention(model.config, model_name)
        self.model, self.tokenizer = model, tokenizer
        set_fused_norms(model, wants_fused_norms(fused_norm, model))  # before any decode step is captured
        set_merged_linear(model, wants_merged_linear(merged_linear, model))
        self.model_name = model_name
        static_why = static_cache_supported(model)  # None: plain full-attention layers (static buffers, tree masks)
        self.capabilities = EngineCapabilities("transformers", raw_model=True, tree_attention=static_why is None)
        self.max_batch_rows = max(1, max_batch_rows)
        self.text = StepTokenizer(tokenizer, use_chat_template=use_chat_template, system_prompt=system_prompt,
                                  eos_ids=eos_token_ids(tokenizer, getattr(model, "generation_config", None)),
                                  stop_at_eos=stop_at_eos)
        self.runner = ModelRunner(model, tokenizer.pad_token_id or 0, prefix_cache_size)
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.info = EngineInfo(
            model_id=describe_source(model_name),
            revision=getattr(cfg, "_commit_hash", None),
            num_layers=int(text_cfg.num_hidden_layers),
            hidden_size=int(text_cfg.hidden_size),
            vocab_size=int(text_cfg.vocab_size),
            tokenizer_id=self.text.tokenizer_id,
            max_length=int(getattr(text_cfg, "max_position_embeddings", 0) or 0) or None,
            extra={"name": model_name, "dtype": str(next(model.parameters()).dtype)},
        )
        self.token_spec: TokenSpecConfig | None = None
        self._proposer = None
        on_cuda = self.runner.device.type == "cuda"
        self.decode = ("fast" if on_cuda else "eager") if decode == "auto" else decode
        if self.decode == "fast" and static_why is not None:
            log.warning("%s: the fast decode path cannot run (%s); decoding on the eager path", model_name, static_why)
            self.decode = "eager"
        # the fast path's buffers and decode-step captures, shared by all its batches (a capture per buffer)
        self.decode_step = (DecodeStep(model, decode_graph, bucket_chunks=None if capture_joins else False)
                            if self.decode == "fast" else None)
        self.kv_pool = StaticKVPool(model, self.runner.pad_id) if self.decode == "fast" else None
        # its own CUDA stream: the draft and target engines of async Lookahead Reasoning, driven from two threads,
        # then overlap on the GPU instead of queueing behind each other on the default stream
        self.stream_priority = stream_priority
        self.stream = engine_stream(self.runner.device, stream_priority)

    @property
    def fused_norms(self) -> int:
        """How many of the model's norm layers run fused now (the newest engine on these weights set it)."""
        return fused_norm_count(self.model)

    @property
    def merged_linears(self) -> int:
        """How many groups of the model's linear layers run as one product now (as `fused_norms`, shared)."""
        return merged_linear_count(self.model)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """This engine's GPU work inside the block runs on its own stream, after the work the caller's stream
        already holds and before the work the caller queues next (so tensors and caches handed across stay
        ordered); on the CPU nothing changes."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.runner.device)
        if caller == self.stream:  # nested (an assistant proposing inside this engine's own call)
            yield
            return
        self.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            caller.wait_stream(self.stream)

    @property
    def eos_ids(self) -> set[int]:
        return self.text.eos_ids

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (results never depend on it; only the work done does)."""
        self.runner.clear()

    # ---------------------------------------------------------------- token speculation
    def with_token_spec(self, spec: TokenSpecConfig | None, assistant: HFStepEngine | None = None) -> HFStepEngine:
        """This engine with token-level speculation inside steps for the calls made through the returned view
        (None: off); the engine itself is unchanged, so methods sharing it cannot leak a setting into each
        other. The view shares the model, tokenizer and prefix cache.

        ngram: prompt lookup over the prompt and the step so far. assistant: greedy proposals from
        `assistant` (an engine whose tokenizer must equal this one's). lookahead: Lookahead Decoding (each
        row its own Jacobi window and n-gram pool). All three run in the engine's batches, on either decode path.
        """
        if spec is None and self.token_spec is None:
            return self
        proposer = None
        if spec is not None and spec.method == "ngram":
            proposer = NgramProposer(spec.ngram_size, spec.min_ngram)
        elif spec is not None and spec.method == "lookahead":
            proposer = JacobiProposer(spec.lookahead or LookaheadConfig())
        elif spec is not None:
            if assistant is None:
                raise ValueError("token_spec 'assistant' needs an assistant engine (the draft model)")
            proposer = AssistantProposer(assistant, self.info.tokenizer_id)
        view = copy.copy(self)
        view.token_spec, view._proposer = spec, proposer
        return view

    def sequence_kv(self) -> SequenceKV:
        """One sequence's KV cache on this model, for tree-attention decoders (SEED, the reference LookaheadDecoder); it
        takes the engine's model lock for every forward and starts new sequences from its prefix cache."""
        return SequenceKV(self.runner.model, self.runner.lock, prefill=self.runner.prefill)

    @_on_engine_stream
    def greedy_continue(self, ids: Sequence[int], k: int, stats: EngineStats) -> list[int]:
        """k greedy tokens after `ids` (assistant proposals for another engine); stops early at EOS."""
        return self.runner.greedy_continue(list(ids), k, self.eos_ids, stats)

    # ---------------------------------------------------------------- generation
    def _batch(self, params: SamplingParams) -> DecodeBatch | FastDecodeBatch:
        spec_tokens = self.token_spec.num_tokens if self.token_spec else 0
        if self.decode == "fast":
            return FastDecodeBatch(self.runner, self.text, params, max_length=self.info.max_length,
                                   pool=self.kv_pool, decode_step=self.decode_step, proposer=self._proposer,
                                   spec_tokens=spec_tokens)
        return DecodeBatch(self.runner, self.text, params, max_length=self.info.max_length,
                           proposer=self._proposer, spec_tokens=spec_tokens)

    def _row_specs(self, keyed: Sequence[tuple[Hashable, StepRequest]], params: SamplingParams) -> list[RowSpec]:
        specs = []
        for key, req in keyed:
            ids = self.prefix_ids(req.prefix)
            seed = params.seed if req.seed is None else req.seed
            for k in range(req.n):
                specs.append(RowSpec((key, k), ids, req.cap(params), sample_seed(seed, k), keep=req.n == 1))
        return specs

    @_on_engine_stream
    def generate(self, requests: Sequence[StepRequest], params: SamplingParams) -> Generation:
        """All requests decoded together (at most max_batch_rows rows per batch). The KV of every one-sample
        step is kept, so a later prefix that continues it only encodes its new tokens."""
        t0 = time.perf_counter()
        stats = EngineStats()
        specs = self._row_specs(list(enumerate(requests)), params)
        results: dict[Hashable, Step] = {}
        kept: dict = {}
        for start in range(0, len(specs), self.max_batch_rows):
            batch = self._batch(params)
            results.update(batch.add(specs[start:start + self.max_batch_rows]))
            results.update(batch.run())
            stats += batch.stats
            kept.update(batch.finished_kv)
        if kept:
            self.runner.keep_recent(kept)
        stats.seconds = time.perf_counter() - t0
        steps = [[results[(i, k)] for k in range(req.n)] for i, req in enumerate(requests)]
        return Generation(steps, stats)

    def open_stream(self, params: SamplingParams) -> HFStepStream:
        return HFStepStream(self, params)

    # ---------------------------------------------------------------- teacher forcing
    def _layer_index(self, layers: Sequence[int] | None) -> list[int]:
        total = self.info.num_layers + 1
        chosen = list(range(total)) if layers is None else [i if i >= 0 else total + i for i in layers]
        bad = [i for i in chosen if not 0 <= i < total]
        if bad:
            raise ValueError(f"layers {bad} out of range for a model with {self.info.num_layers} layers (+ embeddings)")
        return chosen

    def _score_inputs(self, prefix: Prefix, steps: Sequence[str]) -> tuple[list[int], list[list[int]]]:
        if not isinstance(prefix, Prefix):
            raise TypeError(f"score: prefix must be a Prefix, got {type(prefix).__name__}")
        ids = self.prefix_ids(prefix)
        step_ids = [self.text.text_ids(s) for s in steps]
        empty = [i for i, s in enumerate(step_ids) if not s]
        if empty:
            raise ValueError(f"steps {empty} encode to no tokens; cannot score an empty step")
        return ids, step_ids

    @_on_engine_stream
    def score(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True,
              layers: Sequence[int] | None = None) -> Scoring:
        """Each step teacher-forced after `prefix` independently; the prefix is encoded once and every step
        reads its KV: the steps are packed in one row under a 4-D mask (`ModelRunner.score_packed`) when that
        costs no more attention (`packing_pays`), else (and on a model whose cache layers cannot take a 4-D mask)
        the prefix's cache is repeated across a batch of right-padded rows (`score_rows`)."""
        t0, stats = time.perf_counter(), EngineStats()
        if not steps:
            return Scoring([], stats)
        ids, step_ids = self._score_inputs(prefix, steps)
        self._check_length(len(ids) + max(map(len, step_ids)), "prompt plus step")
        chosen = self._layer_index(layers)
        results = []
        for start in range(0, len(step_ids), self.max_batch_rows):
            chunk = step_ids[start:start + self.max_batch_rows]
            packed = self.capabilities.tree_attention and packing_pays(len(ids), list(map(len, chunk)))
            score = self.runner.score_packed if packed else self.runner.score_rows
            results.extend(score(ids, chunk, hidden, chosen, stats))
        stats.seconds = time.perf_counter() - t0
        return Scoring(results, stats)

    @_on_engine_stream
    def score_chain(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True,
                    layers: Sequence[int] | None = None) -> Scoring:
        """steps[0] ⊕ steps[1] ⊕ ... teacher-forced after `prefix` in one pass; one result per step,
        each conditioned on the steps before it (causal attention)."""
        t0, stats = time.perf_counter(), EngineStats()
        if not steps:
            return Scoring([], stats)
        ids, step_ids = self._score_inputs(prefix, steps)
        self._check_length(len(ids) + sum(map(len, step_ids)), "prompt plus steps")
        results = self.runner.score_chain(ids, step_ids, hidden, self._layer_index(layers), stats)
        stats.seconds = time.perf_counter() - t0
        return Scoring(results, stats)


class HFStepStream:
    """StepStream of the transformers engine: one DecodeBatch that requests join while it runs."""

    def __init__(self, engine: HFStepEngine, params: SamplingParams):
        self.engine, self.params = engine, params
        self.batch = engine._batch(params)
        self._taken = EngineStats()

    @_on_engine_stream
    def add(self, requests: Sequence[tuple[Hashable, StepRequest]]) -> list[tuple[Hashable, Step]]:
        bad = [key for key, req in requests if req.n != 1]
        if bad:
            raise ValueError(f"stream requests {bad}: n must be 1")
        t0 = time.perf_counter()
        specs = [RowSpec(key, self.engine.prefix_ids(req.prefix), req.cap(self.params),
                         self.params.seed if req.seed is None else req.seed) for key, req in requests]
        done = self.batch.add(specs) if specs else []
        self.batch.stats.seconds += time.perf_counter() - t0
        return done

    @_on_engine_stream
    def step(self) -> list[tuple[Hashable, Step]]:
        t0 = time.perf_counter()
        done = self.batch.step()
        self.batch.stats.seconds += time.perf_counter() - t0
        return done

    @_on_engine_stream
    def cancel(self, keys: Sequence[Hashable]) -> None:
        self.batch.remove(keys)

    def __len__(self) -> int:
        return len(self.batch)

    def take_stats(self) -> EngineStats:
        stats, self.batch.stats = self.batch.stats, EngineStats()
        return stats
