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
    remove_stale,
    served_objectives,
    should_stop,
    slo_concurrency,
)
from jaxserve.bench.sweep_report import best_goodput, format_table, recommend, write_yaml
from jaxserve.cli.main import main
from jaxserve.config import DEFAULT_SLOS_MS
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


def test_the_servers_objectives_are_the_default_slos() -> None:
    """A server's objectives (jaxserve:ttft_slo_seconds / itl_slo_seconds) become --goodput;
    a zero objective is none, and a server with none (vLLM, or both 0) is refused."""
    m = EngineMetrics("m")
    with pytest.raises(ValueError, match="no service objectives.*--goodput"):
        served_objectives(m.render().decode(), "http://h")  # the gauges read 0 until set
    m.set_objectives(ttft_slo_s=2.0, itl_slo_s=0.3)
    assert served_objectives(m.render().decode(), "http://h") == ["ttft:2000", "itl:300"]
    m.set_objectives(ttft_slo_s=0.0, itl_slo_s=0.05)
    assert served_objectives(m.render().decode(), "http://h") == ["itl:50"]
    with pytest.raises(ValueError, match="http://v"):
        served_objectives("# HELP vllm:x x\n# TYPE vllm:x gauge\nvllm:x 1.0\n", "http://v")


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
    # itl is judged on each request's largest gap, as the server's objective and goodput are
    step = {"p99_itl_ms": 40.0, "p99_max_itl_ms": 350.0}
    assert not meets_slo(step, 99, {"itl": 300.0}) and meets_slo(step, 99, {"itl": 350.0})


def test_grid_booleans_ranges_and_flags() -> None:
    from jaxserve.bench.sweep_grid import grid_flags

    grid = parse_grid(["enable_prefix_caching=false,on", "max_num_seqs=2"])
    assert [g["enable_prefix_caching"] for g in grid] == [False, True]
    assert grid_flags(grid[0]) == ["--no-enable-prefix-caching", "--max-num-seqs", "2"]
    assert grid_flags(grid[1])[0] == "--enable-prefix-caching"
    with pytest.raises(ValueError, match="enable_prefix_caching: values must be bool"):
        parse_grid(["enable_prefix_caching=maybe"])
    # out of range: refused before any server starts, naming the setting and the value
    with pytest.raises(ValueError, match=r"--grid max_num_seqs=-1: max_num_seqs=-1 must be >= 1"):
        parse_grid(["max_num_seqs=2,-1"])


def test_a_grid_over_the_objectives_needs_goodput(tmp_path: Path, capsys) -> None:
    """Judged by the first server's objectives, a grid over them would judge by whichever came
    first: refused before anything starts."""
    assert main(["sweep", "--grid", "itl_slo_ms=0,50", "--output-dir", str(tmp_path)]) == 2
    assert "varies itl_slo_ms: give --goodput" in capsys.readouterr().err


def test_an_earlier_runs_recommendation_is_not_left_behind(tmp_path: Path) -> None:
    for name in ("interactive", "offline"):
        (tmp_path / f"{name}.yaml").write_text("max_num_seqs: 1\n")
    remove_stale(str(tmp_path), {"offline": {}})
    assert not (tmp_path / "interactive.yaml").exists() and (tmp_path / "offline.yaml").exists()


def test_parse_grid() -> None:
    assert parse_grid(None) == [{}]
    assert parse_grid(["itl_slo_ms=0,50", "max_num_batched_tokens=512"]) == [
        {"itl_slo_ms": 0.0, "max_num_batched_tokens": 512},
        {"itl_slo_ms": 50.0, "max_num_batched_tokens": 512}]
    g = parse_grid(["max_num_seqs=32,64", "max-num-batched-tokens=512", "kv_cache_memory_gib=1.5"])
    assert g == [{"max_num_seqs": 32, "max_num_batched_tokens": 512, "kv_cache_memory_gib": 1.5},
                 {"max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_cache_memory_gib": 1.5}]
    for bad in (["max_num_seqs"], ["nope=1"], ["max_num_seqs=a"], ["block_size=1", "block_size=2"]):
        with pytest.raises(ValueError):
            parse_grid(bad)


def _cfg(mns: int, thr: list[float], ok_upto: int | None,
         goodput: list[float] | None = None) -> dict:
    good = goodput or [t / 10 for t in thr]  # requests/s meeting the SLOs, per step
    steps = [{"concurrency": c, "output_throughput": t, "request_goodput": g,
              "max_num_seqs": mns, "max_num_batched_tokens": 512}
             for c, t, g in zip(CONC, thr, good)]
    return {"config": {"max_num_seqs": mns}, "steps": steps, "slo_concurrency": ok_upto}


def test_best_goodput_counts_only_steps_meeting_the_slos() -> None:
    c = _cfg(16, [10, 20, 30, 40], 4, goodput=[1.0, 1.9, 1.7, 3.5])
    assert best_goodput(c["steps"], 4)["concurrency"] == 2  # 8 has more, but breaks the SLOs
    assert best_goodput(c["steps"], 8)["concurrency"] == 8
    assert best_goodput(c["steps"], None) is None
    tie = _cfg(16, [10, 20], 2, goodput=[1.0, 1.0])
    assert best_goodput(tie["steps"], 2)["concurrency"] == 2  # the tie goes to throughput


def test_recommend_interactive_is_most_goodput_offline_most_throughput() -> None:
    # A meets the SLOs up to 16 but few of its requests meet them per request (goodput 1.2);
    # B only up to 8, with more goodput there (2.5 at concurrency 8). Goodput picks B.
    a = _cfg(64, [10, 19, 36, 62, 80, 95], 16, goodput=[0.9, 1.0, 1.1, 1.2, 1.2, 0.5])
    b = _cfg(16, [10, 19, 35, 60, 70, 71], 8, goodput=[1.0, 1.8, 2.2, 2.5, 2.0, 1.0])
    rec = recommend([a, b], headroom=0.25)
    assert rec["interactive"]["from_config"] == {"max_num_seqs": 16}
    # 8 * 0.75 = 6 sequences
    assert rec["interactive"]["settings"] == {"max_num_seqs": 6, "max_num_batched_tokens": 512}
    assert "2.50 req/s" in rec["interactive"]["why"] and "holds back 25%" in rec["interactive"]["why"]
    # the highest throughput: 95 tok/s at concurrency 32 on max_num_seqs 64
    assert rec["offline"]["settings"] == {"max_num_seqs": 64, "max_num_batched_tokens": 512}
    assert rec["offline"]["from_config"] == {"max_num_seqs": 64} and "32" in rec["offline"]["why"]
    # the most goodput below the SLO limit: concurrency 2 of 4 -> floor(1.5) = 1 sequence
    two = recommend([_cfg(16, [10, 12, 13], 4, goodput=[1.0, 1.5, 1.4])], 0.25)["interactive"]
    assert two["settings"]["max_num_seqs"] == 1 and "holds back 50%" in two["why"]
    # most goodput at concurrency 1: one sequence, and the sentence says no headroom is left
    one = recommend([_cfg(16, [10, 12], 2, goodput=[1.5, 1.2])], 0.25)["interactive"]
    assert one["settings"]["max_num_seqs"] == 1 and "no headroom" in one["why"]
    # the SLOs it was chosen by become the scheduler's objectives, unless the grid point set one
    slos = {"ttft": 2000.0, "itl": 300.0, "tpot": 100.0}
    objectives = recommend([b], 0.25, slos)["interactive"]["settings"]
    assert (objectives["ttft_slo_ms"], objectives["itl_slo_ms"]) == (2000.0, 300.0)
    assert "tpot" not in str(objectives)  # no scheduler objective of its own
    b["config"] = {"max_num_seqs": 16, "itl_slo_ms": 50.0}
    assert recommend([b], 0.25, slos)["interactive"]["settings"]["itl_slo_ms"] == 50.0
    none_ok = recommend([_cfg(16, [10, 12], None)], 0.25)
    assert "interactive" not in none_ok and none_ok["offline"]["settings"]["max_num_seqs"] == 16


def test_table_prints_p99_ttft_itl_and_the_largest_gap() -> None:
    step = {"concurrency": 4, "request_throughput": 2.0, "output_throughput": 64.0,
            "mean_ttft_ms": 120.0, "p99_ttft_ms": 410.0, "mean_itl_ms": 21.5, "p99_itl_ms": 88.2,
            "largest_itl_ms": 950.0, "p90_tpot_ms": 33.3, "p90_ttft_ms": 300.0,
            "p90_itl_ms": 40.0, "p99_max_itl_ms": 420.0, "request_goodput": 1.75, "seqs_usage": 0.5,
            "tokens_usage": None, "kv_usage": 0.25, "meets_slo": True}
    cfg = {"config": {"itl_slo_ms": 50.0}, "steps": [step], "knee": None, "slo_concurrency": 4,
           "goodput": 1.75, "goodput_concurrency": 4}
    table = format_table([cfg], 99, {"ttft": 500.0, "itl": 100.0})
    head, cols, row = table.splitlines()
    assert "itl_slo_ms=50.0" in head and "goodput 1.75 req/s at concurrency 4" in head
    assert cols.split() == ["conc", "req/s", "out", "tok/s", "gain", "TTFT", "mean", "p99",
                            "ITL", "mean", "p99", "max", "gap", "p99", "max", "itl", "goodput",
                            "seqs", "tokens", "KV", "SLO"]  # itl's SLO: the largest gaps' p99
    assert row.split() == ["4", "2.00", "64.0", "-", "120", "410", "21.5", "88.2", "950",
                           "420.0", "1.75", "50%", "-", "25%", "ok"]
    assert "no knee (throughput still rising" in head
    assert "meets the SLOs up to concurrency 4" in head
    cfg2 = {**cfg, "knee": 8, "slo_concurrency": None, "goodput": None}
    head2 = format_table([cfg2], 99, {"ttft": 500.0}).splitlines()[0]
    assert "knee at concurrency 8" in head2 and "meets the SLOs at no concurrency" in head2
    assert "None" not in head + head2
    # SLOs at p90 (and on TPOT) add their own columns
    cols90 = format_table([cfg], 90, {"ttft": 500.0, "tpot": 50.0}).splitlines()[1]
    assert "p90 ttft" in cols90 and "p90 tpot" in cols90


def test_the_yaml_says_how_to_serve_it(tmp_path: Path) -> None:
    rec = {"why": "most goodput", "settings": {"max_num_seqs": 6}}
    started, running = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write_yaml(str(started), rec, "--model m.gguf  --max-model-len 2048")
    assert "# serve: jaxserve serve --model m.gguf  --max-model-len 2048 --config a.yaml" in (
        started.read_text())
    write_yaml(str(tmp_path / "c.yaml"), rec, "")  # the default model, no flags
    assert "# serve: jaxserve serve --config c.yaml\n" in (tmp_path / "c.yaml").read_text()
    write_yaml(str(running), rec, None)  # --base-url: the sweep does not know the server's flags
    text = running.read_text()
    assert "jaxserve serve MODEL_AND_FLAGS --config b.yaml" in text
    assert "# MODEL_AND_FLAGS: the model and flags the swept server" in text
    assert "max_num_seqs: 6" in text


# -- end to end -------------------------------------------------------------------------------


def _sweep(out: Path, *args: str, goodput: tuple[str, ...] = ("ttft:60000", "tpot:60000")
           ) -> dict:
    rc = main(["sweep", *args, "--dataset-name", "random", "--random-input-len", "12",
               "--random-output-len", "4", "--prompts-per-concurrency", "1", "--num-warmups",
               "1", "--percentile", "90", *(("--goodput", *goodput) if goodput else ()),
               "--metrics-interval-s", "0.05", "--output-dir", str(out)])
    assert rc == 0
    return json.loads((out / "sweep.json").read_text())


def test_sweep_real_server_real_model(engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The HTTP server over the shared SmolLM2 engine (with metrics attached for the test):
    three concurrency steps, occupancy from /metrics, JSON, plots and both configurations."""
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.routes import build_app
    from tests.support.http_server import serve_app

    engine.set_metrics(EngineMetrics(engine.model_name))
    aeng = AsyncEngine(engine)
    aeng.start(warmup=False)
    out = tmp_path / "sw"
    try:
        with serve_app(build_app(aeng, engine.model_name)) as url:
            res = _sweep(out, "--base-url", url, "--num-prompts", "4",
                         "--max-concurrency-limit", "4")
    finally:
        aeng.shutdown()
        engine.set_metrics(None)
    (c,) = res["configs"]
    assert [s["concurrency"] for s in c["steps"]] == [1, 2, 4]
    for s in c["steps"]:
        assert s["completed"] == s["num_prompts"] == 4 and s["failed"] == 0
        assert s["max_num_seqs"] == 64 and s["max_num_batched_tokens"] == 512
        assert 0 < s["seqs_usage"] <= 1 and 0 < s["tokens_usage"] <= 1 and 0 < s["kv_usage"] <= 1
        assert s["meets_slo"] and s["p90_ttft_ms"] >= s["median_ttft_ms"] > 0
    assert c["slo_concurrency"] == 4 and c["config"] == {}
    assert c["goodput"] == max(s["request_goodput"] for s in c["steps"])
    for s in c["steps"]:
        assert s["p99_itl_ms"] <= s["largest_itl_ms"] and s["mean_max_itl_ms"] > 0
    for name in ("throughput.png", "latency.png", "occupancy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    inter = engine_config_from_args(argparse.Namespace(config=str(out / "interactive.yaml")))
    offline = engine_config_from_args(argparse.Namespace(config=str(out / "offline.yaml")))
    # the most goodput's concurrency (1, 2 or 4 on a busy machine) less 25%, at least 1
    assert inter.max_num_seqs == max(1, int(c["goodput_concurrency"] * 0.75))
    assert inter.max_num_batched_tokens == 512
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (64, 512)


def test_sweep_grid_starts_a_server_per_config(tmp_path: Path) -> None:
    """--grid: a `jaxserve serve` subprocess per configuration (a tiny dummy model: fast)."""
    serve_args = (f"tiny --load-format dummy --max-model-len 64 --num-kv-blocks 32 "
                  f"--max-num-batched-tokens 16 --compilation-cache-dir {REPO_ROOT / '.jax_cache'}")
    res = _sweep(tmp_path, "--serve-args", serve_args, "--grid", "max_num_seqs=2",
                 "--num-prompts", "2", "--max-concurrency-limit", "2", goodput=())
    # no --goodput: the CPU server's own objectives (config.DEFAULT_SLOS_MS)
    ttft, itl = DEFAULT_SLOS_MS["cpu"]
    assert res["args"]["goodput"] == [f"ttft:{ttft:g}", f"itl:{itl:g}"]
    (c,) = res["configs"]
    assert c["config"] == {"max_num_seqs": 2}
    if c["slo_concurrency"]:  # the tiny model meets them unless the machine stalls for seconds
        inter = engine_config_from_args(
            argparse.Namespace(config=str(tmp_path / "interactive.yaml")))
        assert (inter.ttft_slo_ms, inter.itl_slo_ms) == (ttft, itl)
    assert [s["concurrency"] for s in c["steps"]] == [1, 2]
    assert all(s["max_num_seqs"] == 2 and s["completed"] == 2 for s in c["steps"])
    offline = engine_config_from_args(argparse.Namespace(config=str(tmp_path / "offline.yaml")))
    assert (offline.max_num_seqs, offline.max_num_batched_tokens) == (2, 16)
    assert main(["sweep", "--base-url", "http://127.0.0.1:9", "--grid", "max_num_seqs=2"]) == 2
