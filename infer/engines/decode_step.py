"""The fast path's plain decode forward on a batch's `StaticKV` (`DecodeStep`): eager, captured as a CUDA graph once
per buffer, or compiled by inductor and captured likewise; and the chunk forwards of rows joining a batch, padded to a
few widths and captured per buffer and width. `static_kv.FastDecodeBatch` drives it; the engine owns one per model,
so that its captures outlive a batch (`static_kv.StaticKVPool` hands the same buffers to later batches). Its `kv`
arguments are `static_kv.StaticKV` buffers (not imported here: static_kv imports this module)."""
from __future__ import annotations

import logging
import threading

import torch

from specprobe.infer.engines.hf_kv import cache_keyword

log = logging.getLogger(__name__)

DECODE_GRAPHS = ("auto", "cuda_graph", "compile", "none")
# torch.compile is not thread-safe: the compiled step's first call on a buffer (which may compile) and its capture
# run under this lock, so async LR's two engine threads do not compile at once
_COMPILE_LOCK = threading.Lock()
# torch.cuda.graph() synchronizes the device and empties the allocator's cache before it captures: during another
# thread's capture (async LR's two engines; two engines on one model's weights) that fails, and invalidates the other
# capture too (on an H100, two of three threads' captures failed so). Captures take turns under this lock.
_CAPTURE_LOCK = threading.Lock()
# every DecodeStep compiles the same code object, so all models share dynamo's entries for it (two per model): the
# default limit of 8 would leave a process's fifth model eager
_RECOMPILE_LIMIT = 64
# widths a join's chunk forward is padded to when chunks are captured (`DecodeStep.chunk_width`): few captures per
# buffer; a longer chunk runs eagerly at its own width
CHUNK_WIDTHS = (16, 32, 64, 128, 256, 512)
# the largest chunk taken, in slots and in slots x width (padded tokens): a chunk computes slots x slots rows of
# logits (a kept index for every slot, at every slot: 78 MB at 16 slots of a 152k vocabulary in bf16) and every
# slot's padded width, where an eager join computes the rows' own tokens; on an H100 an eager forward's launches
# cost ~44 ms on a 7B, about what 512 tokens of a 32B's compute cost. Larger joins run eagerly. (A nested batch's
# chunk is one slot's: its width alone is bounded, and its rows by CHUNK_MAX_SLOTS.)
CHUNK_MAX_SLOTS = 16
CHUNK_MAX_TOKENS = 512


def capture_graph(forward, stream, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """`forward()` captured as a CUDA graph on `stream` (its memory from `pool`; None: the graph's own), and the
    output the capture wrote, which every replay rewrites. One capture in the process at a time (`_CAPTURE_LOCK`);
    thread_local: the other threads go on decoding (eager steps, replays, allocations) while it captures."""
    graph = torch.cuda.CUDAGraph()
    with _CAPTURE_LOCK, torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = forward()
    return graph, out


class DecodeStep:
    """The plain decode forward of a batch on its StaticKV (`kv.ids`, `kv.pos`, `kv.mask`, `kv.cache`), one
    per model. mode:
    - "cuda_graph": the forward captured as a `torch.cuda.CUDAGraph` once per StaticKV (pooled buffers keep their
      capture across batches) and replayed: the launches of a whole forward in one call, no Python between
      kernels, no compilation. The first step on a buffer runs eagerly on the capture stream (the real step, and
      the warm-up the capture needs), then the forward is captured; nothing runs during a capture.
    - "compile": inductor's fused kernels (`torch.compile`, symbolic buffer sizes), captured per StaticKV like
      "cuda_graph" on CUDA (on the CPU the compiled forward is called). The sizes are symbolic so that one
      compilation serves every pooled buffer: two in all (dynamo specializes a buffer of one slot), each tens of
      seconds on a large model, paid on the first steps (a benchmark's warm-up). The capture is this class's own,
      not inductor's "reduce-overhead" graphs: those are tied to their inputs' addresses and re-record per buffer.
    - "none": eager on the static buffers (the CPU's choice; "auto" is "cuda_graph" on CUDA, else "none").
    A capture or a compilation that fails (a host sync inside the model's forward, an unsupported op) is logged
    once and the step runs eagerly from then on: slower, still correct.

    It also runs a batch's chunk forwards (`chunk`: the tails of rows joining, several tokens a slot). With a captured
    decode step they are padded to one of `CHUNK_WIDTHS` and captured once per buffer and width (eager on their
    first use, in one memory pool for all of them: a model's forwards never run at once), since an eager forward of a
    large model costs tens of milliseconds of launches (on an H100 a 7B's took 44 ms where its captured step takes 8).
    bucket_chunks: pad chunks to those widths whether or not they are captured (None: when captured; the CPU tests
    set it to run the padded chunk eagerly)."""

    def __init__(self, model, mode: str = "auto", bucket_chunks: bool | None = None):
        if mode not in DECODE_GRAPHS:
            raise ValueError(f"decode graph mode must be one of {DECODE_GRAPHS}, got {mode!r}")
        on_cuda = next(model.parameters()).device.type == "cuda"
        if mode == "auto":
            mode = "cuda_graph" if on_cuda else "none"
        if mode == "cuda_graph" and not on_cuda:
            raise ValueError("decode graph mode 'cuda_graph' needs the model on a CUDA device")
        self.model, self.mode = model, mode
        self.cache_keyword = cache_keyword(model)
        self.capture = on_cuda and mode in ("cuda_graph", "compile")  # replay a CUDA graph per buffer
        self.failed: str | None = None  # why the step fell back to eager, if it did
        self.captures = self.replays = 0
        self.bucket_chunks = self.capture if bucket_chunks is None else bucket_chunks
        self.chunk_failed: str | None = None  # why chunks fell back to eager forwards, if they did
        self.chunk_captures = self.chunk_replays = self.chunk_calls = 0
        self._chunk_pool = None  # the chunk captures' shared memory pool
        self._forward = self._eager
        if mode == "compile":
            import torch._dynamo.config as dynamo_config

            name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), _RECOMPILE_LIMIT))
            # fullgraph: a graph break would leave Python (and its launches) between the compiled pieces
            self._forward = torch.compile(self._eager, dynamic=True, fullgraph=True)

    @property
    def graphed(self) -> bool:
        """Whether a step replays a captured graph, so that it costs far less than an eager forward of the same
        tokens."""
        return self.failed is None and self.capture

    def __call__(self, kv) -> torch.Tensor:
        """The logits (slots, vocab) of every slot's next token; on a captured step they live in the capture's
        output buffer, which the next replay on the same buffers overwrites."""
        if self.failed is None and self.capture:
            return self._graphed(kv)
        if self.failed is None and self.mode == "compile":
            try:
                with _COMPILE_LOCK:
                    return self._forward(kv.ids, kv.pos, kv.mask, kv.cache)
            except Exception as err:  # noqa: BLE001 - compilation problems must not stop decoding
                return self._fall_back(kv, err)
        return self._eager(kv.ids, kv.pos, kv.mask, kv.cache)

    def _eager(self, ids, pos, mask, cache):
        return self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                          **{self.cache_keyword: cache}).logits[:, -1]

    def _graphed(self, kv) -> torch.Tensor:
        if kv.graph is not None:
            graph, out = kv.graph
            graph.replay()
            self.replays += 1
            return out
        if self.mode == "compile":
            with _COMPILE_LOCK:
                return self._capture(kv)
        return self._capture(kv)

    def _capture(self, kv) -> torch.Tensor:
        device = kv.mask.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            # the real step, and the capture stream's warm-up (kernel choice, handles; the compilation in "compile")
            with torch.cuda.stream(stream):
                logits = self._forward(kv.ids, kv.pos, kv.mask, kv.cache)
        except Exception as err:  # noqa: BLE001 - a compilation that fails must not stop decoding
            torch.cuda.current_stream(device).wait_stream(stream)
            if self.mode != "compile":
                raise  # the eager forward itself failed: nothing to fall back to
            return self._fall_back(kv, err)
        torch.cuda.current_stream(device).wait_stream(stream)
        logits.record_stream(torch.cuda.current_stream(device))  # made on the capture stream, read on this one
        try:
            graph, out = capture_graph(lambda: self._forward(kv.ids, kv.pos, kv.mask, kv.cache), stream)
        except Exception as err:  # noqa: BLE001 - an uncapturable forward must not stop decoding
            self._fail(err, "captured")
            return logits
        kv.graph = (graph, out)
        self.captures += 1
        return logits

    def _fall_back(self, kv, err: Exception) -> torch.Tensor:
        """The step eagerly after the compiled forward failed (from then on, every step is eager)."""
        self._fail(err, "compiled")
        kv.set_column(kv.col)  # a run that failed midway may have moved the cache's write offset
        return self._eager(kv.ids, kv.pos, kv.mask, kv.cache)

    def _fail(self, err: Exception, what: str) -> None:
        self.failed = f"{type(err).__name__}: {err}"
        log.warning("the decode step could not be %s (%s); decoding eagerly on static buffers", what, self.failed)

    # ------------------------------------------------------------------ chunks
    def chunks_for(self, slots: int, width: int) -> bool:
        """Whether a join on a buffer of `slots` slots runs as a chunk of `width` columns (`chunk`): chunks bucketed
        (captured where the step is) and not failed, the width one of `CHUNK_WIDTHS`, within the chunk limits."""
        return (self.bucket_chunks and self.chunk_failed is None and width in CHUNK_WIDTHS
                and slots <= CHUNK_MAX_SLOTS and slots * width <= CHUNK_MAX_TOKENS)

    def chunk_width(self, m: int) -> int:
        """Columns a chunk of m tokens a slot forwards: the next of `CHUNK_WIDTHS` when chunks are bucketed, else m."""
        if not self.bucket_chunks:
            return m
        return next((w for w in CHUNK_WIDTHS if w >= m), m)

    def chunk(self, kv, width: int) -> torch.Tensor:
        """The forward of `width` columns of every slot from `kv.chunk_inputs(width)` into the write column on: the
        logits (slots, vocab) it keeps, row k at (keep_slot[k], keep_index[k]). Captured per buffer and width when
        the decode step captures and the width is one of `CHUNK_WIDTHS`; the output of a replay lives in the
        capture's buffer until the next replay."""
        self.chunk_calls += 1
        if self.capture and self.chunk_failed is None and width in CHUNK_WIDTHS:
            entry = kv.chunk_graphs.get(width)
            if entry is not None:
                graph, out = entry
                graph.replay()
                self.chunk_replays += 1
                return out
            return self._capture_chunk(kv, width)
        return self._chunk_forward(*kv.chunk_inputs(width), kv.mask, kv.cache)

    def _chunk_forward(self, ids, pos, keep_slot, keep_index, mask, cache):
        # logits at every kept index for every slot (slots x slots rows of the vocabulary), then the kept pairs
        logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                            logits_to_keep=keep_index, **{self.cache_keyword: cache}).logits
        return logits[keep_slot, torch.arange(keep_slot.shape[0], device=keep_slot.device)]

    def _capture_chunk(self, kv, width: int) -> torch.Tensor:
        device = kv.mask.device
        inputs = (*kv.chunk_inputs(width), kv.mask, kv.cache)
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # the real chunk, and the capture stream's warm-up
            logits = self._chunk_forward(*inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        logits.record_stream(torch.cuda.current_stream(device))
        if self._chunk_pool is None:
            self._chunk_pool = torch.cuda.graph_pool_handle()
        try:
            graph, out = capture_graph(lambda: self._chunk_forward(*inputs), stream, self._chunk_pool)
        except Exception as err:  # noqa: BLE001 - an uncapturable chunk must not stop decoding
            self.chunk_failed = f"{type(err).__name__}: {err}"
            log.warning("a chunk forward could not be captured (%s); chunks run eagerly", self.chunk_failed)
            return logits
        kv.chunk_graphs[width] = (graph, out)
        self.chunk_captures += 1
        return logits
