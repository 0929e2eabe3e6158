"""Sentence embeddings by sentence-transformers, pooled the way the model was trained to be pooled.

A sentence-transformers model folder says how its token vectors become one sentence vector (`modules.json`:
Transformer, Pooling, optionally Normalize; `1_Pooling/config.json`; `sentence_bert_config.json` for the
maximum length); sentence-transformers reads those files itself. A plain transformers encoder without them
gets sentence-transformers' default, mean pooling. The offline default is ``offline:minilm`` (384-d).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from sentence_transformers import SentenceTransformer

from specprobe.infer.models import hub_error, resolve_model_folder


class SentenceEmbedder:
    """Encode texts into sentence vectors; `cosine` compares them pairwise.

    name: ``offline:minilm``, a local sentence-transformers or transformers folder, or a hub id (``id@revision``).
    Embeddings come back as float32 on the CPU whatever the device.
    """

    def __init__(self, name: str = "offline:minilm", device: str | None = None, batch_size: int = 64,
                 max_length: int | None = None, cache_dir: str | None = None):
        if batch_size < 1:
            raise ValueError(f"SentenceEmbedder.batch_size must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"SentenceEmbedder.max_length must be >= 2, got {max_length}")
        source, revision = resolve_model_folder(name, cache_dir)
        try:
            self.model = SentenceTransformer(source, device=device, revision=revision, cache_folder=cache_dir)
        except OSError as err:  # not cached and no hub: say how to get it
            raise hub_error(source, revision, err) from None
        if max_length is not None:
            self.model.max_seq_length = max_length
        self.name, self.batch_size = name, batch_size
        self.max_length = self.model.max_seq_length
        self.tokenizer = self.model.tokenizer
        self.dim = int(self.model.get_embedding_dimension())

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(len(texts), dim) float32, pooled (and normalised) as the model's files say."""
        texts = _as_text_list(texts)
        if not texts:
            return torch.empty(0, self.dim, dtype=torch.float32)
        out = self.model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True, show_progress_bar=False)
        return out.float().cpu()

    def cosine(self, a_texts: Sequence[str], b_texts: Sequence[str]) -> torch.Tensor:
        """Cosine similarity of a_texts[i] and b_texts[i] for every i: Tensor[n]."""
        a_texts, b_texts = _as_text_list(a_texts), _as_text_list(b_texts)
        if len(a_texts) != len(b_texts):
            raise ValueError(f"cosine needs equally long lists, got {len(a_texts)} and {len(b_texts)}")
        # Each distinct text is encoded once (a cluster representative is often in many pairs).
        unique = list(dict.fromkeys(a_texts + b_texts))
        where = {t: i for i, t in enumerate(unique)}
        emb = torch.nn.functional.normalize(self.encode(unique), p=2, dim=-1)  # cosine needs unit rows
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
