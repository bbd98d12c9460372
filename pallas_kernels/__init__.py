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


def resolve_attention_backend(backend: str, platform: str | None = None) -> str:
    """The backend an ``attention_backend`` setting runs on ``platform``: "auto" resolved, the
    others checked. "auto": "pallas" on GPUs; on CPUs "native" where its kernel builds, else
    "reference". ``platform`` defaults to ``jax.default_backend()``.

    Raises:
      ValueError: an unknown backend name, "native"/"native-decode" off the CPU, or "pallas"
        (the compiled Triton kernel) off a GPU.
      RuntimeError: "native"/"native-decode" asked for where its kernel cannot be built (no
        C++ compiler).
    """
    platform = platform or jax.default_backend()
    gpu = platform in ("gpu", "cuda", "rocm")
    if backend == "auto":
        if gpu:
            return "pallas"
        return "native" if platform == "cpu" and cpu_attention.available() else "reference"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} must be one of {ATTENTION_BACKENDS}")
    if backend in ("native", "native-decode"):
        if platform != "cpu":
            raise ValueError(f"attention_backend={backend!r} runs on CPUs only, not on "
                             f"{platform!r}")
        if not cpu_attention.available():
            raise RuntimeError(f"attention_backend={backend!r} needs the CPU attention kernel, "
                               "which could not be built (see the log; set CXX to a C++17 "
                               "compiler)")
    if backend == "pallas" and not gpu:
        raise ValueError(f"attention_backend='pallas' (the compiled Triton kernel) runs on GPUs "
                         f"only, not on {platform!r}; use 'auto', 'native' or 'reference' there "
                         "('pallas-interpret' runs the kernel in the Pallas interpreter, for "
                         "tests, too slow to serve: minutes for a few tokens)")
    return backend


def attention_fn_for_backend(backend: str, platform: str | None = None) -> Callable[..., jax.Array]:
    """The attention op for an ``attention_backend`` setting (resolved and checked by
    ``resolve_attention_backend``, which names the errors raised).

    "reference": the pure-jnp op; "native": the jnp op with its decode and prefill rows in the
    native CPU kernel (XLA:CPU only); "native-decode": the kernel for the decode rows only, the
    jnp path for prefill rows; "pallas": the Pallas Triton kernel (GPUs); "pallas-interpret":
    that kernel in interpret mode.
    """
    backend = resolve_attention_backend(backend, platform)
    if backend == "reference":
        return ragged_paged_attention
    if backend in ("native", "native-decode"):
        return functools.partial(ragged_paged_attention, native_decode=True,
                                 native_prefill=backend == "native")
    if backend == "pallas":
        return ragged_paged_attention_pallas
    return functools.partial(ragged_paged_attention_pallas, interpret=True)


__all__ = [
    "ATTENTION_BACKENDS",
    "KVCache",
    "allocate_kv_cache",
    "attention_fn_for_backend",
    "kv_cache_bytes_per_block",
    "ragged_paged_attention",
    "ragged_paged_attention_pallas",
    "ref_ragged_paged_attention",
    "resolve_attention_backend",
    "write_kv",
]
