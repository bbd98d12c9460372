"""The built-in architectures, registered in ``models.registry`` on import.

``llama`` covers the Llama family as HF transformers and llama.cpp name it: GGUF
``general.architecture`` ``llama``; HF ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM`` (safetensors directories). ``gemma3``: Gemma 3 text models from GGUF
(``general.architecture`` ``gemma3``; ``models.gemma3``).
"""

from __future__ import annotations

from models.config import Gemma3Config, ModelConfig
from models.gemma3 import Gemma3ForCausalLM, gemma3_gguf_config, gemma3_gguf_params
from models.hf import llama_hf_config, llama_hf_params
from models.llama import LlamaForCausalLM
from models.loader import gguf_model_config, llama_gguf_params
from models.quant import QuantTargets
from models.registry import Architecture, register_architecture

DECODER_QUANT_TARGETS = QuantTargets(
    linear=tuple(f"layers/{n}" for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")),
    embeddings=(("embed", -1), ("lm_head", -2)))
"""Every linear of a Llama / Gemma 3 decoder layer; the embedding table (per-row scales, which
serve the gather and the tied LM head alike) and an untied LM head with --quantize-embeddings."""

LLAMA = Architecture(
    name="llama",
    model=LlamaForCausalLM,
    config_from_dict=ModelConfig.from_dict,
    aliases=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    gguf_config=gguf_model_config,
    gguf_params=llama_gguf_params,
    hf_config=llama_hf_config,
    hf_params=llama_hf_params,
    quant_targets=DECODER_QUANT_TARGETS,
)

GEMMA3 = Architecture(
    name="gemma3",
    model=Gemma3ForCausalLM,
    config_from_dict=Gemma3Config.from_dict,
    aliases=("Gemma3ForCausalLM",),
    gguf_config=gemma3_gguf_config,
    gguf_params=gemma3_gguf_params,
    quant_targets=DECODER_QUANT_TARGETS,
)

register_architecture(LLAMA)
register_architecture(GEMMA3)
