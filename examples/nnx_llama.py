"""Serve a Flax NNX model of your own through the NNX adapter (``models.nnx_adapter``).

A small Llama-style decoder written as an ordinary ``nnx.Module`` (RMSNorm, RoPE, grouped-query
attention, SwiGLU MLP, tied embedding), whose blocks call ``PagedAttention`` where they would
call dense attention. The module trains and evaluates as any NNX module (``model(token_ids)``:
``PagedAttention`` is dense causal attention there); ``nnx_architecture`` serves the same module
with the engine's paged-attention op, its blocks stacked and scanned. What a module must
satisfy, and the errors otherwise: ``models/nnx_adapter.py`` and docs/models.md.

    python examples/nnx_llama.py write /tmp/nnx-llama     # random weights, SmolLM2 tokenizer
    python examples/nnx_llama.py serve /tmp/nnx-llama --port 8000 --max-model-len 256

(``serve`` registers the architecture, then runs ``jaxserve serve`` with the flags given.)
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from models.nnx_adapter import PagedAttention, dense_forward, nnx_architecture, params_of
from models.registry import register_architecture

ARCHITECTURE_NAME = "nnx-llama"


@dataclass(frozen=True)
class NNXLlamaConfig:
    """Hyper-parameters, with the fields the engine reads (``models.interface``)."""

    vocab_size: int = 49152
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 512
    name: str = "nnx-llama"
    architecture: str = ARCHITECTURE_NAME

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> NNXLlamaConfig:
        """Inverse of ``to_dict``. Raises ValueError naming unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - names):
            raise ValueError(f"unknown nnx-llama config keys {unknown}")
        return cls(**data)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float) -> None:
        self.scale, self.eps = nnx.Param(jnp.ones((dim,))), eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.scale[...]).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE; x ``[B, T, heads, head_dim]``, positions ``i32[B, T]``."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[..., None, None] * inv
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = jnp.cos(ang), jnp.sin(ang)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: NNXLlamaConfig, rngs: nnx.Rngs) -> None:
        h, nq, nkv, hd, i = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size)
        lin = lambda a, b: nnx.Linear(a, b, use_bias=False, rngs=rngs)
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.q, self.k, self.v, self.o = lin(h, nq * hd), lin(h, nkv * hd), lin(h, nkv * hd), \
            lin(nq * hd, h)
        self.attn = PagedAttention(nq, nkv, hd)  # the one attention the adapter replaces
        self.gate, self.up, self.down = lin(h, i), lin(h, i), lin(i, h)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg, (b, t, _) = self.cfg, x.shape
        y = self.attn_norm(x)
        q = rope(self.q(y).reshape(b, t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(self.k(y).reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions,
                 cfg.rope_theta)
        v = self.v(y).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        x = x + self.o(self.attn(q, k, v).reshape(b, t, -1))
        y = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(y)) * self.up(y))


class NNXLlama(nnx.Module):
    """The adapter's shape: ``embed``, ``layers`` (alike blocks), ``logits``."""

    def __init__(self, cfg: NNXLlamaConfig, rngs: nnx.Rngs) -> None:
        self.embedding = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        return self.embedding(token_ids)

    def logits(self, x: jax.Array) -> jax.Array:
        return self.embedding.attend(self.norm(x))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return dense_forward(self, token_ids)


def make_module(cfg: NNXLlamaConfig, rngs: nnx.Rngs) -> NNXLlama:
    return NNXLlama(cfg, rngs)


ARCHITECTURE = nnx_architecture(ARCHITECTURE_NAME, make_module, NNXLlamaConfig.from_dict)


def register() -> None:
    """Register ``nnx-llama`` (again, if this file was imported twice)."""
    register_architecture(ARCHITECTURE, replace=True)


def write_checkpoint(path: str, model: NNXLlama, cfg: NNXLlamaConfig, tokenizer) -> None:
    """The module's params as an orbax checkpoint at ``path`` (what a training loop would
    save), with ``tokenizer`` (a ``jaxserve.tokenizer.Tokenizer``) beside them."""
    from models.checkpoint import save_checkpoint

    save_checkpoint(path, cfg, params_of(model))
    tokenizer.save_pretrained(path)


def main(argv: list[str]) -> int:
    """``write DIR`` or ``serve DIR [jaxserve serve flags]``."""
    if len(argv) < 2 or argv[0] not in ("write", "serve"):
        print("usage: python examples/nnx_llama.py write DIR\n"
              "       python examples/nnx_llama.py serve DIR [jaxserve serve flags]",
              file=sys.stderr)
        return 2
    register()
    if argv[0] == "write":
        from jaxserve.loading.model_files import default_gguf_path
        from jaxserve.tokenizer import Tokenizer

        cfg = NNXLlamaConfig()
        write_checkpoint(argv[1], NNXLlama(cfg, nnx.Rngs(0)), cfg,
                         Tokenizer.from_gguf(default_gguf_path()))
        print(f"wrote {argv[1]}")
        return 0
    from jaxserve.cli.main import main as jaxserve_main

    return jaxserve_main(["serve", *argv[1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
