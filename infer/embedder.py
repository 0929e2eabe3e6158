"""Sentence embeddings with a transformers encoder, pooled the way the model was trained to be pooled.

A sentence-transformers model folder says how its token vectors become one sentence vector:
``modules.json`` lists its modules (Transformer, Pooling, optionally Normalize), ``1_Pooling/config.json``
(the Pooling module's folder) picks the pooling (mean, CLS, max, mean/sqrt(len), last token) and
``sentence_bert_config.json`` the maximum sequence length. `read_pooling` reads those files and
`SentenceEmbedder` applies them, so no sentence-transformers install is needed. A plain transformers
encoder without those files gets mean pooling + L2 normalisation (what all-MiniLM-L6-v2 and
all-mpnet-base-v2 use). The offline default is ``offline:minilm`` (384-d).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specprobe.infer.models import load_model, resolve_model_folder

log = logging.getLogger(__name__)
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingSpec:
    """How token vectors become a sentence vector; `source` says where the settings came from."""

    mode: str = "mean"
    normalize: bool = True
    max_length: int | None = None
    source: str = "default (no sentence-transformers modules.json)"


_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
                 "lasttoken": "pooling_mode_lasttoken", "weightedmean": "pooling_mode_weightedmean_tokens"}


def _pooling_mode(config: dict, where: str) -> str:
    on = [mode for mode, key in _POOLING_KEYS.items() if config.get(key)]
    if len(on) != 1 or on[0] not in POOLING_MODES:
        raise ValueError(f"{where}: this embedder supports exactly one of the pooling modes {POOLING_MODES}; "
                         f"the file switches on {on or 'none'}")
    return on[0]


def read_pooling(folder: str | os.PathLike) -> PoolingSpec:
    """The pooling settings of a sentence-transformers model folder (defaults when it has none)."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingSpec()
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    types = {m.get("type"): m for m in modules}
    if _ST_POOLING not in types:
        raise ValueError(f"{modules_file} has no {_ST_POOLING} module; this embedder needs one")
    pool_file = folder / types[_ST_POOLING].get("path", "1_Pooling") / "config.json"
    mode = _pooling_mode(json.loads(pool_file.read_text(encoding="utf-8")), str(pool_file))
    bert_file = folder / "sentence_bert_config.json"
    max_length = json.loads(bert_file.read_text(encoding="utf-8")).get("max_seq_length") if bert_file.is_file() else None
    return PoolingSpec(mode, _ST_NORMALIZE in types, max_length, str(folder))


def _model_folder(name: str) -> Path | None:
    """The local folder of `name`, downloading nothing: a hub id is looked up in the local hub cache only."""
    folder, revision = resolve_model_folder(name)
    if os.path.isdir(folder):
        return Path(folder)
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(folder, "modules.json", revision=revision)
    except Exception:  # noqa: BLE001 - no cache or an odd name: fall back to the defaults
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def mean_pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the token vectors of each row, ignoring padding. (batch, seq, d) -> (batch, d)."""
    mask = attention_mask.unsqueeze(-1).to(last_hidden.dtype)
    summed = (last_hidden * mask).sum(dim=1)
    # clamp: an all-padding row (cannot happen with a real tokenizer) must not divide by zero
    return summed / mask.sum(dim=1).clamp(min=1e-9)


def pool(last_hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """(batch, seq, d) -> (batch, d) by `mode` (`POOLING_MODES`), padding ignored (right or left)."""
    if mode == "mean":
        return mean_pool(last_hidden, attention_mask)
    if mode == "mean_sqrt_len":
        counts = attention_mask.sum(dim=1, keepdim=True).to(last_hidden.dtype).clamp(min=1.0)
        return mean_pool(last_hidden, attention_mask) * counts / counts.sqrt()
    if mode == "max":
        mask = attention_mask.unsqueeze(-1).bool()
        return last_hidden.masked_fill(~mask, torch.finfo(last_hidden.dtype).min).max(dim=1).values
    if mode == "cls":
        return last_hidden[:, 0]
    if mode == "lasttoken":
        seq = attention_mask.shape[1]
        last = seq - 1 - attention_mask.flip(1).long().argmax(dim=1)  # last real token, whichever side pads
        return last_hidden[torch.arange(last_hidden.shape[0]), last]
    raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")


class SentenceEmbedder:
    """Encode texts into unit-length vectors; `cosine` compares them pairwise.

    name: anything `infer.models.load_model` accepts (``offline:minilm``, a local folder, a hub id).
    Pooling, normalisation and the default max_length come from the model's own sentence-transformers
    files (`read_pooling`). Embeddings come back as float32 on the CPU whatever the device.
    """

    def __init__(self, name: str = "offline:minilm", device: str | None = None, batch_size: int = 64,
                 max_length: int | None = None):
        if batch_size < 1:
            raise ValueError(f"SentenceEmbedder.batch_size must be >= 1, got {batch_size}")
        if max_length is not None and max_length < 2:
            raise ValueError(f"SentenceEmbedder.max_length must be >= 2, got {max_length}")
        folder = _model_folder(name)
        self.pooling = read_pooling(folder) if folder is not None else PoolingSpec(source="default (not cached)")
        if folder is None:
            log.warning("no local files of %s: pooling by mean + normalisation, as most sentence models do", name)
        self.name = name
        self.batch_size = batch_size
        self.max_length = max_length or self.pooling.max_length or 256
        self.model, self.tokenizer = load_model(name, kind="encoder", device=device)
        self.device = next(self.model.parameters()).device
        self.dim = int(self.model.config.hidden_size)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(len(texts), dim) float32, pooled as the model says (rows L2-normalised when it normalises)."""
        texts = _as_text_list(texts)
        out = torch.empty(len(texts), self.dim, dtype=torch.float32)
        # Sorting by length keeps padding (wasted compute) small inside each batch.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                   max_length=self.max_length, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state
            pooled = pool(hidden.float(), batch["attention_mask"], self.pooling.mode)
            out[idx] = (torch.nn.functional.normalize(pooled, p=2, dim=-1) if self.pooling.normalize
                        else pooled).cpu()
        return out

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
