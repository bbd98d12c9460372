"""Loading onto a mesh (jaxserve/loading/sharded.py) on simulated CPU devices.

Orbax and HF safetensors loads onto a mesh give every leaf its intended ``NamedSharding`` and the
values of a full load followed by ``shard_params``; HF reads only each device's regions of the
files (``get_slice``, never a whole tensor); the per-device report adds up; dummy weights drawn per
shard equal the single-device ones. A load without a mesh runs the same loader on a 1-device mesh
and hands back single-device arrays with the whole-read values. The engine-level check (a TP=2
engine from an orbax checkpoint generating the TP=1 tokens) is in tests/test_sharding.py beside
the tiny engines.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jaxserve import sharding
from jaxserve.config import LoadConfig
from jaxserve.loading import sharded as sharded_load
from jaxserve.loading.load import load_model
from models import checkpoint, hf
from models.config import builtin_config
from models.llama import LlamaForCausalLM
from models.loader import dummy_params

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")

HF_DIR = Path(__file__).resolve().parents[1] / "goldens" / "hf_tiny"
TINY = builtin_config("tiny")


def _assert_placed_like(got, want, mesh, cfg) -> None:
    """Same tree, bitwise the same values, and every leaf on the TP spec of its path."""
    specs = sharding.param_partition_specs(want, cfg)
    flat_g, tree_g = jax.tree_util.tree_flatten_with_path(got)
    flat_w, tree_w = jax.tree_util.tree_flatten(want)
    assert tree_g == tree_w
    for (path, g), w, spec in zip(flat_g, flat_w, jax.tree_util.tree_leaves(
            specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)), strict=True):
        name = jax.tree_util.keystr(path)
        assert g.sharding == NamedSharding(mesh, spec), name
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w)), name


@pytest.fixture(scope="module")
def tiny_orbax(tmp_path_factory) -> tuple[str, dict]:
    """The tiny config as an orbax checkpoint, and its params (the dummy weights of seed 0;
    the HF tests cover an untied head and q/k/v bias)."""
    path = str(tmp_path_factory.mktemp("orbax") / "tiny")
    params = dummy_params(LlamaForCausalLM(TINY), seed=0)
    checkpoint.save_checkpoint(path, TINY, params)
    return path, params


@pytest.mark.parametrize("tp", [2, 8])
def test_orbax_restores_each_leaf_into_its_shards(tiny_orbax, tp: int) -> None:
    """TP 2 splits the kv heads; TP 8 replicates each of the 4 kv heads twice, read per device
    from the stored (unreplicated) arrays."""
    path, params = tiny_orbax
    mesh = sharding.make_mesh(tp)
    cfg, got, report = sharded_load.load_orbax_sharded(path, jnp.float32, mesh)
    assert cfg == TINY
    want = sharding.shard_params(params, TINY, mesh)
    _assert_placed_like(got, want, mesh, sharding.sharded_config(TINY, tp))
    # column-parallel wq: each device holds (and read) 1/tp of the columns
    wq = got["layers"]["wq"]
    assert {s.data.shape for s in wq.addressable_shards} == {
        (TINY.num_layers, TINY.hidden_size, TINY.num_heads * TINY.head_dim // tp)}
    assert (report.source, report.method) == ("orbax", "sharded")
    assert [d.device_id for d in report.devices] == [d.id for d in mesh.devices.flat]
    stored_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    replicated = sum(  # the norm weights: every device reads them whole
        x.nbytes for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if "norm" in jax.tree_util.keystr(p))
    kv = sum(params["layers"][k].nbytes for k in ("wk", "wv", "bk", "bv") if k in params["layers"])
    extra_kv = kv * (sharding.kv_replication(TINY, tp) - 1)  # replicated kv heads
    assert sum(d.bytes_read for d in report.devices) == (
        stored_bytes + (tp - 1) * replicated + extra_kv)
    assert len({d.bytes_read for d in report.devices}) == 1  # an even split
    assert all(d.bytes_placed == d.bytes_read for d in report.devices)  # stored in float32
    assert report.storage_bytes_read > 0


def test_orbax_stores_large_arrays_in_chunks(tiny_orbax) -> None:
    """The embedding (12 MiB) is stored in chunks of at most CHUNK_BYTES, so a device's vocab
    slice maps onto whole chunks rather than one chunk holding the whole table."""
    import orbax.checkpoint as ocp

    path, _ = tiny_orbax
    ckpt = ocp.StandardCheckpointer()
    meta = ckpt.metadata(str(Path(path) / "params")).item_metadata.tree["embed"]
    ckpt.close()
    chunk = tuple(meta.storage.chunk_shape)
    assert chunk != tuple(meta.shape)
    assert np.prod(chunk) * 4 <= checkpoint.CHUNK_BYTES


@pytest.mark.parametrize(("name", "tp"), [("llama", 2), ("qwen2", 4)])
def test_hf_reads_only_each_devices_regions(name: str, tp: int, monkeypatch) -> None:
    """llama: bfloat16 files, untied head, TP 2; qwen2: q/k/v bias, tied embeddings, three
    files, TP 4 with the 2 kv heads replicated. No tensor is read whole; q_proj is read in row
    blocks of ``out / tp`` (columns of our ``[in, out]``) and o_proj in column blocks."""
    path = str(HF_DIR / name)
    cfg, full = hf.load_hf_params(path, jnp.float32, progress=False)  # read whole
    mesh = sharding.make_mesh(tp)
    want = sharding.shard_params(full, cfg, mesh)

    reads: list[tuple[str, tuple[int, ...], int]] = []
    orig = hf.SafetensorsDir.get_slice

    def spy(self, tensor, index):
        x = orig(self, tensor, index)
        reads.append((tensor, x.shape, x.nbytes))
        return x

    def no_whole_reads(self, tensor):
        raise AssertionError(f"{tensor} read whole")

    monkeypatch.setattr(hf.SafetensorsDir, "get_slice", spy)
    monkeypatch.setattr(hf.SafetensorsDir, "get", no_whole_reads)
    got_cfg, got, report = sharded_load.load_hf_sharded(path, jnp.float32, mesh, progress=False)
    assert got_cfg == cfg
    _assert_placed_like(got, want, mesh, sharding.sharded_config(cfg, tp))

    hd, hidden = cfg.head_dim, cfg.hidden_size
    q = [shape for t, shape, _ in reads if t == "model.layers.0.self_attn.q_proj.weight"]
    assert q == [(cfg.num_heads * hd // tp, hidden)] * tp
    o = [shape for t, shape, _ in reads if t == "model.layers.1.self_attn.o_proj.weight"]
    assert o == [(hidden, cfg.num_heads * hd // tp)] * tp
    k = [shape for t, shape, _ in reads if t == "model.layers.0.self_attn.k_proj.weight"]
    assert k == [(hd * max(1, cfg.num_kv_heads // tp), hidden)] * tp  # one head each at TP 4

    per_device = [d.bytes_read for d in report.devices]
    assert sum(per_device) == sum(n for _, _, n in reads)
    assert len(set(per_device)) == 1  # an even split
    assert (report.source, report.method, report.timing) == ("hf", "sharded", "per-device")
    assert report.full_read_leaves == []


def test_hf_shape_mismatch_names_the_param(tmp_path) -> None:
    dst = tmp_path / "llama"
    shutil.copytree(HF_DIR / "llama", dst)
    data = json.loads((dst / "config.json").read_text())
    data["intermediate_size"] = 32
    (dst / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"param \['layers'\]\['w_down'\] reads tensors of shape"):
        sharded_load.load_hf_sharded(str(dst), jnp.float32, sharding.make_mesh(2),
                                     progress=False)


def test_dummy_weights_drawn_per_shard_equal_the_single_device_ones(tiny_orbax) -> None:
    """TP 8 on the tiny config: kv heads replicated; every leaf equals the single-device
    dummy weights of the same seed, sharded."""
    _, params = tiny_orbax
    mesh = sharding.make_mesh(8)
    loaded = load_model(LoadConfig("tiny", "dummy"), jnp.float32, 0, mesh)
    want = sharding.shard_params(params, TINY, mesh)
    _assert_placed_like(loaded.params, want, mesh, sharding.sharded_config(TINY, 8))
    assert loaded.report.method == "sharded" and loaded.model_config == TINY


@pytest.mark.parametrize("fmt", ["dummy", "orbax", "hf"])
def test_one_device_loads_as_a_one_device_mesh(fmt: str, tiny_orbax, tmp_path,
                                               monkeypatch) -> None:
    """Without a mesh, the format's one loader runs on a 1-device mesh over the first local
    device; the params come back as single-device arrays there (as the engine's programs and
    executable cache have always seen them), bitwise the whole-read values, with no report."""
    orbax_path, saved = str(tmp_path / "tiny"), tiny_orbax[1]
    shutil.copytree(tiny_orbax[0], orbax_path)
    hf_path = str(HF_DIR / "llama")
    shutil.copy(Path(hf_path) / "tokenizer.json", orbax_path)  # load_model reads one
    load, reader, want = {
        "dummy": (LoadConfig("tiny", "dummy"), "load_dummy_sharded", saved),
        "orbax": (LoadConfig(orbax_path), "load_orbax_sharded", saved),
        "hf": (LoadConfig(hf_path), "load_hf_sharded",
               hf.load_hf_params(hf_path, jnp.float32, progress=False)[1]),
    }[fmt]
    meshes: list[Mesh] = []
    orig = getattr(sharded_load, reader)

    def spy(*args, **kw):
        meshes.append(next(a for a in args if isinstance(a, Mesh)))
        return orig(*args, **kw)

    monkeypatch.setattr(sharded_load, reader, spy)
    loaded = load_model(load, jnp.float32, seed=0)
    device = jax.local_devices()[0]
    assert [m.devices.tolist() for m in meshes] == [[device]]
    assert loaded.report is None
    flat_g, tree_g = jax.tree_util.tree_flatten_with_path(loaded.params)
    flat_w, tree_w = jax.tree_util.tree_flatten(want)
    assert tree_g == tree_w
    for (path, g), w in zip(flat_g, flat_w, strict=True):
        name = jax.tree_util.keystr(path)
        assert g.sharding == SingleDeviceSharding(device), name
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w)), name
