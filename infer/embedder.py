"""Sentence embeddings with a transformers encoder: mean pooling over the attention mask, L2-normalised.

This is what sentence-transformers does for all-MiniLM-L6-v2 / all-mpnet-base-v2 (Pooling with
``pooling_mode_mean_tokens`` followed by ``Normalize``), written out so that no sentence-transformers
install is needed. The offline default is ``offline:minilm`` (384-d).
"""
from __future__ import annotations

from typing import Sequence

import torch

from infer.models import load_model


def mean_pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the token vectors of each row, ignoring padding. (batch, seq, d) -> (batch, d)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden.dtype)
    summed = (last_hidden * mask).sum(dim=1)
    # clamp: an all-padding row (cannot happen with a real tokenizer) must not divide by zero
    return summed / mask.sum(dim=1).clamp(min=1e-9)


class SentenceEmbedder:
    """Encode texts into unit-length vectors; `cosine` compares them pairwise.

    name: anything `infer.models.load_model` accepts (``offline:minilm``, a local folder, a hub id).
    Embeddings come back as float32 on the CPU whatever the device, so callers can mix them freely.
    """

    def __init__(self, name: str = "offline:minilm", device: str | None = None, batch_size: int = 64,
                 max_length: int = 256):
        if batch_size < 1:
            raise ValueError(f"SentenceEmbedder.batch_size must be >= 1, got {batch_size}")
        if max_length < 2:
            raise ValueError(f"SentenceEmbedder.max_length must be >= 2, got {max_length}")
        self.name = name
        self.batch_size = batch_size
        self.max_length = max_length
        self.model, self.tokenizer = load_model(name, kind="encoder", device=device)
        self.device = next(self.model.parameters()).device
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(len(texts), dim) float32, each row L2-normalised."""
        texts = _as_text_list(texts)
        out = torch.empty(len(texts), self.dim, dtype=torch.float32)
        # Sorting by length keeps padding (wasted compute) small inside each batch.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state
            pooled = mean_pool(hidden.float(), batch["attention_mask"])
            out[idx] = torch.nn.functional.normalize(pooled, p=2, dim=-1).cpu()
        return out

    def cosine(self, a_texts: Sequence[str], b_texts: Sequence[str]) -> torch.Tensor:
        """Cosine similarity of a_texts[i] and b_texts[i] for every i: Tensor[n]."""
        a_texts, b_texts = _as_text_list(a_texts), _as_text_list(b_texts)
        if len(a_texts) != len(b_texts):
            raise ValueError(f"cosine needs equally long lists, got {len(a_texts)} and {len(b_texts)}")
        # Each distinct text is encoded once (a cluster representative is often in many pairs).
        unique = list(dict.fromkeys(a_texts + b_texts))
        where = {t: i for i, t in enumerate(unique)}
        emb = self.encode(unique)
        ea = emb[[where[t] for t in a_texts]]
        eb = emb[[where[t] for t in b_texts]]
        return (ea * eb).sum(dim=-1)


def _as_text_list(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):  # a bare string would be encoded character by character
        raise TypeError("expected a sequence of strings, got a single str; wrap it in a list")
    texts = list(texts)
    bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
    if bad:
        raise TypeError(f"expected strings only, got {sorted(set(bad))}")
    return texts
