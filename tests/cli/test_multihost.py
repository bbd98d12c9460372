"""One model over two processes on 127.0.0.1 (jax.distributed, gloo CPU collectives).

Two ``jaxserve serve`` processes with one CPU device each run the ``tiny`` dummy model with
tensor parallelism 2 across them: process 0 serves HTTP and schedules, process 1 follows its
steps. The completion must equal the single-process engine's, and SIGTERM on process 0 must
release process 1 (exit 0). Two plain processes load an orbax checkpoint and an HF directory
sharded over both: each reads only its own device's slices.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--max-model-len", "128", "--num-kv-blocks", "24", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--compilation-cache-dir", ""]
PROMPT = [504, 3575, 3004, 314, 253, 1345, 30, 42, 9, 1000, 77, 12, 8, 3100, 2, 3, 901, 22]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_tensor_parallel_across_two_processes(tmp_path: Path) -> None:
    coord, http = _free_port(), _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs, logs = [], []
    for pid in (0, 1):
        cmd = [sys.executable, "-m", "jaxserve.cli.main", "serve", "tiny", "--load-format", "dummy",
               "--tensor-parallel-size", "2", "--num-processes", "2", "--process-id", str(pid),
               "--coordinator-address", f"127.0.0.1:{coord}", "--port", str(http), *FLAGS]
        log = tmp_path / f"p{pid}.log"
        logs.append(log)
        with open(log, "wb") as fh:
            procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, env=env))
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            dead = [p.returncode for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"not ready (exit codes {dead}):\n" + "\n".join(
                    log.read_text(errors="replace")[-3000:] for log in logs))
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{http}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]

        eng = LLMEngine(EngineConfig(max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                                     max_num_batched_tokens=16, compilation_cache_dir=""),
                        LoadConfig(model="tiny", load_format="dummy"))
        eng.warmup(progress=False)
        eng.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=6,
                                                    ignore_eos=True))
        want = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    want = out.outputs[0].text
        assert got == want

        procs[0].send_signal(signal.SIGTERM)  # drain, exit 0, and release the follower
        assert procs[0].wait(180) == 0
        assert procs[1].wait(180) == 0, logs[1].read_text(errors="replace")[-3000:]
        assert "process 0 stopped after" in logs[1].read_text()
        # both froze their compiled heap (docs/configuration.md#the-garbage-collector-in-a-server)
        assert all("garbage collector: " in log.read_text() for log in logs)
    finally:
        for p in procs:
            _kill(p)


# One process of the two-process load below: joins the group, loads an orbax checkpoint and an
# HF directory onto the 2-device mesh, prints its own device's report row, the bytes tensorstore
# read from files, and a float64 sum of every local shard (with the shard's index).
LOAD_CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jaxserve import sharding
from jaxserve.cli import multihost
from jaxserve.loading import sharded as sharded_load
coord, pid, orbax_dir, hf_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
multihost.initialize(coord, 2, pid)
mesh = sharding.make_mesh(2)
out = {}
for fmt, fn, path in (("orbax", sharded_load.load_orbax_sharded, orbax_dir),
                      ("hf", sharded_load.load_hf_sharded, hf_dir)):
    before = sharded_load.tensorstore_bytes_read()
    _, params, report = fn(path, jnp.float32, mesh)
    sums = {jax.tree_util.keystr(p): [[[(i.start, i.stop) for i in s.index],
                                       float(np.asarray(s.data, np.float64).sum())]
                                      for s in x.addressable_shards]
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    out[fmt] = {"devices": report.as_dict()["devices"], "sums": sums,
                "storage": sharded_load.tensorstore_bytes_read() - before}
print(json.dumps(out))
"""


def test_each_process_reads_only_its_own_shards(tmp_path: Path) -> None:
    """Two processes, one CPU device each, load a tiny orbax checkpoint and an HF directory with
    TP 2: each process holds its device's shards with the values of a whole load, its report
    has only its own device, and tensorstore read well under the whole checkpoint in each."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve import sharding
    from jaxserve.loading import sharded as sharded_load
    from models import checkpoint
    from models.config import builtin_config
    from models.llama import LlamaForCausalLM
    from models.loader import dummy_params

    cfg = builtin_config("tiny")
    orbax_dir = str(tmp_path / "tiny")
    checkpoint.save_checkpoint(orbax_dir, cfg, dummy_params(LlamaForCausalLM(cfg), 0))
    hf_dir = str(REPO_ROOT / "tests" / "goldens" / "hf_tiny" / "llama")
    coord = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO_ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, "-c", LOAD_CHILD, f"127.0.0.1:{coord}", str(pid),
                               orbax_dir, hf_dir], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=REPO_ROOT, env=env, text=True)
             for pid in (0, 1)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            _kill(p)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]

    mesh = sharding.make_mesh(2)  # this process's first two devices stand in for the pair
    for fmt, fn, path in (("orbax", sharded_load.load_orbax_sharded, orbax_dir),
                          ("hf", sharded_load.load_hf_sharded, hf_dir)):
        before = sharded_load.tensorstore_bytes_read()
        _, want, report = fn(path, jnp.float32, mesh)
        whole_storage = sharded_load.tensorstore_bytes_read() - before
        for pid, g in enumerate(got):
            rows = g[fmt]["devices"]
            assert [r["process_index"] for r in rows] == [pid]
            assert rows[0]["bytes_read"] == report.devices[pid].bytes_read
            for path_s, x in jax.tree_util.tree_flatten_with_path(want)[0]:
                shard = x.addressable_shards[pid]
                want_index = [[i.start, i.stop] for i in shard.index]
                [[index, total]] = g[fmt]["sums"][jax.tree_util.keystr(path_s)]
                assert index == want_index, (fmt, path_s)
                assert total == float(np.asarray(shard.data, np.float64).sum()), (fmt, path_s)
            if fmt == "orbax":  # the 12 MiB embedding dominates; each process reads half of it
                assert 0 < g[fmt]["storage"] < 0.75 * whole_storage, (g[fmt]["storage"],
                                                                     whole_storage)


def test_multiprocess_flags_are_checked() -> None:
    from jaxserve.cli.multihost import initialize

    assert initialize(None, 1, 0) is False
    with pytest.raises(ValueError, match="--coordinator-address"):
        initialize(None, 2, 0)
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, 2\)"):
        initialize("127.0.0.1:1", 2, 2)
