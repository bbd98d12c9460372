"""``jaxserve bench replay``: the real scheduler on a modelled machine. Exact times on a
declared machine without noise, determinism with it, the machine of a real engine's step
trace, and the SLO policy's goodput against first-come-first-served on a modelled load (the
policy does what it is for; figures of a real server are in docs/decisions/0041)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.bench import replay
from jaxserve.bench.arrivals import arrival_offsets
from jaxserve.bench.datasets import SampleRequest
from jaxserve.bench.profiles import default_burstiness
from jaxserve.bench.serve import build_workload
from jaxserve.cli.main import main
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.core.step_cost import StepCostModel, prefill_pairs

COST = StepCostModel(fixed_s=0.02, per_token_s=5.5e-4, per_row_s=5e-4,
                     per_context_token_s=2e-7, per_prefill_pair_s=2e-7)


def declared(ttft_s: float = 2.0, itl_s: float = 0.3, **engine: object) -> replay.Machine:
    return replay.declared_machine(COST, EngineConfig(max_model_len=4096, **engine), ttft_s,
                                   itl_s)


def test_a_lone_request_takes_the_modelled_step_times() -> None:
    """One 100-token prompt, 4 outputs, nothing else: the first token after the prompt's
    step (padded to the 128 bucket), each next one after a one-row decode step."""
    m = declared()
    results, steps = replay.simulate(m, [SampleRequest(list(range(100)), 100, 4)],
                                     np.zeros(1))
    (r,) = results
    assert r.success and r.output_tokens == 4
    assert r.ttft == pytest.approx(COST.predict(128, 0, 0, prefill_pairs(100, 0)))
    decode = [COST.predict(1, 1, 100 + i + 1) for i in range(3)]
    assert r.itl == pytest.approx(decode)
    assert steps["num_steps"] == 4 and steps["prefill_padding"] == pytest.approx(28 / 128)


def chat_load(n: int, rate: float, seed: int) -> tuple[list[SampleRequest], np.ndarray]:
    ns = argparse.Namespace(dataset_name="chat-like", num_prompts=n, seed=seed, tokenizer=None,
                            profile_max_len=1800, profile_system_prompt_len=256,
                            random_token_range=(0, 0))
    samples, _ = build_workload(ns, chat=False)
    return samples, arrival_offsets(n, rate, default_burstiness("chat-like"),
                                    np.random.default_rng(seed))


def test_replay_is_deterministic_with_noise() -> None:
    samples, offsets = chat_load(12, 1.0, 0)
    m = dataclasses.replace(declared(), residuals=(0.8, 1.0, 1.3))
    a, _ = replay.simulate(m, samples, offsets, seed=3)
    b, _ = replay.simulate(m, samples, offsets, seed=3)
    c, _ = replay.simulate(m, samples, offsets, seed=4)
    assert [(r.ttft, r.itl) for r in a] == [(r.ttft, r.itl) for r in b]
    assert [r.ttft for r in a] != [r.ttft for r in c]
    assert all(r.success and r.output_tokens == s.expected_output_len
               for r, s in zip(a, samples, strict=True))


def test_the_slo_policy_serves_more_requests_within_both_objectives_than_fcfs() -> None:
    """A chat-like load at half this machine's capacity: first come first served with no gap
    objective (vLLM's policy) stalls streams behind long prompts; the SLO policy keeps most
    requests within 2 s to the first token and 300 ms between tokens."""
    samples, offsets = chat_load(48, 0.5, 0)
    m = dataclasses.replace(declared(), residuals=tuple(np.exp(
        np.random.default_rng(1).normal(0, 0.15, 500))))
    fcfs = dataclasses.replace(m, scheduler=dataclasses.replace(
        m.scheduler, prefill_order="fcfs", ttft_slo_s=0.0, itl_slo_s=0.0))

    def good(machine: replay.Machine) -> float:
        results, _ = replay.simulate(machine, samples, offsets)
        return sum(r.ttft <= 2.0 and max(r.itl, default=0.0) <= 0.3 for r in results) / 48

    assert good(m) >= 0.8 and good(m) >= good(fcfs) + 0.4


def test_the_machine_of_an_engines_step_trace(tmp_path: Path) -> None:
    """A real (tiny) engine writes its settings and measured steps; the replay builds its
    machine from them: the engine's buckets and limits, a model fitted to its steps, the
    residuals, and flags that override the settings."""
    from jaxserve import SamplingParams
    from jaxserve.engine.llm_engine import LLMEngine

    trace = tmp_path / "steps.jsonl"
    eng = LLMEngine(EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                                 step_trace_file=str(trace)), LoadConfig("tiny", "dummy"))
    eng.warmup(progress=False)
    for i in range(3):
        eng.add_request(f"r{i}", list(range(1, 20 + 10 * i)),
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.reporter.close()
    m = replay.machine_from_trace(str(trace), {"max_num_seqs": 2, "itl_slo_s": 0.5})
    assert m.scheduler.token_buckets == eng.scheduler.token_buckets
    assert (m.scheduler.max_num_seqs, m.scheduler.itl_slo_s) == (2, 0.5)
    assert m.scheduler.max_num_batched_tokens == 64 and m.step_cost.per_token_s > 0
    assert len(m.residuals) >= 4 and all(r > 0 for r in m.residuals)
    with pytest.raises(ValueError, match="no config line"):
        (tmp_path / "bare.jsonl").write_text(trace.read_text().split("\n", 1)[1])
        replay.machine_from_trace(str(tmp_path / "bare.jsonl"))


def test_bench_replay_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "replay", "--cost-model", json.dumps(dataclasses.asdict(COST)),
                 "--dataset-name", "code-like", "--num-prompts", "8", "--request-rate", "0.5",
                 "--goodput", "ttft:2000", "itl:300", "--max-model-len", "4096",
                 "--profile-max-len", "1800", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["request_goodput"] is not None
    assert res["replay"]["num_steps"] > 8 and res["replay"]["scheduler"]["ttft_slo_s"] == 2.0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert main(["bench", "replay", "--dataset-name", "code-like"]) == 2  # no machine
    assert "--step-trace" in capsys.readouterr().err


@pytest.mark.parametrize(("cost_model", "match"), [
    ('{"fixed_s": 0.005,', "--cost-model: Expecting"),
    ("[1, 2]", "a JSON object of step costs.*not list"),
    ('{"fixed_s": 0.01, "per_tokn_s": 1e-4}', "unknown key.*per_tokn_s; the keys are fixed_s"),
    ('{"fixed_s": 0.01}', "per_token_s required"),
    ('{"fixed_s": -1, "per_token_s": 2e-5}', "fixed_s must be a number of seconds"),
    ('{"fixed_s": NaN, "per_token_s": 2e-5}', "fixed_s must be .* got nan"),
    ('{"fixed_s": "fast", "per_token_s": 2e-5}', "fixed_s must be .* got 'fast'"),
    ('{"fixed_s": 0.01, "per_token_s": true}', "per_token_s must be"),
    ('{"fixed_s": 1e300, "per_token_s": 2e-5}', r"in \[0, 3600\]"),
    ('{"fixed_s": 0, "per_token_s": 0}', "per_token_s must be > 0"),
])
def test_a_bad_declared_cost_model_names_the_key(cost_model: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replay.parse_cost_model(cost_model)


def test_bad_replay_flags_exit_2_with_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A directory as the trace, no prompts, a bad cost model: exit 2, the flag named, no
    traceback."""
    good = json.dumps(dataclasses.asdict(COST))
    for args, said in ((["--step-trace", str(tmp_path)], "--step-trace: Is a directory"),
                       (["--cost-model", good, "--num-prompts", "0"], "--num-prompts must be >= 1"),
                       (["--cost-model", '{"fixed_s": 0, "per_token_s": 0}'], "per_token_s")):
        assert main(["bench", "replay", "--dataset-name", "chat-like", *args]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    assert replay.parse_cost_model('{"fixed_s": 0, "per_token_s": 2e-5}') == StepCostModel(0.0, 2e-5)
