"""The model protocol and the registry of architectures by name.

A model file names its architecture: a GGUF's ``general.architecture`` (``llama``), an HF
``config.json``'s ``architectures[0]`` (``LlamaForCausalLM``), or the ``architecture`` key of the
``config.json`` that ``jaxserve convert`` writes beside an orbax checkpoint. ``get_architecture``
maps that name to an ``Architecture``: how to parse the config, how to build the model, and how to
load its params from each format it supports. Every loader (GGUF, HF safetensors, orbax, dummy)
goes through this one table, so a model registered here is served like the built-in Llama.

Bring your own model: write a config class and a model class that follow ``ModelConfigLike`` and
``CausalLM`` (``models.interface``) (see ``examples/tiny_gpt.py``), then

    register_architecture(Architecture(name="my-model", model=MyModel,
                                       config_from_dict=MyConfig.from_dict))

Write its params with ``models.checkpoint.save_checkpoint`` (orbax) and serve the directory. A
package can also register on ``jaxserve`` start-up through the entry-point group
``jaxserve.models``: each entry point names a callable that is called with no arguments (and calls
``register_architecture``) the first time a name is not found.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from models.interface import CausalLM, ModelConfigLike
from models.quant import QuantTargets

ENTRY_POINT_GROUP = "jaxserve.models"
BUILTIN_MODULES = ("models.architectures",)
"""Modules that register the built-in architectures when imported (imported on first lookup)."""


@dataclass(frozen=True)
class Architecture:
    """One architecture: its config parser, model builder and param loaders.

    Fields:
      name: the canonical name (also written to an orbax checkpoint's ``config.json``).
      model: ``model(cfg, dtype, attention_fn) -> CausalLM``.
      config_from_dict: ``config.json`` of an orbax checkpoint (``cfg.to_dict()``) -> config.
      aliases: further names that select it (HF ``architectures[0]``, GGUF architecture).
      gguf_config / gguf_params: ``(reader) -> cfg`` and ``(reader, cfg, dtype) -> params`` for a
        ``gguf.GGUFReader``; None when GGUF files of it are not read.
      hf_config / hf_params: ``(config.json dict) -> cfg`` and ``(tensors, cfg, dtype) ->
        params``, where ``tensors`` is a ``models.hf.SafetensorsDir``; None when not read.
      hf_sources: ``(tensors, cfg) -> pytree of models.hf.HFLeaf`` (the params tree's
        structure): lets a tensor-parallel load read only each device's slice of every tensor
        (``jaxserve.loading.sharded``); None: such a load reads ``hf_params`` whole, then shards.
      quant_targets: the params that load-time weight quantisation replaces by
        ``models.quant.QuantizedWeight`` leaves (the model must compute with
        ``models.quant.qmatmul`` / ``embed_lookup``); None: the model does not support
        quantisation, and asking for it is a ValueError.
    """

    name: str
    model: Callable[..., CausalLM]
    config_from_dict: Callable[[dict], ModelConfigLike]
    aliases: tuple[str, ...] = ()
    gguf_config: Callable | None = None
    gguf_params: Callable | None = None
    hf_config: Callable[[dict], ModelConfigLike] | None = None
    hf_params: Callable | None = None
    hf_sources: Callable | None = None
    quant_targets: QuantTargets | None = None


_REGISTRY: dict[str, Architecture] = {}
_loaded_builtins = False
_loaded_entry_points = False


def register_architecture(arch: Architecture, *, replace: bool = False) -> None:
    """Make ``arch`` selectable by its name and aliases.

    Raises:
      ValueError: a name is already taken by another architecture (unless ``replace``).
    """
    for key in (arch.name, *arch.aliases):
        old = _REGISTRY.get(key)
        if old is not None and old is not arch and not replace:
            raise ValueError(f"architecture name {key!r} is already registered "
                             f"(by {old.name!r}); pass replace=True to override it")
    for key in (arch.name, *arch.aliases):
        _REGISTRY[key] = arch


def _load_builtins() -> None:
    global _loaded_builtins
    if not _loaded_builtins:
        _loaded_builtins = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def _load_entry_points() -> None:
    global _loaded_entry_points
    if not _loaded_entry_points:
        _loaded_entry_points = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            ep.load()()


def get_architecture(name: str) -> Architecture:
    """The architecture registered under ``name`` (a canonical name or an alias).

    Raises:
      ValueError: naming the known architectures, when none is registered under ``name``.
    """
    _load_builtins()
    if name not in _REGISTRY:
        _load_entry_points()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model architecture {name!r}; registered: "
                         f"{', '.join(sorted(_REGISTRY))}") from None
