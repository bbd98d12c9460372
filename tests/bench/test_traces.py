"""Published traces (jaxserve/bench/traces.py): Mooncake-style JSONL with hash ids, the Azure LLM
inference trace's CSV, and a trace's shared prefixes hitting a real tiny server's prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from jaxserve.bench.datasets import TextCorpus
from jaxserve.bench.traces import read_trace
from jaxserve.cli.main import main
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.server.routes import build_app
from tests.conftest import REPO_ROOT
from tests.support.http_server import serve_app


@pytest.fixture(scope="module")
def corpus(tokenizer) -> TextCorpus:
    return TextCorpus(tokenizer.backend)


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_arrivals_prompts_and_errors(tmp_path: Path, tokenizer, corpus) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 2500, "input_length": 12, "output_length": 3}\n\n'
                 '{"timestamp": 1000, "prompt": "It is a truth", "output_length": 5}\n'
                 '{"timestamp": 1200, "input_length": 7, "output_length": 1}\n')
    reqs, times = read_trace(str(p), None, 0, chat=False, corpus=corpus)
    np.testing.assert_allclose(times, [0.0, 0.2, 1.5])  # timestamps in ms, sorted
    assert reqs[0].prompt == "It is a truth" and reqs[0].expected_output_len == 5
    assert reqs[0].prompt_len == len(tokenizer.encode("It is a truth", add_special_tokens=False))
    assert [(len(r.prompt), r.expected_output_len) for r in reqs[1:]] == [(7, 1), (12, 3)]
    first, t = read_trace(str(p), 2, 0, chat=False, corpus=corpus)
    assert len(first) == 2 and t.tolist() == pytest.approx([0.0, 0.2])
    for bad, field in (('{"arrival_time": 1, "output_length": 2}', "prompt"),
                       (('{"arrival_time": 1, "timestamp": 3, "input_length": 2, '
                         '"output_length": 2}'), "arrival_time"),
                       ('{"arrival_time": -1, "input_length": 2, "output_length": 2}',
                        "arrival_time"),
                       ('{"arrival_time": 0, "input_length": 2, "output_length": 0}',
                        "output_length"),
                       (('{"timestamp": 0, "input_length": 40, "output_length": 2, '
                         '"hash_ids": [1, "x"]}'), "hash_ids"),
                       (('{"timestamp": 0, "input_length": 16, "output_length": 2, '
                         '"hash_ids": [1, 2]}'), "more than input_length"),
                       ("[1]", "object"), ("{", "JSON")):
        p.write_text(bad + "\n")
        with pytest.raises(ValueError, match=field):
            read_trace(str(p), None, 0, chat=False, corpus=corpus, block_size=16)


def test_shared_hash_ids_are_shared_prefixes(tmp_path: Path, corpus) -> None:
    """As AIPerf's mooncake_trace: each hash id one block of tokens, the same in every request;
    exactly input_length tokens (the last block cut, or fresh tokens after the hash ids)."""
    path = jsonl(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [7, 8, 9]},
        {"timestamp": 10, "input_length": 50, "output_length": 2, "hash_ids": [7, 8]},
        {"timestamp": 20, "input_length": 48, "output_length": 2, "hash_ids": [5, 8, 9]},
        {"timestamp": 30, "input_length": 20, "output_length": 2},
    ])
    reqs, _ = read_trace(path, None, 3, chat=False, corpus=corpus, block_size=16)
    a, b, c, d = (r.prompt for r in reqs)
    assert [len(x) for x in (a, b, c, d)] == [40, 50, 48, 20]
    assert a[:32] == b[:32] and a[32:40] == c[32:40]  # ids 7, 8; id 9's block cut to 8 tokens
    assert a[16:32] == c[16:32] and a[:16] != c[:16] and b[32:] != c[32:48]
    again, _ = read_trace(path, None, 3, chat=False, corpus=corpus, block_size=16)
    assert [r.prompt for r in again] == [a, b, c, d]  # deterministic per seed
    chat, _ = read_trace(path, None, 3, chat=True, corpus=corpus, block_size=16)
    assert chat[0].prompt == corpus.tokenizer.decode(a)


def test_azure_csv_2023_and_2024(tmp_path: Path, corpus) -> None:
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,109\n"
                 "2023-11-16 18:15:47.0000000,879,20\n")
    reqs, times = read_trace(str(p), None, 0, chat=False, corpus=corpus)
    np.testing.assert_allclose(times, [0.0, 0.31941, 4.314579], atol=1e-6)
    assert [(len(r.prompt), r.expected_output_len) for r in reqs] == [(374, 44), (879, 20),
                                                                      (396, 109)]
    p.write_text("TIMESTAMP,ContextTokens\n2024-05-10 00:00:00.0,10\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        read_trace(str(p), None, 0, chat=False, corpus=corpus)
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,10,2\n")
    with pytest.raises(ValueError, match="line 2: TIMESTAMP"):
        read_trace(str(p), None, 0, chat=False, corpus=corpus)


def test_a_traces_shared_prefixes_hit_a_real_servers_prefix_cache(tmp_path: Path) -> None:
    """A Mooncake-style trace with 32-token hash blocks replayed by ``jaxserve bench serve``
    against the tiny model served over HTTP: each request finds exactly the prefix blocks an
    earlier one shares with it (its full 16-token blocks, the last token always computed)."""
    trace = jsonl(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 100, "output_length": 2, "hash_ids": [1, 2, 3]},
        {"timestamp": 600, "input_length": 100, "output_length": 2, "hash_ids": [1, 2, 4]},
        {"timestamp": 1200, "input_length": 100, "output_length": 2, "hash_ids": [1, 2, 3]},
        {"timestamp": 1800, "input_length": 100, "output_length": 2, "hash_ids": [9]},
    ])
    eng = LLMEngine(EngineConfig(max_model_len=256, num_kv_blocks=64, max_num_seqs=4,
                                 max_num_batched_tokens=128,
                                 compilation_cache_dir=str(REPO_ROOT / ".jax_cache")),
                    LoadConfig(model="tiny", load_format="dummy"), metrics=EngineMetrics("tiny"))
    aeng = AsyncEngine(eng)
    aeng.start(warmup=True, progress=False)
    try:
        with serve_app(build_app(aeng, "tiny")) as url:
            rc = main(["bench", "serve", "--base-url", url, "--model", "tiny", "--disable-tqdm",
                       "--dataset-name", "trace", "--dataset-path", trace,
                       "--trace-block-size", "32", "--num-warmups", "0", "--save-result",
                       "--result-dir", str(tmp_path), "--result-filename", "out.json"])
            metrics = httpx.get(url + "/metrics").text
    finally:
        aeng.shutdown()
    res = json.loads((tmp_path / "out.json").read_text())
    assert rc == 0 and res["completed"] == 4 and res["input_lens"] == [100] * 4

    def sample(name: str) -> float:
        line = next(x for x in metrics.splitlines() if x.startswith(f"jaxserve:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    # request 2 shares ids 1, 2 (64 tokens) with request 1; request 3 all of request 1's 96
    # full-block tokens (ids 1-3; the cap (100 - 1) // 16 = 6 blocks); request 4 nothing
    assert sample("prefix_cache_queries_total") == 400
    assert sample("prefix_cache_hits_total") == 64 + 96
