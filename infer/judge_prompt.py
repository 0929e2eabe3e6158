"""The step-equivalence judge prompt, shared by the runtime and by judge-LoRA training.

One forward pass decides: the prompt asks whether two candidate next steps of a solution mean the same
thing and pre-fills the assistant turn with "[", so the next token starts either "aligned" or
"unaligned". P(aligned) = softmax over the logits of those two first tokens (the idea of Lookahead
Reasoning's judge prompt, App. A; the wording here is ours). Training a LoRA judge must use
`build_judge_prompt` and `answer_token_ids` unchanged — `PROMPT_VERSION` is recorded in judge.json and
checked when an adapter is loaded.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

PROMPT_VERSION = 1
PREFILL = "["
YES_WORD = "aligned"
NO_WORD = "unaligned"
MAX_CONTEXT_CHARS = 1500  # the context is cut from the left to its last this-many characters

INSTRUCTIONS = (
    "Below is the beginning of a step-by-step solution and two candidate next steps, A and B. "
    "Decide whether A and B say the same thing: the same idea, the same reasoning and the same numbers "
    "and results. Differences in wording, order of words or formatting do not matter; a different "
    "calculation, a different result or a different idea does. "
    "Answer [aligned] if they mean the same. Answer [unaligned] if they differ, or if you cannot tell. "
    "Reply with [aligned] or [unaligned] only."
)


def _clip_context(context: str, max_chars: int) -> str:
    text = context.strip()
    if len(text) > max_chars:
        text = "..." + text[-max_chars:]
    return text


def build_judge_prompt(tokenizer, context: str, step_a: str, step_b: str, *,
                       max_context_chars: int = MAX_CONTEXT_CHARS) -> str:
    """The full judge input as text, ending with the pre-filled "[" of the answer.

    With a chat template the instructions are the user turn and "[" starts the assistant turn; without
    one a plain "Answer: [" follows the instructions. Tokenize the result with
    `add_special_tokens=not uses_chat_template(tokenizer)`.
    """
    if not isinstance(step_a, str) or not isinstance(step_b, str) or not isinstance(context, str):
        raise TypeError("context, step_a and step_b must be strings")
    user = (f"{INSTRUCTIONS}\n\n"
            f"Solution so far:\n<context>\n{_clip_context(context, max_context_chars)}\n</context>\n\n"
            f"Step A:\n<step>\n{step_a.strip()}\n</step>\n\n"
            f"Step B:\n<step>\n{step_b.strip()}\n</step>")
    if uses_chat_template(tokenizer):
        head = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
        return head + PREFILL
    return f"{user}\n\nAnswer: {PREFILL}"


def uses_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _first_token_after_prefill(tokenizer, word: str) -> int:
    base = tokenizer(PREFILL, add_special_tokens=False)["input_ids"]
    full = tokenizer(PREFILL + word, add_special_tokens=False)["input_ids"]
    if len(full) > len(base) and full[:len(base)] == base:
        return int(full[len(base)])
    alone = tokenizer(word, add_special_tokens=False)["input_ids"]  # "[" merged with the word's start
    if not alone:
        raise ValueError(f"the tokenizer encodes {word!r} to no tokens")
    return int(alone[0])


def answer_token_ids(tokenizer) -> tuple[int, int]:
    """(yes_id, no_id): the first token of "aligned" and of "unaligned" after the pre-filled "["."""
    yes, no = _first_token_after_prefill(tokenizer, YES_WORD), _first_token_after_prefill(tokenizer, NO_WORD)
    if yes == no:
        raise ValueError(f"this tokenizer starts {YES_WORD!r} and {NO_WORD!r} with the same token ({yes}); "
                         "the one-token judge cannot tell them apart")
    return yes, no


def encode_judge_batch(tokenizer, batch: Sequence[tuple[str, str, str]], device=None,
                       max_context_chars: int = MAX_CONTEXT_CHARS) -> dict[str, torch.Tensor]:
    """Left-padded input_ids / attention_mask / position_ids for a batch of (context, step_a, step_b)."""
    if not batch:
        raise ValueError("empty judge batch")
    prompts = [build_judge_prompt(tokenizer, c, a, b, max_context_chars=max_context_chars) for c, a, b in batch]
    add_special = not uses_chat_template(tokenizer)
    ids = [tokenizer(p, add_special_tokens=add_special)["input_ids"] for p in prompts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


def judge_answer_logits(model, tokenizer, batch: Sequence[tuple[str, str, str]],
                        max_context_chars: int = MAX_CONTEXT_CHARS) -> torch.Tensor:
    """(B, 2) logits of [yes, no] at the answer position; differentiable (use it to train a LoRA judge).
    The LM head runs on the last position only (`logits_to_keep=1`): no (B, T, vocab) tensor, same numbers."""
    device = next(model.parameters()).device
    enc = encode_judge_batch(tokenizer, batch, device, max_context_chars)
    yes, no = answer_token_ids(tokenizer)
    out = model(**enc, use_cache=False, logits_to_keep=1)
    return out.logits[:, -1, [yes, no]].float()


def judge_probability(model, tokenizer, batch: Sequence[tuple[str, str, str]], *, batch_size: int = 8,
                      max_context_chars: int = MAX_CONTEXT_CHARS, progress: str | None = None) -> torch.Tensor:
    """P(aligned) for each (context, step_a, step_b): one forward pass per chunk of `batch_size`;
    `progress`: a progress bar with this description over the chunks."""
    batch = list(batch)
    if not batch:
        return torch.empty(0)
    was_training = model.training
    model.eval()
    try:
        probs = []
        with torch.inference_mode():
            starts = range(0, len(batch), batch_size)
            for start in tqdm(starts, desc=progress, unit="batch", disable=progress is None):
                logits = judge_answer_logits(model, tokenizer, batch[start:start + batch_size], max_context_chars)
                probs.append(torch.softmax(logits, -1)[:, 0].cpu())
    finally:
        model.train(was_training)
    return torch.cat(probs)
