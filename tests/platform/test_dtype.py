"""``--dtype auto``: bfloat16 weights on CPUs with a bfloat16 dot (float32 activations there),
float32 on other CPUs (jaxserve.platform.cpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxserve.platform import cpu as load


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\n"
                    f"processor\t: 1\nflags\t\t: {flags}\n")
    return str(path)


def test_cpu_bf16_dot_is_read_from_the_cpu_flags(tmp_path) -> None:
    assert load.cpu_has_bf16_dot(_cpuinfo(tmp_path, "fpu sse2 avx512f avx512_vnni avx512_bf16"))
    assert load.cpu_has_bf16_dot(_cpuinfo(tmp_path, "fpu avx512f amx_bf16 amx_tile"))
    # avx512_bf16 as a prefix of another flag does not count
    assert not load.cpu_has_bf16_dot(_cpuinfo(tmp_path, "fpu sse2 avx512f avx512_vnni"))
    assert not load.cpu_has_bf16_dot(_cpuinfo(tmp_path, "avx512_bf16x"))
    assert not load.cpu_has_bf16_dot(str(tmp_path / "absent"))


@pytest.mark.parametrize("bf16_dot, want", [(True, jnp.bfloat16), (False, jnp.float32)])
def test_auto_follows_the_cpu(monkeypatch, bf16_dot: bool, want) -> None:
    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(load, "cpu_has_bf16_dot", lambda: bf16_dot)
    assert load.CpuPlatform().resolve_dtype("auto") == jnp.dtype(want)
    assert load.CpuPlatform().resolve_dtype("float32") == jnp.float32
    assert load.CpuPlatform().resolve_dtype("bfloat16") == jnp.bfloat16


def test_bfloat16_weights_compute_in_float32_on_the_cpu() -> None:
    assert load.CpuPlatform().compute_dtype(jnp.bfloat16) == jnp.float32
    assert load.CpuPlatform().compute_dtype(jnp.float32) == jnp.float32
    assert load.CpuPlatform().compute_dtype(jnp.float16) == jnp.float16  # no mixed mode for float16
