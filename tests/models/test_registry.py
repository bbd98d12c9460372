"""models.registry: architecture names -> config parser, model, loaders."""

from __future__ import annotations

import pytest

from models.config import BUILTIN_CONFIGS, ModelConfig, builtin_config
from models.llama import LlamaForCausalLM
from models.registry import Architecture, get_architecture, register_architecture


def test_builtin_names_select_llama() -> None:
    for name in ("llama", "LlamaForCausalLM"):
        arch = get_architecture(name)
        assert arch.name == "llama" and arch.model is LlamaForCausalLM
        assert arch.gguf_config is not None and arch.gguf_params is not None


def test_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown model architecture 'nope'.*llama"):
        get_architecture("nope")


def test_taken_name_is_refused_unless_replaced() -> None:
    other = Architecture(name="test-other", model=LlamaForCausalLM,
                         config_from_dict=ModelConfig.from_dict, aliases=("llama",))
    with pytest.raises(ValueError, match="'llama' is already registered"):
        register_architecture(other)
    with pytest.raises(ValueError, match="unknown model architecture 'test-other'"):
        get_architecture("test-other")  # nothing of a refused registration stays


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_config_dict_round_trip(name: str) -> None:
    cfg = builtin_config(name)
    assert get_architecture(cfg.architecture).config_from_dict(cfg.to_dict()) == cfg


def test_gemma3_registered() -> None:
    from models.config import Gemma3Config
    from models.gemma3 import Gemma3ForCausalLM

    for name in ("gemma3", "Gemma3ForCausalLM"):
        arch = get_architecture(name)
        assert arch.model is Gemma3ForCausalLM and arch.config_from_dict == Gemma3Config.from_dict
        assert arch.gguf_config is not None and arch.gguf_params is not None
    assert builtin_config("gemma3-270m").architecture == "gemma3"


def test_config_from_dict_names_bad_keys() -> None:
    d = builtin_config("tiny").to_dict()
    with pytest.raises(ValueError, match="unknown model config keys.*'hiden_size'"):
        ModelConfig.from_dict({**d, "hiden_size": 3})
    del d["num_layers"]
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig.from_dict(d)
