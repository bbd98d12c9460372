"""The attention op for an ``attention_backend`` setting (temporary home: the platform layer
takes these over).

"reference": ``pallas_kernels``' pure-jnp op; "native" / "native-decode": that op with its decode
and prefill rows / its decode rows in the native CPU kernel (``cpu_kernels.attention``);
"pallas": the Pallas Triton kernel (GPUs); "pallas-interpret": that kernel in the Pallas
interpreter (docs/architecture.md#attention-op).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from cpu_kernels import attention as cpu_attention
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_pallas

# "pallas-interpret" runs the Pallas kernel in the interpreter: for CPU tests only (slow).
ATTENTION_BACKENDS = ("auto", "reference", "native", "native-decode", "pallas",
                      "pallas-interpret")


def resolve_attention_backend(backend: str, platform: str | None = None) -> str:
    """The backend an ``attention_backend`` setting runs on ``platform``: "auto" resolved, the
    others checked. "auto": "pallas" on GPUs; on CPUs "native" where its kernel is built, else
    "reference". ``platform`` defaults to ``jax.default_backend()``.

    Raises:
      ValueError: an unknown backend name, "native"/"native-decode" off the CPU, or "pallas"
        (the compiled Triton kernel) off a GPU.
      RuntimeError: "native"/"native-decode" asked for where its kernel is not available (no
        library built for this CPU: ``jaxserve build-kernels``).
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
                               "which is not built for this CPU (see the log; run `jaxserve "
                               "build-kernels` with a C++17 compiler)")
    if backend == "pallas" and not gpu:
        raise ValueError(f"attention_backend='pallas' (the compiled Triton kernel) runs on GPUs "
                         f"only, not on {platform!r}; use 'auto', 'native' or 'reference' there "
                         "('pallas-interpret' runs the kernel in the Pallas interpreter, for "
                         "tests, too slow to serve: minutes for a few tokens)")
    return backend


def attention_fn_for_backend(backend: str, platform: str | None = None) -> Callable[..., jax.Array]:
    """The attention op for an ``attention_backend`` setting (resolved and checked by
    ``resolve_attention_backend``, which names the errors raised): see the module docstring.
    """
    backend = resolve_attention_backend(backend, platform)
    if backend == "reference":
        return ragged_paged_attention
    if backend in ("native", "native-decode"):
        return cpu_attention.native_attention_fn(prefill=backend == "native")
    if backend == "pallas":
        return ragged_paged_attention_pallas
    return functools.partial(ragged_paged_attention_pallas, interpret=True)
