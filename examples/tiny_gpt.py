"""Bring your own Flax model: a GPT-2-style decoder served by jaxserve (an example outside models/).

What a model needs (``models.registry``'s protocol):

1. A config object with ``architecture``, ``name``, ``vocab_size``, ``num_layers``,
   ``num_kv_heads``, ``head_dim``, ``max_position_embeddings`` and ``to_dict()`` (the engine sizes
   the paged KV cache ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` from it).
2. A model class built as ``Model(cfg, dtype, attention_fn)`` with
   ``forward(params, token_ids i32[T], positions i32[T], kv_cache, md) -> (hidden [T, H],
   kv_cache)``, ``compute_logits(params, hidden [L, H]) -> f32[L, vocab]`` and
   ``param_shapes()``. Each layer writes its K/V with ``write_kv`` and attends with the
   ``attention_fn`` it was given (the paged-attention op the engine picked), reading the ragged
   batch layout from ``md`` (``models.llama.AttentionMetadata``).
3. ``register_architecture(Architecture(name=..., model=..., config_from_dict=...))``.

Then write the params as an orbax checkpoint (``models.checkpoint.save_checkpoint``) with a
tokenizer beside it, and serve the directory. This file does both:

    python examples/tiny_gpt.py write /tmp/tiny-gpt          # random weights, SmolLM2 tokenizer
    python examples/tiny_gpt.py serve /tmp/tiny-gpt --port 8000 --max-model-len 256

(``serve`` registers the architecture, then runs ``jaxserve serve`` with the flags given.) An
installed package would instead register through the ``jaxserve.models`` entry-point group, so
the plain ``jaxserve serve DIR`` finds it.

The model: learned token and position embeddings, pre-LayerNorm blocks of multi-head attention
(one fused q/k/v projection, no RoPE) and a GELU MLP, a final LayerNorm and an output head tied to
the token embedding (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners"). ``reference_logits`` is the same network with dense causal attention over one
sequence, for checking the paged path.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.registry import Architecture, register_architecture
from pallas_kernels import KVCache, ragged_paged_attention, write_kv

ARCHITECTURE_NAME = "tiny-gpt"


@dataclass(frozen=True)
class TinyGPTConfig:
    """Hyper-parameters. ``num_kv_heads`` equals ``num_heads`` (no GQA); ``head_dim`` is
    ``hidden_size // num_heads``.

    Raises:
      ValueError: hidden_size not a multiple of num_heads.
    """

    vocab_size: int = 49152
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-5
    name: str = "tiny-gpt"
    architecture: str = ARCHITECTURE_NAME

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{self.hidden_size=} must be a multiple of {self.num_heads=}")

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TinyGPTConfig:
        """Inverse of ``to_dict``. Raises ValueError naming unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown tiny-gpt config keys {unknown}")
        return cls(**data)


class Block(nn.Module):
    """One pre-LN block; ``nn.scan`` runs it with carry ``(x, k_cache, v_cache, layer)``."""

    cfg: TinyGPTConfig
    dtype: jnp.dtype
    attention_fn: object

    @nn.compact
    def __call__(self, carry, md):
        x, k_cache, v_cache, layer = carry
        cfg, t = self.cfg, x.shape[0]
        nh, hd = cfg.num_heads, cfg.head_dim
        y = nn.LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.dtype,
                         name="ln_1")(x)
        qkv = nn.Dense(3 * cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                       name="qkv")(y).reshape(t, 3, nh, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        k_cache, v_cache = write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping)
        attn = self.attention_fn(q, k_cache, v_cache, layer, md.block_tables, md.seq_lens,
                                 md.query_start_loc, md.num_seqs, sm_scale=hd ** -0.5)
        x = x + nn.Dense(cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         name="proj")(attn.reshape(t, cfg.hidden_size).astype(self.dtype))
        y = nn.LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.dtype,
                         name="ln_2")(x)
        y = nn.Dense(4 * cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                     name="fc")(y)
        x = x + nn.Dense(cfg.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                         name="fc_out")(jax.nn.gelu(y))
        return (x, k_cache, v_cache, layer + 1), None


class TinyGPTModule(nn.Module):
    """Params: ``wte [vocab, H]``, ``wpe [max_pos, H]``, ``blocks/*`` stacked ``[L, ...]``,
    ``ln_f/{scale,bias} [H]``."""

    cfg: TinyGPTConfig
    dtype: jnp.dtype
    attention_fn: object

    def setup(self) -> None:
        cfg, init = self.cfg, nn.initializers.normal(0.02)
        self.wte = self.param("wte", init, (cfg.vocab_size, cfg.hidden_size), self.dtype)
        self.wpe = self.param("wpe", init, (cfg.max_position_embeddings, cfg.hidden_size),
                              self.dtype)
        self.blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=nn.broadcast, length=cfg.num_layers)(
            cfg, self.dtype, self.attention_fn)
        self.ln_f = nn.LayerNorm(cfg.layer_norm_eps, dtype=self.dtype, param_dtype=self.dtype)

    def __call__(self, token_ids, positions, kv_cache: KVCache, md):
        x = (self.wte[token_ids] + self.wpe[positions]).astype(self.dtype)
        (x, k, v, _), _ = self.blocks((x, kv_cache.k, kv_cache.v, jnp.int32(0)), md)
        return self.ln_f(x), KVCache(k, v)

    def logits(self, hidden):
        return (hidden.astype(self.dtype) @ self.wte.T).astype(jnp.float32)


class TinyGPT:
    """The model protocol over ``TinyGPTModule`` (see the module docstring)."""

    def __init__(self, cfg: TinyGPTConfig, dtype: jnp.dtype = jnp.float32,
                 attention_fn=ragged_paged_attention) -> None:
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.module = TinyGPTModule(cfg, self.dtype, attention_fn)

    def forward(self, params, token_ids, positions, kv_cache: KVCache, md):
        return self.module.apply({"params": params}, token_ids, positions, kv_cache, md)

    def compute_logits(self, params, hidden):
        return self.module.apply({"params": params}, hidden, method=TinyGPTModule.logits)

    def param_shapes(self):
        cfg = self.cfg
        kv = jnp.zeros((cfg.num_layers, 2, 1, cfg.num_kv_heads, cfg.head_dim), self.dtype)
        one = jnp.zeros((1,), jnp.int32)
        return jax.eval_shape(lambda: self.module.init(
            jax.random.PRNGKey(0), one, one, KVCache(kv, kv), _one_token_metadata()))["params"]


def _one_token_metadata():
    """Attention metadata of a one-token step (for tracing ``init``)."""
    from models.interface import AttentionMetadata

    return AttentionMetadata(jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                             jnp.ones((1,), jnp.int32), jnp.array([0, 1], jnp.int32),
                             jnp.ones((1,), jnp.int32))


@functools.partial(jax.jit, static_argnums=1)
def reference_logits(params, cfg: TinyGPTConfig, token_ids: jax.Array) -> jax.Array:
    """The same network with dense causal attention over one sequence, in plain jnp.

    token_ids: ``i32[T]`` from position 0 (padding after the real tokens changes no earlier
    row). Returns ``f32[T, vocab]``.
    """
    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + cfg.layer_norm_eps) * p["scale"] + p["bias"]

    def dense(x, p):
        return x @ p["kernel"] + p["bias"]

    t, nh, hd = token_ids.shape[0], cfg.num_heads, cfg.head_dim
    x = params["wte"][token_ids] + params["wpe"][jnp.arange(t)]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in range(cfg.num_layers):
        p = jax.tree_util.tree_map(lambda a, i=i: a[i], params["blocks"])
        qkv = dense(ln(x, p["ln_1"]), p["qkv"]).reshape(t, 3, nh, hd)
        s = jnp.einsum("qhd,khd->hqk", qkv[:, 0], qkv[:, 1]) * hd ** -0.5
        w = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        x = x + dense(jnp.einsum("hqk,khd->qhd", w, qkv[:, 2]).reshape(t, -1), p["proj"])
        x = x + dense(jax.nn.gelu(dense(ln(x, p["ln_2"]), p["fc"])), p["fc_out"])
    return ln(x, params["ln_f"]) @ params["wte"].T


def init_params(cfg: TinyGPTConfig, seed: int = 0, dtype: jnp.dtype = jnp.float32):
    """Random params as Flax initialises them (normal(0.02) embeddings, LeCun-normal dense
    kernels, zero biases, LayerNorm scale 1), created on the device in one jitted call."""
    model = TinyGPT(cfg, dtype)
    kv = jnp.zeros((cfg.num_layers, 2, 1, cfg.num_kv_heads, cfg.head_dim), dtype)
    one = jnp.zeros((1,), jnp.int32)
    init = jax.jit(lambda key: model.module.init(key, one, one, KVCache(kv, kv),
                                                 _one_token_metadata())["params"])
    return init(jax.random.PRNGKey(seed))


ARCHITECTURE = Architecture(name=ARCHITECTURE_NAME, model=TinyGPT,
                            config_from_dict=TinyGPTConfig.from_dict)


def register() -> None:
    """Register ``tiny-gpt`` (again, if this file was imported twice)."""
    register_architecture(ARCHITECTURE, replace=True)


def write_checkpoint(path: str, cfg: TinyGPTConfig, tokenizer, seed: int = 0) -> None:
    """``init_params`` weights as an orbax checkpoint at ``path`` (what a training loop would
    save), with ``tokenizer`` (a ``jaxserve.tokenizer.Tokenizer``) beside them."""
    from models.checkpoint import save_checkpoint

    save_checkpoint(path, cfg, init_params(cfg, seed))
    tokenizer.save_pretrained(path)


def main(argv: list[str]) -> int:
    """``write DIR`` or ``serve DIR [jaxserve serve flags]``."""
    if len(argv) < 2 or argv[0] not in ("write", "serve"):
        print("usage: python examples/tiny_gpt.py write DIR\n"
              "       python examples/tiny_gpt.py serve DIR [jaxserve serve flags]", file=sys.stderr)
        return 2
    register()
    if argv[0] == "write":
        from jaxserve.loading.model_files import default_gguf_path
        from jaxserve.tokenizer import Tokenizer

        write_checkpoint(argv[1], TinyGPTConfig(), Tokenizer.from_gguf(default_gguf_path()))
        print(f"wrote {argv[1]}")
        return 0
    from jaxserve.cli.main import main as jaxserve_main

    return jaxserve_main(["serve", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
