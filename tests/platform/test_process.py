"""Process settings: applied by ``configure_process`` (the entry points), never by importing
jaxserve (jaxserve/platform/process.py)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import weakref

from jaxserve.platform import process

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"

# In a fresh process: the environment before and after importing jaxserve's entry modules. jax
# itself sets TF_CPP_MIN_LOG_LEVEL and TPU_SKIP_MDS_QUERY when imported, so "before" is taken
# after `import jax`: what is checked is what jaxserve adds.
_IMPORT_CHANGES_NOTHING = r"""
import gc, json, os
frozen = gc.get_freeze_count()  # the interpreter's own, if any
import prometheus_client.metrics as pm
import jax
before = dict(os.environ)
import jaxserve, jaxserve.config, jaxserve.platform, jaxserve.engine.llm_engine, jaxserve.llm
import jaxserve.engine.metrics, jaxserve.server.routes, jaxserve.cli.main
changed = {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}
changed.update({k: (v, None) for k, v in before.items() if k not in os.environ})
print(json.dumps({"changed": changed, "applied": jaxserve.platform.process._applied is not None,
                  "created_series": pm._use_created, "frozen": gc.get_freeze_count() - frozen}))
"""


def test_importing_jaxserve_changes_no_process_setting() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (
        "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "TF_CPP_MIN_LOG_LEVEL", "TPU_SKIP_MDS_QUERY")}
    out = subprocess.run([sys.executable, "-c", _IMPORT_CHANGES_NOTHING], env=env, check=True,
                         capture_output=True, text=True).stdout
    got = json.loads(out.splitlines()[-1])
    # prometheus-client's process-wide switch stays on (jaxserve filters its own scrape)
    assert got == {"changed": {}, "applied": False, "created_series": True, "frozen": 0}


_CONFIGURE = r"""
import json, os
from jaxserve.platform import configure_process
first = configure_process()
again = configure_process()
print(json.dumps({"xla": os.environ.get("XLA_FLAGS"), "frac":
                  os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "same": first is again,
                  "arena": first.single_malloc_arena, "thresholds": first.malloc_thresholds}))
"""


def _configure(env_extra: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "GLIBC_TUNABLES",
                                                            "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _CONFIGURE], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_configure_process_applies_each_setting_once() -> None:
    got = _configure({"JAX_PLATFORMS": "cpu"})
    assert got["xla"] == " ".join(process.CPU_XLA_FLAGS)
    assert f"{FLAG}=false" in process.CPU_XLA_FLAGS
    assert got["frac"] == process.ACCELERATOR_MEM_FRACTION and got["same"]
    assert got["arena"] and got["thresholds"]  # glibc, the CPU backend


def test_configure_process_keeps_what_the_user_set() -> None:
    mine = f"--xla_force_host_platform_device_count=8 {FLAG}=true"
    got = _configure({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": mine,
                      "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",
                      "GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.malloc.mmap_threshold=1"})
    assert got["xla"] == mine and got["frac"] == "0.5"
    assert not got["arena"] and not got["thresholds"]


def test_cpu_flags_are_appended_to_other_flags(monkeypatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert process.add_cpu_xla_flags() == process.CPU_XLA_FLAGS
    assert os.environ["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=8",
                                               *process.CPU_XLA_FLAGS]


def test_jax_platforms_decides_the_cpu_settings(monkeypatch) -> None:
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not process.expects_cpu_backend()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert process.expects_cpu_backend()


def test_this_test_process_runs_with_them() -> None:
    """tests/conftest.py applies them before jax opens its backend, as the entry points do."""
    assert f"{FLAG}=false" in os.environ["XLA_FLAGS"].split()


def test_lower_compile_priority_lowers_only_the_calling_thread() -> None:
    me = threading.get_native_id()
    seen: dict[str, int] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        process.lower_compile_priority(3)
        seen["before"], seen["after"] = before, os.getpriority(os.PRIO_PROCESS, tid)

    main_before = os.getpriority(os.PRIO_PROCESS, me)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["after"] == min(19, seen["before"] + 3)  # Linux caps niceness at 19
    assert os.getpriority(os.PRIO_PROCESS, me) == main_before


# ---- the garbage collector's permanent generation -------------------------------------------
# Each test unfreezes what it froze: frozen objects are never collected, and the other tests
# build and drop engines in this process.

class _Node:
    """An object the cyclic collector tracks."""


def test_freeze_heap_takes_the_live_objects_out_of_every_later_collection() -> None:
    made = [_Node() for _ in range(1000)]
    before = gc.get_freeze_count()
    try:
        frozen = process.freeze_heap(full=False)
        # (a frozen object freed since by its refcount leaves the count, so not ==)
        assert frozen >= before + 1000 and gc.get_freeze_count() >= before + 1000
        walked = {id(o) for o in gc.get_objects()}  # what a full collection walks
        assert not any(id(o) in walked for o in made)
        fresh = _Node()
        assert id(fresh) in {id(o) for o in gc.get_objects()}  # new objects are walked as before
    finally:
        gc.unfreeze()


def _unreachable_cycle_in_the_oldest_generation() -> weakref.ref:
    node = _Node()
    node.me = node
    gc.collect(0)
    gc.collect(1)  # a survivor of both young collections: in the oldest generation now
    return weakref.ref(node)


def test_freeze_heap_collects_the_oldest_generation_first_only_when_full() -> None:
    try:
        young = _unreachable_cycle_in_the_oldest_generation()
        process.freeze_heap(full=False)
        assert young() is not None  # the young pass left it, and it is frozen now
        gc.unfreeze()
        gc.collect()
        assert young() is None

        full = _unreachable_cycle_in_the_oldest_generation()
        process.freeze_heap(full=True)
        assert full() is None
    finally:
        gc.unfreeze()


def test_freeze_heap_when_waits_for_every_event() -> None:
    assert process.freeze_heap_when([]) is None
    events = [threading.Event(), threading.Event()]
    before = gc.get_freeze_count()
    try:
        thread = process.freeze_heap_when(events)
        assert thread is not None and thread.daemon
        events[0].set()
        thread.join(0.2)
        assert thread.is_alive() and gc.get_freeze_count() == before  # one compile still runs
        events[1].set()
        thread.join(10)
        assert not thread.is_alive() and gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
