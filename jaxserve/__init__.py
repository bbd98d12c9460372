"""jaxserve: a JAX/XLA serving engine for LLMs.

``from jaxserve import LLM, SamplingParams`` for offline use; ``jaxserve serve`` for the
OpenAI-compatible server. Attributes load lazily so that the engine core (models, runner,
scheduler, kernels) imports with jax, flax and numpy alone.

Importing it also sets jaxserve's XLA:CPU defaults in ``XLA_FLAGS`` (``CPU_XLA_FLAGS``), each only
where ``XLA_FLAGS`` does not name that flag already; XLA reads the variable once, when jax opens
its first backend, so a process that ran jax code before importing jaxserve keeps XLA's own.
"""

from __future__ import annotations

import importlib
import os

__version__ = "0.1.0"

# XLA:CPU's concurrency-optimised HLO scheduler (its default) made every step program of
# SmolLM2-135M slower on a 2-core CPU: decode 12-19% and 512-token prefill 6% (wall and CPU
# seconds alike), with the same tokens (docs/configuration.md#xla-cpu-flags).
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def _set_cpu_xla_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


_set_cpu_xla_flags()

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.sampling_params",
    "StructuredOutputsParams": "jaxserve.sampling_params",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "EngineConfig": "jaxserve.config",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "AsyncEngine": "jaxserve.engine.async_engine",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")


__all__ = list(_EXPORTS)
