"""``jaxserve sweep`` (jaxserve/bench/sweep.py) and the batch-occupancy gauges it reads."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from jaxserve.bench.sweep import (
    _scrape,
    gains,
    knee_concurrency,
    meets_slo,
    parse_grid,
    should_stop,
    slo_concurrency,
)
from jaxserve.bench.sweep_report import recommend
from jaxserve.cli.main import main
from jaxserve.config_args import engine_config_from_args
from jaxserve.engine.metrics import EngineMetrics
from tests.conftest import REPO_ROOT


def test_batch_occupancy_gauges() -> None:
    m = EngineMetrics("m")
    m.record_batch(3, 100)  # before the limits are known the ratios read 0
    assert _scrape(m.render().decode())["jaxserve:batch_seqs_usage_perc"] == 0.0
    m.set_batch_limits(max_num_seqs=8, max_num_batched_tokens=512)
    m.record_batch(6, 128)
    got = _scrape(m.render().decode())
    for name, value in (("num_scheduled_seqs", 6), ("num_scheduled_tokens", 128),
                        ("max_num_seqs", 8), ("max_num_batched_tokens", 512),
                        ("batch_seqs_usage_perc", 0.75), ("batch_tokens_usage_perc", 0.25)):
        assert got["jaxserve:" + name] == value, name


# -- knee, SLO and stopping on synthetic curves ---------------------------------------------------

CONC = [1, 2, 4, 8, 16, 32]


def test_gains_and_stop_rule() -> None:
    thr = [100.0, 190.0, 360.0, 370.0, 372.0]
    g = gains(thr)
    assert g[0] is None and g[1] == pytest.approx(0.9) and g[3] == pytest.approx(10 / 360)
    assert not should_stop(thr[:4], 0.05, 2)  # one small gain
    assert should_stop(thr, 0.05, 2)  # two in a row
    assert not should_stop([100.0, 101.0, 150.0, 151.0], 0.05, 2)  # the plateau was broken
    assert should_stop([100.0, 101.0], 0.05, 1)
    assert gains([0.0, 5.0])[1] == math.inf


@pytest.mark.parametrize(("thr", "knee"), [
    ([100, 190, 360, 600, 620, 625], 8),  # +90%, +89%, +67%, then +3%, +1%: plateau from 8
    ([100, 190, 360, 600, 900, 1300], None),  # still climbing at the limit: no knee
    ([100, 102, 101], 1),  # no gain from the baseline on
    ([100, 200, 203, 290, 292, 293], 8),  # a late jump (4 -> 8: +43%) moves the knee past 2
])
def test_knee(thr: list[float], knee: int | None) -> None:
    assert knee_concurrency(CONC[:len(thr)], [float(x) for x in thr], 0.05) == knee


def _step(c: int, ttft: float, tpot: float) -> dict:
    return {"concurrency": c, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot}


def test_slo_detection() -> None:
    slos = {"ttft": 500.0, "tpot": 50.0}
    steps = [_step(1, 50, 10), _step(2, 80, 12), _step(4, 200, 30), _step(8, 600, 45),
             _step(16, 400, 40)]  # 8 breaks TTFT; 16 passing again does not count
    assert slo_concurrency(steps, 99, slos) == 4
    assert meets_slo(_step(1, 500, 50), 99, slos)  # at the target is within it
    assert not meets_slo(_step(1, 10, 50.1), 99, slos)
    assert slo_concurrency([_step(1, 900, 10)], 99, slos) is None
    assert slo_concurrency([{"concurrency": 3, "p99.9_tpot_ms": 1.0}], 99.9, {"tpot": 2}) == 3


def test_parse_grid() -> None:
    assert parse_grid(None) == [{}]
    g = parse_grid(["max_num_seqs=32,64", "max-num-batched-tokens=512", "kv_cache_memory_gib=1.5"])
    assert g == [{"max_num_seqs": 32, "max_num_batched_tokens": 512, "kv_cache_memory_gib": 1.5},
                 {"max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_cache_memory_gib": 1.5}]
    for bad in (["max_num_seqs"], ["nope=1"], ["max_num_seqs=a"], ["block_size=1", "block_size=2"]):
        with pytest.raises(ValueError):
            parse_grid(bad)


def test_recommend() -> None:
    def cfg(mns: int, thr: list[float], ok_upto: int | None) -> dict:
        steps = [{"concurrency": c, "output_throughput": t, "max_num_seqs": mns,
                  "max_num_batched_tokens": 512} for c, t in zip(CONC, thr)]
        return {"config": {"max_num_seqs": mns}, "steps": steps, "slo_concurrency": ok_upto}

    configs = [cfg(16, [10, 19, 35, 60, 70, 71], 8), cfg(64, [10, 19, 36, 62, 80, 95], 8)]
    rec = recommend(configs, headroom=0.25)
    # both meet the SLOs up to 8; the second is faster there; 8 * 0.75 = 6 sequences
    assert rec["interactive"]["settings"] == {"max_num_seqs": 6, "max_num_batched_tokens": 512}
    assert rec["interactive"]["from_config"] == {"max_num_seqs": 64}
    # the highest throughput: 95 tok/s at concurrency 32 on max_num_seqs 64
    assert rec["offline"]["settings"] == {"max_num_seqs": 64, "max_num_batched_tokens": 512}
    assert "32" in rec["offline"]["why"]
    assert "holds back 25%" in rec["interactive"]["why"]
    # met only at concurrency 1: one sequence, and the sentence says no headroom is left
    at_one = recommend([cfg(16, [10, 12], 1)], 0.25)["interactive"]
    assert at_one["settings"]["max_num_seqs"] == 1 and "no headroom" in at_one["why"]
    none_ok = recommend([cfg(16, [10, 12], None)], 0.25)
    assert "interactive" not in none_ok and none_ok["offline"]["settings"]["max_num_seqs"] == 16


# -- end to end -------------------------------------------------------------------------------


def _sweep(out: Path, *args: str) -> dict:
    rc = main(["sweep", *args, "--dataset-name", "random", "--random-input-len", "12",
               "--random-output-len", "4", "--prompts-per-concurrency", "1", "--num-warmups",
               "1", "--percentile", "90", "--goodput", "ttft:60000", "tpot:60000",
               "--metrics-interval-s", "0.05", "--output-dir", str(out)])
    assert rc == 0
    return json.loads((out / "sweep.json").read_text())


def test_sweep_real_server_real_model(engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The HTTP server over the shared SmolLM2 engine (with metrics attached for the test):
    three concurrency steps, occupancy from /metrics, JSON, plots and both configurations."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.routes import build_app
    from tests.support.http_server import serve_app

    metrics = EngineMetrics(engine.model_name)
    metrics.set_batch_limits(engine.config.max_num_seqs, engine.config.max_num_batched_tokens)
    engine.metrics = metrics
    aeng = AsyncEngine(engine)
    aeng.start(warmup=False)
    out = tmp_path / "sw"
    try:
        with serve_app(build_app(aeng, engine.model_name)) as url:
            res = _sweep(out, "--base-url", url, "--num-prompts", "4",
                         "--max-concurrency-limit", "4")
    finally:
        aeng.shutdown()
        engine.metrics = None
    (c,) = res["configs"]
    assert [s["concurrency"] for s in c["steps"]] == [1, 2, 4]
    for s in c["steps"]:
        assert s["completed"] == s["num_prompts"] == 4 and s["failed"] == 0
        assert s["max_num_seqs"] == 64 and s["max_num_batched_tokens"] == 512
        assert 0 < s["seqs_usage"] <= 1 and 0 < s["tokens_usage"] <= 1 and 0 < s["kv_usage"] <= 1
        assert s["meets_slo"] and s["p90_ttft_ms"] >= s["median_ttft_ms"] > 0
    assert c["slo_concurrency"] == 4 and c["config"] == {}
    for name in ("throughput.png", "latency.png", "occupancy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    inter = engine_config_from_args(argparse.Namespace(config=str(out / "interactive.yaml")))
    offline = engine_config_from_args(argparse.Namespace(config=str(out / "offline.yaml")))
    assert (inter.max_num_seqs, inter.max_num_batched_tokens) == (3, 512)  # 4 * (1 - 0.25)
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (64, 512)


def test_sweep_grid_starts_a_server_per_config(tmp_path: Path) -> None:
    """--grid: a `jaxserve serve` subprocess per configuration (a tiny dummy model: fast)."""
    serve_args = (f"tiny --load-format dummy --max-model-len 64 --num-kv-blocks 32 "
                  f"--max-num-batched-tokens 16 --compilation-cache-dir {REPO_ROOT / '.jax_cache'}")
    res = _sweep(tmp_path, "--serve-args", serve_args, "--grid", "max_num_seqs=2",
                 "--num-prompts", "2", "--max-concurrency-limit", "2")
    (c,) = res["configs"]
    assert c["config"] == {"max_num_seqs": 2}
    assert [s["concurrency"] for s in c["steps"]] == [1, 2]
    assert all(s["max_num_seqs"] == 2 and s["completed"] == 2 for s in c["steps"])
    offline = engine_config_from_args(argparse.Namespace(config=str(tmp_path / "offline.yaml")))
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (2, 16)
    assert main(["sweep", "--base-url", "http://127.0.0.1:9", "--grid", "max_num_seqs=2"]) == 2
