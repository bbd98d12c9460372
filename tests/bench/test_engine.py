"""``jaxserve bench step``, ``bench prefix-cache``, ``bench startup`` and the matmul ceiling of
``bench throughput`` on the tiny dummy model: their JSON keys and that the figures are
positive and consistent (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.bench.startup import parse_server_output, pending_programs
from jaxserve.bench.static_batch import StaticRequest
from jaxserve.bench.step import _summary
from jaxserve.bench.throughput import model_flops
from jaxserve.cli.main import main
from jaxserve.device.buckets import Bucket
from models.config import builtin_config

TINY = ["--model", "tiny", "--load-format", "dummy"]


def test_bench_step_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    assert main(["bench", "step", *TINY, "--batch-sizes", "4,8", "--context", "12",
                 "--num-steps", "3", "--modes", "greedy,n4,json1,json",
                 "--max-num-batched-tokens", "32", "--num-kv-blocks", "64",
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["model"] == "tiny" and res["num_programs"] > 0 and res["compile_s"] > 0
    assert res["engine_config"]["max_num_seqs"] == 8  # the largest batch size
    assert [(r["mode"], r["batch"], r["num_constrained"]) for r in res["rows"]] == [
        ("greedy", 4, 0), ("greedy", 8, 0), ("n4", 4, 0), ("n4", 8, 0), ("json1", 4, 1),
        ("json1", 8, 1), ("json", 4, 4), ("json", 8, 8)]
    for r in res["rows"]:
        d = r["decode"]
        # token masks are computed on the host only in steps with a constrained row
        assert (d["median_mask_ms"] > 0) == (r["num_constrained"] > 0)
        assert d["median_mask_ms"] <= d["median_host_ms"]  # per step mask <= host
        assert d["num_steps"] == 3 and d["bucket_seqs"] >= r["batch"]
        assert 0 < d["median_device_ms"] <= d["median_step_ms"]
        assert d["min_step_ms"] <= d["median_step_ms"] <= d["max_step_ms"]
        assert d["tokens_per_second"] == pytest.approx(r["batch"] / d["median_step_ms"] * 1e3)
        # batch x 12 prompt tokens over steps of at most 32 tokens
        assert sum(p["num_steps"] for p in r["prefill"]) >= r["batch"] * 12 // 32
        assert all(p["bucket_tokens"] > d["bucket_tokens"] for p in r["prefill"])
        # the CPU's default ITL target plans with a step-cost model: its prediction of every
        # step sits beside the measured time
        for s in [d, *r["prefill"]]:
            assert s["median_predicted_ms"] > 0 and s["median_measured_over_predicted"] > 0
    assert "pred ms" in capsys.readouterr().out


def test_bench_step_summary_without_a_target_has_no_prediction() -> None:
    bucket = Bucket(num_tokens=8, num_seqs=8)
    steps = [(bucket, 0.02, 0.015, 0.0, 0.03, None), (bucket, 0.03, 0.02, 0.0, 0.04, None)]
    assert "median_predicted_ms" not in _summary(steps, 8)
    with_target = _summary([(bucket, 0.02, 0.015, 0.0, 0.03, 0.01)], 8)
    assert with_target["median_predicted_ms"] == pytest.approx(10.0)
    assert with_target["median_measured_over_predicted"] == pytest.approx(2.0)


def test_bench_step_refuses_bad_flags() -> None:
    assert main(["bench", "step", *TINY, "--batch-sizes", "6", "--modes", "n4"]) == 2
    assert main(["bench", "step", *TINY, "--batch-sizes", "16", "--max-num-seqs", "8"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "step", *TINY, "--modes", "beam"])


def test_bench_prefix_cache_command(tmp_path: Path) -> None:
    out = tmp_path / "pc.json"
    assert main(["bench", "prefix-cache", *TINY, "--num-requests", "4", "--system-len", "64",
                 "--question-min", "3", "--question-max", "6", "--max-tokens", "2",
                 "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                 "--num-kv-blocks", "64", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    off, on = res["prefix_caching_off"], res["prefix_caching_on"]
    assert off["prefix_cache_hit_tokens"] == 0
    # caching on: the 64-token system prompt (4 full blocks) is computed once, then found
    assert on["prefix_cache_hit_tokens"] >= 3 * 64
    assert on["prefill_tokens"] + on["prefix_cache_hit_tokens"] == off["prefill_tokens"]
    assert res["prefill_ratio_on_over_off"] == pytest.approx(
        on["prefill_tokens"] / off["prefill_tokens"])
    for r in (off, on):
        assert len(r["ttfts_ms"]) == 4 and 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"]


def test_bench_startup_command(tmp_path: Path) -> None:
    out = tmp_path / "su.json"
    serve_args = "--max-num-batched-tokens 16 --max-num-seqs 4 --max-model-len 64 --num-kv-blocks 16"
    assert main(["bench", "startup", *TINY, f"--serve-args={serve_args}",
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    for kind in ("cold", "warm"):
        r = res[kind]
        assert r["num_programs"] > 0 and r["median_load_s"] >= 0 and r["median_compile_s"] >= 0
        assert r["median_ready_s"] > r["median_load_s"]
        assert 0 < r["median_port_s"] <= r["median_ready_s"]  # the port answers first
        assert r["median_cpu_s"] > 0 and r["median_background_s"] >= 0
        assert len(res["runs"][kind]) == 1
        run = res["runs"][kind][0]
        assert run["stage_at_s"]["ready"] <= run["ready_s"] and len(run["loadavg"]) == 3
        stages = r["median_stages_s"]
        assert set(stages) == {"import", "load_weights", "plan_kv", "kv_cache", "runner",
                               "engine", "compile", "probe", "server", "compile_cpu"}
        assert stages["import"] > 0 and stages["compile"] > 0
        # the server's own stages lie within the time to ready (the rest, "server", is not
        # negative but for the rounding of the server's figures to 1 ms)
        assert stages["server"] > -0.01


def test_pending_programs_sums_the_replicas_gauges() -> None:
    page = ('# TYPE jaxserve:step_programs_pending gauge\n'
            'jaxserve:step_programs_pending{engine="0",model_name="a"} 3.0\n'
            'jaxserve:step_programs_pending{engine="1",model_name="a"} 2.0\n'
            'jaxserve:step_programs_pending_other 9.0\n')
    assert pending_programs(page) == 5.0
    assert pending_programs("jaxserve:num_requests_running 1.0\n") is None


def test_parse_server_output() -> None:
    text = ("loaded tiny in 1.5 s (float32 weights, 3 MiB, ...)\n"
            "compiled 4 programs in 2.25 s; ready in 4.0 s\n"
            "start-up stages (s): load_weights=1.200 plan_kv=0.001 compile=2.250 probe=0.100\n")
    assert parse_server_output(text) == {
        "load_s": 1.5, "compile_s": 2.25, "num_programs": 4,
        "stages_s": {"load_weights": 1.2, "plan_kv": 0.001, "compile": 2.25, "probe": 0.1,
                     "ready_in": 4.0}}
    assert parse_server_output("") == {"load_s": -1.0, "compile_s": -1.0, "num_programs": -1,
                                       "stages_s": {}}


def test_model_flops_hand_count() -> None:
    mc = builtin_config("tiny")
    h, hd, L = mc.hidden_size, mc.head_dim, mc.num_layers
    linear = L * (h * hd * (2 * mc.num_heads + 2 * mc.num_kv_heads) + 3 * h * mc.intermediate_size)
    # 3 prompt + 2 output tokens: 4 processed tokens attending to 1, 2, 3, 4 positions
    want = 2 * linear * 4 + 2 * h * mc.vocab_size * 2 + 4 * mc.num_heads * hd * L * 10
    assert model_flops(mc, [StaticRequest([1, 2, 3], 2)]) == want


def test_bench_throughput_reports_the_matmul_ceiling(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", *TINY, "--dataset-name", "random", "--num-prompts", "4",
                 "--random-input-len", "12", "--random-output-len", "4", "--max-num-seqs", "4",
                 "--max-num-batched-tokens", "32", "--max-model-len", "64",
                 "--num-kv-blocks", "64", "--matmul-ceiling-size", "128",
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["matmul_ceiling_gflops"] > 0 and res["model_flops"] > 0
    for m in ("continuous", "static"):
        r = res[m]
        assert r["model_gflops_per_s"] == pytest.approx(
            res["model_flops"] / r["elapsed_time"] / 1e9)
        assert r["fraction_of_ceiling"] == pytest.approx(
            r["model_gflops_per_s"] / res["matmul_ceiling_gflops"])
