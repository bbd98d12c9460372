"""Tensor parallelism on simulated CPU devices (conftest.py asks XLA for 8 host devices).

Checks: refusal of shapes that cannot be split, the param and KV-cache shardings, the sharded
model's logits against one device, greedy engine output with TP 1/2/4/8 (tiny), TP 2 from an
orbax checkpoint restored per shard (tiny) and TP 3 (SmolLM2) against one device, and the
collectives XLA emits per layer. The loaders' per-shard reads: tests/loading/test_sharded_load.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve import sharding
from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from models.config import builtin_config
from models.interface import AttentionMetadata
from models.llama import LlamaForCausalLM
from models.loader import dummy_params
from pallas_kernels import allocate_kv_cache, ragged_paged_attention

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8,
                             reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
pytestmark = needs_8

SMOLLM2 = builtin_config("smollm2-135m")
TINY = builtin_config("tiny")


def test_refuses_heads_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="num_heads=9"):
        sharding.check_tensor_parallel(SMOLLM2, 2)
    with pytest.raises(ValueError, match="num_heads=9"):
        sharding.check_tensor_parallel(SMOLLM2, 4)
    sharding.check_tensor_parallel(SMOLLM2, 3)  # 9 q heads and 3 kv heads both split by 3
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive"):
        sharding.check_tensor_parallel(TINY, 0)


def test_refuses_kv_heads_that_neither_split_nor_replicate() -> None:
    cfg = TINY.replace(num_heads=12, num_kv_heads=3, intermediate_size=120, vocab_size=49152)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        sharding.check_tensor_parallel(cfg, 4)  # 3 kv heads: 4 neither divides nor is divided


def test_engine_refuses_tp2_for_smollm2_naming_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*num_heads=9"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, max_model_len=64, num_kv_blocks=8,
                               compilation_cache_dir=""))


def test_refuses_more_devices_than_exist() -> None:
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(16)


def test_replicated_kv_heads_keep_each_q_head_on_its_kv_head() -> None:
    """With 4 kv heads over 8 devices each kv head is copied twice, adjacent, so q head h
    (group 2 of 8) meets the copy of its original kv head h // 2."""
    cfg = TINY
    params = dummy_params(LlamaForCausalLM(cfg), 0)
    rep = sharding.replicate_kv_heads(params, cfg, 8)
    hd = cfg.head_dim
    wk = np.asarray(params["layers"]["wk"]).reshape(cfg.num_layers, cfg.hidden_size, 4, hd)
    wk8 = np.asarray(rep["layers"]["wk"]).reshape(cfg.num_layers, cfg.hidden_size, 8, hd)
    for new_head in range(8):
        np.testing.assert_array_equal(wk8[:, :, new_head], wk[:, :, new_head // 2])
    assert sharding.sharded_config(cfg, 8).num_kv_heads == 8
    assert sharding.replicate_kv_heads(params, cfg, 4) is params


def test_param_and_cache_shardings() -> None:
    cfg = TINY.replace(tie_word_embeddings=False)
    params = dummy_params(LlamaForCausalLM(cfg), 0)
    mesh = sharding.make_mesh(4)
    placed = sharding.shard_params(params, cfg, mesh)
    lay = placed["layers"]
    want = {"wq": P(None, None, "tp"), "wk": P(None, None, "tp"), "wv": P(None, None, "tp"),
            "wo": P(None, "tp", None), "w_gate": P(None, None, "tp"),
            "w_up": P(None, None, "tp"), "w_down": P(None, "tp", None)}
    for name, spec in want.items():
        assert lay[name].sharding.spec == spec, name
        # each device holds 1/4 of the leaf
        shard = lay[name].addressable_shards[0].data
        assert shard.size * 4 == lay[name].size, name
    assert placed["embed"].sharding.spec == P("tp", None)
    assert placed["lm_head"].sharding.spec == P(None, "tp")
    assert lay["attn_norm"]["weight"].sharding.is_fully_replicated
    kv = allocate_kv_cache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32,
                           sharding=NamedSharding(mesh, sharding.kv_cache_spec()))
    assert kv.k.addressable_shards[0].data.shape == (cfg.num_layers, 8, 16, 1, cfg.head_dim)


def _logits(model, params, kv, tokens: list[int]) -> np.ndarray:
    t = len(tokens)
    md = AttentionMetadata(
        slot_mapping=jnp.arange(16, 16 + t, dtype=jnp.int32),
        block_tables=jnp.array([[1, 2, 3, 4]], jnp.int32), seq_lens=jnp.array([t], jnp.int32),
        query_start_loc=jnp.array([0, t], jnp.int32), num_seqs=jnp.array([1], jnp.int32))

    @jax.jit
    def f(params, kv):
        hidden, _ = model.forward(params, jnp.asarray(tokens, jnp.int32),
                                  jnp.arange(t, dtype=jnp.int32), kv, md)
        return model.compute_logits(params, hidden)

    return np.asarray(f(params, kv))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sharded_logits_match_one_device(tp: int) -> None:
    """All prompt positions' logits of the tiny model (untied LM head, q/k/v bias) under TP
    equal the single-device logits to float32 rounding."""
    cfg = TINY.replace(tie_word_embeddings=False, qkv_bias=True)
    params = dummy_params(LlamaForCausalLM(cfg), 3)
    params = jax.tree_util.tree_map(lambda a: a * 10 if a.ndim > 1 else a, params)  # livelier
    tokens = [5, 17, 300, 42, 9, 4000, 77, 12, 8, 31000, 2, 3]
    kv1 = allocate_kv_cache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    want = _logits(LlamaForCausalLM(cfg), params, kv1, tokens)

    mesh = sharding.make_mesh(tp)
    scfg = sharding.sharded_config(cfg, tp)
    model = LlamaForCausalLM(scfg, attention_fn=sharding.shard_attention(
        ragged_paged_attention, mesh))
    kv = allocate_kv_cache(scfg.num_layers, 8, 16, scfg.num_kv_heads, scfg.head_dim,
                           jnp.float32, sharding=NamedSharding(mesh, sharding.kv_cache_spec()))
    got = _logits(model, sharding.shard_params(params, cfg, mesh), kv, tokens)
    # float32 partial sums meet in another order; seen up to 1.8e-4 (TP 8) on logits of scale ~1,
    # while a wrong head or shard mapping moves them by O(1)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=5e-4)
    assert np.std(want) > 0.1  # the check is not vacuous: logits vary


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for r in engine.step():
            if r.finished:
                out[r.request_id] = list(r.outputs[0].token_ids)
    return [out[str(i)] for i in range(len(prompts))]


_TINY_ENGINES: dict[int, LLMEngine] = {}


def _tiny_engine(tp: int) -> LLMEngine:
    """A warmed tiny dummy engine per TP size, built once per session (two step programs)."""
    if tp not in _TINY_ENGINES:
        eng = LLMEngine(EngineConfig(tensor_parallel_size=tp, max_model_len=128,
                                     num_kv_blocks=24, max_num_seqs=4,
                                     max_num_batched_tokens=16, compilation_cache_dir=""),
                        LoadConfig(model="tiny", load_format="dummy"))
        eng.warmup(progress=False)
        _TINY_ENGINES[tp] = eng
    return _TINY_ENGINES[tp]


def test_tiny_engine_greedy_tp_1_2_4() -> None:
    """Chunked prefills (a 37-token prompt over a 16-token budget) beside short prompts."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (3, 37, 9)]
    want = _greedy(_tiny_engine(1), prompts, 5)
    for tp in (2, 4):
        eng = _tiny_engine(tp)
        assert eng.runner.kv_cache.k.sharding.spec == sharding.kv_cache_spec()
        assert _greedy(eng, prompts, 5) == want, f"tp={tp}"


def test_orbax_checkpoint_loaded_per_shard_serves_the_tp2_weights(tmp_path, tokenizer,
                                                                  caplog) -> None:
    """The tiny dummy weights saved as an orbax checkpoint and served with TP 2: each device
    restores its own slices (the report says so, logged at INFO), and the engine holds bitwise
    the weights, with the shardings, of the dummy TP 2 engine, whose greedy tokens
    test_tiny_engine_greedy_tp_1_2_4 checks against TP 1 (same program, same inputs: same
    tokens, without compiling a third engine)."""
    from models import checkpoint

    path = str(tmp_path / "tiny")
    checkpoint.save_checkpoint(path, TINY, dummy_params(LlamaForCausalLM(TINY), 0))
    tokenizer.save_pretrained(path)
    with caplog.at_level("INFO", logger="jaxserve.loading"):
        eng = LLMEngine(EngineConfig(tensor_parallel_size=2, max_model_len=128,
                                     num_kv_blocks=24, max_num_seqs=4,
                                     max_num_batched_tokens=16, compilation_cache_dir=""),
                        LoadConfig(model=path))
    report = eng.load_report
    assert (report.source, report.method) == ("orbax", "sharded")
    assert len(report.devices) == 2 and report.devices[0].bytes_read > 0
    assert "loaded orbax weights (sharded, ready) over 2 devices" in caplog.text
    want = _tiny_engine(2)
    assert want.load_report.method == "sharded"  # dummy weights are drawn per shard
    assert _tiny_engine(1).load_report is None  # TP 1 loads as before
    assert eng.model_config == want.model_config
    for (p, got), ref in zip(jax.tree_util.tree_flatten_with_path(eng.runner.params)[0],
                             jax.tree_util.tree_leaves(want.runner.params), strict=True):
        assert got.sharding == ref.sharding, p
        assert np.array_equal(np.asarray(got), np.asarray(ref)), p


def _collectives(text: str) -> dict[str, list[str]]:
    """Collective ops of a compiled HLO module, grouped by the computation that holds them."""
    out: dict[str, list[str]] = {}
    comp = ""
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            comp = m.group(1)
        for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute",
                   "reduce-scatter"):
            if re.search(rf"= [^=]*\b{op}(-start)?\(", line):
                out.setdefault(comp, []).append(op + " " + line.split("=")[1].split(op)[0].strip())
    return out


def test_two_all_reduces_per_layer() -> None:
    """The layer loop body (nn.scan -> one while body) holds exactly two all-reduces of
    ``[T, hidden]`` (after o-proj and after down-proj) and nothing else; outside it only the
    vocabulary-split embedding's all-reduce and the logits' all-gather (plus the gather in the
    prompt-logprobs branch)."""
    eng = _tiny_engine(4)
    bucket = eng.runner.buckets[-1]
    text = eng.runner.compiled[bucket].as_text()
    coll = _collectives(text)
    t, h = bucket.num_tokens, eng.model_config.hidden_size
    layer_bodies = [ops for ops in coll.values()
                    if sum(f"f32[{t},{h}]" in o for o in ops) == 2]
    assert len(layer_bodies) == 1, coll
    assert all(o.startswith("all-reduce") for o in layer_bodies[0]), layer_bodies
    main = [ops for name, ops in coll.items() if name.startswith("main")]
    assert len(main) == 1, coll
    assert sorted(o.split(" ")[0] for o in main[0]) == ["all-gather", "all-reduce"], main
    # the only other collective: the prompt-logprobs branch (lax.cond, run only when a request
    # asks for prompt logprobs) gathers the logits of every token
    rest = [o for ops in coll.values() if ops is not layer_bodies[0] and ops is not main[0]
            for o in ops]
    assert len(rest) == 1 and rest[0].startswith("all-gather"), coll


def test_smollm2_tp3_matches_one_device(engine, goldens) -> None:
    """The real model split 3 ways (9 q heads, 3 kv heads) generates the single-device
    engine's greedy tokens."""
    prompts = [p["prompt_token_ids"] for p in goldens["prompts"][:2]]
    want = _greedy(engine, prompts, 8)
    eng3 = LLMEngine(EngineConfig(tensor_parallel_size=3, max_model_len=256, num_kv_blocks=64,
                                  max_num_seqs=4, max_num_batched_tokens=16,
                                  compilation_cache_dir=""))
    assert eng3.load_report.method == "full-then-shard"  # GGUF: dequantised whole, then split
    eng3.warmup(progress=False)
    assert _greedy(eng3, prompts, 8) == want
