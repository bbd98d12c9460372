"""The KV cache's layout, decided once at start-up, and the start-up summary lines.

``plan_kv_cache`` runs after the weights are on the devices (what they hold counts against the
budget) and before the cache is allocated:

  kv_cache_dtype -> storage dtype -> bytes per block -> number of blocks (``num_kv_blocks``, or
  ``kv_cache_memory_gib`` / a fraction of one device's free memory) -> for an 8-bit cache, the
  per-(layer, kv-head) scales: all 1.0 (``kv_scale_mode="unit"``), those ``jaxserve convert
  --kv-cache-dtype`` stored beside an orbax checkpoint, or from a calibration prefill
  (``jaxserve.device.kv_calibration``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.device import kv_calibration as cal
from jaxserve.platform.cpu_weights import NativeInt4Weight, PackedWeight
from jaxserve.tokenizer import Tokenizer
from models.interface import CausalLM
from models.quant import param_bytes
from pallas_kernels import kv_cache_bytes_per_block
from pallas_kernels.kv_cache import KV_FORMAT_NAMES, KV_QUANT_DTYPES

GIB = 1 << 30


@dataclass(frozen=True)
class KVLayout:
    """How the paged KV cache is stored and how big it is."""

    name: str  # kv_cache_dtype as configured: "auto", "bfloat16", "fp8" or "int8"
    dtype: jnp.dtype  # storage dtype (uint8 holds fp8 bit patterns)
    num_blocks: int  # including padding block 0
    bytes_per_token: int  # K + V, all layers, all devices
    scales: tuple[np.ndarray, np.ndarray] | None  # (k, v) f32[num_layers, num_kv_heads] each
    scales_source: Literal["calibrated", "checkpoint", "unit"] | None
    calibration_tokens: int = 0  # tokens of the calibration prefill (0: none ran)
    calibration_s: float = 0.0

    def summary(self) -> str:
        """One line for start-up logs: the cache dtype, bytes per token, and for an 8-bit
        cache how its scales were set (e.g. ``"kv auto (bfloat16), 23040 B/token"``, ``"kv fp8
        (float8_e4m3fn bits in uint8), 23040 B/token, scales calibrated on 868 tokens in
        1.2 s"``)."""
        line = f"kv {self.name}"
        if self.name == "auto":  # the serving dtype it resolved to
            line += f" ({jnp.dtype(self.dtype).name})"
        elif self.dtype in KV_FORMAT_NAMES:
            line += f" ({KV_FORMAT_NAMES[self.dtype]})"
        line += f", {self.bytes_per_token} B/token"
        if self.scales_source == "calibrated":
            line += (f", scales calibrated on {self.calibration_tokens} tokens in "
                     f"{self.calibration_s:.1f} s")
        elif self.scales_source is not None:
            line += f", {self.scales_source} scales"
        return line


def plan_kv_cache(config: EngineConfig, load: LoadConfig, model: CausalLM, params,
                  dtype: jnp.dtype, tokenizer: Tokenizer, mesh: Mesh | None,
                  kv_sharding: NamedSharding | None) -> KVLayout:
    """Size the KV cache and set an 8-bit cache's scales (module doc).

    Args:
      config: the engine settings (``kv_cache_dtype``, the memory budget, the calibration).
      load: where the weights came from (an orbax checkpoint may hold stored scales).
      model: the model as served (on a mesh: its sharded config), for the calibration prefill.
      params: its params, already placed.
      dtype: the compute dtype (also the storage dtype of a float cache).
      tokenizer: encodes the calibration text.
      mesh: the tensor-parallel mesh, or None for one device.
      kv_sharding: the cache's sharding on ``mesh`` (None without one).

    Raises:
      ValueError / FileNotFoundError: an unreadable calibration file or stored scales that do
        not fit the model (``jaxserve.device.kv_calibration``).
    """
    mc = model.cfg
    kv_dtype = {"auto": jnp.dtype(dtype), "bfloat16": jnp.dtype(jnp.bfloat16),
                **KV_QUANT_DTYPES}[config.kv_cache_dtype]
    float_cache = KVLayout(
        config.kv_cache_dtype, kv_dtype, _num_blocks(config, mc, kv_dtype, mesh),
        kv_cache_bytes_per_block(mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, kv_dtype),
        scales=None, scales_source=None)
    if config.kv_cache_dtype not in KV_QUANT_DTYPES:  # a float cache: no scales
        return float_cache
    shape = (mc.num_layers, mc.num_kv_heads)
    if config.kv_scale_mode == "unit":
        ones = np.ones(shape, np.float32), np.ones(shape, np.float32)
        return replace(float_cache, scales=ones, scales_source="unit")
    if config.kv_calibration_file is None and load.load_format != "dummy" and load.model:
        stored = cal.checkpoint_kv_scales(load.model, mc.num_layers, mc.num_kv_heads, kv_dtype)
        if stored is not None:
            return replace(float_cache, scales=stored, scales_source="checkpoint")
    t0 = time.perf_counter()
    ids = cal.calibration_token_ids(tokenizer, config.kv_calibration_file, min(
        cal.MAX_CALIBRATION_TOKENS, mc.max_position_embeddings))
    k_amax, v_amax = cal.calibration_amax(
        model, params, ids, block_size=config.block_size, dtype=dtype,
        percentile=config.kv_calibration_percentile, cache_sharding=kv_sharding)
    scales = cal.scales_from_amax(k_amax, kv_dtype), cal.scales_from_amax(v_amax, kv_dtype)
    return replace(float_cache, scales=scales, scales_source="calibrated",
                   calibration_tokens=len(ids), calibration_s=time.perf_counter() - t0)


def _num_blocks(config: EngineConfig, mc, kv_dtype: jnp.dtype, mesh: Mesh | None) -> int:
    """``num_kv_blocks`` if set, else the memory budget of one device over one block's bytes
    on it (at least 2: the padding block and one usable)."""
    c = config
    if c.num_kv_blocks is not None:
        return c.num_kv_blocks
    # per device: with tensor parallelism each device holds num_kv_heads / tp heads, and
    # both memory settings are budgets of one device (as vLLM's gpu_memory_utilization)
    per_block = kv_cache_bytes_per_block(mc.num_layers, c.block_size, mc.num_kv_heads,
                                         mc.head_dim, kv_dtype) // c.tensor_parallel_size
    if c.kv_cache_memory_gib is not None:
        budget = c.kv_cache_memory_gib * GIB
    else:
        dev = jax.local_devices()[0] if mesh is None else next(
            d for d in mesh.devices.flat if d.process_index == jax.process_index())
        stats = dev.memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            budget = c.kv_cache_memory_fraction * free
        else:  # the CPU reports no statistics
            budget = 2 * GIB
    return max(2, int(budget // per_block))


def weights_summary(params, config: EngineConfig, dtype: jnp.dtype,
                    compute_dtype: jnp.dtype | None = None) -> str:
    """One line for start-up logs: the weights' format and size, e.g. ``"float32 weights,
    513 MiB"``, ``"bfloat16 weights, float32 activations, 257 MiB"`` or ``"int8 weights
    (+embeddings) computing in float32, 129 MiB"``; int4 matmuls run by the native CPU
    kernel add ``" (up to 8 rows in the native CPU kernel)"`` before the size, bfloat16
    weights packed for theirs ``" (layers' matmuls in the native CPU kernel)"``.

    Args:
      params: the served params pytree.
      config: the engine settings (``quantization`` and its options).
      dtype: the serving (float weights') dtype.
      compute_dtype: the activations' dtype (default: ``dtype``).
    """
    c = config
    compute = dtype if compute_dtype is None else compute_dtype
    size = param_bytes(params)["total_bytes"] / 2 ** 20
    if c.quantization == "none":
        acts = "" if compute == dtype else f", {compute} activations"
        packed = any(isinstance(leaf, PackedWeight) for leaf in jax.tree_util.tree_leaves(
            params, is_leaf=lambda x: isinstance(x, PackedWeight)))
        kernel = " (layers' matmuls in the native CPU kernel)" if packed else ""
        return f"{dtype} weights{acts}{kernel}, {size:.0f} MiB"
    group = f" group {c.quantization_group_size}" if c.quantization == "int4" else ""
    emb = " (+embeddings)" if c.quantize_embeddings else ""
    rows = max((leaf.max_rows for leaf in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, NativeInt4Weight))
        if isinstance(leaf, NativeInt4Weight)), default=0)
    native = f" (up to {rows} rows in the native CPU kernel)" if rows else ""
    return (f"{c.quantization}{group} weights{emb} computing in {compute}{native}, "
            f"{size:.0f} MiB")
