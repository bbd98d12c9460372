"""Flax model definitions and weight loaders (GGUF, dummy)."""

from models.config import BUILTIN_CONFIGS, ModelConfig, RopeScaling, builtin_config
from models.llama import AttentionMetadata, LlamaForCausalLM, LlamaModel

__all__ = [
    "BUILTIN_CONFIGS",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "builtin_config",
]
