"""Running the shared engine with a fresh KV manager for the length of a test."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jaxserve.core.kv_manager import KVManager
from jaxserve.engine.llm_engine import LLMEngine


@contextlib.contextmanager
def kv_manager(engine: LLMEngine, *, caching: bool, num_host_blocks: int | None = None
               ) -> Iterator[KVManager]:
    """Run an idle engine with a fresh (empty) KV manager: prefix caching on or off, and the
    engine's host tier used or not (``num_host_blocks=0``). The scheduler is the only reader
    of these settings, so this is the engine that ``--[no-]enable-prefix-caching`` builds.

    The old manager comes back with its prefix cache emptied: the fresh one handed out the
    same device and host blocks and overwrote their K/V, so the old one's cached-free blocks
    no longer hold what their hashes say.

    Args:
      engine: an engine with no unfinished requests.
      caching: prefix caching on in the fresh manager.
      num_host_blocks: host-tier blocks of the fresh manager; None: the engine's own.
    """
    assert not engine.has_unfinished_requests()
    old = engine.scheduler.kv
    hosts = old.num_host_blocks if num_host_blocks is None else num_host_blocks
    engine.scheduler.kv = KVManager(old.num_blocks, old.block_size, caching, hosts)
    try:
        yield engine.scheduler.kv
    finally:
        engine.scheduler.kv = old
        engine.reset_prefix_cache()
