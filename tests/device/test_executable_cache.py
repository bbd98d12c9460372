"""The on-disk cache of compiled programs (jaxserve/device/executable_cache.py): hits skip the
compile, anything that changes the program misses, bad entries are compiled again, and a warm
engine built from the cache serves the same tokens as a cold one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.device.executable_cache import ExecutableCache
from jaxserve.engine.llm_engine import LLMEngine


def _compiler(calls: list, fn=lambda x, y: x * 2 + y):
    """A compile function that records its salt in ``calls``: a random constant added to
    ``fn``'s result, so that jax's persistent cache (on in this process once an engine test has
    run) cannot answer it and what is compiled is stored."""
    salt = float(np.random.default_rng().integers(1, 1 << 20))

    def compile_fn(args):
        calls.append(salt)
        return jax.jit(lambda *a: fn(*a) + salt, donate_argnums=(0,)).lower(*args).compile()
    return compile_fn


def test_hit_skips_compile_and_runs_the_same(tmp_path):
    args = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))
    calls: list = []
    first = ExecutableCache(tmp_path)
    a = first.get_or_compile("double", args, lambda: _compiler(calls)(args))
    second = ExecutableCache(tmp_path)  # a new process's cache on the same directory
    b = second.get_or_compile("double", args, lambda: _compiler(calls)(args))
    assert len(calls) == 1 and (first.misses, second.hits, second.misses) == (1, 1, 0)
    x, y = np.arange(4, dtype=np.float32), np.ones(4, np.float32)
    np.testing.assert_array_equal(np.asarray(b(jnp.asarray(x), y)), x * 2 + 1 + calls[0])
    np.testing.assert_array_equal(np.asarray(a(jnp.asarray(x), y)), x * 2 + 1 + calls[0])


def test_description_and_avals_are_part_of_the_key(tmp_path):
    cache = ExecutableCache(tmp_path)
    calls: list = []
    f32 = (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2
    cache.get_or_compile("double", f32, lambda: _compiler(calls)(f32))
    cache.get_or_compile("triple", f32, lambda: _compiler(calls)(f32))
    other_shape = (jax.ShapeDtypeStruct((8,), jnp.float32),) * 2
    cache.get_or_compile("double", other_shape, lambda: _compiler(calls)(other_shape))
    other_dtype = (jax.ShapeDtypeStruct((4,), jnp.int32),) * 2
    cache.get_or_compile("double", other_dtype, lambda: _compiler(calls)(other_dtype))
    other_tree = ({"x": f32[0]}, f32[1])
    cache.get_or_compile("double", other_tree, lambda: _compiler(
        calls, lambda d, y: d["x"] * 2 + y)(other_tree))
    assert len(calls) == 5 and cache.hits == 0
    assert len(list(tmp_path.glob("*.bin"))) == 5


def test_bad_entry_is_compiled_again_and_replaced(tmp_path, caplog):
    args = (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2
    calls: list = []
    cache = ExecutableCache(tmp_path)
    cache.get_or_compile("double", args, lambda: _compiler(calls)(args))
    (entry,) = tmp_path.glob("*.bin")
    entry.write_bytes(b"not a pickle")
    prog = cache.get_or_compile("double", args, lambda: _compiler(calls)(args))
    assert len(calls) == 2 and "not using" in caplog.text
    assert float(prog(jnp.ones(4), jnp.ones(4))[0]) == 3.0 + calls[1]
    assert ExecutableCache(tmp_path).get_or_compile(
        "double", args, lambda: _compiler(calls)(args)) is not None
    assert len(calls) == 2  # the replaced entry loads


def test_a_flipped_byte_is_caught_by_the_checksum_and_the_entry_deleted(tmp_path, caplog):
    """A damaged executable can unpickle and load, then run wrong code or crash; the entry's
    sha256 is checked first, and the entry is deleted."""
    args = (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2
    calls: list = []
    ExecutableCache(tmp_path).get_or_compile("double", args, lambda: _compiler(calls)(args))
    (entry,) = tmp_path.glob("*.bin")
    blob = bytearray(entry.read_bytes())
    blob[len(blob) * 85 // 100] ^= 0x01  # inside the serialized executable
    entry.write_bytes(bytes(blob))
    cache = ExecutableCache(tmp_path)
    prog = cache.get_or_compile("double", args, lambda: _compiler(calls)(args))
    assert "checksum" in caplog.text and cache.hits == 0 and len(calls) == 2
    assert float(prog(jnp.ones(4), jnp.ones(4))[0]) == 3.0 + calls[1]
    (entry,) = tmp_path.glob("*.bin")  # the damaged one was deleted, the new one stored
    assert ExecutableCache(tmp_path).get_or_compile("double", args, lambda: None) is not None


def test_read_only_entries_and_a_moved_directory_still_hit(tmp_path, monkeypatch):
    args = (jax.ShapeDtypeStruct((4,), jnp.float32),) * 2
    calls: list = []
    ExecutableCache(tmp_path / "a").get_or_compile("double", args,
                                                   lambda: _compiler(calls)(args))
    def no_utime(*a, **k):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr("os.utime", no_utime)
    ro = ExecutableCache(tmp_path / "a")
    assert ro.get_or_compile("double", args, lambda: _compiler(calls)(args)) is not None
    assert ro.hits == 1 and len(calls) == 1
    monkeypatch.undo()
    # the key does not hold the directory (jax's cache-dir setting included), so a copy of a
    # warm cache mounted elsewhere hits
    (tmp_path / "b").mkdir()
    for p in (tmp_path / "a").glob("*.bin"):
        (tmp_path / "b" / p.name).write_bytes(p.read_bytes())
    old = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "b"))
        moved = ExecutableCache(tmp_path / "b")
        moved.get_or_compile("double", args, lambda: _compiler(calls)(args))
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
    assert moved.hits == 1 and len(calls) == 1


def test_entries_past_max_bytes_are_pruned_oldest_first(tmp_path):
    calls: list = []
    sizes = [(n,) for n in (2, 3, 5, 7)]
    cache = ExecutableCache(tmp_path)
    for shape in sizes[:1]:
        args = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2
        cache.get_or_compile("double", args, lambda a=args: _compiler(calls)(a))
    one = next(tmp_path.glob("*.bin")).stat().st_size
    cache.max_bytes = int(2.5 * one)  # room for two entries of about that size
    for shape in sizes[1:]:
        args = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2
        cache.get_or_compile("double", args, lambda a=args: _compiler(calls)(a))
    assert len(list(tmp_path.glob("*.bin"))) == 2
    newest = (jax.ShapeDtypeStruct((7,), jnp.float32),) * 2
    cache.get_or_compile("double", newest, lambda: _compiler(calls)(newest))
    assert len(calls) == 4  # the newest entry was kept


def test_warm_engine_loads_every_program_and_serves_the_same_tokens(tmp_path):
    """Two starts on one cache directory, each in its own process (as serve's are): the
    first compiles and stores every program, the second loads them all and samples the same
    tokens (seeded sampling)."""
    script = textwrap.dedent("""
        import sys
        from jaxserve.config import EngineConfig, LoadConfig
        from jaxserve.engine.llm_engine import LLMEngine
        from jaxserve.sampling_params import SamplingParams
        eng = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                                     compilation_cache_dir=sys.argv[1]), LoadConfig("tiny", "dummy"))
        n = int(eng.warmup(progress=False)["num_programs"])
        eng.add_request("r", [3, 1, 4, 1, 5], SamplingParams(max_tokens=6, temperature=0.8, seed=3))
        while eng.has_unfinished_requests():
            for out in eng.step():
                ids = out.outputs[0].token_ids
        c = eng.runner.executable_cache
        print(n, c.hits, c.misses, c.not_stored, *ids)
    """)
    run = lambda d: [int(x) for x in subprocess.run(
        [sys.executable, "-c", script, str(d)], capture_output=True, text=True,
        check=True, timeout=600).stdout.split()]
    cold, warm = run(tmp_path / "a"), run(tmp_path / "a")
    n = cold[0]  # model, sampler and logit_bias programs
    # buckets (1, 1), (4, 4), (8, 4) and (16, 4): 4 model programs, samplers for 1 and 4
    # rows, and the logit_bias row writer
    assert n == 7
    assert cold[1:4] == [0, n, 0] and warm[1:4] == [n, 0, 0]
    assert len(warm[4:]) == 6 and warm[4:] == cold[4:]
    # a copy of the warm cache at another path (another volume mount) hits as well
    shutil.copytree(tmp_path / "a" / "jaxserve-executables", tmp_path / "b" / "jaxserve-executables")
    assert run(tmp_path / "b")[1:] == warm[1:]


def test_no_cache_dir_or_a_mesh_means_no_executable_cache():
    one = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                                 compilation_cache_dir=""), LoadConfig("tiny", "dummy"))
    assert one.runner.executable_cache is None
    tp = LLMEngine(EngineConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                                tensor_parallel_size=2), LoadConfig("tiny", "dummy"))
    assert tp.mesh is not None and tp.runner.executable_cache is None


def test_program_from_jax_persistent_cache_is_not_stored(tmp_path):
    """XLA:CPU serializes an executable that jax's persistent cache loaded without its
    functions (running the reloaded copy fails with NOT_FOUND): such a program is used but
    not stored, and a fresh compile is. Each step runs in its own process, as starts do."""
    script = textwrap.dedent("""
        import sys
        import jax, jax.numpy as jnp, numpy as np
        from jaxserve.device.executable_cache import ExecutableCache
        from jaxserve.loading.load import setup_compilation_cache
        setup_compilation_cache(sys.argv[1])
        cache = ExecutableCache(sys.argv[2])
        args = (jax.ShapeDtypeStruct((8,), jnp.float32),)
        f = lambda x: (jnp.sin(x[:3]) * 2).sum() + x.max()
        prog = cache.get_or_compile("f", args, lambda: jax.jit(f).lower(*args).compile())
        print(cache.hits, cache.misses, cache.not_stored, float(prog(np.ones(8, np.float32))))
    """)
    run = lambda jax_dir, ours: subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / jax_dir), str(tmp_path / ours)],
        capture_output=True, text=True, check=True, timeout=300).stdout.split()
    want = f"{6 * np.sin(1.0) + 1:.4f}"
    value = lambda out: f"{float(out[3]):.4f}"
    # 1: jax compiles; ours stores. 2: ours answers.
    assert run("jax", "ours")[:3] == ["0", "1", "0"]
    out = run("jax", "ours")
    assert out[:3] == ["1", "0", "0"] and value(out) == want
    # 3: a second cache dir: jax's persistent cache answers, so nothing is stored, and the
    # next start compiles (or reads jax's cache) again rather than loading a broken copy
    assert run("jax", "ours2")[:3] == ["0", "1", "1"]
    out = run("jax", "ours2")
    assert out[:3] == ["0", "1", "1"] and value(out) == want


def test_only_a_reported_miss_counts_as_fresh_while_jax_cache_is_on(tmp_path, monkeypatch):
    from jax import monitoring

    from jaxserve.device import executable_cache as ec

    monkeypatch.setattr(ec, "_jax_cache_on", lambda: True)
    cache = ExecutableCache(tmp_path)
    stored: list = []
    monkeypatch.setattr(cache, "_store", lambda path, compiled: stored.append(compiled))
    args = (jax.ShapeDtypeStruct((4,), jnp.float32),)

    def from_jax_cache():
        monitoring.record_event("/jax/compilation_cache/cache_hits")
        return "from jax's cache"

    def compiled_by_xla():
        monitoring.record_event(ec.CACHE_MISS_EVENT)
        return "compiled"

    assert cache.get_or_compile("hit", args, from_jax_cache) == "from jax's cache"
    assert cache.get_or_compile("miss", args, compiled_by_xla) == "compiled"
    assert cache.get_or_compile("no event", args, lambda: "unknown") == "unknown"
    assert stored == ["compiled"] and cache.not_stored == 2
    monkeypatch.setattr(ec, "_jax_cache_on", lambda: False)  # then every compile is XLA's
    cache.get_or_compile("no jax cache", args, lambda: "compiled too")
    assert stored == ["compiled", "compiled too"]


def test_the_code_digest_covers_the_native_kernels_sources(tmp_path, monkeypatch):
    """A kernel's C++ source is part of the key: a program binds its custom calls' attributes,
    which a handler built from other sources may not take."""
    from jaxserve.device import executable_cache as ec

    pkg = tmp_path / "fakepkg"
    (pkg / "csrc").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "csrc" / "k.cc").write_text("int a;")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ec, "_SOURCE_PACKAGES", ("fakepkg",))
    digests = []
    for text in ("int a;", "int b;"):
        (pkg / "csrc" / "k.cc").write_text(text)
        monkeypatch.setattr(ec, "_code_digest", None)
        digests.append(ec.code_digest())
    assert digests[0] != digests[1]
    monkeypatch.setattr(ec, "_code_digest", None)  # the next test computes the real one
