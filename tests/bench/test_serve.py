"""``jaxserve bench serve`` (jaxserve/bench/): metrics against hand-computed values, arrival
statistics, workloads, and end-to-end runs of ``jaxserve.cli.main.main`` over real HTTP against the
fake engine (tests/support/fake_engine.py; one character per token, so lengths are exact and fast).

Expected values in the metric tests are worked out by hand in the comments (times in s, metrics
in ms, ``numpy.percentile``'s linear interpolation: p of sorted x at index ``p/100 * (n-1)``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from jaxserve.bench.arrivals import arrival_offsets, inter_arrival_times, paced
from jaxserve.bench.client import build_payload, first_model, server_root
from jaxserve.bench.datasets import (
    CORPUS_PATH,
    SHAREGPT_MEAN_INPUT_LEN,
    SHAREGPT_MEAN_OUTPUT_LEN,
    WORDS,
    SampleRequest,
    TextCorpus,
    prefix_dataset,
    random_dataset,
    sample_lengths,
    sharegpt_like_dataset,
    sharegpt_like_lengths,
)
from jaxserve.bench.metrics import (
    RequestResult,
    build_result,
    calculate_metrics,
    format_table,
    parse_goodput,
    with_tails,
)
from jaxserve.bench.serve import result_path
from jaxserve.cli.main import main
from jaxserve.server.routes import build_app
from tests.support.fake_engine import FakeEngine
from tests.support.http_server import serve_app

# -- metrics --------------------------------------------------------------------------------------

# A: 4 tokens, TPOT (0.2 - 0.1) / 3 = 1/30. B: one token, no TPOT (0 for goodput).
# C: failed. D: 3 tokens, TPOT (0.25 - 0.05) / 2 = 0.1.
TIMELINES = [
    RequestResult(True, 10, 4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
    RequestResult(True, 20, 1, ttft=0.3, itl=[], latency=0.3),
    RequestResult(False, 5, 0, error="HTTP 500: boom"),
    RequestResult(True, 30, 3, ttft=0.05, itl=[0.1, 0.05], latency=0.25),
]


def test_metrics_hand_computed() -> None:
    m, output_lens = calculate_metrics(TIMELINES, duration=2.0, percentiles=[90, 99])
    assert output_lens == [4, 1, 0, 3]
    assert (m["completed"], m["failed"], m["total_input"], m["total_output"]) == (3, 1, 60, 8)
    assert m["request_throughput"] == pytest.approx(1.5)  # 3 / 2
    assert m["output_throughput"] == pytest.approx(4.0)  # 8 / 2
    assert m["total_token_throughput"] == pytest.approx(34.0)  # (60 + 8) / 2
    assert m["request_goodput"] is None
    # TTFT [0.1, 0.3, 0.05]: mean 0.15, median 0.1, std sqrt(0.035 / 3);
    # sorted [0.05, 0.1, 0.3]: p90 at index 1.8 -> 0.1 + 0.8 * 0.2 = 0.26, p99 at 1.98 -> 0.296.
    t = m["ttft"]
    assert t["mean"] == pytest.approx(150.0)
    assert t["median"] == pytest.approx(100.0)
    assert t["std"] == pytest.approx(math.sqrt(0.035 / 3) * 1000)
    assert t["percentiles"] == [(90, pytest.approx(260.0)), (99, pytest.approx(296.0))]
    # TPOT only over A and D: [1/30, 0.1]; p99 = 1/30 + 0.99 * (0.1 - 1/30).
    p = m["tpot"]
    assert p["mean"] == pytest.approx((1 / 30 + 0.1) / 2 * 1000)
    assert p["percentiles"][1][1] == pytest.approx((1 / 30 + 0.99 * (0.1 - 1 / 30)) * 1000)
    # ITLs pooled: [0.02, 0.03, 0.05, 0.1, 0.05] -> mean 0.05, median 0.05,
    # sorted [.02, .03, .05, .05, .1]: p99 at index 3.96 -> 0.05 + 0.96 * 0.05 = 0.098.
    i = m["itl"]
    assert (i["mean"], i["median"]) == (pytest.approx(50.0), pytest.approx(50.0))
    assert i["percentiles"][1][1] == pytest.approx(98.0)
    # E2EL [0.2, 0.3, 0.25]
    assert (m["e2el"]["mean"], m["e2el"]["median"]) == (pytest.approx(250.0), pytest.approx(250.0))


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 150, "tpot": 50}, 1),  # A only (B: ttft 0.3; D: tpot 0.1)
        ({"tpot": 50}, 2),  # A and B (B's TPOT counts 0)
        ({"e2el": 250}, 2),  # A and D (0.25 <= 0.25 meets it)
        ({"ttft": 10}, 0),
        # itl: each request's largest gap, A 0.05, B none (met), D 0.1
        ({"itl": 50}, 2),  # A (0.05 <= 0.05) and B
        ({"itl": 49}, 1),  # B only
        ({"itl": 100}, 3),
        ({"ttft": 150, "itl": 50}, 1),  # A (B breaks TTFT)
    ],
)
def test_goodput(slos: dict[str, float], good: int) -> None:
    m, _ = calculate_metrics(TIMELINES, 2.0, [99], slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_largest_gap_per_request() -> None:
    """max_itl: A's largest gap 0.05, D's 0.1 (B has none, C failed): mean 75 ms, median 75,
    p99 at index 0.99 -> 0.05 + 0.99 * 0.05 = 0.0995; the run's largest 100 ms."""
    m, _ = calculate_metrics(TIMELINES, 2.0, [50, 99])
    x = m["max_itl"]
    assert (x["mean"], x["median"]) == (pytest.approx(75.0), pytest.approx(75.0))
    assert x["percentiles"] == [(50, pytest.approx(75.0)), (99, pytest.approx(99.5))]
    assert m["largest_itl"] == pytest.approx(100.0)
    sel, pcts = with_tails(["tpot"], [50])
    res = build_result(TIMELINES, 2.0, pcts, sel)
    assert res["p99_max_itl_ms"] == pytest.approx(99.5) and res["largest_itl_ms"] == 100.0
    assert res["p99_ttft_ms"] == pytest.approx(296.0) and res["p99_itl_ms"] == pytest.approx(98.0)
    table = format_table(res, sel, pcts, None, float("inf"))
    for label in ("Mean TTFT (ms):", "P99 TTFT (ms):", "Mean ITL (ms):", "P99 ITL (ms):",
                  "Mean Max ITL (ms):", "P99 Max ITL (ms):", "Largest ITL (ms):",
                  "P50 TPOT (ms):"):
        assert label in table, label
    assert "E2EL" not in table
    assert with_tails(["e2el", "ttft"], [90.0, 50.0]) == (
        ["ttft", "itl", "max_itl", "e2el"], [50.0, 90.0, 99.0])


def test_result_keys_and_table() -> None:
    res = build_result(TIMELINES, 2.0, [50, 99.9], ["ttft", "tpot", "itl", "e2el"], {"ttft": 150})
    for m in ("ttft", "tpot", "itl", "e2el"):
        for k in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{k}_{m}_ms" in res
    assert res["request_goodput"] == pytest.approx(1.0)  # A and D meet ttft <= 0.15: 2 / 2 s
    assert res["input_lens"] == [10, 20, 5, 30]
    assert res["output_lens"] == [4, 1, 0, 3]
    assert res["itls"][0] == [0.02, 0.03, 0.05]
    assert res["errors"] == ["", "", "HTTP 500: boom", ""]
    table = format_table(res, ["ttft", "itl"], [50, 99.9], 4, 2.0)
    assert "Successful requests:                     3" in table
    assert "P99.9 TTFT (ms):" in table and "TPOT" not in table
    assert "Request goodput (req/s):" in table and "Maximum request concurrency:" in table


def test_all_failed_counts_zero() -> None:
    res = build_result([RequestResult(error="x")] * 3, 1.0, [99], ["ttft", "tpot"])
    assert (res["completed"], res["failed"], res["output_throughput"]) == (0, 3, 0.0)
    assert res["mean_ttft_ms"] == 0.0 and res["p99_tpot_ms"] == 0.0


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2e3"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    assert parse_goodput(["itl:200"]) == {"itl": 200.0}
    for bad, says in ((["max_itl:5"], "must be one of"), (["ttft"], "METRIC:MS"),
                      (["ttft:x"], "METRIC:MS"), (["ttft:-1"], "must be > 0"),
                      (["ttft:0"], "must be > 0"), (["ttft:inf"], "METRIC:MS"),
                      (["itl:nan"], "METRIC:MS"),
                      (["ttft:500", "ttft:900"], "ttft given twice")):
        with pytest.raises(ValueError, match=says):
            parse_goodput(bad)


def test_base_url_is_the_servers_root() -> None:
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert server_root(url) == "http://h:8000"
    assert server_root("https://x.example/proxy/v1") == "https://x.example/proxy"
    for bad in ("h:8000", "localhost", "ftp://h/", "http:///v1"):
        with pytest.raises(ValueError, match="--base-url"):
            server_root(bad)


def test_first_model_names_what_a_foreign_endpoint_answered() -> None:
    import httpx

    def answer(status: int, body: str, ctype: str):
        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(status, text=body, headers={"content-type": ctype})
        return httpx.AsyncClient(transport=httpx.MockTransport(handler))

    async def ask(client) -> str:  # type: ignore[no-untyped-def]
        async with client:
            return await first_model(client, "http://h")

    page = "<!DOCTYPE html><html><body><h1>404 Not Found</h1>" + "x" * 2000 + "</body></html>"
    with pytest.raises(ValueError, match="HTTP 404: an HTML page") as e:
        asyncio.run(ask(answer(404, page, "text/html")))
    assert "<" not in str(e.value)
    with pytest.raises(ValueError, match="HTTP 401: .*bad key"):
        asyncio.run(ask(answer(401, '{"error": "bad key"}', "application/json")))
    with pytest.raises(ValueError, match="did not answer a model list: an HTML page"):
        asyncio.run(ask(answer(200, page, "text/html")))
    assert asyncio.run(ask(answer(200, '{"data": [{"id": "m"}]}', "application/json"))) == "m"


# -- arrivals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_gap_statistics(burstiness: float) -> None:
    """Gamma(shape b, scale 1/(rate b)) gaps: mean 1/rate, variance 1/(rate^2 b)."""
    rate, n = 10.0, 200_000
    gaps = inter_arrival_times(n, rate, burstiness, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.05)


def test_poisson_counts() -> None:
    """Burstiness 1: arrivals per 1 s window are Poisson(rate): mean = variance = rate."""
    rate = 20.0
    t = arrival_offsets(100_000, rate, 1.0, np.random.default_rng(1), normalize=False)
    counts = np.bincount(t.astype(int))[:-1]  # drop the last, partial window
    assert counts.mean() == pytest.approx(rate, rel=0.02)
    assert counts.var() == pytest.approx(rate, rel=0.1)


def test_offsets_normalized_and_special_rates() -> None:
    t = arrival_offsets(50, 5.0, 0.5, np.random.default_rng(2))
    assert t[-1] == pytest.approx(10.0) and np.all(np.diff(t) >= 0)
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))
    np.testing.assert_allclose(arrival_offsets(4, 2.0, math.inf, np.random.default_rng(0)),
                               [0.5, 1.0, 1.5, 2.0])
    a = arrival_offsets(10, 3.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(a, arrival_offsets(10, 3.0, 1.0, np.random.default_rng(7)))
    with pytest.raises(ValueError):
        inter_arrival_times(3, 0.0, 1.0, np.random.default_rng(0))


def test_paced_waits_for_offsets() -> None:
    async def go() -> list[float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        return [loop.time() - t0 async for _ in paced(np.array([0.0, 0.05, 0.1]))]

    got = asyncio.run(go())
    assert got[1] >= 0.045 and got[2] >= 0.095


# -- workloads -----------------------------------------------------------------------------------


def test_random_dataset() -> None:
    reqs = random_dataset(500, 100, 20, 0.5, seed=3, chat=False, token_range=(1000, 2000))
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and min(outs) >= 10 and max(outs) <= 30
    assert np.mean(ins) == pytest.approx(100, rel=0.05)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(1000 <= t < 2000 for r in reqs for t in r.prompt)
    assert reqs == random_dataset(500, 100, 20, 0.5, seed=3, chat=False, token_range=(1000, 2000))
    fixed = random_dataset(5, 7, 3, 0.0, seed=0, chat=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 7 for r in fixed)
    assert all(w in WORDS for w in fixed[0].prompt.split())
    assert {r.expected_output_len for r in fixed} == {3}
    with pytest.raises(ValueError):
        random_dataset(5, 7, 3, 1.0, seed=0, chat=False)


def test_prefix_dataset() -> None:
    reqs = prefix_dataset(12, prefix_len=8, suffix_len=4, num_prefixes=3, output_len=5, seed=0,
                          chat=False)
    heads = [tuple(r.prompt[:8]) for r in reqs]
    assert len(set(heads)) == 3 and all(heads.count(h) == 4 for h in set(heads))
    assert all(r.prompt_len == 12 and r.expected_output_len == 5 for r in reqs)
    assert len({tuple(r.prompt) for r in reqs}) == 12


def test_build_payload() -> None:
    s = SampleRequest([5, 6], 2, 7)
    body = build_payload(s, "m", chat=False, ignore_eos=True, extra={"temperature": 0.0})
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    chat = build_payload(SampleRequest("a b", 2, 3), "m", chat=True, ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "a b"}]
    assert chat["max_completion_tokens"] == 3 and "ignore_eos" not in chat


def test_result_path(tmp_path: Path) -> None:
    ns = argparse.Namespace(max_concurrency=8, label=None, result_filename=None,
                            result_dir=str(tmp_path / "r"), request_rate=4.0)
    p = result_path(ns, {"backend": "openai", "date": "20250101-000000"}, "org/m")
    assert p == str(tmp_path / "r" / "openai-4.0qps-concurrency8-m-20250101-000000.json")
    assert (tmp_path / "r").is_dir()


# -- end to end over HTTP against the fake engine ------------------------------------------------


class CountingEngine(FakeEngine):
    """FakeEngine that records the most requests in flight at once (from the start of
    ``generate`` to the yield of the finished output, which precedes the client seeing it)."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.in_flight = 0
        self.peak = 0

    async def generate(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        done = False
        try:
            async for out in super().generate(*args, **kwargs):
                if out.finished and not done:
                    done, self.in_flight = True, self.in_flight - 1
                yield out
        finally:
            if not done:
                self.in_flight -= 1


def _bench(base_url: str, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    rc = main(["bench", "serve", "--base-url", base_url, "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "out.json", *extra])
    return rc, json.loads((tmp_path / "out.json").read_text())


def test_end_to_end_completions(tmp_path: Path) -> None:
    eng = CountingEngine(max_model_len=256, step_s=0.002)
    with serve_app(build_app(eng, "m")) as url:
        rc, res = _bench(url, tmp_path, "--num-prompts", "20", "--random-input-len", "16",
                         "--random-output-len", "8", "--random-range-ratio", "0.5",
                         "--request-rate", "200", "--max-concurrency", "4", "--num-warmups", "2",
                         "--goodput", "ttft:5000", "tpot:5000", "--seed", "1")
    assert rc == 0
    expect = random_dataset(20, 16, 8, 0.5, seed=1, chat=False)
    assert res["model_id"] == "m" and res["completed"] == 20 and res["failed"] == 0
    assert res["input_lens"] == [r.prompt_len for r in expect]
    assert res["output_lens"] == [r.expected_output_len for r in expect]  # ignore_eos: exact
    assert res["total_output_tokens"] == sum(res["output_lens"])
    assert res["total_input_tokens"] == sum(res["input_lens"])
    assert [len(x) for x in res["itls"]] == [n - 1 for n in res["output_lens"]]
    assert all(0 < t <= lat for t, lat in zip(res["ttfts"], res["latencies"]))
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / res["duration"])
    for k in ("duration", "request_throughput", "total_token_throughput", "mean_ttft_ms",
              "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
              "p99_e2el_ms", "generated_texts", "errors", "max_concurrency", "request_rate"):
        assert k in res, k
    assert len(eng.requests) == 22  # 2 warm-ups, not in the figures
    assert sum(rid.startswith("cmpl-bench-warmup-") for rid in eng.requests) == 2
    assert eng.peak <= 4


def test_concurrency_cap_never_exceeded(tmp_path: Path) -> None:
    eng = CountingEngine(max_model_len=128, step_s=0.01)
    with serve_app(build_app(eng, "m")) as url:
        rc, res = _bench(url, tmp_path, "--num-prompts", "16", "--random-input-len", "4",
                         "--random-output-len", "6", "--max-concurrency", "3")
    assert rc == 0 and res["completed"] == 16
    assert eng.peak == 3  # the cap binds (inf rate) and is never exceeded at the server
    # nor at the client: sweep over [start, start + latency) intervals
    events = sorted([(s, 1) for s in res["start_times"]]
                    + [(s + lat, -1) for s, lat in zip(res["start_times"], res["latencies"])],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 3


def test_end_to_end_chat_counts_only_content_chunks(tmp_path: Path) -> None:
    eng = FakeEngine(max_model_len=256)
    with serve_app(build_app(eng, "m")) as url:
        rc, res = _bench(url, tmp_path, "--endpoint", "/v1/chat/completions",
                         "--num-prompts", "5", "--random-input-len", "6",
                         "--random-output-len", "4", "--percentile-metrics", "ttft,itl")
    assert rc == 0 and res["completed"] == 5 and res["output_lens"] == [4] * 5
    # the role chunk and the empty finish chunk are not tokens: 4 content chunks -> 3 gaps
    assert [len(x) for x in res["itls"]] == [3] * 5
    # prompt lengths from usage: the fake template "<|user|>TEXT\n<|assistant|>", one token a char
    texts = [r.prompt for r in random_dataset(5, 6, 4, 0.0, seed=0, chat=True)]
    assert res["input_lens"] == [len(f"<|user|>{t}\n<|assistant|>") for t in texts]
    assert "p99_ttft_ms" in res and "mean_tpot_ms" not in res


def test_failures_are_recorded(tmp_path: Path) -> None:
    with serve_app(build_app(FakeEngine(max_model_len=10), "m")) as url:
        rc, res = _bench(url, tmp_path, "--num-prompts", "3", "--random-input-len", "16",
                         "--random-output-len", "4")
    assert rc == 1 and res["failed"] == 3 and res["output_lens"] == [0, 0, 0]
    assert all(e.startswith("HTTP 400") for e in res["errors"])
    with serve_app(build_app(FakeEngine(max_model_len=64, fail_after=2), "m")) as url:
        rc, res = _bench(url, tmp_path, "--num-prompts", "2", "--random-input-len", "4",
                         "--random-output-len", "8")
    assert rc == 1 and res["failed"] == 2
    assert all("stream error" in e and "simulated engine fault" in e for e in res["errors"])


def test_bad_flags_exit_2(tmp_path: Path) -> None:
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--goodput", "itl:5"]) == 2
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
                 "--max-concurrency", "0"]) == 2


# -- length distributions, sharegpt-like, trace -------------------------------------------------


@pytest.mark.parametrize(("dist", "ratio", "std"), [
    ("normal", 0.3, 30.0),  # std r * len
    ("lognormal", 0.5, 50.0),  # coefficient of variation r: std r * mean
])
def test_length_distributions(dist: str, ratio: float, std: float) -> None:
    lens = sample_lengths(np.random.default_rng(0), 100_000, 100, dist, ratio)
    assert lens.dtype == np.int64 and lens.min() >= 1
    assert lens.mean() == pytest.approx(100, rel=0.01)
    assert lens.std() == pytest.approx(std, rel=0.03)


def test_length_distribution_edges() -> None:
    rng = np.random.default_rng(0)
    assert set(sample_lengths(rng, 50, 7, "fixed", 0.0).tolist()) == {7}
    u = sample_lengths(rng, 10_000, 10, "uniform", 0.5)
    assert (u.min(), u.max()) == (5, 15)
    assert sample_lengths(rng, 1000, 2, "normal", 5.0).min() == 1  # clipped at the minimum
    for dist, ratio in (("fixed", 0.1), ("uniform", 1.0), ("normal", -0.1), ("zipf", 0.0)):
        with pytest.raises(ValueError):
            sample_lengths(rng, 3, 10, dist, ratio)
    reqs = random_dataset(200, 50, 20, 0.4, seed=1, chat=False, distribution="lognormal")
    assert all(len(r.prompt) == r.prompt_len >= 1 for r in reqs)


def test_sharegpt_like_lengths_match_published_means() -> None:
    ins, outs = sharegpt_like_lengths(100_000, np.random.default_rng(0))
    assert ins.mean() == pytest.approx(SHAREGPT_MEAN_INPUT_LEN, rel=0.02)
    assert outs.mean() == pytest.approx(SHAREGPT_MEAN_OUTPUT_LEN, rel=0.02)
    assert ins.min() >= 4 and outs.min() >= 4 and ins.max() <= 1024
    assert (ins + outs).max() <= 2048


def test_sharegpt_like_prompts_are_real_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    corpus = TextCorpus(tokenizer.backend)
    reqs = sharegpt_like_dataset(20, seed=3, chat=False, corpus=corpus)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    text = tokenizer.decode(reqs[0].prompt)
    with open(CORPUS_PATH, encoding="utf-8") as fh:
        book = fh.read()
    assert text[5:-5] in book  # a window of the book (ends may be cut mid-token)
    chat = sharegpt_like_dataset(20, seed=3, chat=True, corpus=corpus)
    assert [r.prompt_len for r in chat] == [r.prompt_len for r in reqs]
    assert chat[0].prompt == text


def test_trace_end_to_end_keeps_arrival_times(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": t, "input_length": 5,
                                         "output_length": 3}) + "\n" for t in (0.0, 0.3, 0.6)))
    with serve_app(build_app(FakeEngine(max_model_len=256), "m")) as url:
        rc, res = _bench(url, tmp_path, "--dataset-name", "trace", "--dataset-path", str(trace))
        assert main(["bench", "serve", "--base-url", url, "--dataset-name", "trace",
                     "--dataset-path", str(trace), "--request-rate", "2"]) == 2
    assert rc == 0 and res["completed"] == 3 and res["output_lens"] == [3, 3, 3]
    assert res["input_lens"] == [5, 5, 5]
    assert res["start_times"][1] >= 0.29 and res["start_times"][2] >= 0.59


def test_server_pid_reports_the_server_process_tree_cpu(tmp_path: Path) -> None:
    """--server-pid: the in-process fake server is this process, so its CPU time is ours."""
    import os

    from jaxserve.bench.serve import process_tree_cpu_s

    eng = CountingEngine(max_model_len=128, step_s=0.001)
    with serve_app(build_app(eng, "m")) as url:
        before = process_tree_cpu_s(os.getpid())
        rc, res = _bench(url, tmp_path, "--num-prompts", "8", "--random-input-len", "4",
                         "--random-output-len", "6", "--server-pid", str(os.getpid()))
        after = process_tree_cpu_s(os.getpid())
    assert rc == 0
    assert 0 < res["server_cpu_s"] <= after - before
    assert res["server_cpu_s_per_output_token"] == pytest.approx(
        res["server_cpu_s"] / res["total_output_tokens"])
    with pytest.raises(ValueError, match="no such process"):
        process_tree_cpu_s(2 ** 22 + 12345)
