"""Loading onto a mesh: each device reads only its own slice of every weight.

These are each format's one loader: ``jaxserve.loading.load.load_model`` calls them for every
load, one device being a 1-device mesh (its slice of a leaf is the whole leaf). Each returns
(config, params placed as ``sharding.param_partition_specs`` of the ``sharded_config``, a
``LoadReport``). Per format:

- orbax: one restore into ``ShapeDtypeStruct(..., sharding=...)`` targets, tensorstore reading
  each device's index; a quantised checkpoint is restored whole, then split.
- HF safetensors: ``HFLeaf.read(index)`` per leaf and addressable device (``get_slice``; the
  transpose and layer stacking apply per region), ``device_put``, then
  ``make_array_from_single_device_arrays``. Without ``Architecture.hf_sources``: whole, then split.
- dummy: drawn under ``jit(out_shardings=...)``; values equal the single-device ones.
- gemma library checkpoints: whole (restored to host memory, re-laid out), then split.
- GGUF: whole, dequantised, then split: a row-parallel slice cuts quantisation blocks of 32 or
  256 input columns (docs/configuration.md#sharded-loading).

Replicated kv heads (``num_kv_heads < tp``): the stored ``[..., kv * head_dim]`` leaf is read
split over kv heads on a ``(kv, tp // kv)`` view of the devices, so device ``d`` reads head
``d // r``, its shard of the served ``[..., tp * head_dim]`` leaf; buffers are rewrapped, no copy.
Index maps are ``addressable_devices_indices_map``, so each process reads only its devices'.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxserve import sharding
from models import checkpoint, gemma_lib, hf
from models.config import ModelConfig
from models.gguf_reader import GGUFFile
from models.loader import dummy_params, gguf_architecture
from models.registry import get_architecture


@dataclass
class DeviceLoad:
    """What one device (one shard) of a load cost."""

    device_id: int  # jax.Device.id
    process_index: int  # the process that owns it
    # this device's slices in the stored dtype (orbax: logical size); None: full-then-shard
    bytes_read: int | None
    bytes_placed: int  # its shards on the device, serving dtype
    seconds: float  # as LoadReport.timing says


@dataclass
class LoadReport:
    """Per-device figures of one load (this process's devices)."""

    source: str  # "orbax", "orbax-quantized", "hf", "dummy", "gguf" or "gemma-lib"
    method: str  # "sharded" (each device read its slice) or "full-then-shard"
    # "per-device": its own read + transfer time; "ready": from the load's start until its
    # shards were ready (overlapping, not additive)
    timing: str
    total_s: float  # the whole load: config, weights, placement; not the tokenizer
    devices: list[DeviceLoad]  # addressable devices, mesh order
    storage_bytes_read: int | None = None  # orbax: file bytes tensorstore read (whole chunks)
    full_read_leaves: list[str] = field(default_factory=list)  # params paths read whole

    def as_dict(self) -> dict:
        """JSON-able form (``devices`` as a list of dicts)."""
        return asdict(self)

    def table(self) -> str:
        """A text table, one row per device, and a totals row."""
        def mib(n: int | None) -> str:
            return "-" if n is None else f"{n / 2**20:.2f}"

        rows = [f"{'device':>6} {'process':>7} {'read MiB':>9} {'placed MiB':>10} {'s':>7}"]
        for d in self.devices:
            rows.append(f"{d.device_id:>6} {d.process_index:>7} {mib(d.bytes_read):>9} "
                        f"{mib(d.bytes_placed):>10} {d.seconds:>7.3f}")
        read = [d.bytes_read for d in self.devices]
        total_read = None if None in read else sum(read)
        rows.append(f"{'all':>6} {'':>7} {mib(total_read):>9} "
                    f"{mib(sum(d.bytes_placed for d in self.devices)):>10} {self.total_s:>7.3f}")
        return "\n".join(rows)


def check_shardable(cfg: ModelConfig, tp: int) -> None:
    """Refuse a model the TP layout cannot split, before any weight is read.

    Raises:
      ValueError: ``tp > 1`` for a non-llama architecture; as ``sharding.check_tensor_parallel``.
    """
    if tp > 1 and getattr(cfg, "architecture", "llama") != "llama":
        raise ValueError(
            f"tensor_parallel_size={tp}: tensor parallelism is built for the llama "
            f"architecture (Llama, Mistral, Qwen2 layouts), not {cfg.architecture!r}; use "
            f"tensor_parallel_size=1")
    sharding.check_tensor_parallel(cfg, tp)


def target_shardings(cfg: ModelConfig, dtype: jnp.dtype, mesh: Mesh, stored=None):
    """(targets, read_shardings) for ``cfg``'s params on ``mesh``.

    ``targets``: the served tree as sharded ``ShapeDtypeStruct``s; ``read_shardings``: per leaf
    of the stored shape, the sharding under which each device reads its target shard.

    Args:
      stored: the model's ``param_shapes()`` if already at hand.

    Raises:
      ValueError: as ``check_shardable``; a leaf whose stored and served shapes differ other
        than by kv-head replication on the last axis.
    """
    tp = mesh.shape[sharding.TP_AXIS]
    check_shardable(cfg, tp)
    arch = get_architecture(cfg.architecture)
    stored = stored if stored is not None else arch.model(cfg, dtype).param_shapes()
    served_cfg = sharding.sharded_config(cfg, tp)
    served = stored if served_cfg == cfg else arch.model(served_cfg, dtype).param_shapes()
    specs = sharding.param_partition_specs(served, cfg)
    r = sharding.kv_replication(cfg, tp)
    kv_mesh = Mesh(mesh.devices.reshape(-1, r), ("kv_heads", "kv_copies")) if r > 1 else None

    def one(path, src: jax.ShapeDtypeStruct, dst: jax.ShapeDtypeStruct, spec: P):
        target = NamedSharding(mesh, spec)
        if src.shape == dst.shape:
            return jax.ShapeDtypeStruct(dst.shape, dtype, sharding=target), target
        if (kv_mesh is None or src.shape[:-1] != dst.shape[:-1]
                or dst.shape[-1] != src.shape[-1] * r or spec[-1] != sharding.TP_AXIS):
            raise ValueError(f"param {jax.tree_util.keystr(path)}: stored shape {src.shape} "
                             f"and served shape {dst.shape} differ other than by kv-head "
                             f"replication")
        read = NamedSharding(kv_mesh, P(*spec[:-1], "kv_heads"))
        return jax.ShapeDtypeStruct(dst.shape, dtype, sharding=target), read

    pairs = jax.tree_util.tree_map_with_path(one, stored, served, specs)
    is_pair = lambda x: isinstance(x, tuple)
    targets = jax.tree_util.tree_map(lambda p: p[0], pairs, is_leaf=is_pair)
    reads = jax.tree_util.tree_map(lambda p: p[1], pairs, is_leaf=is_pair)
    return targets, reads


def _as_target(arr: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
    """``arr``'s per-device buffers rewrapped under ``target``'s shape and sharding."""
    if arr.shape == target.shape and arr.sharding == target.sharding:
        return arr
    return jax.make_array_from_single_device_arrays(
        target.shape, target.sharding, [s.data for s in arr.addressable_shards])


def _local_devices(mesh: Mesh) -> list[jax.Device]:
    return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _placed_bytes(params, devices: list[jax.Device]) -> dict[int, int]:
    out = {d.id: 0 for d in devices}
    for leaf in jax.tree_util.tree_leaves(params):
        for s in leaf.addressable_shards:
            out[s.device.id] += s.data.nbytes
    return out


def _ready_report(params, mesh: Mesh, t0: float, **kw) -> LoadReport:
    """A ``timing="ready"`` report, blocking on each device's shards in mesh order."""
    devices = _local_devices(mesh)
    by_dev: dict[int, list[jax.Array]] = {d.id: [] for d in devices}
    for leaf in jax.tree_util.tree_leaves(params):
        for s in leaf.addressable_shards:
            by_dev[s.device.id].append(s.data)
    ready = {}
    for d in devices:
        jax.block_until_ready(by_dev[d.id])
        ready[d.id] = time.perf_counter() - t0
    placed = _placed_bytes(params, devices)
    read = kw.pop("bytes_read", {})
    rows = [DeviceLoad(d.id, d.process_index, read.get(d.id), placed[d.id], ready[d.id])
            for d in devices]
    return LoadReport(timing="ready", total_s=time.perf_counter() - t0, devices=rows, **kw)


def tensorstore_bytes_read() -> int:
    """tensorstore's process-wide count of bytes read from files."""
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
    return sum(v.get("value", 0) for m in metrics for v in m.get("values", []))


def load_orbax_sharded(path: str, dtype: jnp.dtype, mesh: Mesh) -> tuple[ModelConfig, object,
                                                                          LoadReport]:
    """(config, params on ``mesh``, report) of an orbax checkpoint, read per device.

    Raises:
      ValueError: as ``target_shardings`` and ``load_checkpoint``.
    """
    t0 = time.perf_counter()
    cfg = checkpoint.read_config(path)
    if checkpoint.read_quantization(path).method != "none":
        check_shardable(cfg, mesh.shape[sharding.TP_AXIS])
        cfg, params = checkpoint.load_checkpoint(path, dtype)
        return cfg, *shard_loaded(params, cfg, mesh, t0, "orbax-quantized")
    targets, reads = target_shardings(cfg, dtype, mesh)
    stored = checkpoint.stored_params(path)
    before = tensorstore_bytes_read()
    _, restored = checkpoint.load_checkpoint(path, dtype, shardings=reads)
    storage = tensorstore_bytes_read() - before
    params = jax.tree_util.tree_map(_as_target, restored, targets)
    devices = _local_devices(mesh)
    read = {d.id: 0 for d in devices}
    for leaf, st in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(stored),
                        strict=True):
        for s in leaf.addressable_shards:
            read[s.device.id] += s.data.size * np.dtype(st.dtype).itemsize
    report = _ready_report(params, mesh, t0, source="orbax", method="sharded", bytes_read=read,
                           storage_bytes_read=storage)
    return cfg, params, report


def _read_leaf(leaf, target: jax.ShapeDtypeStruct, read: NamedSharding, dtype: jnp.dtype,
               rows: dict[int, DeviceLoad]) -> jax.Array:
    """One HF leaf: each addressable device reads its region and puts it on itself."""
    bufs = []
    for dev, index in read.addressable_devices_indices_map(tuple(leaf.shape)).items():
        t = time.perf_counter()
        host = leaf.read(index)
        buf = jax.device_put(np.asarray(host, dtype), dev)
        buf.block_until_ready()
        row = rows[dev.id]
        row.bytes_read += host.nbytes
        row.bytes_placed += buf.nbytes
        row.seconds += time.perf_counter() - t
        bufs.append(buf)
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, bufs)


def load_hf_sharded(path: str, dtype: jnp.dtype, mesh: Mesh, progress: bool = True
                    ) -> tuple[ModelConfig, object, LoadReport]:
    """(config, params on ``mesh``, report) of an HF safetensors directory, read per device.

    Raises:
      ValueError: as ``models.hf.load_hf_params`` and ``target_shardings``; a tensor whose shape
        differs from the model's (naming the param).
    """
    t0 = time.perf_counter()
    data = hf.read_hf_config(path)
    try:
        arch = get_architecture(str(data["architectures"][0]))
    except ValueError as e:
        raise ValueError(f"{path}/{hf.CONFIG_FILE}: architectures[0]: {e}") from None
    if arch.hf_config is None or arch.hf_params is None:
        raise ValueError(f"{path}: architecture {data['architectures'][0]!r} has no HF "
                         f"safetensors loader")
    cfg = arch.hf_config(data)
    check_shardable(cfg, mesh.shape[sharding.TP_AXIS])
    if arch.hf_sources is None:
        _, params = hf.load_hf_params(path, dtype, progress)
        return cfg, *shard_loaded(params, cfg, mesh, t0, "hf")
    stored = arch.model(cfg, dtype).param_shapes()
    targets, reads = target_shardings(cfg, dtype, mesh, stored)
    tensors = hf.SafetensorsDir(path, progress=False)
    sources = arch.hf_sources(tensors, cfg)
    for (p, src), want in zip(jax.tree_util.tree_flatten_with_path(sources)[0],
                              jax.tree_util.tree_leaves(stored), strict=True):
        if tuple(src.shape) != tuple(want.shape):
            raise ValueError(f"{path}: param {jax.tree_util.keystr(p)} reads tensors of shape "
                             f"{src.shape}; the model expects {want.shape}")
    rows = {d.id: DeviceLoad(d.id, d.process_index, 0, 0, 0.0) for d in _local_devices(mesh)}
    flat, treedef = jax.tree_util.tree_flatten(sources)
    bar = None
    if progress:
        bar = tqdm(total=len(flat), desc="loading shards", unit="param", leave=False)
    out = []
    for src, target, read in zip(flat, treedef.flatten_up_to(targets),
                                 treedef.flatten_up_to(reads), strict=True):
        out.append(_read_leaf(src, target, read, dtype, rows))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    report = LoadReport(source="hf", method="sharded", timing="per-device",
                        total_s=time.perf_counter() - t0, devices=list(rows.values()))
    return cfg, jax.tree_util.tree_unflatten(treedef, out), report


def shard_loaded(params, cfg: ModelConfig, mesh: Mesh, t0: float, source: str
                 ) -> tuple[object, LoadReport]:
    """Place a whole params tree with ``sharding.shard_params``; returns (params, report).

    Args:
      t0: ``time.perf_counter()`` at the start of the load.
      source: the format, for the report.
    """
    placed = sharding.shard_params(params, cfg, mesh)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(placed)[0]]
    return placed, _ready_report(placed, mesh, t0, source=source, method="full-then-shard",
                                 full_read_leaves=names)


def load_dummy_sharded(cfg: ModelConfig, dtype: jnp.dtype, seed: int, mesh: Mesh
                       ) -> tuple[object, LoadReport]:
    """(params on ``mesh``, report) of ``cfg``'s dummy weights, drawn per device.

    Raises:
      ValueError: as ``target_shardings``.
    """
    t0 = time.perf_counter()
    targets, reads = target_shardings(cfg, dtype, mesh)
    model = get_architecture(cfg.architecture).model(cfg, dtype)
    params = jax.tree_util.tree_map(_as_target, dummy_params(model, seed, reads), targets)
    return params, _ready_report(params, mesh, t0, source="dummy", method="sharded")


def load_gguf_sharded(path: str, reader: GGUFFile, dtype: jnp.dtype, mesh: Mesh
                      ) -> tuple[ModelConfig, object, LoadReport]:
    """(config, params on ``mesh``, report) of the GGUF ``reader`` opened, read whole.

    Raises:
      ValueError: an architecture without a GGUF loader; as ``check_shardable``.
    """
    t0 = time.perf_counter()
    arch = gguf_architecture(reader, path)
    cfg = arch.gguf_config(reader)
    check_shardable(cfg, mesh.shape[sharding.TP_AXIS])
    params = arch.gguf_params(reader, cfg, dtype)
    return cfg, *shard_loaded(params, cfg, mesh, t0, "gguf")


def load_gemma_lib_sharded(path: str, dtype: jnp.dtype, mesh: Mesh
                           ) -> tuple[ModelConfig, object, LoadReport]:
    """(config, params on ``mesh``, report) of a ``gemma`` library checkpoint, read whole; the
    tree and the settings are checked (``models.gemma_lib.read_gemma_lib``) before any tensor
    is read.

    Raises:
      ValueError: as ``read_gemma_lib``; as ``check_shardable``.
    """
    t0 = time.perf_counter()
    ckpt = gemma_lib.read_gemma_lib(path)
    check_shardable(ckpt.config, mesh.shape[sharding.TP_AXIS])
    params = gemma_lib.load_gemma_lib_params(ckpt, dtype)
    return ckpt.config, *shard_loaded(params, ckpt.config, mesh, t0, "gemma-lib")
