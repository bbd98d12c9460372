"""A user's own Flax NNX module served through ``models.nnx_adapter``: examples/nnx_llama.py,
written as a checkpoint and served by the engine, gives the greedy tokens of the module's own
dense forward; modules that do not satisfy the adapter's shape get its named errors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams
from models.nnx_adapter import NNXCausalLM, PagedAttention, dense_attention, params_of
from models.registry import get_architecture
from pallas_kernels import ragged_paged_attention
from tests.support.prefill import prefill_logits

REPO_ROOT = Path(__file__).resolve().parents[2]
# paged vs the module's dense forward, float32: measured max abs diff 2.7e-6 (logits up to ~3);
# the tolerance is ~10x.
ATOL = 3e-5
_PAD = 48
N_NEW = 8


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("nnx_llama", REPO_ROOT / "examples" /
                                                  "nnx_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    module.register()
    return module


def _dense_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from the module's own forward (ids padded to one length: one compile)."""
    fwd = nnx.jit(lambda m, x: m(x))
    out = list(ids)
    for _ in range(n):
        logits = fwd(model, jnp.asarray([out + [0] * (_PAD - len(out))], jnp.int32))
        out.append(int(np.argmax(np.asarray(logits[0, len(out) - 1]))))
    return out[len(ids):]


def test_served_greedy_tokens_equal_the_dense_forward(example, tokenizer, tmp_path) -> None:
    cfg = example.NNXLlamaConfig()
    model = example.NNXLlama(cfg, nnx.Rngs(3))
    path = str(tmp_path / "nnx-llama")
    example.write_checkpoint(path, model, cfg, tokenizer)
    prompts = ["The capital city of France is", "Once upon a time, in a land far away,",
               "1, 2, 3, 4,", "def main():"]
    ids = [tokenizer.encode(p) for p in prompts]

    served = get_architecture("nnx-llama").model(cfg, jnp.float32)
    for got, seq in zip(prefill_logits(served, params_of(model), ids), ids, strict=True):
        want = np.asarray(model(jnp.asarray([seq], jnp.int32))[0])
        assert float(np.max(np.abs(got - want))) <= ATOL

    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.05)
    assert isinstance(llm.engine.model, NNXCausalLM)
    outs = llm.generate([{"prompt_token_ids": s} for s in ids],
                        SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True))
    for seq, out in zip(ids, outs, strict=True):
        assert list(out.outputs[0].token_ids) == _dense_greedy(model, seq, N_NEW)


def test_paged_attention_is_dense_outside_the_engine() -> None:
    """The marker's own forward: GQA, a window and a soft-cap, against a per-head loop."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 7, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 7, 2, 8)), jnp.float32) for _ in range(2))
    att = PagedAttention(4, 2, 8, sliding_window=3, logit_soft_cap=5.0)
    got = np.asarray(att(q, k, v))
    for b in range(2):
        for h in range(4):
            for i in range(7):
                lo = max(0, i - 2)
                s = np.asarray(q[b, i, h] @ k[b, lo:i + 1, h // 2].T) * 8 ** -0.5
                s = 5.0 * np.tanh(s / 5.0)
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                np.testing.assert_allclose(got[b, i, h], p @ np.asarray(v[b, lo:i + 1, h // 2]),
                                           atol=1e-5)
    assert np.allclose(dense_attention(q, k, v, 8 ** -0.5), att.__class__(4, 2, 8)(q, k, v))


class _Cfg:
    architecture, name, vocab_size, max_position_embeddings = "bad", "bad", 16, 32
    num_layers, num_kv_heads, head_dim = 2, 1, 4

    def to_dict(self) -> dict:
        return {}


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, marks: int = 1, width: int = 4, stats: bool = False):
        self.proj = nnx.Linear(4, width, rngs=rngs)
        self.attns = nnx.List([PagedAttention(1, 1, 4) for _ in range(marks)])
        if stats:
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x, positions):
        return x


class _Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, blocks=None, embed: bool = True):
        self.table = nnx.Param(jnp.zeros((16, 4)))
        self.layers = nnx.List(blocks if blocks is not None else [_Block(rngs), _Block(rngs)])
        if embed:
            self.embed = lambda ids: self.table[...][ids]

    def logits(self, x):
        return x @ self.table[...].T


@pytest.mark.parametrize("build, match", [
    (lambda r: _Model(r, embed=False), "has no method 'embed'"),
    (lambda r: _Model(r, blocks=[]), r"layers must be a non-empty list"),
    (lambda r: _Model(r, blocks=[_Block(r), _Block(r, marks=2)]),
     r"layers\[1\] holds 2 PagedAttention modules"),
    (lambda r: _Model(r, blocks=[_Block(r), _Block(r, marks=0)]),
     r"layers\[1\] holds 0 PagedAttention modules"),
    (lambda r: _Model(r, blocks=[_Block(r), _Block(r, width=8)]),
     r"layers\[1\] differs in structure from layers\[0\]"),
    (lambda r: _Model(r, blocks=[_Block(r, stats=True), _Block(r, stats=True)]),
     r"layers\[0\]\.bn\.\w+ is a BatchStat; only nnx\.Param state is served"),
    (lambda r: _Model(r, blocks=[_Block(r), _Block(r), _Block(r)]),
     r"config num_layers=2 but the module has 3"),
])
def test_a_module_that_does_not_conform_gets_a_named_error(build, match: str) -> None:
    with pytest.raises(ValueError, match=f"nnx module: .*{match}"):
        NNXCausalLM(_Cfg(), jnp.float32, None, lambda cfg, rngs: build(rngs))


def test_a_block_calling_its_attention_twice_is_refused() -> None:
    class Twice(_Block):
        def __call__(self, x, positions):
            q = x.reshape(1, -1, 1, 4)
            self.attns[0](q, q, q)
            return x + self.attns[0](q, q, q).reshape(x.shape)

    served = NNXCausalLM(_Cfg(), jnp.float32, ragged_paged_attention,
                         lambda cfg, rngs: _Model(rngs, blocks=[Twice(rngs), Twice(rngs)]))
    params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), served.param_shapes())
    with pytest.raises(ValueError, match="called its PagedAttention 2 times"):
        prefill_logits(served, params, [[1, 2, 3]])
