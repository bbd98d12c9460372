"""The prepared run for a GPU machine (scripts/device_run.sh) in its dry run on the CPU, and the
pieces it judges by: the reference comparison (device_correctness.py), the schema check and the
compile counter (device_server.py), and build_wheelhouse.py's selection and budget (without a
download).

The dry run does what the GPU run does at tiny sizes: serves the ``tiny`` dummy model with a
tokenizer directory (as the GPU run serves Llama-3.1-8B with the carried one), cold then warm;
``jaxserve bench serve`` at concurrency 1, 8 and 64 and a shared-prefix workload; greedy tokens
against the reference's tiny tokens (float32 and bfloat16 caches), async against synchronous
scheduling; one structured-output request; gpu_check's bandwidth row; the floors; the JSON and
the PNG.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("device_run")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    proc = subprocess.run(["bash", "scripts/device_run.sh", "--dry-run", "--json",
                           str(out / "run.json"), "--png", str(out / "run.png")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "run.json").read_text()), out


def test_dry_run_serves_benchmarks_and_compiles_nothing_after_warmup(dry_run) -> None:
    result, _ = dry_run
    assert {"server", "kernels", "correctness", "floors", "wheelhouse_mib"} <= result.keys()
    server = result["server"]
    assert server["status"] == "ok", server
    assert server["compiles_after_warmup"] == 0
    for kind in ("cold", "warm"):
        start = server["startup"][kind]
        assert start["ready_s"] > 0 and start["num_programs"] > 0 and start["exit_code"] == 0
    benches = server["benchmarks"]
    assert [b["name"] for b in benches] == ["c1", "c8", "c64", "prefix-c64"]
    for b in benches:
        assert b["completed"] == b["num_prompts"] and b["failed"] == 0, b
        assert b["output_tok_s"] > 0 and 0 < b["itl_ms_p50"] <= b["itl_ms_p99"], b
        assert b["command"].startswith("jaxserve bench serve --base-url http://127.0.0.1:")
    floors = result["floors"]
    assert floors["itl_c1"]["floor_ms"] > 0 and floors["tok_s_c64"]["ceiling_tok_s"] > 0


def test_dry_run_tokens_equal_the_reference_on_the_cpu(dry_run) -> None:
    result, _ = dry_run
    c = result["correctness"]
    assert c["status"] == "ok", c
    reference = json.loads((ROOT / "scripts" / "device_run_reference.json").read_text())
    assert c["tokens"] == reference["models"]["tiny"]["tokens"]
    assert c["reference"]["num_identical"] == c["reference"]["num_sequences"] == len(c["tokens"])
    assert c["tokens_kv_bf16"] == reference["models"]["tiny kv-bfloat16"]["tokens"]
    assert c["reference_kv_bf16"]["status"] == "ok"
    assert c["async_vs_sync"]["identical"]
    assert c["structured_output"]["status"] == "ok", c["structured_output"]
    assert json.loads(c["structured_output"]["content"])["answer"] in ("yes", "no")


def test_dry_run_kernels_and_figure(dry_run) -> None:
    result, out = dry_run
    rows = {r["check"]: r for r in result["kernels"]["rows"]}
    assert rows["copy bandwidth"]["status"] == "ok" and rows["copy bandwidth"]["GBps"] > 0
    assert rows["engine pallas"]["status"] == "skipped (--only)"  # the interpret-mode rows
    assert result["floors"]["bandwidth_GBps"] == rows["copy bandwidth"]["GBps"]
    assert result["png"] == "ok"
    assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reference_comparison_allows_only_near_ties() -> None:
    compare = _script("device_correctness").compare
    want, gaps = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[0.5, 0.001, 0.5], [0.5, 0.5, 0.5],
                                                      [0.2, 0.3, 0.4]]
    r = compare(want, gaps, [[1, 2, 3], [4, 5, 6], [7, 8, 9]], near_tie=0.01)
    assert (r["status"], r["num_identical"], r["num_positions_compared"]) == ("ok", 3, 9)
    r = compare(want, gaps, [[1, 9, 9], [4, 5, 6], [7, 8, 9]], near_tie=0.01)  # a near-tie
    assert r["status"] == "ok" and r["near_ties"][0]["position"] == 1 and not r["mismatches"]
    assert r["num_positions_compared"] == 2 + 3 + 3
    r = compare(want, gaps, [[1, 2, 3], [4, 9, 6], [7, 8, 9]], near_tie=0.01)  # a real one
    assert r["status"] == "FAIL" and r["mismatches"][0] == {
        "prompt": 1, "position": 1, "reference_gap": 0.5, "reference_token": 5, "token": 9}


def test_structured_reply_and_compile_counter_checks() -> None:
    dr = _script("device_server")
    assert dr.schema_error('{"answer": "yes", "confidence": "low"}') is None
    assert "enum" in dr.schema_error('{"answer": "maybe", "confidence": "low"}')
    assert "keys" in dr.schema_error('{"answer": "yes"}')
    assert "not JSON" in dr.schema_error('{"answer": "yes", "confi')
    page = ('# TYPE jaxserve:num_compiles_after_warmup_total counter\n'
            'jaxserve:num_compiles_after_warmup_total{model_name="a"} 0.0\n'
            'jaxserve:num_compiles_after_warmup_total{model_name="b"} 2.0\n')
    assert dr.compiles_after_warmup(page) == 2
    with pytest.raises(ValueError, match="no jaxserve:num_compiles_after_warmup_total"):
        dr.compiles_after_warmup("# nothing\n")


def _meta(name: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "version": "1.0", "requires_dist": list(requires)}}


def test_wheelhouse_leaves_out_what_jax_flax_and_numpy_bring() -> None:
    bw = _script("build_wheelhouse")
    report = {"install": [
        _meta("jax", "jaxlib<=0.11.2", "numpy>=2", "scipy", "pytest; extra == 'test'"),
        _meta("jaxlib", "numpy", "scipy"), _meta("numpy"), _meta("scipy", "numpy"),
        _meta("flax", "orbax-checkpoint", "PyYAML>=5.4", "typing_extensions", "rich[jupyter]"),
        _meta("orbax_checkpoint", "protobuf"), _meta("protobuf"), _meta("PyYAML"),
        _meta("typing-extensions"), _meta("rich", "ipywidgets; extra == 'jupyter'"),
        _meta("ipywidgets"),
        _meta("gguf", "numpy>=1.17", "pyyaml>=5.1", "tqdm>=4.27"),
        _meta("tqdm", "colorama; platform_system == 'Windows'"),
        _meta("starlette", "anyio>=3.6", "typing_extensions>=4.10; python_version < '3.13'"),
        _meta("anyio", "idna>=2.8"), _meta("idna"),
        _meta("uvicorn", "click>=7.0", "h11>=0.8"), _meta("click"), _meta("h11")]}
    carry, base = bw.split(report)
    assert sorted(carry) == ["anyio", "click", "gguf", "h11", "idna", "starlette", "tqdm",
                             "uvicorn"]
    # flax's own requirements and the extra one of them names (rich[jupyter]) stay behind
    assert {"orbax-checkpoint", "pyyaml", "typing-extensions", "ipywidgets"} <= set(base)


def test_wheelhouse_requirements_and_budget() -> None:
    bw = _script("build_wheelhouse")
    needed, base = bw.requirements(str(ROOT / "pyproject.toml"), plot=True)
    names = {bw.normalize(bw.Requirement(r).name) for r in needed}
    assert {"starlette", "uvicorn", "msgspec", "tokenizers", "gguf", "jinja2", "llguidance",
            "prometheus-client", "httpx", "matplotlib"} <= names
    assert base == ["jax==0.11.2", "flax", "numpy"]
    no_plot, _ = bw.requirements(str(ROOT / "pyproject.toml"), plot=False)
    assert "matplotlib" not in {bw.normalize(bw.Requirement(r).name) for r in no_plot}
    assert bw.check_budget(5 * MiB, 50 * MiB) == pytest.approx(64 - 2 - 55)
    with pytest.raises(ValueError, match=r"exceed the 64 MiB .* by 3\.0 MiB"):
        bw.check_budget(10 * MiB, 55 * MiB)
