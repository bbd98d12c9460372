"""The planner's arithmetic (jaxserve/autoscaling/plan.py) on synthetic curves, worked by
hand, and reading curves from sweep and bench serve results (curve.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jaxserve.autoscaling.curve import load_curve, slo_concurrency
from jaxserve.autoscaling.plan import PlanInputs, parse_slos, plan, tokens_per_request
from tests.autoscaling.curves import curve

# concurrency, req/s, p99 TTFT ms, p99 ITL ms
ROWS = [(1, 1.0, 100.0, 20.0), (2, 1.8, 150.0, 25.0), (4, 3.2, 300.0, 35.0),
        (8, 5.0, 600.0, 60.0), (16, 6.0, 1500.0, 120.0)]
MEDIANS = {"ttft": [50.0, 80.0, 200.0, 400.0, 900.0],
           "e2el": [800.0, 850.0, 1000.0, 1600.0, 2700.0]}
CURVE = curve(ROWS, MEDIANS, lens=(100.0, 40.0))


def inputs(**kw: object) -> PlanInputs:
    base: dict = {"slos_ms": {"ttft": 800.0}, "time_to_ready_s": 30.0,
                  "growth_concurrency_per_s": 0.02}
    return PlanInputs(**{**base, **kw})


def test_slo_limited_concurrency() -> None:
    assert slo_concurrency(CURVE, {"ttft": 800.0}) == 8  # 600 <= 800 < 1500
    assert slo_concurrency(CURVE, {"ttft": 800.0, "itl": 50.0}) == 4  # ITL 60 > 50 at 8
    assert slo_concurrency(CURVE, {"ttft": 600.0}) == 8  # at the target is within it
    assert slo_concurrency(CURVE, {"ttft": 99.0}) is None


def test_running_threshold_headroom_binds_at_slow_growth() -> None:
    # lag 30 + 15 + 15 = 60 s; trigger 8 - 0.02 * 60 = 6.8; target 8 * 0.75 = 6;
    # 6.8 / 1.1 = 6.18 > 6: the headroom binds
    p = plan(CURVE, inputs())
    s = p.signals["running"]
    assert (p.c_slo, p.lag_s, p.max_num_seqs) == (8, 60.0, 8)
    assert (s.capacity, s.early_trigger, s.target) == pytest.approx((8.0, 6.8, 6.0))
    assert s.threshold == 6.0 and s.binding == "headroom"


def test_running_threshold_early_trigger_binds_at_fast_growth() -> None:
    # trigger 8 - 0.05 * 60 = 5; 5 / 1.1 = 4.545..., floored to 4.54
    s = plan(CURVE, inputs(growth_concurrency_per_s=0.05)).signals["running"]
    assert s.early_trigger == pytest.approx(5.0)
    assert s.threshold == 4.54 and s.binding == "early trigger"


def test_growth_in_requests_per_second_goes_through_littles_law() -> None:
    # 8 in flight at 5 req/s: 1.6 s in the system; 0.1 req/s per s -> 0.16 in flight per s;
    # trigger 8 - 0.16 * 60 = -1.6: none; the least N with 8 - 0.16 / N * 60 > 0 is 2
    p = plan(CURVE, inputs(growth_concurrency_per_s=None, growth_rps_per_s=0.1))
    assert p.time_in_system_s == pytest.approx(1.6)
    assert p.concurrency_growth_per_s == pytest.approx(0.16)
    s = p.signals["running"]
    assert s.early_trigger == pytest.approx(-1.6) and s.threshold is None
    assert s.min_replicas_needed == 2 and "arrives after the SLO breaks" in s.note
    # at 2 replicas each carries half the growth: 8 - 0.08 * 60 = 3.2 -> 3.2 / 1.1 = 2.909
    s2 = plan(CURVE, inputs(growth_concurrency_per_s=None, growth_rps_per_s=0.1,
                            min_replicas=2)).signals["running"]
    assert s2.early_trigger == pytest.approx(3.2) and s2.threshold == 2.9


def test_waiting_signal() -> None:
    # max_num_seqs = c_slo = 8: a queue of (800 - 600) ms * 5 req/s = 1 request still meets TTFT;
    # trigger 1 - 0.02 * 60 < 0: scaling on waiting cannot be early enough here
    s = plan(CURVE, inputs()).signals["waiting"]
    assert s.capacity == pytest.approx(1.0) and s.early_trigger == pytest.approx(-0.2)
    assert s.threshold is None
    slow = plan(CURVE, inputs(growth_concurrency_per_s=0.005)).signals["waiting"]
    assert slow.early_trigger == pytest.approx(0.7)  # 1 - 0.3
    assert slow.threshold == 0.63 and slow.binding == "early trigger"  # 0.7 / 1.1 = 0.636
    # max_num_seqs 4 < c_slo: the queue forms at 4: (800 - 300) ms * 3.2 req/s = 1.6
    assert plan(CURVE, inputs(max_num_seqs=4)).signals["waiting"].capacity == pytest.approx(1.6)
    assert plan(CURVE, inputs(max_num_seqs=4)).signals["running"].capacity == 4
    assert "after the SLO broke" in plan(CURVE, inputs(max_num_seqs=16)).signals["waiting"].note
    assert "no TTFT SLO" in plan(CURVE, inputs(slos_ms={"itl": 70.0})).signals["waiting"].note


def test_tokens_signal_follows_the_load() -> None:
    # at 8: 40 / 2 + 100 * 400 / 1600 = 45 tokens per request: capacity 360
    assert tokens_per_request(CURVE, 8) == pytest.approx(45.0)
    s = plan(CURVE, inputs()).signals["tokens"]
    assert s.capacity == pytest.approx(360.0)
    # trigger at 6.8 in flight: TTFT 200 + 0.7 * 200 = 340, E2E 1000 + 0.7 * 600 = 1420
    tpr_68 = 20.0 + 100.0 * 340.0 / 1420.0
    assert s.early_trigger == pytest.approx(6.8 * tpr_68)
    # target at 6 in flight: TTFT 300, E2E 1300
    assert s.target == pytest.approx(6.0 * (20.0 + 100.0 * 300.0 / 1300.0))
    assert s.threshold == math.floor(min(s.target, s.early_trigger / 1.1) * 100) / 100
    fixed = plan(CURVE, inputs(tokens_per_request=50.0)).signals["tokens"]
    assert (fixed.capacity, fixed.early_trigger) == pytest.approx((400.0, 340.0))
    no_lens = plan(curve(ROWS, MEDIANS), inputs()).signals["tokens"]
    assert no_lens.threshold is None and "--tokens-per-request" in no_lens.note


def test_no_concurrency_meets_the_slo() -> None:
    with pytest.raises(ValueError, match="no measured concurrency meets the SLO.*ttft 100 ms"):
        plan(CURVE, inputs(slos_ms={"ttft": 50.0}))


@pytest.mark.parametrize(("kw", "match"), [
    ({"growth_rps_per_s": 0.1}, "exactly one of growth_rps_per_s"),
    ({"growth_concurrency_per_s": None}, "exactly one of growth_rps_per_s"),
    ({"growth_concurrency_per_s": -1.0}, "growth_concurrency_per_s must be > 0"),
    ({"time_to_ready_s": -1.0}, "time_to_ready_s must be >= 0"),
    ({"headroom": 1.0}, r"headroom must be in \[0, 1\)"),
    ({"min_replicas": 0}, "min_replicas must be >= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"tokens_per_request": 0.0}, "tokens_per_request must be > 0"),
    ({"slos_ms": {"e2e": 5.0}}, "--slo metric must be one of"),
])
def test_inconsistent_inputs_name_the_field(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        inputs(**kw)


def test_parse_slos() -> None:
    assert parse_slos(["ttft:500", "itl:50"]) == {"ttft": 500.0, "itl": 50.0}
    for bad, match in ((["ttft"], "METRIC:MS"), (["ttft:x"], "METRIC:MS"),
                       (["ttft:0"], "must be > 0"), (["ttft:1", "ttft:2"], "given twice"),
                       ([], "at least one")):
        with pytest.raises(ValueError, match=match):
            parse_slos(bad)


# -- reading the measurements ----------------------------------------------------------------------

def _step(c: int, x: float, ttft: float, itl: float, pkey: str = "99") -> dict:
    out = {"concurrency": c, "completed": 8, "request_throughput": x}
    for m, v in (("ttft", ttft), ("itl", itl), ("tpot", itl), ("e2el", 1000.0 * c / x)):
        out[f"median_{m}_ms"] = v / 2
        if m != "e2el":
            out[f"p{pkey}_{m}_ms"] = v
    out[f"p{pkey}_max_itl_ms"] = itl  # the largest gaps' tail, which the itl SLO judges
    out[f"p{pkey}_itl_ms"] = itl / 4  # pooled ITLs: read by no SLO
    return out


def _sweep(tmp_path: Path, configs: list[list[dict]], **args: object) -> Path:
    path = tmp_path / "sweep.json"
    a = {"percentile": 99.0, "dataset_name": "random", "random_input_len": 128,
         "random_output_len": 32, **args}
    path.write_text(json.dumps({"args": a, "configs": [{"config": {}, "steps": s}
                                                       for s in configs]}))
    return path


def test_load_sweep_picks_the_config_meeting_the_slo_highest(tmp_path: Path) -> None:
    a = [_step(1, 1.0, 100, 10), _step(2, 1.8, 200, 12), _step(4, 3.0, 900, 20)]
    b = [_step(1, 1.0, 100, 10), _step(2, 1.9, 150, 12), _step(4, 3.1, 400, 20)]
    path = _sweep(tmp_path, [a, b])
    c, k = load_curve(str(tmp_path), None, None, {"ttft": 500.0})  # the directory is enough
    assert k == 1 and c.concurrencies == [1, 2, 4] and c.percentile == 99.0
    assert (c.mean_input_len, c.mean_output_len) == (128.0, 32.0)
    assert c.tail_ms("ttft", 3) == pytest.approx(275.0)  # interpolated
    assert c.tail_ms("ttft", 8) == pytest.approx(800.0)  # past the last: in proportion
    assert c.throughput(8) == pytest.approx(3.1)  # saturated
    assert c.tail_ms("itl", 4) == 20.0  # the largest gaps', not the pooled ITLs' (5.0)
    c0, k0 = load_curve(str(path), None, 0, {"ttft": 500.0})
    assert k0 == 0 and c0.tail_ms("ttft", 4) == 900.0
    with pytest.raises(ValueError, match=r"--config-index must be in \[0, 1\]"):
        load_curve(str(path), None, 2)
    with pytest.raises(ValueError, match="'p95_ttft_ms' must be a number"):
        load_curve(str(path), 95.0)


def test_load_bench_serve_directory(tmp_path: Path) -> None:
    for c, x, ttft in ((1, 1.0, 100.0), (4, 3.0, 300.0)):
        r = {**_step(c, x, ttft, 20.0), "max_concurrency": c, "request_rate": "inf",
             "input_lens": [100, 120], "output_lens": [30, 0]}  # the second failed
        (tmp_path / f"openai-infqps-concurrency{c}.json").write_text(json.dumps(r))
    c, k = load_curve(str(tmp_path))
    assert k is None and c.concurrencies == [1.0, 4.0]
    assert (c.mean_input_len, c.mean_output_len) == (100.0, 30.0)
    (tmp_path / "open.json").write_text(json.dumps({**_step(2, 2.0, 1, 1), "max_concurrency": 2,
                                                   "request_rate": 4.0}))
    with pytest.raises(ValueError, match="open.json: not a closed-loop bench serve result"):
        load_curve(str(tmp_path))


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_curve(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="no sweep.json and no bench serve result"):
        load_curve(str(tmp_path))
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_curve(str(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text("{}")
    with pytest.raises(ValueError, match="not a jaxserve sweep result"):
        load_curve(str(tmp_path / "y.json"))
    bad = _sweep(tmp_path, [[_step(2, 1.0, 1, 1), _step(1, 1.0, 1, 1)]])
    with pytest.raises(ValueError, match="concurrencies must rise"):
        load_curve(str(bad))
