"""A toy step engine whose every result is exact integer arithmetic (no floating point decides a token).

It implements `infer.engines.base.StepEngine` on a character-level toy tokenizer and uses the real
`StepTokenizer` (prefix ids, stop rule) and `SerialStream`. Next-token weights are integers hashed from
(salt, context ids); greedy takes the largest (lowest id on ties), sampling draws an integer below the
total weight from Python's `random.Random(seed)`. So the runtime's exactness relations (reject-all =
target-only, pairing, caps, EOS) can be asserted bit for bit on any machine. Two engines with the same
salt are the same "model".
"""
from __future__ import annotations

import hashlib
import math
import random
import string
from collections.abc import Sequence

import torch

from specprobe.infer.engines.base import (
    EngineInfo,
    EngineStats,
    Generation,
    Prefix,
    PromptTooLongError,
    SamplingParams,
    ScoredStep,
    Scoring,
    SerialStream,
    StepRequest,
)
from specprobe.infer.engines.tokens import StepTokenizer

WORDS = [" one", " two", " plus", " is", " so", "."]


class ToyTokenizer:
    """Printable ASCII characters, "\\n", "\\n\\n", a few words, and EOS; longest-match encoding."""

    chat_template = None

    def __init__(self):
        self.pieces = list(string.printable[:95]) + ["\n", "\n\n"] + WORDS + ["<eos>"]
        self.ids = {p: i for i, p in enumerate(self.pieces)}
        self.eos_token_id = self.ids["<eos>"]
        self.delimiter_id = self.ids["\n\n"]
        self.pad_token_id = None

    def get_vocab(self) -> dict:
        return dict(self.ids)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.pieces[i] for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        out, i = [], 0
        longest = max(len(p) for p in self.pieces)
        while i < len(text):
            for n in range(min(longest, len(text) - i), 0, -1):
                if text[i:i + n] in self.ids and text[i:i + n] != "<eos>":
                    out.append(self.ids[text[i:i + n]])
                    i += n
                    break
            else:
                out.append(self.ids["?"])
                i += 1
        return {"input_ids": out}


class ToyEngine:
    """StepEngine over integer next-token weights. `delimiter_weight` / `eos_weight` (the largest weight
    the delimiter / EOS can draw) tune how often a step ends on the delimiter / the answer ends."""

    def __init__(self, salt: str = "target", *, delimiter_weight: int = 60, eos_weight: int = 0,
                 max_length: int | None = None):
        self.tokenizer = ToyTokenizer()
        self.text = StepTokenizer(self.tokenizer, use_chat_template=False, eos_ids=[self.tokenizer.eos_token_id])
        self.salt, self.delimiter_weight, self.eos_weight = salt, delimiter_weight, eos_weight
        self.info = EngineInfo(model_id=f"toy:{salt}", revision=None, num_layers=2, hidden_size=4,
                               vocab_size=len(self.tokenizer.pieces), tokenizer_id=self.text.tokenizer_id,
                               max_length=max_length)

    # ---------------------------------------------------------------- the "model"
    def weights(self, context: Sequence[int]) -> list[int]:
        digest = hashlib.blake2b(repr((self.salt, tuple(context))).encode(), digest_size=64).digest()
        rng = random.Random(digest)
        w = [rng.randrange(1, 40) for _ in self.tokenizer.pieces]
        # other tokens weigh 1..39: the delimiter / EOS is the greedy choice when its draw exceeds them
        w[self.tokenizer.delimiter_id] = rng.randrange(1, self.delimiter_weight + 1)
        w[self.tokenizer.eos_token_id] = rng.randrange(0, self.eos_weight + 1) if self.eos_weight else 0
        return w

    def next_token(self, context: Sequence[int], temperature: float, rng: random.Random) -> tuple[int, float]:
        w = self.weights(context)
        if temperature == 0:
            tok = max(range(len(w)), key=lambda i: (w[i], -i))
        else:
            u, tok = rng.randrange(sum(w)), 0
            while u >= w[tok]:
                u -= w[tok]
                tok += 1
        return tok, math.log(w[tok] / sum(w))

    # ---------------------------------------------------------------- interface
    def format_prefix(self, question, steps=(), delimiter="\n\n") -> str:
        return self.text.format_prefix(question, steps, delimiter)

    def prefix_ids(self, prefix: Prefix) -> list[int]:
        return self.text.prefix_ids(prefix)

    def check_fits(self, prefix: Prefix, extra_tokens: int = 0) -> None:
        n = len(self.text.prefix_ids(prefix)) + extra_tokens
        if self.info.max_length and n > self.info.max_length:
            raise PromptTooLongError(f"the prompt has {n} tokens, more than the context window ({self.info.max_length})")

    def count_tokens(self, text: str) -> int:
        return len(self.text.text_ids(text))

    def continue_ids(self, ids: list[int], n_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
        """Plain autoregressive generation of n_tokens after ids (no step boundaries)."""
        rng, out = random.Random(seed), []
        for _ in range(n_tokens):
            tok, _ = self.next_token(ids + out, temperature, rng)
            out.append(tok)
            if tok == self.tokenizer.eos_token_id:
                break
        return out

    def generate(self, requests: Sequence[StepRequest], params: SamplingParams) -> Generation:
        stats, out = EngineStats(), []
        for req in requests:
            ids = self.text.prefix_ids(req.prefix)
            self.check_fits(req.prefix, req.cap(params))
            seed = params.seed if req.seed is None else req.seed
            samples = []
            for k in range(req.n):
                rng = random.Random(repr((seed, k)))
                tokens, logprob = [], 0.0
                while True:
                    tok, lp = self.next_token(ids + tokens, params.temperature, rng)
                    tokens.append(tok)
                    logprob += lp
                    step = self.text.make_step(tokens, logprob, req.cap(params), params.delimiter)
                    if step is not None:
                        break
                samples.append(step)
                stats.forward_passes += len(tokens)
                stats.generated_tokens += len(tokens)
            out.append(samples)
        return Generation(out, stats)

    def open_stream(self, params: SamplingParams) -> SerialStream:
        return SerialStream(self, params)

    def _scored(self, ids: list[int], step_ids: list[int], hidden: bool) -> ScoredStep:
        lps = []
        for t, tok in enumerate(step_ids):
            w = self.weights(ids + step_ids[:t])
            lps.append(math.log(w[tok] / sum(w)))
        feats = torch.tensor([[float(sum(step_ids) % 7), float(len(step_ids)), 1.0, 0.0]] * 3) if hidden else None
        return ScoredStep(list(step_ids), torch.tensor(lps), feats, feats)

    def score(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True, layers=None) -> Scoring:
        ids = self.text.prefix_ids(prefix)
        return Scoring([self._scored(ids, self.text.text_ids(s), hidden) for s in steps], EngineStats(forward_passes=1))

    def score_chain(self, prefix: Prefix, steps: Sequence[str], *, hidden: bool = True, layers=None) -> Scoring:
        ids, out = self.text.prefix_ids(prefix), []
        for s in steps:
            sid = self.text.text_ids(s)
            out.append(self._scored(ids, sid, hidden))
            ids = ids + sid
        return Scoring(out, EngineStats(forward_passes=1))
