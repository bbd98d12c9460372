"""``--dtype auto``: bfloat16 weights on CPUs with a bfloat16 dot or AVX2 (float32 activations
there), float32 on other CPUs (jaxserve.loading.load)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.loading import load


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: {flags}\n")
    return str(path)


def test_cpu_bf16_weights_are_read_from_the_cpu_flags(tmp_path) -> None:
    prefers = load.cpu_prefers_bf16_weights
    assert prefers(_cpuinfo(tmp_path, "fpu sse2 avx512f avx512_vnni avx512_bf16"))
    assert prefers(_cpuinfo(tmp_path, "fpu avx512f amx_bf16 amx_tile"))
    assert prefers(_cpuinfo(tmp_path, "fpu sse2 avx avx2 fma f16c"))  # AVX2 without a bf16 dot
    assert not prefers(_cpuinfo(tmp_path, "fpu sse2 sse4_2 avx"))  # x86 before AVX2
    # a listed flag as a prefix of another flag does not count
    assert not prefers(_cpuinfo(tmp_path, "avx512_bf16x avx2x"))
    assert not prefers(_cpuinfo(tmp_path, "fp asimd bf16"))  # an unmeasured architecture
    assert not prefers(str(tmp_path / "absent"))


@pytest.mark.parametrize("bf16, want", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_auto_follows_the_cpu(monkeypatch, bf16: bool, want) -> None:
    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(load, "cpu_prefers_bf16_weights", lambda: bf16)
    assert load.resolve_dtype("auto") == jnp.dtype(want)
    assert load.resolve_dtype("float32") == jnp.float32
    assert load.resolve_dtype("bfloat16") == jnp.bfloat16


def test_bfloat16_weights_compute_in_float32_on_the_cpu() -> None:
    assert load.compute_dtype(jnp.bfloat16) == jnp.float32
    assert load.compute_dtype(jnp.float32) == jnp.float32
    assert load.compute_dtype(jnp.float16) == jnp.float16  # no mixed mode for float16
