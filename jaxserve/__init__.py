"""jaxserve: a JAX/XLA serving engine for LLMs.

``from jaxserve import LLM, SamplingParams`` for offline use; ``jaxserve serve`` for the
OpenAI-compatible server. Attributes load lazily so that the engine core (models, runner,
scheduler, kernels) imports with jax, flax and numpy alone.

Importing jaxserve changes no process setting: ``XLA_FLAGS``, malloc and allocator settings are
applied by the entry points (``jaxserve`` commands and ``LLM()``) through
``jaxserve.platform.configure_process``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

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
