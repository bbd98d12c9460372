"""Compiled step programs kept on disk, so a warm start skips tracing and lowering.

JAX's persistent compilation cache keys an executable by its lowered HLO, so even a warm start
traces and lowers every step program before it can look one up: about 0.3 s per program on
this project's 2-core CPU, most of a warm start's compile stage. This cache keys a serialized
executable (``jax.experimental.serialize_executable``) by what decides the program instead,
known before tracing:

- the source of the packages that build it (``jaxserve``, ``models``, ``cpu_kernels``,
  ``pallas_kernels``: every ``.py`` file's bytes),
- the jax, jaxlib and numpy versions, the backend's platform and platform version, the device
  kinds, ``XLA_FLAGS`` and the jax config,
- the caller's description of the program (the engine config, model config and bucket layout)
  and the tree structure, shapes, dtypes and shardings of every argument.

An entry carries a sha256 of its bytes, checked before anything is unpickled, and a loaded
program is checked against the arguments' tree and avals before it is used; an entry that is
damaged (a flipped byte in an executable could otherwise run wrong code), unreadable or
mismatching is logged and deleted, and the program compiled as before, and stored only if XLA
compiled it: an executable that jax's persistent cache loaded serializes without its
functions on XLA:CPU (jax 0.11.2: running it fails with "NOT_FOUND: Function ... not found"),
so after a persistent-cache hit the entry is left out and the next start takes the same path.
Programs over a multi-device mesh are not cached (the engine passes no cache then). Entries
are files in ``<compilation cache dir>/jaxserve-executables``; the most recently used ones are
kept, up to ``max_bytes`` in all.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

log = logging.getLogger(__name__)

_SOURCE_PACKAGES = ("jaxserve", "models", "cpu_kernels", "pallas_kernels")
# an entry: magic, sha256 of the payload, the payload (the pickled serialized executable)
_MAGIC = b"jaxserve-exe-1\n"
_DIGEST_BYTES = len(_MAGIC) + 32
# jax settings that do not change a compiled program (where the caches live); left out of the
# key so that a warm cache still hits after it is copied or mounted at another path
_KEY_EXCLUDED_CONFIG = ("jax_compilation_cache_dir", "jax_persistent_cache_",
                        "jax_compilation_cache_")
_code_digest: str | None = None
# jax's event for a compile its persistent cache could not answer (jax._src.compiler); only
# what XLA compiled is stored (module docstring)
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_misses_by_thread: dict[int, int] = {}
_listener_lock = threading.Lock()
_listening = False


def _on_event(event: str, **kwargs: object) -> None:
    if event == CACHE_MISS_EVENT:
        me = threading.get_ident()
        if me in _misses_by_thread:
            _misses_by_thread[me] += 1


def _compiled_fresh(compile_fn: Callable[[], jax.stages.Compiled]
                    ) -> tuple[jax.stages.Compiled, bool]:
    """``compile_fn()``, and whether XLA compiled it rather than loading it from jax's
    persistent cache: that cache is off, or it reported a miss on this thread."""
    global _listening
    me = threading.get_ident()
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
        _misses_by_thread[me] = 0
    try:
        compiled = compile_fn()
    finally:
        with _listener_lock:
            misses = _misses_by_thread.pop(me)
    return compiled, misses > 0 or not _jax_cache_on()


def _jax_cache_on() -> bool:
    return bool(jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)


def code_digest() -> str:
    """sha256 hex of every ``.py`` and ``.cc`` file (path and bytes) of the packages that build
    the step programs (the native kernels' sources too: a program binds its custom calls'
    attributes, which the handlers built from them must take); computed once per process."""
    global _code_digest
    if _code_digest is None:
        h = hashlib.sha256()
        for pkg in _SOURCE_PACKAGES:
            root = Path(__import__(pkg).__file__).parent
            for path in sorted([*root.rglob("*.py"), *root.rglob("*.cc")]):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
        _code_digest = h.hexdigest()
    return _code_digest


def _environment() -> str:
    import jaxlib

    dev = jax.devices()
    return repr((jax.__version__, jaxlib.__version__, np.__version__, dev[0].platform,
                 dev[0].client.platform_version, sorted({d.device_kind for d in dev}),
                 len(dev), os.environ.get("XLA_FLAGS", ""),
                 sorted((k, repr(v)) for k, v in jax.config.values.items()
                        if not k.startswith(_KEY_EXCLUDED_CONFIG))))


def _describe_args(args: tuple) -> str:
    """The tree structure and each leaf's shape, dtype and sharding."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return repr((str(tree), [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None)))
                             for x in leaves]))


class ExecutableCache:
    """Serialized compiled programs in ``directory``, keyed as the module docstring says.

    Args:
      directory: where entries go (created when the first one is stored).
      max_bytes: the entries kept, most recently used first, up to this many bytes in all;
        older ones are deleted when one is stored (one CPU step program of SmolLM2-135M is
        about 1.2 MB).
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 2 << 30) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.not_stored = 0  # misses answered by jax's persistent cache

    def key(self, description: str, args: tuple) -> str:
        """sha256 hex of the code, the environment, ``description`` and ``args``' avals."""
        h = hashlib.sha256()
        for part in (code_digest(), _environment(), description, _describe_args(args)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def get_or_compile(self, description: str, args: tuple,
                       compile_fn: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The program for ``args`` (a tuple of arrays or ``jax.ShapeDtypeStruct`` pytrees, the
        program's positional arguments): loaded from the cache, else ``compile_fn()``, which
        is then stored if XLA compiled it (the module docstring). Errors while loading or
        storing are logged and never raised."""
        key = self.key(description, args)
        path = self.directory / f"{key}.bin"
        compiled = self._load(path, args)
        if compiled is not None:
            self.hits += 1
            return compiled
        self.misses += 1
        compiled, fresh = _compiled_fresh(compile_fn)
        if fresh:
            self._store(path, compiled)
        else:
            self.not_stored += 1
            # one line per program at every start: DEBUG (it interleaved with the progress bar)
            log.debug("executable cache: %s came from jax's persistent cache; not stored",
                     path.name)
        return compiled

    def _load(self, path: Path, args: tuple) -> jax.stages.Compiled | None:
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("executable cache: cannot read %s: %s", path, e)
            return None
        digest, payload = blob[:_DIGEST_BYTES], blob[_DIGEST_BYTES:]
        if blob[:len(_MAGIC)] != _MAGIC or hashlib.sha256(payload).digest() != \
                digest[len(_MAGIC):]:
            self._discard(path, "its checksum does not match (a damaged or foreign file)")
            return None
        try:
            serialized, in_tree, out_tree, device_ids = pickle.loads(payload)
            by_id = {d.id: d for d in jax.devices()}
            compiled = deserialize_and_load(serialized, in_tree, out_tree,
                                            execution_devices=[by_id[i] for i in device_ids])
            want = jax.tree_util.tree_structure((args, {}))
            got = [(tuple(a.shape), a.dtype) for a in jax.tree_util.tree_leaves(compiled.in_avals)]
            if compiled.in_tree != want or got != [
                    (tuple(x.shape), x.dtype) for x in jax.tree_util.tree_leaves(args)]:
                self._discard(path, "it does not match the program's arguments")
                return None
        except Exception as e:  # noqa: BLE001 (a bad entry must never stop a start)
            self._discard(path, f"it cannot be loaded ({type(e).__name__}: {e})")
            return None
        with contextlib.suppress(OSError):  # a read-only cache is still read
            os.utime(path)
        return compiled

    def _discard(self, path: Path, why: str) -> None:
        """Log and delete a bad entry (so that a later compile can store it again)."""
        log.warning("executable cache: not using %s: %s; the program is compiled (or read "
                    "from XLA's cache) instead", path.name, why)
        with contextlib.suppress(OSError):
            path.unlink()

    def _store(self, path: Path, compiled: jax.stages.Compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        try:
            devices = compiled.runtime_executable().local_devices()
            payload = pickle.dumps((*serialize(compiled), [d.id for d in devices]))
            blob = _MAGIC + hashlib.sha256(payload).digest() + payload
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            self._prune()
        except Exception as e:  # noqa: BLE001 (the program is compiled; caching is optional)
            log.warning("executable cache: cannot store %s (%s: %s)", path.name,
                        type(e).__name__, e)

    def _prune(self) -> None:
        entries = sorted(((p.stat(), p) for p in self.directory.glob("*.bin")),
                         key=lambda e: e[0].st_mtime, reverse=True)
        total = 0
        for st, p in entries:
            total += st.st_size
            if total > self.max_bytes:
                p.unlink(missing_ok=True)
