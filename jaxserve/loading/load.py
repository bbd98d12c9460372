"""Model loading: a LoadConfig to (model config, params, tokenizer, served name)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxserve.config import LoadConfig
from jaxserve.tokenizer import Tokenizer
from models.config import ModelConfig


def setup_compilation_cache(cache_dir: str) -> None:
    """Turn on JAX's persistent compilation cache in ``cache_dir`` ("" leaves it off)."""
    if not cache_dir:
        return
    path = os.path.expanduser(cache_dir)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def resolve_dtype(name: str) -> jnp.dtype:
    """"auto" -> float32 on the CPU, bfloat16 on accelerators."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def load_model(load: LoadConfig, dtype: jnp.dtype, seed: int
               ) -> tuple[ModelConfig, object, Tokenizer, str]:
    """(model config, params, tokenizer, served name) for a LoadConfig.

    GGUF: weights and tokenizer from the file. A directory: an orbax checkpoint written by
    ``jaxserve convert`` or an HF safetensors directory, with the tokenizer files beside it.
    Dummy: random weights of a built-in config with the SmolLM2 tokenizer. Raises ValueError /
    FileNotFoundError with the reason.
    """
    from jaxserve.loading.model_files import default_gguf_path
    from models.config import builtin_config
    from models.gguf_reader import GGUFFile
    from models.loader import dummy_params, gguf_name, load_gguf_params
    from models.registry import get_architecture

    if load.load_format == "dummy":
        cfg = builtin_config(load.model or "smollm2-135m")
        params = dummy_params(get_architecture(cfg.architecture).model(cfg, dtype), seed)
        return cfg, params, Tokenizer.from_gguf(default_gguf_path()), cfg.name
    path = load.model or default_gguf_path()
    if os.path.isdir(path):
        return _load_model_dir(path, dtype)
    if not path.lower().endswith(".gguf"):
        raise ValueError(
            f"model {path!r} is not a GGUF file or a model directory; serve a .gguf file, an HF "
            f"safetensors directory, an orbax checkpoint from 'jaxserve convert', or a built-in "
            f"config with --load-format dummy")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file {path!r} does not exist")
    reader = GGUFFile(path)  # opened once for the weights and the tokenizer
    cfg, params = load_gguf_params(path, dtype, reader)
    return cfg, params, Tokenizer.from_gguf(path, reader), gguf_name(path)


def _load_model_dir(path: str, dtype: jnp.dtype) -> tuple[ModelConfig, object, Tokenizer, str]:
    """An orbax checkpoint written by ``jaxserve convert``, or an HF safetensors directory."""
    from models import checkpoint, hf

    if checkpoint.is_checkpoint(path):
        cfg, params = checkpoint.load_checkpoint(path, dtype)
    elif hf.is_hf_dir(path):
        cfg, params = hf.load_hf_params(path, dtype)
    else:
        raise ValueError(f"directory {path!r} is neither an orbax checkpoint written by "
                         f"'jaxserve convert' (config.json with format {checkpoint.FORMAT!r} and "
                         f"params/) nor an HF safetensors directory (config.json, *.safetensors)")
    tokenizer = Tokenizer.from_pretrained_dir(path)
    return cfg, params, tokenizer, os.path.basename(os.path.normpath(path))
