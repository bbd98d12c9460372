"""Static scales for the 8-bit KV cache, measured by one calibration prefill at engine start.

Data flow (``LLMEngine`` with ``kv_cache_dtype`` "fp8" / "int8", ``kv_scale_mode`` "calibrated"):
  calibration text (``kv_calibration_file``, else ``jaxserve/data/kv_calibration.txt``, a short
  passage of original English prose written for this purpose, independent of the evaluation
  text) -> the model's tokenizer -> at most ``MAX_CALIBRATION_TOKENS`` ids -> one
  ``model.forward`` prefill into a *float* paged cache of just enough blocks, with the model's
  own attention op (sharded or not) -> the K and V every layer wrote, ``[L, n, kv_heads,
  head_dim]`` each -> per (layer, kv head) the ``percentile`` of ``|x|`` over the tokens and
  head_dim (100: the maximum) -> ``scale = max(amax, AMAX_FLOOR) * HEADROOM[dtype] /
  QUANT_MAX[dtype]`` (QUANT_MAX: 448 for float8 e4m3, 127 for int8).

An orbax checkpoint written by ``jaxserve convert --kv-cache-dtype`` carries the scales
(``kv_scales.json``), and serving it skips the pass (``checkpoint_kv_scales``).

Scales are static after that: the same bytes mean the same value in every step, in the host tier
and after a swap. Values beyond the calibrated range saturate. Static scales calibrated on
sample text are what TensorRT-LLM's and vLLM's FP8 KV caches use (per tensor there, per (layer,
kv head) here); a fixed scale of 1.0 (``kv_scale_mode`` "unit") is kept to measure the
difference.
"""

from __future__ import annotations

import importlib.resources
import os

import jax
import jax.numpy as jnp
import numpy as np

from models import checkpoint
from models.interface import AttentionMetadata
from pallas_kernels.kv_cache import KV_QUANT_DTYPES, QUANT_MAX, allocate_kv_cache

MAX_CALIBRATION_TOKENS = 1024
MIN_CALIBRATION_TOKENS = 16
# |x| below this never sets a scale: a head that is (nearly) always zero keeps a usable scale
AMAX_FLOOR = 1e-4
# The calibrated max |x| maps to QUANT_MAX / HEADROOM, so values up to HEADROOM times what the
# calibration text produced still fit instead of saturating. For e4m3 (a float format: the same
# 3-bit relative precision from 2^-6 of its max up) headroom costs almost nothing; for int8 the
# step grows with it. Chosen by docs/decisions/0012-kv-quant-scales.md.
HEADROOM: dict[jnp.dtype, float] = {
    KV_QUANT_DTYPES["fp8"]: 1.0,
    jnp.dtype(jnp.int8): 1.0,
}


def default_calibration_text() -> str:
    """The calibration passage shipped as package data (about 870 SmolLM2 tokens)."""
    return (importlib.resources.files("jaxserve") / "data" / "kv_calibration.txt").read_text(
        encoding="utf-8")


def calibration_token_ids(tokenizer, path: str | None = None,
                          max_tokens: int = MAX_CALIBRATION_TOKENS) -> list[int]:
    """Token ids of the calibration text (``path``, else the shipped passage), cut to
    ``max_tokens``.

    Raises:
      ValueError: naming ``kv_calibration_file``, if the file cannot be read as UTF-8 or gives
        fewer than ``MIN_CALIBRATION_TOKENS`` tokens.
    """
    if path is None:
        text = default_calibration_text()
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"kv_calibration_file={path!r} cannot be read as UTF-8 text: "
                             f"{e}") from e
    ids = tokenizer.encode(text)[:max_tokens]
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ValueError(f"kv_calibration_file={path!r} gives {len(ids)} tokens; the "
                         f"calibration pass needs at least {MIN_CALIBRATION_TOKENS}")
    return ids


def calibration_amax(model, params, token_ids: list[int], *, block_size: int,
                     dtype: jnp.dtype, percentile: float = 100.0,
                     cache_sharding: jax.sharding.Sharding | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per-(layer, kv head) magnitude of the keys and values ``model`` writes for ``token_ids``.

    Args:
      model: a model of the serving protocol (``forward``) with ``cfg.num_layers``,
        ``cfg.num_kv_heads``, ``cfg.head_dim`` (the sharded config under tensor parallelism).
      params: its params (placed as the engine serves them).
      token_ids: the calibration tokens, one sequence prefilled in one step.
      block_size: tokens per block of the temporary float cache.
      dtype: the temporary cache's dtype (the serving dtype: what would be quantised).
      percentile: of ``|x|`` over tokens and head_dim; 100 takes the maximum.
      cache_sharding: the cache's sharding under tensor parallelism, else None.
    Returns:
      ``(k_amax, v_amax)``, each ``float32[num_layers, num_kv_heads]``.
    Raises:
      ValueError: if a magnitude is not finite (the model produced NaN/inf).
    """
    cfg = model.cfg
    n = len(token_ids)
    nb = -(-n // block_size)
    kv = allocate_kv_cache(cfg.num_layers, nb + 1, block_size, cfg.num_kv_heads, cfg.head_dim,
                           dtype, sharding=cache_sharding)
    def amax(pages: jax.Array) -> jax.Array:  # [L, nb + 1, bs, kv, hd] -> f32[L, kv]
        x = pages[:, 1:].reshape(cfg.num_layers, nb * block_size, cfg.num_kv_heads,
                                 cfg.head_dim)[:, :n]
        return head_magnitude(x, percentile)

    ids = np.asarray(token_ids, np.int32)

    def run(params, kv):  # the tokens and their layout are constants of the program
        md = AttentionMetadata(
            slot_mapping=jnp.arange(block_size, block_size + n, dtype=jnp.int32),
            block_tables=jnp.arange(1, nb + 1, dtype=jnp.int32)[None],
            seq_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32),
            num_seqs=jnp.array([1], jnp.int32))
        _, kv = model.forward(params, jnp.asarray(ids), jnp.arange(n, dtype=jnp.int32), kv, md)
        return amax(kv.k), amax(kv.v)

    # replicated results, so that every process of a multi-host mesh can read them
    out = None if cache_sharding is None else jax.sharding.NamedSharding(
        cache_sharding.mesh, jax.sharding.PartitionSpec())
    run = jax.jit(run, out_shardings=out)

    k_amax, v_amax = (np.asarray(jax.device_get(x), np.float32)
                      for x in run(params, kv))
    if not (np.all(np.isfinite(k_amax)) and np.all(np.isfinite(v_amax))):
        raise ValueError("the KV calibration pass produced non-finite keys or values")
    return k_amax, v_amax


def checkpoint_kv_scales(path: str, num_layers: int, num_kv_heads: int,
                         kv_dtype: jnp.dtype) -> tuple[np.ndarray, np.ndarray] | None:
    """Scales stored by ``jaxserve convert --kv-cache-dtype`` in the orbax checkpoint at
    ``path`` (``kv_scales.json``), converted to ``kv_dtype`` (the same max ``|x|`` maps to its
    largest value) and repeated over replicated kv heads (tensor parallelism with fewer kv heads
    than devices); None if ``path`` is no checkpoint directory or holds none.

    Raises:
      ValueError: an unreadable file, an unknown stored format, or a shape that does not fit
        ``[num_layers, a divisor of num_kv_heads]``.
    """
    if not os.path.isdir(path) or not checkpoint.is_checkpoint(path):
        return None
    data = checkpoint.read_kv_scales(path)
    if data is None:
        return None
    where = os.path.join(path, checkpoint.KV_SCALES_FILE)
    stored_dt = KV_QUANT_DTYPES.get(data["kv_cache_dtype"])
    if stored_dt is None:
        raise ValueError(f"{where}: kv_cache_dtype {data['kv_cache_dtype']!r} must be one of "
                         f"{sorted(KV_QUANT_DTYPES)}")
    ratio = QUANT_MAX[stored_dt] / QUANT_MAX[jnp.dtype(kv_dtype)]
    out = []
    for key in ("k_scale", "v_scale"):
        a = data[key]
        if a.shape[0] != num_layers or num_kv_heads % a.shape[1]:
            raise ValueError(f"{where}: {key} has shape {a.shape}; the model has {num_layers} "
                             f"layers and {num_kv_heads} kv heads")
        out.append(np.repeat(a * ratio, num_kv_heads // a.shape[1], axis=1).astype(np.float32))
    return out[0], out[1]


def head_magnitude(x: jax.Array, percentile: float = 100.0) -> jax.Array:
    """``f32[L, kv_heads]``: the ``percentile`` of ``|x|`` per (layer, kv head) over tokens and
    head_dim of ``x [L, tokens, kv_heads, head_dim]`` (100: the maximum; else
    ``jnp.percentile``'s linear interpolation)."""
    num_layers, n, kvh, hd = x.shape
    a = jnp.abs(x.astype(jnp.float32)).transpose(0, 2, 1, 3).reshape(num_layers, kvh, n * hd)
    return a.max(axis=-1) if percentile >= 100.0 else jnp.percentile(a, percentile, axis=-1)


def scales_from_amax(amax: np.ndarray, quant_dtype: jnp.dtype,
                     headroom: float | None = None) -> np.ndarray:
    """``max(amax, AMAX_FLOOR) * headroom / QUANT_MAX[quant_dtype]`` as float32 (same shape);
    ``headroom`` defaults to ``HEADROOM[quant_dtype]``."""
    dt = jnp.dtype(quant_dtype)
    h = HEADROOM[dt] if headroom is None else headroom
    return (np.maximum(np.asarray(amax, np.float32), AMAX_FLOOR) * h
            / QUANT_MAX[dt]).astype(np.float32)
