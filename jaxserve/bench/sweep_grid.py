"""``jaxserve sweep --grid``: the engine settings to cross, typed and checked before any server
starts, and a grid point as ``jaxserve serve`` flags."""

from __future__ import annotations

import dataclasses
import itertools
import typing
from typing import Any

from jaxserve.config import EngineConfig


def parse_grid(items: list[str] | None) -> list[dict[str, Any]]:
    """``["max_num_seqs=32,64", "block_size=16"]`` -> the cross product of engine settings
    (values typed as the EngineConfig field); ``[{}]`` without a grid.

    Raises:
      ValueError: a malformed item, an unknown or repeated field, or a value of the wrong type
        or out of range (each value is checked alone against the defaults, before any server
        starts).
    """
    hints = typing.get_type_hints(EngineConfig)
    base = EngineConfig()
    axes: dict[str, list[Any]] = {}
    for item in items or []:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values:
            raise ValueError(f"--grid takes KEY=V1,V2,... items, got {item!r}")
        if key not in {f.name for f in dataclasses.fields(EngineConfig)}:
            raise ValueError(f"--grid: {key!r} is not an engine setting")
        if key in axes:
            raise ValueError(f"--grid: {key!r} given twice")
        kinds = [a for a in typing.get_args(hints[key]) or (hints[key],) if a is not type(None)]
        try:
            axes[key] = [_typed(kinds[0], v) for v in values.split(",")]
        except ValueError:
            raise ValueError(f"--grid {key}: values must be {kinds[0].__name__}, "
                             f"got {values!r}") from None
        for v in axes[key]:
            try:
                dataclasses.replace(base, **{key: v})
            except ValueError as e:
                raise ValueError(f"--grid {key}={v}: {str(e).removeprefix('self.')}") from None
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


BOOLS = {"true": True, "on": True, "yes": True, "1": True,
         "false": False, "off": False, "no": False, "0": False}


def _typed(kind: type, text: str) -> Any:
    """``text`` as ``kind``; booleans from true/false, on/off, yes/no or 1/0."""
    if kind is bool:
        if text.strip().lower() not in BOOLS:
            raise ValueError(text)
        return BOOLS[text.strip().lower()]
    return kind(text)


def grid_flags(cfg: dict[str, Any]) -> list[str]:
    """A grid point as ``jaxserve serve`` flags (``--key value``; a boolean ``--key`` or
    ``--no-key``)."""
    out: list[str] = []
    for key, v in cfg.items():
        flag = "--" + key.replace("_", "-")
        out += [flag if v else "--no-" + flag[2:]] if isinstance(v, bool) else [flag, str(v)]
    return out
