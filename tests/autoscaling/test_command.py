"""``jaxserve plan-autoscaling`` (jaxserve/autoscaling/command.py): flags, errors, the
written thresholds, and the simulated comparison."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from jaxserve.cli.main import main
from tests.autoscaling.test_plan import _step, _sweep

STEPS = [_step(1, 1.0, 100, 20), _step(2, 1.8, 150, 25), _step(4, 3.2, 300, 35),
         _step(8, 5.0, 600, 60), _step(16, 6.0, 1500, 120)]


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return ["plan-autoscaling", str(_sweep(tmp_path, [STEPS])), "--slo", "ttft:800",
            "--time-to-ready-s", "30", "--growth-concurrency", "0.05", *extra]


def test_writes_the_thresholds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.yaml"
    assert main(_args(tmp_path, "--output", str(out), "--model-name", "m")) == 0
    text = capsys.readouterr().out
    assert "met up to concurrency 8" in text and "lag = time to ready 30 s" in text
    plan = yaml.safe_load(out.read_text())
    running = plan["thresholds"]["running"]
    assert running["threshold"] == "4.54" and running["binding"] == "early trigger"
    assert running["query"] == 'sum(jaxserve:num_requests_running{model_name="m"})'
    assert plan["c_slo"] == 8 and plan["lag_s"] == 60.0 and plan["max_num_seqs"] == 8
    assert plan["recommended_signal"] == "tokens" and plan["thresholds"]["tokens"]["threshold"]
    assert plan["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert main(_args(tmp_path, "--output", str(tmp_path / "p.json"))) == 0
    assert json.loads((tmp_path / "p.json").read_text())["thresholds"]["running"]["threshold"] \
        == "4.54"


def test_startup_json(tmp_path: Path) -> None:
    startup = tmp_path / "startup.json"
    startup.write_text(json.dumps({"cold": {"median_ready_s": 40.0},
                                   "warm": {"median_ready_s": 8.0}}))
    args = _args(tmp_path)
    i = args.index("--time-to-ready-s")
    args[i:i + 2] = ["--startup-json", str(startup), "--extra-start-s", "2"]
    out = tmp_path / "plan.yaml"
    assert main([*args, "--output", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["inputs"]["time_to_ready_s"] == 10.0  # warm + 2
    assert main([*args, "--startup-kind", "cold", "--output", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["lag_s"] == 72.0  # 42 + 15 + 15


def test_no_early_threshold_exits_1_with_the_replicas_needed(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.yaml"
    args = _args(tmp_path, "--output", str(out))
    args[args.index("0.05")] = "0.5"  # 8 - 0.5 * 60 < 0 for every signal
    assert main(args) == 1
    plan = yaml.safe_load(out.read_text())
    assert plan["recommended_signal"] is None
    assert plan["minReplicas"] == 4  # floor(0.5 * 60 / 8) + 1
    assert "arrives after the SLO breaks" in capsys.readouterr().out


def test_simulate_compares_planned_and_naive(tmp_path: Path, capsys) -> None:
    png = tmp_path / "sim.png"
    out = tmp_path / "plan.yaml"
    assert main(_args(tmp_path, "--simulate", "--sim-signal", "running", "--sim-peak-replicas",
                      "3", "--sim-plot", str(png), "--output", str(out))) == 0
    text = capsys.readouterr().out
    assert "planned" in text and "naive 90%" in text
    rows = yaml.safe_load(out.read_text())["simulation"]["rows"]
    assert [r["policy"] for r in rows] == ["planned", "naive 90%"]
    assert rows[0]["threshold"] == 4.54 and rows[1]["threshold"] == pytest.approx(7.2)
    assert all(0 <= r["over_slo_ramp"] <= 1 and r["replica_minutes"] > 0 for r in rows)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize(("extra", "message"), [
    (["--headroom", "1.5"], r"headroom must be in \[0, 1\)"),
    (["--percentile", "100"], r"--percentile must be in \(0, 100\)"),
    (["--sim-plot", "x.png"], "--sim-plot needs --simulate"),
    (["--percentile", "95"], "'p95_ttft_ms' must be a number"),
    (["--config-index", "3"], r"--config-index must be in \[0, 0\]"),
])
def test_bad_inputs_exit_2_naming_them(tmp_path: Path, capsys, extra: list[str],
                                       message: str) -> None:
    assert main(_args(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxserve: error: ")
    assert re.search(message, err), err


def test_bad_slo_and_sources_exit_2(tmp_path: Path, capsys) -> None:
    args = _args(tmp_path)
    args[args.index("ttft:800")] = "ttft:50"  # nothing meets it
    assert main(args) == 2
    assert "no measured concurrency meets the SLO" in capsys.readouterr().err
    args[args.index("ttft:50")] = "e2el:50"
    assert main(args) == 2
    assert "--slo metric must be one of" in capsys.readouterr().err
    args = _args(tmp_path)
    i = args.index("--time-to-ready-s")
    args[i:i + 2] = ["--startup-json", str(tmp_path / "missing.json")]
    assert main(args) == 2
    assert "--startup-json" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [
    ["--growth-rps", "1"],  # both growth flags
    ["--time-to-ready-s", "-1"],
    ["--min-replicas", "0"],
    ["--metric-delay-s", "inf"],
    ["--sim-signal", "cpu"],
])
def test_argparse_errors(tmp_path: Path, extra: list[str]) -> None:
    args = _args(tmp_path)
    if extra[0] == "--time-to-ready-s":
        args[args.index("--time-to-ready-s") + 1] = extra[1]
        extra = []
    with pytest.raises(SystemExit) as e:
        main([*args, *extra])
    assert e.value.code == 2


def test_growth_and_time_to_ready_are_required(tmp_path: Path) -> None:
    args = ["plan-autoscaling", str(_sweep(tmp_path, [STEPS])), "--slo", "ttft:800"]
    for missing in (["--growth-rps", "1"], ["--time-to-ready-s", "30"]):
        with pytest.raises(SystemExit) as e:
            main([*args, *missing])
        assert e.value.code == 2
