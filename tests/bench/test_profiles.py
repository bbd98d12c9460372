"""Production-shaped workloads (jaxserve/bench/profiles.py): lengths against the trace statistics
they were fitted to, the bounds, the shared system prompt, and the default burstiness."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from jaxserve.bench.datasets import TextCorpus
from jaxserve.bench.profiles import (
    BOUNDED_MEDIANS,
    PROFILES,
    LengthFit,
    profile_dataset,
    profile_lengths,
)
from jaxserve.bench.serve import add_cli_args, arrival_burstiness
from jaxserve.cli.main import main
from jaxserve.server.routes import build_app
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app

# (prompt median, prompt p90, output median, output p90) of the Azure LLM inference trace 2023,
# computed from its CSV files (profiles.py's module doc).
TRACE = {"conversation": (1020, 2734.5, 129, 424), "code": (1469, 5187.6, 13, 55)}


@pytest.mark.parametrize(("name", "trace"), [("chat-like", "conversation"),
                                             ("code-like", "code"),
                                             ("mixed-system-prompt", "conversation")])
def test_unbounded_lengths_match_the_trace(name: str, trace: str) -> None:
    """With no effective bound, 200k draws have the trace's medians and 90th percentiles."""
    ins, outs = profile_lengths(PROFILES[name], 200_000, np.random.default_rng(0), 10**9)
    in_med, in_p90, out_med, out_p90 = TRACE[trace]
    assert np.median(ins) == pytest.approx(in_med, rel=0.01)
    assert np.percentile(ins, 90) == pytest.approx(in_p90, rel=0.02)
    assert np.median(outs) == pytest.approx(out_med, rel=0.02)
    assert np.percentile(outs, 90) == pytest.approx(out_p90, rel=0.03)


@pytest.mark.parametrize("name", list(PROFILES))
def test_bounded_lengths_respect_the_bound_and_documented_medians(name: str) -> None:
    budget = 2048 - (256 if PROFILES[name].shared_system_prompt else 0)
    ins, outs = profile_lengths(PROFILES[name], 200_000, np.random.default_rng(1), budget)
    assert len(ins) == len(outs) == 200_000
    assert ins.min() >= 1 and outs.min() >= 1 and (ins + outs).max() <= budget
    in_med, out_med = BOUNDED_MEDIANS[name]
    assert np.median(ins) == pytest.approx(in_med, rel=0.02)
    assert np.median(outs) == pytest.approx(out_med, rel=0.03)


def test_length_fit_and_refused_bound() -> None:
    fit = LengthFit(100, 300)
    assert fit.sigma == pytest.approx(np.log(3) / 1.2815515655446004)
    with pytest.raises(ValueError, match="--profile-max-len"):
        profile_lengths(PROFILES["code-like"], 10, np.random.default_rng(0), 40)


def test_mixed_profile_shares_one_system_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    corpus = TextCorpus(tokenizer.backend)
    reqs = profile_dataset("mixed-system-prompt", 40, seed=2, chat=False, corpus=corpus,
                           max_len=1024, system_prompt_len=64)
    head = reqs[0].prompt[:64]
    assert head == corpus.ids[:64].tolist()
    for r in reqs:
        assert r.prompt[:64] == head and len(r.prompt) == r.prompt_len
        assert r.prompt_len + r.expected_output_len <= 1024 and r.prompt_len > 64
    assert len({tuple(r.prompt[64:]) for r in reqs}) == 40  # the user turns differ
    chat = profile_dataset("mixed-system-prompt", 40, seed=2, chat=True, corpus=corpus,
                           max_len=1024, system_prompt_len=64)
    system = tokenizer.decode(head) + "\n\n"
    assert all(isinstance(r.prompt, str) and r.prompt.startswith(system) for r in chat)
    assert [r.prompt_len for r in chat] == [r.prompt_len for r in reqs]
    plain = profile_dataset("chat-like", 5, seed=2, chat=False, corpus=corpus, max_len=1024)
    assert all(len(r.prompt) == r.prompt_len for r in plain)
    with pytest.raises(ValueError, match="--profile-system-prompt-len"):
        profile_dataset("mixed-system-prompt", 1, 0, False, corpus, system_prompt_len=0)
    with pytest.raises(ValueError, match="--profile-max-len"):
        profile_dataset("mixed-system-prompt", 1, 0, False, corpus, max_len=256,
                        system_prompt_len=255)


def _ns(*args: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(args))


def test_default_burstiness_only_without_the_flag() -> None:
    assert arrival_burstiness(_ns("--dataset-name", "chat-like")) == 0.84
    assert arrival_burstiness(_ns("--dataset-name", "code-like")) == 0.2
    assert arrival_burstiness(_ns("--dataset-name", "mixed-system-prompt")) == 0.84
    assert arrival_burstiness(_ns("--dataset-name", "code-like", "--burstiness", "1")) == 1.0
    assert arrival_burstiness(_ns("--dataset-name", "chat-like", "--burstiness", "3")) == 3.0
    assert arrival_burstiness(_ns()) == 1.0  # random: Poisson, as vLLM
    assert arrival_burstiness(_ns("--dataset-name", "sharegpt-like")) == 1.0


def test_bench_serve_runs_a_profile_with_its_burstiness(tmp_path: Path) -> None:
    """--dataset-name code-like through the CLI against the fake engine: lengths within
    --profile-max-len, the profile's burstiness recorded, the tails in the result."""
    with serve_app(build_app(FakeEngine(max_model_len=1024, step_s=0.0005), "m")) as url:
        rc = main(["bench", "serve", "--base-url", url, "--disable-tqdm", "--save-result",
                   "--result-dir", str(tmp_path), "--result-filename", "out.json",
                   "--dataset-name", "code-like", "--profile-max-len", "1000",
                   "--num-prompts", "6", "--request-rate", "100", "--goodput", "itl:60000"])
    res = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0 and res["completed"] == 6 and res["burstiness"] == 0.2
    assert all(i + o <= 1000 for i, o in zip(res["input_lens"], res["output_lens"]))
    assert res["request_goodput"] == res["request_throughput"]
    assert res["largest_itl_ms"] >= res["p99_max_itl_ms"] > 0
    assert res["largest_itl_ms"] >= res["p99_itl_ms"] > 0
