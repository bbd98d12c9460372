"""jaxserve's XLA:CPU defaults in XLA_FLAGS (jaxserve/__init__.py, docs/configuration.md#xla-cpu-flags)."""

from __future__ import annotations

import os

import jaxserve

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def test_cpu_flags_are_set_when_absent(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    jaxserve._set_cpu_xla_flags()
    assert os.environ["XLA_FLAGS"] == " ".join(jaxserve.CPU_XLA_FLAGS)
    assert f"{FLAG}=false" in jaxserve.CPU_XLA_FLAGS


def test_cpu_flags_are_appended_to_other_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    jaxserve._set_cpu_xla_flags()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8",
                                               *jaxserve.CPU_XLA_FLAGS]


def test_a_flag_the_user_set_is_kept(monkeypatch):
    mine = f"--xla_dump_to=/tmp/x {FLAG}=true"
    monkeypatch.setenv("XLA_FLAGS", mine)
    jaxserve._set_cpu_xla_flags()
    assert os.environ["XLA_FLAGS"] == mine


def test_this_process_runs_with_them():
    """The test session imported jaxserve before jax opened its backend (tests/conftest.py)."""
    assert f"{FLAG}=false" in os.environ["XLA_FLAGS"].split()
