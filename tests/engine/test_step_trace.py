"""--step-trace: one line per step whose phases add up, and the per-bucket summary."""

from __future__ import annotations

import json

import pytest

from jaxserve.cli.main import main
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.step_trace import PHASES, read, summarize
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT


def test_each_step_writes_a_line_whose_phases_add_up(tmp_path, capsys) -> None:
    path = tmp_path / "steps.jsonl"
    eng = LLMEngine(EngineConfig(max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                                 max_num_batched_tokens=32, step_trace_file=str(path),
                                 compilation_cache_dir=str(REPO_ROOT / ".jax_cache")),
                    LoadConfig(model="tiny", load_format="dummy"))
    eng.warmup(progress=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    for i, n in enumerate((40, 5, 7)):  # the first prompt takes two 32-token chunks
        eng.add_request(f"r{i}", list(range(1, n + 1)), params)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    recs = read(str(path))
    assert len(recs) == steps
    for r in recs:
        assert all(r[p] >= 0 for p in PHASES)
        assert sum(r[p] for p in PHASES) == pytest.approx(r["step_ms"], rel=1e-6, abs=1e-6)
        assert r["num_tokens"] <= r["bucket_tokens"] and r["num_seqs"] <= r["bucket_seqs"]
    assert recs[0]["num_prompt_tokens"] == 32  # the budget, filled by prompts
    assert sum(r["num_prompt_tokens"] for r in recs) == 40 + 5 + 7
    # every token computed: the prompts, then 3 more per request (its first comes with prefill)
    assert sum(r["num_tokens"] for r in recs) == 52 + 3 * 3
    s = summarize(recs)
    assert s["num_steps"] == steps
    assert sum(b["steps"] for b in s["buckets"].values()) == steps
    assert sum(b["share"] for b in s["buckets"].values()) == pytest.approx(1.0)

    assert s["num_async_steps"] > 0  # the default loop
    assert s["host_gap_s"] >= 0 and all("host_gap_ms" in r for r in recs[1:-1])

    out = tmp_path / "summary.json"
    assert main(["bench", "step-trace", str(path), "--output-json", str(out)]) == 0
    assert f"{steps} steps over" in capsys.readouterr().out
    assert json.loads(out.read_text())["num_steps"] == steps


def test_a_file_that_is_not_a_trace_is_refused(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a step record"):
        read(str(bad))
    assert main(["bench", "step-trace", str(bad)]) == 2
    assert "not a step record" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["bench", "step-trace", str(empty)]) == 2
