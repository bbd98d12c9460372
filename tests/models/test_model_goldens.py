"""The model (models.llama on the real SmolLM2-135M GGUF) against HF transformers goldens.

The model is called directly, not through the engine's sampler: ``forward`` over a ragged batch
of whole sequences in a small paged KV cache of its own, then ``compute_logits`` on every
position. Params come from the session ``engine`` fixture (one load for all tests). One jitted
program of fixed padded shape (``_T`` tokens, ``_S`` sequences) serves every call here, so the
module compiles once.

Goldens (tests/goldens/smollm2.json, produced by scripts/make_goldens.py): float32 CPU logits of
HF transformers on the dequantised GGUF weights, so the only expected difference is float32
summation order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import bf16_matmul as cpu_bf16_matmul
from jaxserve.platform.cpu import cpu_has_bf16_dot
from jaxserve.platform.cpu_weights import PackedWeight, use_packed_bf16
from models.architectures import DECODER_QUANT_TARGETS
from models.interface import AttentionMetadata
from pallas_kernels import KVCache, allocate_kv_cache

_T = 640  # padded tokens per call: all six prompts + 48-token continuations (624) fit
_S = 8  # padded sequences per call
_BLOCK = 16
_MAX_BLOCKS = 32  # block-table width: 512 positions per sequence
_NUM_BLOCKS = 64  # 1 padding block + 63 usable (a call of _T tokens needs at most 40 + _S - 1)

# Max |logit - golden| over the first-step rows of all six prompts measured 6.5e-05 (logit
# scale ~20-30; float32 on a 2-core x86 CPU); the tolerance is ~5x that.
FIRST_STEP_ATOL = 3e-4
# Max |top-5 logit - golden| over every teacher-forced position measured 7.3e-05.
TEACHER_FORCED_TOP5_ATOL = 5e-4
# Chunked vs one-shot prefill of the same prompt: measured max abs diff 0.0 (bitwise equal on
# the CPU); the tolerance leaves room for a backend whose kernel tiles the two cases differently.
CHUNKED_ATOL = 1e-4
NEAR_TIE = 1e-3  # golden top-2 margins below this may flip under float32 rounding


class _Model:
    """Runs ragged batches of chunks through the model and returns logits of every token."""

    def __init__(self, engine, params=None, kv_dtype=None) -> None:
        mc = engine.model_config
        self.model = engine.model
        self.params = engine.runner.params if params is None else params
        self.kv = allocate_kv_cache(
            mc.num_layers, _NUM_BLOCKS, _BLOCK, mc.num_kv_heads, mc.head_dim,
            engine.dtype if kv_dtype is None else kv_dtype
        )
        model = self.model

        def fn(params, kv: KVCache, tok, pos, md: AttentionMetadata):
            hidden, kv = model.forward(params, tok, pos, kv, md)
            return model.compute_logits(params, hidden), kv

        self.fn = jax.jit(fn, donate_argnums=(1,))
        self.next_block = 1

    def new_table(self, num_tokens: int) -> list[int]:
        """Fresh blocks for a sequence of ``num_tokens`` (the cache is reused round-robin)."""
        n = -(-num_tokens // _BLOCK)
        if self.next_block + n > _NUM_BLOCKS:
            self.next_block = 1
        table = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return table

    def run(self, chunks: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> list[np.ndarray]:
        """One step over ``chunks`` of (token ids, start position, block table).

        Returns per chunk the logits ``f32[len(token ids), vocab]`` of its tokens.
        """
        tok = np.zeros(_T, np.int32)
        pos = np.zeros(_T, np.int32)
        slots = np.zeros(_T, np.int32)  # padding -> slot 0 (reserved block 0)
        tables = np.zeros((_S, _MAX_BLOCKS), np.int32)
        seq_lens = np.zeros(_S, np.int32)
        qsl = np.zeros(_S + 1, np.int32)
        off = 0
        for i, (ids, start, table) in enumerate(chunks):
            n = len(ids)
            p = np.arange(start, start + n)
            tables[i, : len(table)] = table
            tok[off : off + n] = ids
            pos[off : off + n] = p
            slots[off : off + n] = tables[i, p // _BLOCK] * _BLOCK + p % _BLOCK
            seq_lens[i] = start + n
            off += n
            qsl[i + 1] = off
        assert off <= _T and len(chunks) <= _S
        qsl[len(chunks) + 1 :] = off
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            block_tables=jnp.asarray(tables),
            seq_lens=jnp.asarray(seq_lens),
            query_start_loc=jnp.asarray(qsl),
            num_seqs=jnp.asarray([len(chunks)], jnp.int32),
        )
        logits, self.kv = self.fn(self.params, self.kv, jnp.asarray(tok), jnp.asarray(pos), md)
        logits = np.asarray(logits)
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(chunks))]

    def full(self, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Logits of every position of each whole sequence (one ragged prefill step)."""
        self.next_block = 1
        return self.run([(s, 0, self.new_table(len(s))) for s in seqs])


@pytest.fixture(scope="module")
def model(engine) -> _Model:
    return _Model(engine)


@pytest.fixture(scope="module")
def first_step_logits(model: _Model, goldens: dict) -> dict[str, np.ndarray]:
    """Prompt name -> logits row at the last prompt position (all prompts in one batch)."""
    prompts = goldens["prompts"]
    out = model.full([p["prompt_token_ids"] for p in prompts])
    return {p["name"]: rows[-1] for p, rows in zip(prompts, out, strict=True)}


@pytest.fixture(scope="module")
def teacher_forced_logits(model: _Model, goldens: dict) -> dict[str, np.ndarray]:
    """Prompt name -> logits ``[n_greedy, vocab]`` predicting each golden continuation token,
    from one forward of prompt + golden continuation."""
    prompts = goldens["prompts"]
    out = model.full([p["prompt_token_ids"] + p["greedy_token_ids"] for p in prompts])
    res = {}
    for p, rows in zip(prompts, out, strict=True):
        n = len(p["prompt_token_ids"])
        res[p["name"]] = rows[n - 1 : n - 1 + len(p["greedy_token_ids"])]
    return res


def _names() -> list[str]:
    """The golden prompts, in file order (test ids; test_golden_prompt_names checks them)."""
    return [
        "france_text",
        "long_prose",
        "mixed_unicode",
        "france_chat",
        "system_two_turn",
        "alphabet_text",
    ]


def _prompt(goldens: dict, name: str) -> dict:
    return next(p for p in goldens["prompts"] if p["name"] == name)


def test_golden_prompt_names(goldens: dict) -> None:
    assert [p["name"] for p in goldens["prompts"]] == _names()


@pytest.mark.parametrize("name", _names())
def test_first_step_logits(name: str, goldens: dict, first_step_logits: dict) -> None:
    want = _prompt(goldens, name)["logits"]
    got = first_step_logits[name]
    err = float(np.max(np.abs(got - want)))
    assert err <= FIRST_STEP_ATOL, f"{name}: max |logit diff| {err:.3g} > {FIRST_STEP_ATOL}"
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("name", _names())
def test_teacher_forced_greedy(name: str, goldens: dict, teacher_forced_logits: dict) -> None:
    p = _prompt(goldens, name)
    rows = teacher_forced_logits[name]
    gold = np.asarray(p["greedy_token_ids"])
    margins = np.asarray(p["top2_margins"])
    decisive = margins >= NEAR_TIE
    got = rows.argmax(-1)
    bad = np.nonzero(decisive & (got != gold))[0]
    assert bad.size == 0, f"{name}: argmax differs from golden at positions {bad.tolist()}"
    # the golden top-5 logits at every position, within float32 tolerance
    for i, top5 in enumerate(p["step_top5"]):
        ids = [t for t, _ in top5]
        want = np.asarray([v for _, v in top5], np.float32)
        err = float(np.max(np.abs(rows[i, ids] - want)))
        assert err <= TEACHER_FORCED_TOP5_ATOL, f"{name} position {i}: top-5 logit diff {err:.3g}"


def test_chunked_prefill_matches_one_shot(
    model: _Model, goldens: dict, first_step_logits: dict
) -> None:
    """Prompts prefilled in chunks, each step attending to the K/V its earlier steps cached,
    end at the same last-position logits as one-shot prefill.

    All variants run side by side as one ragged batch per step, so steps mix continued chunks
    (cached context) of several sequences with a fresh prefill (system_two_turn, last step).
    """
    variants = [
        ("long_prose", (100, 201)),
        ("long_prose", (16, 32, 219)),
        ("long_prose", (1,)),
        ("france_chat", (20,)),
        ("system_two_turn", ()),
    ]
    seqs = []
    for name, splits in variants:
        ids = _prompt(goldens, name)["prompt_token_ids"]
        bounds = [0, *splits, len(ids)]
        seqs.append((name, ids, model.new_table(len(ids)), list(itertools.pairwise(bounds))))
    num_steps = max(len(c) for *_, c in seqs)
    last: dict[int, np.ndarray] = {}
    for step in range(num_steps):
        batch, who = [], []
        for v, (_, ids, table, chunks) in enumerate(seqs):
            k = step - (num_steps - len(chunks))  # every variant finishes on the last step
            if k >= 0:
                a, b = chunks[k]
                batch.append((ids[a:b], a, table))
                who.append(v)
        for v, rows in zip(who, model.run(batch), strict=True):
            last[v] = rows[-1]
    for v, (name, splits) in enumerate(variants):
        one_shot = first_step_logits[name]
        err = float(np.max(np.abs(last[v] - one_shot)))
        assert err <= CHUNKED_ATOL, f"{name} split at {splits}: max |diff| {err:.3g} vs one-shot"
        assert int(last[v].argmax()) == int(_prompt(goldens, name)["logits"].argmax())


# bfloat16 weights under float32 activations with a bfloat16 KV cache: what ``--dtype auto``
# serves on a CPU with a bfloat16 dot (jaxserve.platform.cpu). Measured against
# the float32 goldens: max |first-step logit diff| 0.12-0.20 per prompt (logit scale ~20-30);
# the teacher-forced argmax equal to the golden at all 6 x 48 positions. The tolerance is 2x;
# argmax flips are allowed only at golden top-2 margins below 0.2. A CPU without a bfloat16
# dot (AVX2 only; --dtype auto serves float32 there) rounds differently: on a Zen 3
# (2026-12-06) 0.13-0.43 (france_chat 0.435, also at the tree before that session's work),
# argmaxes as above; its tolerance is 1.4x that.
BF16_FIRST_STEP_ATOL = 0.4 if cpu_has_bf16_dot() else 0.6
BF16_DECISIVE_MARGIN = 0.2


@pytest.fixture(scope="module")
def bf16_model(engine) -> _Model:
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), engine.runner.params)
    return _Model(engine, params, jnp.bfloat16)


def test_bfloat16_weights_under_float32_activations_stay_near_the_goldens(
        bf16_model: _Model, goldens: dict) -> None:
    _assert_bf16_near_goldens(bf16_model, goldens)


def _assert_bf16_near_goldens(bf16_model: _Model, goldens: dict) -> None:
    assert bf16_model.model.dtype == jnp.float32  # the activations
    prompts = goldens["prompts"]
    firsts = bf16_model.full([p["prompt_token_ids"] for p in prompts])
    forced = bf16_model.full([p["prompt_token_ids"] + p["greedy_token_ids"] for p in prompts])
    worst = 0.0
    for p, first, rows in zip(prompts, firsts, forced, strict=True):
        err = float(np.max(np.abs(first[-1] - p["logits"])))
        worst = max(worst, err)
        assert err <= BF16_FIRST_STEP_ATOL, f"{p['name']}: max |logit diff| {err:.3g}"
        n = len(p["prompt_token_ids"])
        got = rows[n - 1:n - 1 + len(p["greedy_token_ids"])].argmax(-1)
        decisive = np.asarray(p["top2_margins"]) >= BF16_DECISIVE_MARGIN
        bad = np.nonzero(decisive & (got != np.asarray(p["greedy_token_ids"])))[0]
        assert bad.size == 0, f"{p['name']}: argmax differs at decisive positions {bad.tolist()}"
    assert worst > 0  # the bfloat16 weights did change the computation


@pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_bf16_matmul.available(),
                    reason="the native bfloat16 matmul runs on XLA:CPU and needs a C++ compiler")
def test_packed_bfloat16_weights_stay_near_the_goldens(engine, bf16_model: _Model,
                                                       goldens: dict) -> None:
    """The layer weights and the tied LM head packed for the native CPU kernel
    (``--cpu-kernels auto``, on CPUs with AVX512-BF16) meet the plain
    bfloat16 model's bounds. Each matmul equals XLA's bfloat16 dot bit for bit
    (tests/kernels/test_cpu_bf16_matmul.py), but XLA fuses the code around a custom call
    differently, and a last-bit change flips later roundings of activations to bfloat16, so
    the two models' logits differ by as much as either differs from float32."""
    packed = use_packed_bf16(bf16_model.params, DECODER_QUANT_TARGETS)
    assert isinstance(packed["layers"]["wq"], PackedWeight)
    assert isinstance(packed.get("lm_head", packed["embed"]), PackedWeight)
    _assert_bf16_near_goldens(_Model(engine, packed, jnp.bfloat16), goldens)
