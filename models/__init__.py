"""Flax model definitions, weight loaders (GGUF, dummy) and the registry of architectures by
name (``models.registry``)."""

from models.config import BUILTIN_CONFIGS, ModelConfig, RopeScaling, builtin_config
from models.interface import AttentionMetadata
from models.llama import LlamaForCausalLM, LlamaModel

__all__ = [
    "BUILTIN_CONFIGS",
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "builtin_config",
]
