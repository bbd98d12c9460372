"""Weights: random ("dummy") weights of any registered model, and GGUF files (the generic entry
``load_gguf_params`` dispatches on ``general.architecture`` through ``models.registry``; the llama
reader is here).

Params pytree (``LlamaModel``): ``embed [vocab, hidden]``, ``final_norm/weight [hidden]``,
``lm_head [hidden, vocab]`` (untied only) and ``layers/{attn_norm,mlp_norm}/weight [L, hidden]``,
``layers/{wq [L, hidden, nq*hd], wk/wv [L, hidden, nkv*hd], wo [L, nq*hd, hidden],
w_gate/w_up [L, hidden, inter], w_down [L, inter, hidden]}``.
"""

from __future__ import annotations

import os
import re
import zlib
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig, RopeScaling
from models.registry import Architecture, get_architecture

if TYPE_CHECKING:  # reading files needs ``gguf``; dummy weights need jax alone (gpu_check.py)
    from models.gguf_reader import GGUFFile


def dummy_params(model, seed: int, shardings=None):
    """Random weights created on the device in the model's dtype, deterministic for ``seed``,
    for any model with ``param_shapes()`` (``models.registry.CausalLM``).

    Norm weights are 1, every other leaf N(0, 0.02). Nothing is built on the host, so the
    shapes of Llama-3.1-8B cost only device memory. ``shardings`` (a pytree of
    ``jax.sharding.Sharding`` matching the params; default: the default device): each device
    draws only its own slice, and the values equal the unsharded ones (JAX's partitionable
    threefry, ``jax_threefry_partitionable``, the default).
    """
    shapes = model.param_shapes()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    targets = ([None] * len(leaves) if shardings is None
               else treedef.flatten_up_to(shardings))

    def make(path, s, key):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.ones(s.shape, s.dtype)
        return (0.02 * jax.random.normal(key, s.shape, jnp.float32)).astype(s.dtype)

    out = []
    base = jax.random.PRNGKey(seed)
    for (path, s), sharding in zip(leaves, targets, strict=True):
        key = jax.random.fold_in(base, zlib.crc32(jax.tree_util.keystr(path).encode()))
        out.append(jax.jit(make, static_argnums=(0, 1), out_shardings=sharding)(path, s, key))
    return jax.tree_util.tree_unflatten(treedef, out)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_model_config(reader) -> ModelConfig:
    """ModelConfig from a GGUF reader's metadata (``general.architecture`` must be llama).

    Raises:
      ValueError: for another architecture or missing keys.
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama' for now)")

    def get(key: str, default=None):
        v = _field(reader, f"llama.{key}", default)
        if v is None:
            raise ValueError(f"GGUF file lacks metadata key llama.{key}")
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if _field(reader, "llama.rope.scaling.type") == "llama3" or _field(
            reader, "llama.rope.scaling.factor") is not None:
        scaling = RopeScaling(
            factor=float(get("rope.scaling.factor")),
            low_freq_factor=float(_field(reader, "llama.rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(_field(reader, "llama.rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(_field(
                reader, "llama.rope.scaling.original_context_length", 8192)))
    name = _field(reader, "general.name", "gguf-model")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=int(get("context_length", 8192)), name=str(name))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its convert script interleaves the two RoPE halves
    of each head for GGML's interleaved RoPE); rows ``[n_heads * head_dim, ...]``."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


DEQUANT_CHUNK_ELEMENTS = 1 << 24
"""Elements dequantised at once: large enough that numpy's per-call overhead vanishes, small
enough to bound the temporaries (a few float32 copies of the chunk)."""
DEQUANT_THREADS = 4
"""At most this many tensors dequantise at once (numpy releases the GIL in its loops)."""


def dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """``gguf.quants.dequantize`` (f32, the shape GGUF reports), in chunks of
    ``DEQUANT_CHUNK_ELEMENTS`` rather than its groups of 16 rows: SmolLM2-135M's 211 Q4_1 and
    Q8_0 tensors took 2.0 s through ``dequantize`` and 1.4 s so (the same values), on a 2-core
    Zen 3. A quant type without a ``dequantize_rows`` of its own goes through ``dequantize``."""
    import gguf

    q = getattr(gguf.quants, "_type_traits", {}).get(qtype)
    if q is None or data.ndim == 0:
        return gguf.quants.dequantize(data, qtype)
    rows = data.reshape(-1, data.shape[-1])
    out_shape = gguf.quants.quant_shape_from_byte_shape(data.shape, qtype)
    per = max(1, DEQUANT_CHUNK_ELEMENTS // max(1, out_shape[-1]))
    parts = [q.dequantize_rows(rows[i:i + per]) for i in range(0, rows.shape[0], per)]
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)).reshape(out_shape)


def gguf_tensor_getter(reader, path: str = "GGUF file"):
    """``get(name) -> f32 ndarray`` dequantising one tensor of a ``gguf.GGUFReader`` (shape as
    GGUF reports it, e.g. ``[out, in]`` for a linear weight). Every tensor starts dequantising
    at once on up to ``DEQUANT_THREADS`` threads, in file order (the loaders ask for nearly
    all of them and hold them all before stacking): 1.4 -> 0.9 s for SmolLM2-135M on 2 cores.

    Raises (from ``get``):
      ValueError: the file lacks that tensor.
    """
    from concurrent.futures import ThreadPoolExecutor

    tensors = {t.name: t for t in reader.tensors}
    pool = ThreadPoolExecutor(min(DEQUANT_THREADS, os.cpu_count() or 1),
                              thread_name_prefix="jaxserve-dequant")
    futures = {name: pool.submit(lambda t=t: np.asarray(dequantize(t.data, t.tensor_type),
                                                        np.float32))
               for name, t in tensors.items()}
    pool.shutdown(wait=False)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path} lacks tensor {name}")
        f = futures.pop(name, None)  # handed over once: the caller keeps what it needs
        if f is None:  # asked for again
            t = tensors[name]
            return np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        return f.result()

    return get


def check_gguf_tensors(reader, expected: dict[str, tuple[int, ...]]) -> None:
    """Check a GGUF file's tensor infos against the model's, before anything is dequantised.

    Args:
      reader: the open file (``models.gguf_reader.GGUFFile``; its ``path`` names it).
      expected: tensor name -> shape in numpy order (``[out, in]`` for a linear weight).

    Raises:
      ValueError: naming the file and the first tensor that is missing or of another shape.
    """
    path = getattr(reader, "path", "GGUF file")
    have = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    for name, shape in expected.items():
        if name not in have:
            raise ValueError(f"{path} lacks tensor {name}")
        if have[name] != tuple(shape):
            raise ValueError(f"{path}: tensor {name} has shape {have[name]}; the model "
                             f"expects {tuple(shape)}")


def llama_gguf_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors ``llama_gguf_params`` reads, with their numpy-order shapes."""
    h, i, q, kv = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim,
                   cfg.num_kv_heads * cfg.head_dim)
    out = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (cfg.vocab_size, h)
    for b in range(cfg.num_layers):
        p = f"blk.{b}."
        out.update({p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
                    p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h),
                    p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, q),
                    p + "ffn_gate.weight": (i, h), p + "ffn_up.weight": (i, h),
                    p + "ffn_down.weight": (h, i)})
        if cfg.qkv_bias:
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,),
                        p + "attn_v.bias": (kv,)})
    return out


def stack_layers(per_layer: list[dict], dtype: jnp.dtype) -> dict:
    """Stack a list (one per layer) of equal pytrees of host arrays on a new leading axis and put
    each stacked leaf on the device in ``dtype`` (one leaf at a time, to bound host memory)."""
    return jax.tree_util.tree_map(lambda *xs: jnp.asarray(np.stack(xs), dtype=dtype), *per_layer)


def llama_gguf_params(reader, cfg: ModelConfig, dtype: jnp.dtype) -> dict:
    """Params of ``LlamaForCausalLM`` from a llama GGUF (q/k rows un-permuted, linear weights
    transposed to ``[in, out]``), on the default device in ``dtype``.

    Raises:
      ValueError: a missing tensor or one of another shape (naming the file and the tensor,
        before any is dequantised).
    """
    check_gguf_tensors(reader, llama_gguf_tensors(cfg))
    get = gguf_tensor_getter(reader, getattr(reader, "path", "GGUF file"))

    def put(a: np.ndarray) -> jax.Array:
        return jnp.asarray(a, dtype=dtype)

    names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
             "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
    per_layer = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        layer: dict = {"attn_norm": {"weight": get(p + "attn_norm.weight")},
                       "mlp_norm": {"weight": get(p + "ffn_norm.weight")}}
        for ours, theirs in names.items():
            w = get(p + theirs + ".weight")  # [out, in]
            if ours == "wq":
                w = unpermute_qk(w, cfg.num_heads)
            elif ours == "wk":
                w = unpermute_qk(w, cfg.num_kv_heads)
            layer[ours] = w.T
        if cfg.qkv_bias:
            layer["bq"] = unpermute_qk(get(p + "attn_q.bias"), cfg.num_heads)
            layer["bk"] = unpermute_qk(get(p + "attn_k.bias"), cfg.num_kv_heads)
            layer["bv"] = get(p + "attn_v.bias")
        per_layer.append(layer)
    params = {"embed": put(get("token_embd.weight")), "layers": stack_layers(per_layer, dtype),
              "final_norm": {"weight": put(get("output_norm.weight"))}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = put(get("output.weight").T)
    return params


def load_gguf_params(path: str, dtype: jnp.dtype, reader: object = None):
    """Read a GGUF file of any registered architecture (``general.architecture``), dequantise
    every tensor with ``gguf``, return (config, params) with params on the default device in
    ``dtype``. ``reader``: the file already opened (``models.gguf_reader.GGUFFile``), to reuse
    (the engine reads the tokenizer from the same one).

    Raises:
      ValueError: an unregistered architecture, one without a GGUF loader, or a missing tensor.
    """
    if reader is None:
        from models.gguf_reader import GGUFFile

        reader = GGUFFile(path)
    arch = gguf_architecture(reader, path)
    cfg = arch.gguf_config(reader)
    return cfg, arch.gguf_params(reader, cfg, dtype)


def gguf_architecture(reader: GGUFFile, path: str) -> Architecture:
    """The registered architecture a GGUF file names in ``general.architecture``; its
    ``gguf_config`` and ``gguf_params`` are set.

    Args:
      reader: the open file.
      path: its path, for messages.

    Raises:
      ValueError: an unregistered architecture, or one without a GGUF loader.
    """
    name = _field(reader, "general.architecture")
    try:
        arch = get_architecture(str(name))
    except ValueError as e:
        raise ValueError(f"{path}: general.architecture: {e}") from None
    if arch.gguf_config is None or arch.gguf_params is None:
        raise ValueError(f"{path}: architecture {name!r} has no GGUF loader")
    return arch


def gguf_name(path: str) -> str:
    """A served-model name from a GGUF file name, its quantisation suffix dropped:
    ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``,
    ``gemma-3-270m-q4_k_m.gguf`` -> ``gemma-3-270m``."""
    base = re.sub(r"\.gguf$", "", path.rsplit("/", 1)[-1], flags=re.IGNORECASE)
    return re.sub(r"[.-](Q\d\w*|F16|F32|BF16|IQ\w+)$", "", base, flags=re.IGNORECASE)
