"""Attention kernels and the paged KV-cache layout; importable with jax alone.

``ragged_paged_attention`` / ``write_kv`` have one signature (``pallas_kernels/
ragged_paged_attention.py``) and, per backend, one implementation: the pure-jnp one
(``ragged_paged_attention``) runs everywhere; the Pallas Triton kernel
(``ragged_paged_attention_pallas``) runs on NVIDIA GPUs and, in interpret mode, on the CPU; on
CPUs the jnp op's decode rows, and its prefill rows, can run in a native C++ kernel
(``cpu_attention``, an XLA FFI custom call compiled on first use).
``attention_fn_for_backend`` maps the engine's ``attention_backend`` setting onto one of them
(docs/architecture.md#attention-op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels import cpu_attention
from pallas_kernels.kv_cache import KVCache, allocate_kv_cache, kv_cache_bytes_per_block
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
    write_kv,
)
from pallas_kernels.ragged_paged_attention_triton import ragged_paged_attention_pallas

# "pallas-interpret" runs the Pallas kernel in the interpreter: for CPU tests only (slow).
ATTENTION_BACKENDS = ("auto", "reference", "native", "native-decode", "pallas",
                      "pallas-interpret")


def attention_fn_for_backend(backend: str, platform: str | None = None) -> Callable[..., jax.Array]:
    """The attention op for an ``attention_backend`` setting.

    "auto": the Pallas kernel on GPUs; on CPUs "native" where its kernel builds, else
    "reference"; "reference": the pure-jnp op; "native": the jnp op with its decode and prefill
    rows in the native CPU kernel (XLA:CPU only); "native-decode": the kernel for the decode
    rows only, the jnp path for prefill rows; "pallas": the Pallas Triton kernel;
    "pallas-interpret": that kernel in interpret mode. ``platform`` defaults to ``jax.default_backend()``.

    Raises:
      ValueError: for an unknown backend name, or "native"/"native-decode" on a platform
        other than the CPU.
      RuntimeError: "native"/"native-decode" asked for where its kernel cannot be built (no
        C++ compiler).
    """
    platform = platform or jax.default_backend()
    if backend == "auto":
        if platform in ("gpu", "cuda", "rocm"):
            backend = "pallas"
        else:
            backend = "native" if platform == "cpu" and cpu_attention.available() else "reference"
    if backend == "reference":
        return ragged_paged_attention
    if backend in ("native", "native-decode"):
        if platform != "cpu":
            raise ValueError(f"attention_backend={backend!r} runs on CPUs only, not on "
                             f"{platform!r}")
        if not cpu_attention.available():
            raise RuntimeError(f"attention_backend={backend!r} needs the CPU attention kernel, "
                               "which could not be built (see the log; set CXX to a C++17 "
                               "compiler)")
        return functools.partial(ragged_paged_attention, native_decode=True,
                                 native_prefill=backend == "native")
    if backend == "pallas":
        return ragged_paged_attention_pallas
    if backend == "pallas-interpret":
        return functools.partial(ragged_paged_attention_pallas, interpret=True)
    raise ValueError(f"attention_backend={backend!r} must be one of {ATTENTION_BACKENDS}")


__all__ = [
    "ATTENTION_BACKENDS",
    "KVCache",
    "allocate_kv_cache",
    "attention_fn_for_backend",
    "kv_cache_bytes_per_block",
    "ragged_paged_attention",
    "ragged_paged_attention_pallas",
    "ref_ragged_paged_attention",
    "write_kv",
]
