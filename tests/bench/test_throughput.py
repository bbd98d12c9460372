"""``jaxserve bench throughput`` and the static-batching baseline (jaxserve/bench/static_batch.py)
on the real SmolLM2 engine (the shared session fixture) and, for the command, a tiny dummy model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.bench.static_batch import StaticBatchEngine, StaticRequest
from jaxserve.bench.throughput import run_continuous
from jaxserve.cli.main import main


def test_static_batching_matches_continuous_and_counts_waste(engine) -> None:  # type: ignore[no-untyped-def]
    """Greedy: the padded static batch generates exactly what continuous batching does, its
    token accounting is the hand count, and every block comes back."""
    rng = np.random.default_rng(5)
    lens = [(200, 3), (37, 6), (150, 1), (9, 4), (181, 2)]  # (prompt, output)
    reqs = [StaticRequest(rng.integers(1000, 20000, size=p).tolist(), n, 0.0, i)
            for i, (p, n) in enumerate(lens)]
    free = engine.scheduler.block_pool.num_free_blocks
    st = StaticBatchEngine(engine).run(reqs)
    assert engine.scheduler.block_pool.num_free_blocks == free
    _, cont = run_continuous(engine, reqs)
    assert st.outputs == cont
    assert [len(o) for o in st.outputs] == [n for _, n in lens]
    # one batch (max_num_seqs 64): L = 200, M = 6
    assert st.num_batches == 1
    assert st.prefill_slots == 5 * 200
    assert st.prefill_padding == 5 * 200 - (200 + 37 + 150 + 9 + 181)
    assert st.decode_slots == 5 * 5 and st.num_decode_steps == 5
    assert st.decode_idle == 5 * 5 - (2 + 5 + 0 + 3 + 1)
    assert st.num_prefill_steps == 2  # 1000 padded tokens over a 512-token step budget


def test_static_batching_rejects_what_it_cannot_hold(engine) -> None:  # type: ignore[no-untyped-def]
    too_big = [StaticRequest([1000] * 400, 500)] * 8  # 8 rows x 57 blocks > 159 usable
    with pytest.raises(ValueError, match="reserves"):
        StaticBatchEngine(engine).run(too_big)
    with pytest.raises(ValueError, match="max_model_len"):
        StaticBatchEngine(engine).run([StaticRequest([1000] * 1000, 100)])
    with pytest.raises(ValueError, match="num_output_tokens"):
        StaticBatchEngine(engine).run([StaticRequest([1000], 0)])
    assert engine.scheduler.block_pool.num_free_blocks == engine.num_blocks - 1


def test_bench_throughput_command(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", "tiny", "--load-format", "dummy",
               "--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "12",
               "--random-output-len", "5", "--random-range-ratio", "0.5", "--max-num-seqs", "4",
               "--max-num-batched-tokens", "32", "--max-model-len", "64",
               "--num-kv-blocks", "64", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    c, s = res["continuous"], res["static"]
    assert c["total_output_tokens"] == s["total_output_tokens"] == res["total_output_tokens"]
    assert c["output_tokens_per_second"] == pytest.approx(
        res["total_output_tokens"] / c["elapsed_time"])
    assert s["num_batches"] == 2  # 6 requests in batches of 4
    assert s["prefill_padding_tokens"] > 0 and s["decode_idle_slots"] > 0
    assert 0 < s["padding_s"] < s["prefill_s"] and 0 < s["idle_slots_s"] < s["decode_s"]
    assert res["speedup_output_tokens_per_second"] == pytest.approx(
        c["output_tokens_per_second"] / s["output_tokens_per_second"])
    assert main(["bench", "throughput", "--model", "tiny", "--load-format", "dummy",
                 "--dataset-name", "trace", "--dataset-path", str(out)]) == 2
