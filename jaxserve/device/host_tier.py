"""The host tier of the KV cache: K/V blocks in pinned host memory, and the batched copies
between it and the device cache.

The host tier is a ``KVCache`` of the device cache's layout, ``[num_layers, num_host_blocks,
block_size, num_kv_heads, head_dim]`` each for K and V, placed in the device's
``pinned_host`` memory (``jax.sharding.Sharding.with_memory_kind``). The CPU backend exposes the
same memory kinds as GPUs (``device``, ``pinned_host``, ``unpinned_host``), so this path is the
one tested here; a device without ``pinned_host`` memory is refused with a ValueError. Host
block 0 is reserved like device block 0: it is the padding target of the fixed-size copies.

Per step the engine runs the plan's copies (see ``kv_manager``) before the forward pass: one
offload program (gather the device blocks, move them to host memory, scatter into the host
tier, which is donated) and then one load program (gather host blocks, move them to the device,
scatter into the device cache, which is donated). Both are compiled at warm-up for a few batch
sizes (``copy_sizes``); a batch is padded with (0 -> 0) pairs, and a longer one is split.
Dispatch is asynchronous: nothing here waits for a copy, so the step's program is enqueued
behind the copies without a host sync (the device orders them: each reads the arrays the
previous one wrote).

An 8-bit device cache gives an 8-bit host tier (the same dtype, 1 byte per element): its scales
are static per (layer, kv head), so a block's stored bytes mean the same on either side and only
the pages move; the copy programs take and return the K and V page arrays, never the scales.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import KVCache

HOST_MEMORY_KIND = "pinned_host"


def copy_sizes(max_blocks_per_copy: int) -> tuple[int, ...]:
    """Batch sizes of the compiled copy programs: powers of 4 from 4 up to the first one
    >= ``max_blocks_per_copy`` (e.g. 64 -> (4, 16, 64))."""
    sizes = [4]
    while sizes[-1] < max_blocks_per_copy:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


class HostKVTier:
    """K/V blocks in host memory and the programs that copy blocks to and from the device.

    Args:
      device_kv: the device cache (its layout, dtype and sharding are copied).
      num_host_blocks: host blocks including the reserved block 0 (>= 2).
      max_blocks_per_copy: the largest batch one program copies (longer ones are split).
    Raises:
      ValueError: ``num_host_blocks < 2``, or the device has no ``pinned_host`` memory.
    """

    def __init__(self, device_kv: KVCache, num_host_blocks: int, max_blocks_per_copy: int
                 ) -> None:
        if num_host_blocks < 2:
            raise ValueError(f"{num_host_blocks=} must be >= 2 (block 0 is reserved)")
        dev_sharding = device_kv.k.sharding
        kinds = {m.kind for d in dev_sharding.device_set for m in d.addressable_memories()}
        if HOST_MEMORY_KIND not in kinds:
            raise ValueError(f"kv_offloading_size needs '{HOST_MEMORY_KIND}' memory; the "
                             f"device offers {sorted(kinds)}")
        self.device_sharding = dev_sharding
        self.host_sharding = dev_sharding.with_memory_kind(HOST_MEMORY_KIND)
        self.num_blocks = num_host_blocks
        k = device_kv.k
        shape = (k.shape[0], num_host_blocks, *k.shape[2:])
        make = jax.jit(lambda: jnp.zeros(shape, k.dtype), out_shardings=self.host_sharding)
        self.cache = KVCache(k=make(), v=make())
        self.sizes = copy_sizes(max_blocks_per_copy)
        self._offload: dict[int, jax.stages.Compiled] = {}
        self._load: dict[int, jax.stages.Compiled] = {}
        self._device_kv_shape = jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=dev_sharding)
        self.num_compiles = 0

    @property
    def memory_kind(self) -> str:
        return self.cache.k.sharding.memory_kind

    def _offload_fn(self):
        host_sharding = self.host_sharding

        def offload(host: KVCache, k: jax.Array, v: jax.Array, src: jax.Array, dst: jax.Array
                    ) -> KVCache:
            def one(h, d):
                blocks = jax.device_put(d[:, src], host_sharding)  # [L, n, bs, kvh, hd]
                return h.at[:, dst].set(blocks)
            return KVCache(k=one(host.k, k), v=one(host.v, v))

        return offload

    def _load_fn(self):
        dev_sharding = self.device_sharding

        def load(k: jax.Array, v: jax.Array, host: KVCache, src: jax.Array, dst: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
            def one(d, h):
                blocks = jax.device_put(h[:, src], dev_sharding)
                return d.at[:, dst].set(blocks)
            return one(k, host.k), one(v, host.v)

        return load

    def warmup(self) -> dict[str, float]:
        """Compile the copy programs; returns {"num_programs", "compile_s"}."""
        t0 = time.perf_counter()
        dev = self._device_kv_shape
        for n in self.sizes:
            idx = jax.ShapeDtypeStruct((n,), jnp.int32)
            if n not in self._offload:
                self._offload[n] = jax.jit(
                    self._offload_fn(), donate_argnums=(0,),
                    out_shardings=KVCache(self.host_sharding, self.host_sharding),
                ).lower(self.cache, dev, dev, idx, idx).compile()
                self.num_compiles += 1
            if n not in self._load:
                self._load[n] = jax.jit(
                    self._load_fn(), donate_argnums=(0, 1),
                    out_shardings=(self.device_sharding, self.device_sharding),
                ).lower(dev, dev, self.cache, idx, idx).compile()
                self.num_compiles += 1
        return {"num_programs": float(2 * len(self.sizes)), "compile_s": time.perf_counter() - t0}

    def _batches(self, pairs: Sequence[tuple[int, int]]):
        """Split ``pairs`` into padded ``(n, src i32[n], dst i32[n])`` batches."""
        biggest = self.sizes[-1]
        for lo in range(0, len(pairs), biggest):
            chunk = pairs[lo:lo + biggest]
            n = self.sizes[bisect.bisect_left(self.sizes, len(chunk))]
            arr = np.zeros((2, n), np.int32)  # padding pairs copy block 0 to block 0
            arr[:, :len(chunk)] = np.asarray(chunk, np.int32).T
            yield n, arr[0], arr[1]

    def offload(self, kv: KVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``pairs`` of (device block, host block), each
        host block at most once. Asynchronous. Raises RuntimeError before ``warmup``."""
        for n, src, dst in self._batches(pairs):
            prog = self._offload.get(n)
            if prog is None:
                raise RuntimeError("HostKVTier.offload before warmup()")
            self.cache = prog(self.cache, kv.k, kv.v, src, dst)

    def load(self, kv: KVCache, pairs: Sequence[tuple[int, int]]) -> KVCache:
        """Copy host blocks into device blocks, ``pairs`` of (host block, device block), each
        device block at most once; returns the new device cache (``kv``'s pages are donated;
        its scales, if any, carry over). Asynchronous. Raises RuntimeError before ``warmup``."""
        for n, src, dst in self._batches(pairs):
            prog = self._load.get(n)
            if prog is None:
                raise RuntimeError("HostKVTier.load before warmup()")
            k, v = prog(kv.k, kv.v, self.cache, src, dst)
            kv = dataclasses.replace(kv, k=k, v=v)
        return kv
