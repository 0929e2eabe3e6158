"""StepEngine on transformers (CPU and CUDA).

Prefix reuse: a prompt's KV cache is computed once and shared by every sample drawn after it (the
cache is repeated along the batch, not recomputed), and the last few prefixes are kept so that a
growing chain (the decoding runtime) only encodes its new tokens.

The decoding runtime uses `generate_steps` / `open_batch`: rows with different prefixes, seeds and
token caps decode in one batch (`infer.engines.decode.DecodeBatch`), optionally with token-level
speculation inside each step (`set_token_spec`: prompt-lookup n-grams or an assistant model with the
same tokenizer; exact under greedy decoding, lossless under sampling). Forward passes and the prefix
cache are guarded by a lock, so one engine may be driven from several threads (async runtime).
"""
from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn.functional as F

from infer.engines.base import EngineInfo, PromptTooLongError, SamplingParams, ScoredStep, Step
from infer.engines.token_spec import AssistantProposer, NgramProposer, TokenSpecConfig
from infer.models import describe_source, load_model

log = logging.getLogger(__name__)


def _clone_cache(cache):
    """Cheap copy of a DynamicCache: layers are copied, tensors shared. DynamicLayer.update and
    batch ops rebind (never write into) their tensors, so the original stays valid."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    return new


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _croppable(cache) -> bool:
    return all(getattr(layer, "is_croppable", False) for layer in getattr(cache, "layers", [None]))


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


def sample_next_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                       generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from (rows, vocab) logits: greedy at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always survives)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    if generator is not None and generator.device != probs.device:
        probs_cpu = probs.cpu()
        return torch.multinomial(probs_cpu, 1, generator=generator).squeeze(-1).to(logits.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def find_step_end(text: str, delimiter: str) -> int | None:
    """End index (exclusive) of the first delimiter that follows some non-whitespace text, or None.

    A delimiter before any content would make an empty step, so leading blank lines are skipped.
    """
    start = len(text) - len(text.lstrip())
    if start == len(text):
        return None
    pos = text.find(delimiter, start)
    return None if pos < 0 else pos + len(delimiter)


class HFStepEngine:
    """A causal LM from transformers behind the StepEngine interface."""

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
    ):
        if model is None:
            model, tokenizer = load_model(model_name, device=device, dtype=dtype, cache_dir=cache_dir)
        self.model, self.tokenizer = model, tokenizer
        self.model_name = model_name
        self.device = next(model.parameters()).device
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.max_batch_rows = max_batch_rows
        self.eos_ids = _eos_ids(model, tokenizer)
        cfg = model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.max_context = int(getattr(text_cfg, "max_position_embeddings", 0) or 0) or None
        self.info = EngineInfo(
            model_id=describe_source(model_name),
            revision=getattr(cfg, "_commit_hash", None),
            num_layers=int(text_cfg.num_hidden_layers),
            hidden_size=int(text_cfg.hidden_size),
            vocab_size=int(text_cfg.vocab_size),
            extra={"name": model_name, "dtype": str(next(model.parameters()).dtype)},
        )
        self._prefix_cache: OrderedDict[tuple[int, ...], tuple[object, torch.Tensor]] = OrderedDict()
        self._prefix_cache_size = prefix_cache_size
        self.stats = {"forward_passes": 0, "prefill_tokens": 0, "decode_tokens": 0, "reused_prefix_tokens": 0,
                      "spec_rounds": 0, "spec_proposed": 0, "spec_accepted": 0, "shared_prefix_tokens": 0}
        # False only for system-speed runs: random-weight models emit EOS by chance
        self.stop_at_eos = stop_at_eos
        self.token_spec: TokenSpecConfig | None = None
        self._proposer = None
        self.lock = threading.RLock()

    # ---------------------------------------------------------------- text <-> ids
    def format_prefix(self, question: str, steps: Sequence[str] = (), delimiter: str = "\n\n") -> str:
        if not question or not question.strip():
            raise ValueError("empty prompt: the question text is empty")
        if self.use_chat_template:
            messages = [{"role": "user", "content": question}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            head = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            head = question.rstrip() + delimiter
        return head + "".join(s if s.endswith(delimiter) else s + delimiter for s in steps)

    def encode_prefix(self, prefix: str) -> list[int]:
        # A chat template already writes its special tokens; a raw prompt gets the tokenizer's BOS.
        ids = self.tokenizer(prefix, add_special_tokens=not self.use_chat_template)["input_ids"]
        if not ids:
            raise ValueError("empty prompt: it encodes to no tokens")
        return list(ids)

    def encode_step(self, step: str) -> list[int]:
        return list(self.tokenizer(step, add_special_tokens=False)["input_ids"])

    def _check_fits(self, n_tokens: int, what: str) -> None:
        if self.max_context and n_tokens > self.max_context:
            raise PromptTooLongError(
                f"{what} has {n_tokens} tokens, more than the context window of {self.info.model_id} "
                f"({self.max_context}); shorten the prompt or lower the number of steps kept in it")

    # ---------------------------------------------------------------- forward helpers
    def _forward(self, **kw):
        with self.lock, torch.inference_mode():
            self.stats["forward_passes"] += 1
            return self.model(**kw)

    def _prefill(self, ids: list[int]):
        """KV cache and final logits for one prefix, reusing the longest cached prefix of it."""
        with self.lock:
            return self._prefill_locked(ids)

    def _prefill_locked(self, ids: list[int]):
        key = tuple(ids)
        if key in self._prefix_cache:
            self._prefix_cache.move_to_end(key)
            self.stats["reused_prefix_tokens"] += len(ids)
            cache, logits = self._prefix_cache[key]
            return _clone_cache(cache), logits
        # Reuse the cached prefix sharing the most leading tokens with `ids`, cut back to what they share:
        # a text prefix need not tokenize to a token prefix ("...\n\n" is one token at the end of a text,
        # two once another step follows), so exact-prefix matching alone would re-encode whole chains.
        best, shared = None, 0
        for cached in self._prefix_cache:
            n = min(_common_prefix(cached, key), len(key) - 1)  # >= 1 new token gives the logits
            if n > shared and (n == len(cached) or _croppable(self._prefix_cache[cached][0])):
                best, shared = cached, n
        if best is not None:
            cache = _clone_cache(self._prefix_cache[best][0])
            if shared < len(best):
                cache.crop(shared - len(best))
            new = ids[shared:]
            self.stats["reused_prefix_tokens"] += shared
        else:
            cache, new = None, ids
        self.stats["prefill_tokens"] += len(new)
        inp = torch.tensor([new], device=self.device)
        pos = torch.arange(len(ids) - len(new), len(ids), device=self.device)[None]
        out = self._forward(input_ids=inp, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits[0, -1].float()
        self._prefix_cache[key] = (cache, logits)
        while len(self._prefix_cache) > self._prefix_cache_size:
            self._prefix_cache.popitem(last=False)
        return _clone_cache(cache), logits

    def remember_prefix(self, ids: Sequence[int], cache, logits: torch.Tensor) -> None:
        """Add a computed KV cache of `ids` (with the logits after them) to the prefix cache, e.g. the row
        of a DecodeBatch whose step was just committed, so that the next step reuses it."""
        if not ids:
            return
        with self.lock:
            self._prefix_cache[tuple(ids)] = (cache, logits)
            self._prefix_cache.move_to_end(tuple(ids))
            while len(self._prefix_cache) > self._prefix_cache_size:
                self._prefix_cache.popitem(last=False)

    def clear_prefix_cache(self) -> None:
        self._prefix_cache.clear()

    # ---------------------------------------------------------------- sampling
    def sample(self, prefixes: Sequence[str], n: int, params: SamplingParams) -> list[list[Step]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        results: list[list[Step]] = []
        for prefix in prefixes:
            ids = self.encode_prefix(prefix)
            self._check_fits(len(ids) + params.max_step_tokens, "prompt plus one step")
            steps: list[Step] = []
            per_batch = max(1, self.max_batch_rows)
            for start in range(0, n, per_batch):
                steps.extend(self._sample_rows(ids, min(per_batch, n - start), params, generator))
            results.append(steps)
        return results

    def _sample_rows(self, ids: list[int], rows: int, params: SamplingParams,
                     generator: torch.Generator | None) -> list[Step]:
        """`rows` continuations of one prefix, decoded in one batch; finished rows leave the batch."""
        cache, last_logits = self._prefill(ids)
        cache.batch_repeat_interleave(rows)
        logits = last_logits[None].expand(rows, -1)
        tokens: list[list[int]] = [[] for _ in range(rows)]
        logprobs = [0.0] * rows
        done: list[Step | None] = [None] * rows
        active = list(range(rows))  # row index in `tokens` of each batch row
        position = len(ids)
        tok = self.tokenizer
        for t in range(params.max_step_tokens):
            next_ids = sample_next_tokens(logits, params.temperature, params.top_p, generator)
            token_lp = torch.log_softmax(logits.float(), -1).gather(-1, next_ids[:, None]).squeeze(-1)
            keep: list[int] = []
            for b, row in enumerate(active):
                tid = int(next_ids[b])
                tokens[row].append(tid)
                logprobs[row] += float(token_lp[b])
                if self.stop_at_eos and tid in self.eos_ids:
                    done[row] = Step(tok.decode(tokens[row][:-1]), tokens[row], "eos", logprobs[row])
                    continue
                text = tok.decode(tokens[row])
                end = find_step_end(text, params.delimiter)
                if end is not None:
                    done[row] = Step(text[:end], tokens[row], "delimiter", logprobs[row])
                elif t == params.max_step_tokens - 1:
                    done[row] = Step(text, tokens[row], "length", logprobs[row])
                else:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                next_ids = next_ids[idx]
                active = [active[b] for b in keep]
            pos = torch.full((len(active), 1), position, device=self.device)
            out = self._forward(input_ids=next_ids[:, None], past_key_values=cache, position_ids=pos, use_cache=True)
            self.stats["decode_tokens"] += len(active)
            cache, logits = out.past_key_values, out.logits[:, -1]
            position += 1
        return [s for s in done if s is not None]

    def generate_step(self, prefix: str, params: SamplingParams) -> Step:
        """One continuation of one prefix (seeded by params.seed; token speculation when it is on)."""
        return self.generate_steps([prefix], params)[0]

    # ---------------------------------------------------------------- runtime decoding
    def set_token_spec(self, spec: TokenSpecConfig | None, assistant: "HFStepEngine | None" = None) -> None:
        """Turn token-level speculation inside steps on (or off with None).

        ngram: prompt lookup over the prompt and the step so far. assistant: greedy proposals from
        `assistant` (an engine whose tokenizer must equal this one's).
        """
        if spec is None:
            self.token_spec, self._proposer = None, None
            return
        if spec.method == "ngram":
            proposer = NgramProposer(spec.ngram_size, spec.min_ngram)
        else:
            if assistant is None:
                raise ValueError("token_spec 'assistant' needs an assistant engine (the draft model)")
            proposer = AssistantProposer(assistant, self.tokenizer)
        self.token_spec, self._proposer = spec, proposer

    def token_proposer(self):
        return self._proposer

    def open_batch(self, params: SamplingParams, export: bool = False):
        """An empty DecodeBatch on this engine (rows can be added while it runs)."""
        from infer.engines.decode import DecodeBatch

        return DecodeBatch(self, params, export=export)

    def generate_steps(self, prefixes: Sequence[str], params: SamplingParams, *,
                       seeds: Sequence[int | None] | None = None,
                       caps: Sequence[int] | None = None) -> list[Step]:
        """One step after each prefix, all rows decoded in one batch (one forward per token).

        seeds: one sampling seed per row (default params.seed + row index); caps: per-row token caps
        (at most params.max_step_tokens). Under greedy decoding each row is what decoding it alone gives.
        """
        from infer.engines.decode import make_row_specs

        if not prefixes:
            return []
        batch = self.open_batch(params)
        results = dict(batch.add(make_row_specs(self, prefixes, params, seeds, caps)))
        results.update(batch.run())
        return [results[i] for i in range(len(prefixes))]

    def greedy_continue(self, ids: list[int], k: int) -> list[int]:
        """k greedy tokens after `ids` (assistant proposals); stops early at EOS."""
        out: list[int] = []
        if k < 1:
            return out
        with self.lock:
            cache, logits = self._prefill(list(ids))
            position = len(ids)
            while True:
                tok = int(logits.argmax(-1))
                out.append(tok)
                if len(out) >= k or tok in self.eos_ids:
                    return out
                inp = torch.tensor([[tok]], device=self.device)
                pos = torch.tensor([[position]], device=self.device)
                res = self._forward(input_ids=inp, past_key_values=cache, position_ids=pos, use_cache=True)
                self.stats["decode_tokens"] += 1
                cache, logits = res.past_key_values, res.logits[0, -1]
                position += 1

    # ---------------------------------------------------------------- teacher forcing
    def _layer_index(self, layers: Sequence[int] | None) -> list[int]:
        total = self.info.num_layers + 1
        chosen = list(range(total)) if layers is None else [l if l >= 0 else total + l for l in layers]
        bad = [l for l in chosen if not 0 <= l < total]
        if bad:
            raise ValueError(f"layers {bad} out of range for a model with {self.info.num_layers} layers (+ embeddings)")
        return chosen

    def score(self, prefix: str, steps: Sequence[str], *, hidden: bool = True,
              layers: Sequence[int] | None = None) -> list[ScoredStep]:
        """Each step teacher-forced after `prefix` independently; the prefix is encoded once and its
        cache repeated across the batch of steps (right-padded)."""
        if not steps:
            return []
        ids = self.encode_prefix(prefix)
        step_ids = [self.encode_step(s) for s in steps]
        empty = [i for i, s in enumerate(step_ids) if not s]
        if empty:
            raise ValueError(f"steps {empty} encode to no tokens; cannot score an empty step")
        self._check_fits(len(ids) + max(map(len, step_ids)), "prompt plus step")
        chosen = self._layer_index(layers)
        results: list[ScoredStep] = []
        for start in range(0, len(step_ids), self.max_batch_rows):
            chunk = step_ids[start:start + self.max_batch_rows]
            results.extend(self._score_batch(ids, chunk, hidden, chosen))
        return results

    def _score_batch(self, ids, chunk, hidden, chosen) -> list[ScoredStep]:
        cache, last_logits = self._prefill(ids)
        rows, width = len(chunk), max(map(len, chunk))
        cache.batch_repeat_interleave(rows)
        pad = self.tokenizer.pad_token_id or 0
        inp = torch.full((rows, width), pad, device=self.device)
        mask = torch.zeros((rows, len(ids) + width), dtype=torch.long, device=self.device)
        mask[:, : len(ids)] = 1
        for r, s in enumerate(chunk):
            inp[r, : len(s)] = torch.tensor(s)
            mask[r, len(ids): len(ids) + len(s)] = 1
        pos = torch.arange(len(ids), len(ids) + width, device=self.device)[None].expand(rows, -1)
        out = self._forward(input_ids=inp, past_key_values=cache, attention_mask=mask, position_ids=pos,
                            use_cache=False, output_hidden_states=hidden)
        self.stats["prefill_tokens"] += int(sum(map(len, chunk)))
        # Token t of a step is predicted by the position before it: the prefix's last logits for t = 0.
        pred = torch.cat([last_logits[None, None].expand(rows, 1, -1), out.logits[:, :-1].float()], 1)
        lp = torch.log_softmax(pred, -1).gather(-1, inp[..., None]).squeeze(-1)
        hs = torch.stack([out.hidden_states[i] for i in chosen], 1).float() if hidden else None  # (rows, L, T, H)
        results = []
        for r, s in enumerate(chunk):
            n = len(s)
            mean = hs[r, :, :n].mean(1).cpu() if hidden else None
            last = hs[r, :, n - 1].cpu() if hidden else None
            results.append(ScoredStep(list(s), lp[r, :n].cpu(), mean, last))
        return results

    def score_chain(self, prefix: str, steps: Sequence[str], *, hidden: bool = True,
                    layers: Sequence[int] | None = None) -> list[ScoredStep]:
        """steps[0] ⊕ steps[1] ⊕ ... teacher-forced after `prefix` in one pass; one result per step,
        each conditioned on the steps before it (causal attention)."""
        if not steps:
            return []
        ids = self.encode_prefix(prefix)
        step_ids = [self.encode_step(s) for s in steps]
        flat = [t for s in step_ids for t in s]
        self._check_fits(len(ids) + len(flat), "prompt plus steps")
        chosen = self._layer_index(layers)
        cache, last_logits = self._prefill(ids)
        inp = torch.tensor([flat], device=self.device)
        pos = torch.arange(len(ids), len(ids) + len(flat), device=self.device)[None]
        out = self._forward(input_ids=inp, past_key_values=cache, position_ids=pos, use_cache=False,
                            output_hidden_states=hidden)
        self.stats["prefill_tokens"] += len(flat)
        pred = torch.cat([last_logits[None], out.logits[0, :-1].float()], 0)
        lp = torch.log_softmax(pred, -1).gather(-1, inp[0, :, None]).squeeze(-1)
        hs = torch.stack([out.hidden_states[i][0] for i in chosen], 0).float() if hidden else None  # (L, T, H)
        results, offset = [], 0
        for s in step_ids:
            sl = slice(offset, offset + len(s))
            mean = hs[:, sl].mean(1).cpu() if hidden and s else None
            last = hs[:, offset + len(s) - 1].cpu() if hidden and s else None
            results.append(ScoredStep(list(s), lp[sl].cpu(), mean, last))
            offset += len(s)
        return results

    def mean_token_logprob(self, scored: ScoredStep) -> float:
        return scored.logprob / max(1, scored.num_tokens)

