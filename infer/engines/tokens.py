"""Text <-> token ids for a step engine on a Hugging Face tokenizer (transformers and vLLM engines alike).

`StepTokenizer` owns the rules every engine must agree on: the chat-formatted question, the token ids of
a `Prefix` (generated steps by their own ids, never re-tokenised), and the per-token stop rule of a step
(`StepTokenizer.finished`).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from specprobe.infer.engines.base import (
    DEFAULT_STEP_DELIMITER,
    Prefix,
    PrefixStep,
    PromptTooLongError,
    Step,
    StopReason,
    with_delimiter,
)


def find_step_end(text: str, delimiter: str) -> int | None:
    """End index (exclusive) of the first delimiter that follows some non-whitespace text, or None.

    A delimiter before any content would make an empty step, so leading blank lines are skipped.
    """
    start = len(text) - len(text.lstrip())
    if start == len(text):
        return None
    pos = text.find(delimiter, start)
    return None if pos < 0 else pos + len(delimiter)


def tokenizer_fingerprint(tokenizer) -> str:
    """Equal for two tokenizers exactly when they map every token string to the same id."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.blake2b(repr(vocab).encode("utf-8"), digest_size=12).hexdigest()


def eos_token_ids(tokenizer, generation_config=None) -> set[int]:
    """The ids that end an answer: the tokenizer's EOS and the model's generation-config EOS ids (a
    GenerationConfig, or its dict as vLLM reads it)."""
    ids: set[int] = set()
    config_eos = (generation_config.get("eos_token_id") if isinstance(generation_config, dict)
                  else getattr(generation_config, "eos_token_id", None))
    for value in (config_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return ids


class StepTokenizer:
    """Chat template, prefix ids and the step stop rule on one Hugging Face tokenizer."""

    def __init__(self, tokenizer, *, use_chat_template: bool = True, system_prompt: str | None = None,
                 eos_ids: Iterable[int] = (), stop_at_eos: bool = True):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.system_prompt = system_prompt
        self.eos_ids = set(eos_ids) or eos_token_ids(tokenizer)
        # False only for system-speed runs: random-weight models emit EOS by chance
        self.stop_at_eos = stop_at_eos
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        self._heads: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self._pieces: dict[int, str] = {}
        self._cheap_holds: dict[str, bool] = {}

    # ------------------------------------------------------------------ text
    def head_text(self, question: str, delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
        """The question as the model sees it before the first step."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("empty prompt: the question text is empty")
        if self.use_chat_template:
            messages = [{"role": "user", "content": question}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return question.rstrip() + delimiter

    def format_prefix(self, question: str, steps: Sequence[PrefixStep] = (),
                      delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
        return self.head_text(question, delimiter) + "".join(Prefix(question, tuple(steps), delimiter).step_texts())

    # ------------------------------------------------------------------ ids
    def head_ids(self, question: str, delimiter: str = DEFAULT_STEP_DELIMITER) -> list[int]:
        key = (question, delimiter)
        if key not in self._heads:
            # a chat template writes its own special tokens; a raw prompt gets the tokenizer's BOS
            ids = self.tokenizer(self.head_text(question, delimiter),
                                 add_special_tokens=not self.use_chat_template)["input_ids"]
            if not ids:
                raise ValueError("empty prompt: it encodes to no tokens")
            self._heads[key] = list(ids)
            while len(self._heads) > 64:
                self._heads.popitem(last=False)
        return list(self._heads[key])

    def text_ids(self, text: str) -> list[int]:
        """Token ids of a piece of step text (no special tokens)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def step_ids(self, step: PrefixStep, delimiter: str) -> list[int]:
        """A prefix step's ids: a generated step's own ids when they are in this tokenizer."""
        if isinstance(step, Step):
            if step.tokenizer_id == self.tokenizer_id and step.token_ids:
                return list(step.token_ids)
            return self.text_ids(step.text)
        return self.text_ids(with_delimiter(step, delimiter))

    def prefix_ids(self, prefix: Prefix) -> list[int]:
        ids = self.head_ids(prefix.question, prefix.delimiter)
        for step in prefix.steps:
            ids.extend(self.step_ids(step, prefix.delimiter))
        return ids

    def piece(self, token_id: int) -> str:
        """One token decoded on its own (cached): the fast path's cheap delimiter test reads these."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return text

    def next_tail(self, tail: str, token_id: int, delimiter: str) -> tuple[str, bool]:
        """The fast path's per-token test, which spares a full decode at most tokens: (the tail with this token's
        piece added, kept as short as the test needs; whether a step may end at `delimiter` in this token). Only a
        yes needs the exact rule (`finished`); where `cheap_test_holds`, a no is never wrong.

        The tail joins tokens each decoded on its own, which may lack spaces the full decode has (a SentencePiece
        decoder strips a lone token's leading space), so spaces are left out of tail and delimiter; an ASCII
        delimiter's other characters survive (their bytes never share a multi-byte character). A delimiter of
        spaces alone matches everywhere (the exact rule then runs at every token)."""
        core = delimiter.replace(" ", "")
        piece = self.piece(token_id).replace(" ", "")
        tail = (tail + piece)[-(len(core) + len(piece)):]
        return tail, core in tail

    def cheap_test_holds(self, delimiter: str) -> bool:
        """Whether `next_tail` may stand in for the exact rule with this delimiter: an ASCII delimiter, and lone
        tokens that do not add characters a full decode lacks (a WordPiece decoder keeps "##" on a lone token)."""
        if delimiter not in self._cheap_holds:
            tail, found = "", False
            for token_id in self.text_ids(f"Step 1 is done{delimiter}Step 2") if delimiter.isascii() else ():
                tail, may_end = self.next_tail(tail, token_id, delimiter)
                found |= may_end
            self._cheap_holds[delimiter] = found
        return self._cheap_holds[delimiter]

    # ------------------------------------------------------------------ the stop rule
    def finished(self, tokens: Sequence[int], cap: int, delimiter: str) -> tuple[str, StopReason] | None:
        """(text, stop reason) when a step with these sampled tokens is complete, else None. The one rule
        of every engine: EOS ends it (text without the EOS), else the first delimiter after some
        non-whitespace text, else the token cap."""
        if self.stop_at_eos and tokens and tokens[-1] in self.eos_ids:
            return self.tokenizer.decode(list(tokens[:-1])), "eos"
        text = self.tokenizer.decode(list(tokens))
        if find_step_end(text, delimiter) is not None:
            return text, "delimiter"
        if len(tokens) >= cap:
            return text, "length"
        return None

    def make_step(self, tokens: Sequence[int], logprob: float, cap: int, delimiter: str) -> Step | None:
        done = self.finished(tokens, cap, delimiter)
        if done is None:
            return None
        return Step(done[0], list(tokens), done[1], logprob, self.tokenizer_id)


class TokenizedText:
    """The text side of the StepEngine protocol for an engine that holds a StepTokenizer as `text` and an
    EngineInfo as `info`: prefixes as text and ids, token counts, and the context-window check (`window_hint`:
    what a user can do about a prompt too long for this engine)."""

    text: StepTokenizer
    window_hint = "shorten the prompt or lower the number of steps kept in it"

    def format_prefix(self, question: str, steps: Sequence[PrefixStep] = (),
                      delimiter: str = DEFAULT_STEP_DELIMITER) -> str:
        return self.text.format_prefix(question, steps, delimiter)

    def prefix_ids(self, prefix: Prefix) -> list[int]:
        """The token ids this engine conditions on for `prefix` (see `infer.engines.base`)."""
        return self.text.prefix_ids(prefix)

    def count_tokens(self, text: str) -> int:
        return len(self.text.text_ids(text))

    def check_fits(self, prefix: Prefix, extra_tokens: int = 0) -> None:
        self._check_length(len(self.prefix_ids(prefix)) + extra_tokens, "the prompt" if not extra_tokens
                           else "prompt plus the tokens asked for")

    def _check_length(self, n_tokens: int, what: str) -> None:
        limit = self.info.max_length
        if limit and n_tokens > limit:
            raise PromptTooLongError(f"{what} has {n_tokens} tokens, more than the context window of "
                                     f"{self.info.model_id} ({limit}); {self.window_hint}")
