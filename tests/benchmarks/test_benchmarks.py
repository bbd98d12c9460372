"""Every harness in ``benchmarks/`` imports, parses its flags and runs in a tiny mode.

The harnesses are measuring tools, not timed tests: these only check that each still runs on
the current public API (a tiny dummy model, a few steps) and writes its JSON, so that none
rots between the sessions that measure with it. One engine is built for the module and shared.
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import pkgutil
from pathlib import Path

import pytest

import benchmarks
from benchmarks import (
    attention_ab,
    common,
    engine_ab,
    gemma_lib_load,
    greedy_invariance,
    op_profile,
    workload_ab,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESSES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                   if m.name != "common")
TINY_ENGINE = {"max_num_seqs": 2, "max_num_batched_tokens": 32, "max_model_len": 96,
               "compilation_cache_dir": str(REPO_ROOT / ".jax_cache")}


@pytest.fixture(scope="module")
def engine():
    """One warmed-up engine of the built-in ``tiny`` config with dummy weights."""
    return common.build_engine("tiny", "dummy", TINY_ENGINE)


def test_the_harness_list_is_what_the_tests_run() -> None:
    assert HARNESSES == ["attention_ab", "engine_ab", "gc_pause", "gemma_lib_load",
                         "greedy_invariance", "op_profile", "tool_agreement", "workload_ab"]


@pytest.mark.parametrize("name", HARNESSES)
def test_each_harness_imports_and_answers_help(name: str, capsys) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__ and callable(module.main)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    assert "--json" in capsys.readouterr().out


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_harnesses_use_only_public_names() -> None:
    """No private module or name of the product packages, and no product code that imports
    the harnesses (they sit on top of the public API)."""
    for path in sorted((REPO_ROOT / "benchmarks").glob("*.py")):
        for module, names in _imports(path):
            if module.split(".")[0] in ("jaxserve", "models", "cpu_kernels", "pallas_kernels"):
                assert not any(p.startswith("_") for p in module.split(".")), (path, module)
                assert not any(n.startswith("_") for n in names), (path, module, names)
    for pkg in ("jaxserve", "models", "cpu_kernels", "pallas_kernels"):
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            for module, _ in _imports(path):
                assert module.split(".")[0] != "benchmarks", path


def test_settings_parse_into_engine_config_values() -> None:
    assert common.parse_settings("dtype=float32,max-num-seqs=16,x=0.5,y=true") == {
        "dtype": "float32", "max_num_seqs": 16, "x": 0.5, "y": True}
    assert common.parse_config("bf16:kv_cache_dtype=bfloat16") == (
        "bf16", {"kv_cache_dtype": "bfloat16"})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        common.parse_settings("dtype")
    with pytest.raises(ValueError, match="NAME"):
        common.parse_config(":dtype=float32")
    assert common.parse_configs(["off:", "on:x=1"]) == {"off": {}, "on": {"x": 1}}
    with pytest.raises(ValueError, match="names must differ"):
        common.parse_configs(["a:", "a:x=1"])


def test_format_table_aligns_columns() -> None:
    text = common.format_table(["a", "bb"], [("x", 1.25), ("yyy", 10)])
    assert text.splitlines() == ["a    bb ", "---  ---", "x    1.2", "yyy   10"]


def test_engine_ab_runs_two_settings_interleaved(engine, tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    ns = engine_ab.build_parser().parse_args([
        "--model", "tiny", "--load-format", "dummy", "--config", "a:seed=0",
        "--config", "b:seed=0", "--batches", "1", "--context", "16", "--prefill-lens", "16",
        "--rounds", "1", "--steps", "2", "--json", str(out)])
    result = engine_ab.run(ns, engines={"a": engine, "b": engine})
    saved = json.loads(out.read_text())
    assert set(saved["decode"]["1"]) == {"a", "b"} == set(result["prefill"][16])
    assert all(v["median_ms"] > 0 for v in result["decode"][1].values())
    assert not engine.has_unfinished_requests()


def test_workload_ab_times_every_step_of_each_round(engine, tmp_path: Path) -> None:
    out = tmp_path / "wab.json"
    ns = workload_ab.build_parser().parse_args([
        "--config", "a:seed=0", "--config", "b:seed=0", "--requests", "5", "--prompt-lens",
        "4,20", "--output-lens", "1,6", "--wave", "2", "--wave-steps", "2", "--rounds", "2",
        "--json", str(out)])
    result = workload_ab.run(ns, engines={"a": engine, "b": engine})
    saved = json.loads(out.read_text())["engines"]
    assert set(saved) == {"a", "b"}
    for e in result["engines"].values():
        assert e["num_steps"] >= 2 * 6 and 0 < e["p50_ms"] <= e["p99_ms"]
        assert len(e["round_p50_ms"]) == len(e["round_p99_ms"]) == 2
    assert not engine.has_unfinished_requests()
    with pytest.raises(SystemExit):
        workload_ab.build_parser().parse_args(["--config", "a:", "--prompt-lens", "9,3"])


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_op_profile_sums_op_events(engine, phase: str, tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    ns = op_profile.build_parser().parse_args([
        "--phase", phase, "--batch", "2", "--context", "16", "--steps", "2", "--top", "5",
        "--json", str(out)])
    result = op_profile.run(ns, engine=engine)
    assert result["traced_steps"] >= 1 and result["op_ms_per_step"] > 0
    assert 0 < len(json.loads(out.read_text())["ops"]) <= 5
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_attention_ab_compares_the_paths(phase: str, tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    assert attention_ab.main([
        "--phase", phase, "--seqs", "2", "--context", "20", "--layers", "2", "--rounds", "1",
        "--repeats", "1", "--ceiling-mib", "4", "--ceiling-n", "128", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    paths = saved["paths"]
    assert saved["ceiling"] > 0 and all(p["fraction_of_ceiling"] > 0 for p in paths.values())
    assert paths["jnp"]["max_rel_diff"] == 0.0
    if attention_ab.native_available():  # the kernel and the jnp op agree
        assert paths["native"]["max_rel_diff"] < 1e-2


def test_greedy_invariance_compares_each_scenario_with_the_probe_alone(engine, tmp_path: Path
                                                                       ) -> None:
    out = tmp_path / "inv.json"
    ns = greedy_invariance.build_parser().parse_args([
        "--lens", "7,9", "--max-tokens", "4", "--batches", "2", "--json", str(out)])
    result = greedy_invariance.run(ns, engine=engine)
    assert set(result["scenarios"]) == {"again", "batch2", "staggered", "aborted"}
    for s in json.loads(out.read_text())["scenarios"].values():
        assert s["preemptions"] >= 0 and all(d["len"] in (7, 9) for d in s["differ"])
        assert set(s["logprobs_differ"]) <= {7, 9}
        # a token that differs has other logprobs; the converse is the finer check
        assert {d["len"] for d in s["differ"]} <= set(s["logprobs_differ"])
    assert not engine.has_unfinished_requests()
    assert [len(r) for r in result["reference"]] == [4, 4]
    assert all(len(r) == 4 and all(lp <= 0.0 for lp in r) for r in result["reference_logprobs"])
    assert result["batch_invariant"] is False  # "auto": the mode is opt-in
    # against another run's references, in the ready buckets only (put back afterwards)
    usable = list(engine.runner.packer.usable)
    again = greedy_invariance.run(greedy_invariance.build_parser().parse_args([
        "--lens", "7,9", "--max-tokens", "4", "--batches", "2", "--ready-buckets-only",
        "--reference", str(out)]), engine=engine)
    assert again["ready_buckets_only"] and "reference" in again["scenarios"]
    assert engine.runner.packer.usable == usable
    with pytest.raises(ValueError, match="lens and max_tokens differ"):
        greedy_invariance.run(greedy_invariance.build_parser().parse_args([
            "--lens", "7", "--batches", "2", "--reference", str(out)]), engine=engine)
    with pytest.raises(ValueError, match="--batches"):
        greedy_invariance.run(greedy_invariance.build_parser().parse_args(
            ["--lens", "7,9,11", "--batches", "2"]), engine=engine)
    assert greedy_invariance._differences([5, 6], [[1, 2], [3, 4]], [[1, 2], [3, 9]]) == [
        {"len": 6, "first_position": 1}]


def test_gc_pause_times_full_collections_before_and_after_the_freeze(tmp_path: Path) -> None:
    from benchmarks import gc_pause

    out = tmp_path / "gc.json"
    tiny = ",".join(f"{k}={v}" for k, v in {**TINY_ENGINE, "num_kv_blocks": 24}.items())
    assert gc_pause.main(["--model", "tiny", "--load-format", "dummy", "--engine-args", tiny,
                          "--requests", "2", "--repeats", "2", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["tokens"] == 64 and saved["frozen_objects"] > 0
    heap, frozen = saved["collections"]["as it is"], saved["collections"]["frozen"]
    assert frozen["objects_walked"] < heap["objects_walked"] / 10  # the frozen are not walked
    assert gc.get_freeze_count() == 0  # the harness unfroze what it froze
    with pytest.raises(ValueError, match="--requests and --repeats"):
        gc_pause.main(["--requests", "0"])


def test_gemma_lib_load_times_both_layouts(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    assert gemma_lib_load.main([
        "--width", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
        "--mlp", "16", "--vocab", "300", "--dtype", "float32", "--repeats", "1",
        "--dir", str(tmp_path / "ckpts"), "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["median_s"]) == {"gemma-lib", "ours", "gemma-lib tokenizer",
                                      "ours tokenizer"}
    assert all(v > 0 for v in saved["median_s"].values()) and saved["ratio"] > 0


def test_tool_agreement_refuses_bad_flags_before_serving(capsys) -> None:
    import socket

    from benchmarks import tool_agreement

    parser = tool_agreement.build_parser()
    for args, message in ((["--tools", "foo"], "--tools takes some of"),
                          (["--port", "0"], "--port must be in 1-65535"),
                          (["--concurrency", "abc"], "--concurrency takes comma-separated"),
                          (["--num-prompts", "0"], "--num-prompts values must be >= 1")):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(args)
        assert exc.value.code == 2 and message in capsys.readouterr().err, args
    with pytest.raises(SystemExit, match="one count per --concurrency"):
        tool_agreement.run(parser.parse_args(["--concurrency", "1,4", "--num-prompts", "2"]))
    with socket.socket() as taken:  # another server on the port: refused, not measured
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"port {port} is in use"):
            tool_agreement.run(parser.parse_args(["--tools", "bench", "--port", str(port)]))


def test_tool_agreement_compares_a_tool_with_the_servers_own_histograms(tmp_path: Path) -> None:
    """``bench serve`` alone (the other tools need their venvs: tests/peer_tools), the tiny
    model served: the tool's and the server's figures for the same requests."""
    from benchmarks import tool_agreement

    out = tmp_path / "agree.json"
    import socket

    serve = f"tiny --load-format dummy --max-model-len 512 --compilation-cache-dir " \
            f"{REPO_ROOT / '.jax_cache'}"
    with socket.socket() as s:  # a port free now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (row,) = tool_agreement.run(tool_agreement.build_parser().parse_args([
        "--tools", "bench", "--concurrency", "1", "--num-prompts", "2", "--port", str(port),
        "--serve-args", serve, "--json", str(out)]))
    assert row["tool"] == "bench" and row["num_prompts"] == 2 and row["client_cpu_s"] > 0
    # the server counts from the request's arrival, the client from its send: never later
    assert 0 < row["server_ttft_ms"] <= row["ttft_ms"] and row["server_itl_ms"] > 0
    assert json.loads(out.read_text())["rows"] == [row]
