"""``jaxserve sweep`` (jaxserve/bench/sweep.py) and the batch-occupancy gauges it reads."""

from __future__ import annotations

from jaxserve.metrics import EngineMetrics


def test_batch_occupancy_gauges() -> None:
    m = EngineMetrics()
    m.record_batch(3, 100)  # before the limits are known the ratios read 0
    assert "jaxserve:batch_seqs_usage_perc 0.0" in m.render().decode().splitlines()
    m.set_batch_limits(max_num_seqs=8, max_num_batched_tokens=512)
    m.record_batch(6, 128)
    lines = m.render().decode().splitlines()
    for line in ("jaxserve:num_scheduled_seqs 6.0", "jaxserve:num_scheduled_tokens 128.0",
                 "jaxserve:max_num_seqs 8.0", "jaxserve:max_num_batched_tokens 512.0",
                 "jaxserve:batch_seqs_usage_perc 0.75", "jaxserve:batch_tokens_usage_perc 0.25"):
        assert line in lines, line
