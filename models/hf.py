"""HF safetensors directories: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

``load_hf_params`` reads ``config.json``, looks ``architectures[0]`` up in ``models.registry``
and hands the architecture a ``SafetensorsDir`` (memory-mapped; a tensor is read when asked
for). Each params leaf is an ``HFLeaf``, whose ``read(index)`` reads one region, so a
tensor-parallel load (``jaxserve.loading.sharded``) never reads a whole tensor.

Llama family: ``LlamaForCausalLM``, ``MistralForCausalLM`` (sliding window), ``Qwen2ForCausalLM``
(q/k/v bias, tied or untied embeddings). HF q/k rows are already in rotate-half RoPE order, so
a linear ``[out, in]`` is only transposed to ``[in, out]`` and stacked over layers. Config keys:
transformers' v4 (``rope_theta``, ``rope_scaling``) and v5 (``rope_parameters``) forms.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (numpy learns the name "bfloat16" for bf16 slices)
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from models.config import ModelConfig, RopeScaling
from models.registry import get_architecture

CONFIG_FILE = "config.json"


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` holds ``config.json`` and at least one ``*.safetensors`` file."""
    return (os.path.isfile(os.path.join(path, CONFIG_FILE))
            and bool(glob.glob(os.path.join(path, "*.safetensors"))))


class SafetensorsDir:
    """Every tensor of the ``*.safetensors`` files in one directory, memory-mapped.

    Args:
      path: the directory.
      progress: show a tqdm bar advancing once per tensor read.
    Raises:
      ValueError: no ``*.safetensors`` file, or one tensor name in two files.
    """

    def __init__(self, path: str, progress: bool = True) -> None:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"{path} has no *.safetensors file")
        self.path = path
        self._files = [safe_open(f, framework="numpy") for f in files]
        self._where: dict[str, int] = {}
        for i, f in enumerate(self._files):
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name in self._where:
                    raise ValueError(f"{path}: tensor {name} is in two files")
                self._where[name] = i
        self._bar = None
        if progress:
            self._bar = tqdm(total=len(self._where), desc="loading tensors", unit="tensor",
                             leave=False)

    def names(self) -> set[str]:
        """Every tensor name."""
        return set(self._where)

    def get(self, name: str) -> np.ndarray:
        """One tensor as stored (a linear is ``[out, in]``; bfloat16 stays ``ml_dtypes``').

        Raises:
          ValueError: no tensor of that name.
        """
        if name not in self._where:
            raise ValueError(f"{self.path} lacks tensor {name}")
        x = self._files[self._where[name]].get_tensor(name)
        if self._bar is not None:
            self._bar.update()
        return x

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's stored shape, from the file header (nothing read).

        Raises:
          ValueError: no tensor of that name.
        """
        if name not in self._where:
            raise ValueError(f"{self.path} lacks tensor {name}")
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """``tensor[index]`` as stored (one slice per dim), reading only that region.

        Raises:
          ValueError: no tensor of that name.
        """
        if name not in self._where:
            raise ValueError(f"{self.path} lacks tensor {name}")
        return self._files[self._where[name]].get_slice(name)[tuple(index)]

    def close(self) -> None:
        """Close the progress bar (the mapped files close with the object)."""
        if self._bar is not None:
            self._bar.close()


def read_hf_config(path: str) -> dict:
    """``path/config.json`` as a dict.

    Raises:
      ValueError: unreadable, or without a non-empty ``architectures`` list.
    """
    try:
        with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}/{CONFIG_FILE}: {e}") from None
    archs = data.get("architectures") if isinstance(data, dict) else None
    if not (isinstance(archs, list) and archs):
        raise ValueError(f"{path}/{CONFIG_FILE} lacks the list 'architectures'")
    return data


def load_hf_params(path: str, dtype: jnp.dtype, progress: bool = True):
    """(config, params on the default device in ``dtype``) of an HF safetensors directory.

    Raises:
      ValueError: an unregistered architecture or one without an HF loader, an unsupported
        config value (naming the key), or a missing tensor.
    """
    data = read_hf_config(path)
    arch = get_architecture(str(data["architectures"][0]))
    if arch.hf_config is None or arch.hf_params is None:
        raise ValueError(f"{path}: architecture {data['architectures'][0]!r} has no HF "
                         f"safetensors loader")
    cfg = arch.hf_config(data)
    tensors = SafetensorsDir(path, progress)
    try:
        return cfg, arch.hf_params(tensors, cfg, dtype)
    finally:
        tensors.close()


# -- the Llama family ----------------------------------------------------------------------------

LLAMA_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}


def _rope(data: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from v5 ``rope_parameters`` or v4 ``rope_theta``/``rope_scaling``."""
    rope = data.get("rope_parameters")
    if rope is None:
        rope = {**(data.get("rope_scaling") or {}), "rope_theta": data.get("rope_theta", 1e4)}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", data.get("rope_theta", 1e4)))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json: rope type {kind!r} is not supported (only 'default' and "
                         f"'llama3')")
    d = RopeScaling()
    return theta, RopeScaling(
        factor=float(rope.get("factor", d.factor)),
        low_freq_factor=float(rope.get("low_freq_factor", d.low_freq_factor)),
        high_freq_factor=float(rope.get("high_freq_factor", d.high_freq_factor)),
        original_max_position_embeddings=int(rope.get(
            "original_max_position_embeddings", d.original_max_position_embeddings)))


def llama_hf_config(data: dict) -> ModelConfig:
    """ModelConfig from the ``config.json`` of a Llama, Mistral or Qwen2 checkpoint.

    Raises:
      ValueError: naming the key, for a missing key or an unsupported feature (non-SiLU
        activation, o-proj/MLP bias, per-layer sliding window, rope type not default/llama3).
    """
    arch = data["architectures"][0]
    family = LLAMA_FAMILY.get(arch)
    if family is None:
        raise ValueError(f"config.json: architectures[0]={arch!r} is not one of "
                         f"{sorted(LLAMA_FAMILY)}")

    def need(key: str):
        if key not in data:
            raise ValueError(f"config.json lacks the key {key!r}")
        return data[key]

    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={data['hidden_act']!r} is not supported "
                         f"(only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if family == "llama" and data.get(key):
            raise ValueError(f"config.json: {key}=true is not supported")
    sliding = data.get("sliding_window") if family == "mistral" else None
    if family == "qwen2" and (data.get("use_sliding_window") or "sliding_attention" in (
            data.get("layer_types") or [])):
        raise ValueError("config.json: use_sliding_window=true is not supported for Qwen2")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling = _rope(data)
    return ModelConfig(
        vocab_size=int(need("vocab_size")), hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")), num_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads), rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2", max_position_embeddings=int(
            data.get("max_position_embeddings", 8192)),
        sliding_window=None if sliding is None else int(sliding), name=family)


LAYER_TENSORS = {
    ("attn_norm", "weight"): ("input_layernorm.weight", False),
    ("mlp_norm", "weight"): ("post_attention_layernorm.weight", False),
    ("wq",): ("self_attn.q_proj.weight", True),
    ("wk",): ("self_attn.k_proj.weight", True),
    ("wv",): ("self_attn.v_proj.weight", True),
    ("wo",): ("self_attn.o_proj.weight", True),
    ("w_gate",): ("mlp.gate_proj.weight", True),
    ("w_up",): ("mlp.up_proj.weight", True),
    ("w_down",): ("mlp.down_proj.weight", True),
}
"""A Llama-family decoder layer's tensors: our path under ``params["layers"]`` -> (HF name under
``model.layers.{i}.``, whether HF stores it transposed: ``[out, in]`` against our ``[in, out]``)."""
_BIAS_TENSORS = {("bq",): "self_attn.q_proj.bias", ("bk",): "self_attn.k_proj.bias",
                 ("bv",): "self_attn.v_proj.bias"}


@dataclass(frozen=True)
class HFLeaf:
    """How one params leaf is read from HF tensors, whole or one region at a time."""

    tensors: SafetensorsDir
    names: tuple[str, ...]  # one per layer when stacked, else one
    stacked: bool  # stack names on a new leading [num_layers] axis
    transpose: bool  # HF [out, in] -> our [in, out]
    shape: tuple[int, ...]  # our leaf's, from the file headers

    def read(self, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Our leaf's region ``[index]`` (one slice per dim; None: whole) in the stored dtype."""
        def one(name: str, idx: tuple[slice, ...] | None) -> np.ndarray:
            if idx is None:
                x = self.tensors.get(name)
            else:
                x = self.tensors.get_slice(name, idx[::-1] if self.transpose else idx)
            return x.T if self.transpose else x

        if not self.stacked:
            return one(self.names[0], index)
        if index is None:
            return np.stack([one(n, None) for n in self.names])
        layers = range(*index[0].indices(self.shape[0]))
        return np.stack([one(self.names[i], tuple(index[1:])) for i in layers])


def llama_hf_sources(tensors: SafetensorsDir, cfg: ModelConfig) -> dict:
    """The ``HFLeaf`` of every params leaf of ``LlamaForCausalLM``, in the params' structure.

    Raises:
      ValueError: a missing tensor.
    """
    def leaf(names: list[str], stacked: bool, transpose: bool) -> HFLeaf:
        one = tensors.shape(names[0])
        for n in names[1:]:
            tensors.shape(n)  # raises naming a missing layer's tensor
        one = one[::-1] if transpose else one
        return HFLeaf(tensors, tuple(names), stacked, transpose,
                      (len(names), *one) if stacked else one)

    spec = dict(LAYER_TENSORS)
    if cfg.qkv_bias:
        spec.update({path: (hf, False) for path, hf in _BIAS_TENSORS.items()})
    layers: dict = {}
    for path, (hf, transpose) in spec.items():
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf([f"model.layers.{i}.{hf}" for i in range(cfg.num_layers)],
                              True, transpose)
    params = {"embed": leaf(["model.embed_tokens.weight"], False, False), "layers": layers,
              "final_norm": {"weight": leaf(["model.norm.weight"], False, False)}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = leaf(["lm_head.weight"], False, True)
    return params


def llama_hf_params(tensors: SafetensorsDir, cfg: ModelConfig, dtype: jnp.dtype) -> dict:
    """Params of ``LlamaForCausalLM`` on the default device, one leaf in host memory at a time.

    Raises:
      ValueError: a missing tensor.
    """
    return jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf.read(), dtype),
                                  llama_hf_sources(tensors, cfg))


def hf_config_dict(cfg: ModelConfig, dtype: str, bos_token_id: int | None = None,
                   eos_token_id: int | None = None) -> dict:
    """The ``config.json`` of an HF directory holding a Llama-family ``cfg`` (what
    ``llama_hf_config`` reads back to ``cfg``); ``dtype`` names the stored dtype.

    Raises:
      ValueError: for a config that is not of the Llama family.
    """
    if cfg.architecture != "llama":
        raise ValueError(f"an HF directory is written for the Llama family only, not "
                         f"{cfg.architecture!r}")
    # the family by its features, as llama_hf_config maps them (names from GGUF are free text)
    family = "qwen2" if cfg.qkv_bias else "mistral" if cfg.sliding_window else "llama"
    arch = {f: name for name, f in LLAMA_FAMILY.items()}[family]
    data = {"architectures": [arch], "model_type": family, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "torch_dtype": dtype,
            "attention_bias": cfg.qkv_bias, "mlp_bias": False}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        data["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
    if cfg.sliding_window is not None:
        data["sliding_window"] = cfg.sliding_window
    if bos_token_id is not None:
        data["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        data["eos_token_id"] = eos_token_id
    return data


def save_hf_dir(path: str, cfg: ModelConfig, params: dict, dtype: jnp.dtype,
                bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
    """Write Llama-family ``params`` (float, not quantised) as ``path/model.safetensors`` and
    ``path/config.json`` in HF's layout: linears back to ``[out, in]``, one tensor per layer;
    what other engines (transformers, vLLM) load. The tokenizer files are the caller's.

    Raises:
      ValueError: a non-Llama config, quantised params, or a ``path`` that holds a model.
    """
    from safetensors.numpy import save_file

    data = hf_config_dict(cfg, jnp.dtype(dtype).name, bos_token_id, eos_token_id)
    if os.path.exists(os.path.join(path, CONFIG_FILE)):
        raise ValueError(f"{path} already holds a model ({CONFIG_FILE})")

    def host(x) -> np.ndarray:
        if not isinstance(x, jax.Array | np.ndarray):
            raise ValueError(f"quantised weights ({type(x).__name__}) cannot be written as an "
                             f"HF directory; convert without --quantization")
        return np.asarray(jnp.asarray(x, dtype))

    spec = dict(LAYER_TENSORS)
    if cfg.qkv_bias:
        spec.update({p: (hf, False) for p, hf in _BIAS_TENSORS.items()})
    out = {"model.embed_tokens.weight": host(params["embed"]),
           "model.norm.weight": host(params["final_norm"]["weight"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(host(params["lm_head"]).T)
    for p, (hf, transpose) in spec.items():
        node = params["layers"]
        for key in p:
            node = node[key]
        stacked = host(node)
        for i in range(cfg.num_layers):
            t = stacked[i].T if transpose else stacked[i]
            out[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(t)
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(data, f, indent=2)
