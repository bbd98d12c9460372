"""The built-in architectures, registered in ``models.registry`` on import.

``llama`` covers the Llama family as HF transformers and llama.cpp name it: GGUF
``general.architecture`` ``llama``; HF ``LlamaForCausalLM``.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.loader import gguf_model_config, llama_gguf_params
from models.registry import Architecture, register_architecture

LLAMA = Architecture(
    name="llama",
    model=LlamaForCausalLM,
    config_from_dict=ModelConfig.from_dict,
    aliases=("LlamaForCausalLM",),
    gguf_config=gguf_model_config,
    gguf_params=llama_gguf_params,
)

register_architecture(LLAMA)
