"""``jaxserve eval``: windows, perplexity against a direct computation, the report's keys, the
comparison of a configuration with itself and with another dtype, bad inputs, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.eval import inputs as eval_inputs
from jaxserve.eval import quality as ev
from jaxserve.eval import scoring

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY = LoadConfig("tiny", "dummy")
# small buckets and cache: a 48-token window and a 64-token step budget make the engine chunk
# windows across steps (chunked prefill reads the earlier chunk back from the paged cache)
CONFIG = EngineConfig(dtype="float32", max_model_len=128, num_kv_blocks=48, max_num_seqs=4,
                      max_num_batched_tokens=64,
                      compilation_cache_dir=str(REPO_ROOT / ".jax_cache"))
NUM_TOKENS, WINDOW, STRIDE = 150, 48, 20
NUM_PROMPTS, GREEDY_TOKENS = 6, 6


def test_windows_score_every_token_once_with_context() -> None:
    assert scoring.eval_windows(10, 4, 2) == [(0, 1, 4), (2, 4, 6), (4, 6, 8), (6, 8, 10)]
    assert scoring.eval_windows(3, 8, 4) == [(0, 1, 3)]  # shorter than one window
    for n in range(2, 60):
        for window in (2, 3, 7, 16):
            for stride in {1, window // 2 or 1, window - 1}:
                wins = scoring.eval_windows(n, window, stride)
                scored = [q for _, f, e in wins for q in range(f, e)]
                assert scored == list(range(1, n))
                for k, (s, f, e) in enumerate(wins):
                    assert 0 <= s < f <= e <= n and e - s <= window
                    if k:
                        assert f - s >= min(window - stride, f)


def test_window_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        scoring.eval_windows(1, 8, 4)
    with pytest.raises(ValueError, match="--eval-stride"):
        scoring.eval_windows(100, 8, 8)
    with pytest.raises(ValueError, match="--eval-window"):
        scoring.eval_windows(100, 1, 1)
    with pytest.raises(ValueError, match="--greedy-tokens"):
        ev.EvalInputs("text", None, greedy_tokens=0)
    with pytest.raises(ValueError, match="--max-eval-tokens"):
        ev.EvalInputs("text", None, max_eval_tokens=1)
    with pytest.raises(ValueError, match="--text and/or --prompts"):
        ev.EvalInputs(None, None)


ALL_FIELDS = {"quantization", "quantize_embeddings", "kv_cache_dtype", "dtype"}


def test_parse_compare(monkeypatch) -> None:
    monkeypatch.setattr(eval_inputs, "config_fields", lambda: ALL_FIELDS)
    assert eval_inputs.parse_compare("int8,int4,fp8,kv-fp8,kv-int8") == [
        ("int8", {"quantization": "int8"}), ("int4", {"quantization": "int4"}),
        ("fp8", {"quantization": "fp8"}), ("kv-fp8", {"kv_cache_dtype": "fp8"}),
        ("kv-int8", {"kv_cache_dtype": "int8"})]
    assert eval_inputs.parse_compare(" int8+emb+kv-fp8 , none") == [
        ("int8+emb+kv-fp8", {"quantization": "int8", "quantize_embeddings": True,
                             "kv_cache_dtype": "fp8"}), ("none", {})]
    assert eval_inputs.parse_compare("bfloat16,float32+int8") == [
        ("bfloat16", {"dtype": "bfloat16"}),
        ("float32+int8", {"dtype": "float32", "quantization": "int8"})]
    with pytest.raises(ValueError, match="two values for dtype"):
        eval_inputs.parse_compare("bfloat16+float32")
    with pytest.raises(ValueError, match=r"unknown configuration 'int3'.*int8, int4, fp8"):
        eval_inputs.parse_compare("int8,int3")
    with pytest.raises(ValueError, match="two values for quantization"):
        eval_inputs.parse_compare("int8+int4")
    with pytest.raises(ValueError, match="'emb' needs a weight format"):
        eval_inputs.parse_compare("emb+kv-fp8")
    with pytest.raises(ValueError, match="empty configuration"):
        eval_inputs.parse_compare("int8,,fp8")
    with pytest.raises(ValueError, match="named twice"):
        eval_inputs.parse_compare("int8,int8")
    monkeypatch.setattr(eval_inputs, "config_fields", lambda: {"kv_cache_dtype"})
    with pytest.raises(ValueError, match="unsupported configuration.*'quantization' field"):
        eval_inputs.parse_compare("kv-fp8,int4")


def test_describe_and_baseline_follow_the_config_fields() -> None:
    cfg = EngineConfig()
    assert eval_inputs.describe(cfg) == "none"
    assert eval_inputs.baseline_config(cfg) == cfg
    if ALL_FIELDS <= eval_inputs.config_fields():  # once the quantisation fields exist
        q = cfg.replace(quantization="int8", quantize_embeddings=True, kv_cache_dtype="fp8")
        assert eval_inputs.describe(q) == "int8+emb+kv-fp8"
        assert eval_inputs.baseline_config(q) == cfg


def test_rows_that_change_the_float_dtype_are_named_by_it(monkeypatch) -> None:
    from jaxserve.platform import cpu
    monkeypatch.setattr(cpu, "cpu_has_bf16_dot", lambda: True)  # auto -> bfloat16 here
    auto = EngineConfig()
    assert [n for n, _ in ev.row_names(auto, eval_inputs.parse_compare("float32,bfloat16+int8"))
            ] == ["float32", "int8"]
    with pytest.raises(ValueError, match="'none' and 'bfloat16' run the same"):
        ev.row_names(auto, eval_inputs.parse_compare("none,bfloat16"))
    base = EngineConfig(dtype="float32")
    items = eval_inputs.parse_compare("bfloat16,bfloat16+int8,float32+kv-bfloat16,none")
    assert [n for n, _ in ev.row_names(base, items)] == [
        "bfloat16", "bfloat16+int8", "kv-bfloat16", "none"]
    with pytest.raises(ValueError, match="'float32' and 'none' run the same"):
        ev.row_names(base, eval_inputs.parse_compare("float32,none"))


def test_bad_inputs_name_the_file_and_line(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(ValueError, match="--text .*empty.txt: the corpus is empty"):
        eval_inputs.read_corpus(str(empty))
    with pytest.raises(ValueError, match="--text .*cannot read"):
        eval_inputs.read_corpus(str(tmp_path / "missing.txt"))
    bad = tmp_path / "p.jsonl"
    for body, msg in [
        ('{"prompt": "hi"}\n\n{"prompt": "a",\n', "line 3: invalid JSON"),
        ('{"prompt": "hi"}\n["x"]\n', "line 2: want an object with exactly one of"),
        ('{"prompt": "hi", "messages": []}\n', "line 1: want an object with exactly one"),
        ('{"prompt": ""}\n', "line 1: 'prompt' must be a non-empty string"),
        ('{"messages": [{"role": "user"}]}\n', "line 1: 'messages' must be a non-empty list"),
        ('{"prompt": "a", "max_tokens": 3}\n', r"line 1: unknown key\(s\) \['max_tokens'\]"),
        ("\n\n", "holds no prompts"),
    ]:
        bad.write_text(body)
        with pytest.raises(ValueError, match=msg):
            eval_inputs.read_prompts(str(bad))
    bad.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert eval_inputs.read_prompts(str(bad)) == [
        {"prompt": "hi"}, {"messages": [{"role": "user", "content": "yo"}]}]


def test_default_set_ships_enough_prose_and_prompts(tokenizer) -> None:
    ids = tokenizer.encode(eval_inputs.read_corpus(eval_inputs.DEFAULT_CORPUS), add_special_tokens=False)
    assert len(ids) >= 20_000
    prompts = eval_inputs.read_prompts(eval_inputs.DEFAULT_PROMPTS)
    assert len(prompts) >= 50
    assert all("messages" in p for p in prompts)
    texts = [p["messages"][-1]["content"] for p in prompts]
    assert len(set(texts)) == len(texts)


def _direct_ppl(ids: list[int], window: int, stride: int) -> tuple[float, np.ndarray]:
    """Perplexity and argmaxes over the same windows from one plain prefill per window of the
    same dummy weights (tests/support/prefill.py), outside the engine and its sampler."""
    from jaxserve.loading.load import load_model
    from models.registry import get_architecture
    from tests.support.prefill import prefill_logits

    dtype = jnp.dtype(jnp.float32)
    loaded = load_model(TINY, dtype, CONFIG.seed)
    mc, params, tok = loaded.model_config, loaded.params, loaded.tokenizer
    model = get_architecture(mc.architecture).model(mc, dtype)
    wins = scoring.eval_windows(len(ids), window, stride)
    logits = prefill_logits(model, params, [ids[s:e] for s, _, e in wins])
    lps, top = [], []
    for (s, f, e), lg in zip(wins, logits):
        lsm = np.asarray(jax.nn.log_softmax(lg[:, :tok.vocab_size].astype(np.float64), -1))
        for q in range(f, e):
            lps.append(lsm[q - 1 - s, ids[q]])
            top.append(int(np.argmax(lsm[q - 1 - s])))
    assert len(lps) == len(ids) - 1
    return math.exp(-np.mean(lps)), np.asarray(top)


HAS_QUANT = ALL_FIELDS <= eval_inputs.config_fields()


@pytest.fixture(scope="module")
def report(tokenizer) -> dict:
    """Baseline, itself on a fresh engine, bfloat16 and (when this build has weight
    quantisation) int8 with the embedding, over a 150-token corpus and six prompts."""
    inputs = ev.EvalInputs(eval_inputs.read_corpus(eval_inputs.DEFAULT_CORPUS),
                           eval_inputs.read_prompts(eval_inputs.DEFAULT_PROMPTS)[:NUM_PROMPTS],
                           WINDOW, STRIDE, NUM_TOKENS, GREEDY_TOKENS)
    configs = [("self", {}), ("bf16", {"dtype": "bfloat16"})]
    if HAS_QUANT:
        configs += eval_inputs.parse_compare("int8+emb")
    return ev.evaluate(CONFIG, TINY, inputs, configs)


def test_perplexity_equals_a_direct_computation(report, tokenizer) -> None:
    ids = tokenizer.encode(eval_inputs.read_corpus(eval_inputs.DEFAULT_CORPUS), add_special_tokens=False)
    ppl, _ = _direct_ppl(ids[:NUM_TOKENS], WINDOW, STRIDE)
    assert report["baseline"]["ppl"] == pytest.approx(ppl, rel=1e-4)
    assert report["baseline"]["ppl"] > 100  # random weights: near-uniform over 49152 tokens


def test_report_keys_and_the_baseline_against_itself(report) -> None:
    assert set(report) == {"baseline", "rows"}
    assert [r["config"] for r in report["rows"]][:2] == ["self", "bf16"]
    for row in [report["baseline"], *report["rows"]]:
        assert tuple(row) == ev.ROW_KEYS
    base, same, bf16 = report["baseline"], *report["rows"][:2]
    for row in (base, same):
        assert row["delta_ppl_pct"] == 0.0
        assert row["top1_agreement"] == 1.0 and row["greedy_agreement"] == 1.0
    assert same["ppl"] == base["ppl"]
    # memory: 48 blocks x 16 tokens of K and V, 2 layers x 4 heads x 16 dims, float32
    assert base["kv_bytes_per_token"] == 2 * 2 * 4 * 16 * 4
    assert base["max_concurrent_seqs"] == 48 * 16 // 128
    assert bf16["kv_bytes_per_token"] == base["kv_bytes_per_token"] / 2
    assert bf16["weights_gib"] == pytest.approx(base["weights_gib"] / 2)
    # half the weights freed: the baseline's memory holds more sequences of bf16 KV
    assert bf16["max_concurrent_seqs"] > 2 * base["max_concurrent_seqs"]
    assert bf16["ppl"] != base["ppl"] and abs(bf16["delta_ppl_pct"]) < 5
    assert 0.5 < bf16["top1_agreement"] <= 1.0
    assert bf16["greedy_agreement"] in {k / NUM_PROMPTS for k in range(NUM_PROMPTS + 1)}
    assert all(r["output_tok_s"] > 0 for r in (base, same, bf16))
    text = ev.format_table(report)
    assert text.splitlines()[0].split()[:2] == ["config", "weights"]
    assert [line.split()[0] for line in text.splitlines()[2:5]] == ["baseline", "self", "bf16"]


@pytest.mark.skipif(not HAS_QUANT, reason="this build has no weight quantisation fields")
def test_a_quantised_row(report) -> None:
    base, q = report["baseline"], report["rows"][2]
    assert q["config"] == "int8+emb"
    # every matrix at 1 byte per weight plus f32 scales; the norms stay float32
    assert 0.25 < q["weights_gib"] / base["weights_gib"] < 0.27
    assert q["kv_bytes_per_token"] == base["kv_bytes_per_token"]
    assert q["max_concurrent_seqs"] > base["max_concurrent_seqs"]
    assert q["ppl"] != base["ppl"] and abs(q["delta_ppl_pct"]) < 1
    assert 0.5 < q["top1_agreement"] <= 1.0


def test_argmax_is_the_models(tokenizer) -> None:
    """score_corpus's argmaxes and logprobs on the engine match the direct computation."""
    from jaxserve.engine.llm_engine import LLMEngine

    ids = tokenizer.encode(eval_inputs.read_corpus(eval_inputs.DEFAULT_CORPUS), add_special_tokens=False)[:80]
    engine = LLMEngine(CONFIG, TINY)
    engine.warmup(progress=False)
    scores = scoring.score_corpus(engine, ids, 32, 24)
    ppl, top = _direct_ppl(ids, 32, 24)
    assert scores.ppl == pytest.approx(ppl, rel=1e-4)
    np.testing.assert_array_equal(scores.argmax, top)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="perplexity request 0: prompt has 200 tokens"):
        scoring.score_corpus(engine, list(range(1, 400)), 200, 100)


def test_cli_writes_the_report(tmp_path, capsys) -> None:
    from jaxserve.cli.main import main

    text = tmp_path / "c.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking. " * 4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The capital of France is"}\n'
                       '{"messages": [{"role": "user", "content": "Hi!"}]}\n')
    out = tmp_path / "r.json"
    argv = ["eval", "--model", "tiny", "--load-format", "dummy", "--text", str(text),
            "--prompts", str(prompts), "--eval-window", "24", "--greedy-tokens", "4",
            "--output", str(out), "--max-model-len", "128", "--num-kv-blocks", "48",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
            "--compilation-cache-dir", str(REPO_ROOT / ".jax_cache")]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert set(rep) == {"baseline", "rows"} and rep["rows"] == []
    assert tuple(rep["baseline"]) == ev.ROW_KEYS and rep["baseline"]["ppl"] > 1
    assert "baseline" in capsys.readouterr().out
    # bad flags fail before loading, naming the flag
    for extra, msg in [(["--compare", "bogus"], "unknown configuration 'bogus'"),
                       (["--num-prompts", "0"], "--num-prompts must be >= 1"),
                       (["--text", str(tmp_path / "nope.txt")], "--text .*cannot read")]:
        assert main(argv + extra) == 2
        assert msg.split(".*")[0] in capsys.readouterr().err


def test_baseline_drops_the_kv_calibration_file(tmp_path) -> None:
    """The baseline's cache is float, so the 8-bit configuration's calibration file must not
    follow it there (EngineConfig refuses the pair)."""
    if "kv_calibration_file" not in eval_inputs.config_fields():
        pytest.skip("this build has no KV-cache quantisation")
    cal = tmp_path / "cal.txt"
    cal.write_text("text", encoding="utf-8")
    cfg = EngineConfig(kv_cache_dtype="int8", kv_calibration_file=str(cal))
    base = eval_inputs.baseline_config(cfg)
    assert base.kv_cache_dtype == "auto" and base.kv_calibration_file is None


def test_int4_rows_name_a_group_size_that_is_not_the_default(monkeypatch, capsys,
                                                             tmp_path) -> None:
    """Two int4 evaluations at different --quantization-group-size must not print the same
    row name: a non-default group size is appended to int4 rows (``int4@g64``)."""
    from jaxserve.cli.main import main

    seen: list[list[str]] = []

    def fake_evaluate(config, load, inputs, configs, **kw):
        seen.append([name for name, _ in configs])
        raise ValueError("stop here")

    monkeypatch.setattr(ev, "evaluate", fake_evaluate)
    argv = ["eval", "--model", "tiny", "--load-format", "dummy", "--compare", "int4,int8+emb",
            "--max-eval-tokens", "8"]
    assert main(argv) == 2 and main(argv + ["--quantization-group-size", "64"]) == 2
    assert seen == [["int4", "int8+emb"], ["int4@g64", "int8+emb"]]
    assert "stop here" in capsys.readouterr().err
    # rows are named by what runs: a flag beside --compare shows, and "none" is unquantised
    seen.clear()
    kv = ["eval", "--model", "tiny", "--load-format", "dummy", "--max-eval-tokens", "8",
          "--kv-cache-dtype", "fp8", "--compare", "int8,none"]
    assert main(kv) == 2 and seen == [["int8+kv-fp8", "none"]]
    # two items that run the same configuration are refused before anything runs
    for spec in ("int8+emb,emb+int8", "none,baseline"):
        assert main(argv[:-4] + ["--compare", spec]) == 2
        assert "run the same configuration" in capsys.readouterr().err
    assert len(seen) == 1
    # --output is checked up front, without leaving an empty file when the run fails
    out = tmp_path / "r.json"
    assert main(argv + ["--output", str(out)]) == 2 and not out.exists()


def test_a_group_size_the_model_cannot_take_is_refused_before_the_baseline_runs(
        monkeypatch) -> None:
    """int4 at a group size that does not divide the tiny model's 128-row weights: refused as
    soon as the baseline's engine exists, naming the configuration, before any scoring."""
    def no_scoring(*a, **k):
        raise AssertionError("the baseline ran before the configuration was checked")

    monkeypatch.setattr(ev, "score_corpus", no_scoring)
    cfg = EngineConfig(quantization_group_size=40, max_model_len=64, num_kv_blocks=8,
                       max_num_seqs=2, max_num_batched_tokens=32, compilation_cache_dir="")
    inputs = ev.EvalInputs("some text to score " * 4, None)
    with pytest.raises(ValueError, match=r"configuration 'int4': quantization_group_size=40 "
                                         r"must be even and divide .*dim 128 of param "
                                         r"layers/w_down.*\(64, 128\), e\.g\. 64, 32"):
        ev.evaluate(cfg, LoadConfig("tiny", "dummy"), inputs,
                    [("int8", {"quantization": "int8"}), ("int4", {"quantization": "int4"})])
