"""Flax model definitions, weight loaders (GGUF, dummy) and the registry of architectures by
name (``models.registry``)."""

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
