"""Shared pieces of the harnesses: flags, engine construction, timing, the table, the JSON.

Engines are built through the public ``jaxserve.LLM`` (so the process settings that ``LLM()``
applies hold here too) and driven with the engine's public methods (``add_request``, ``step``,
``has_unfinished_requests``, ``abort_request``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine

SEED = 0  # every harness draws its prompts and arrays from numpy's Generator(SEED)
# the defaults of a measuring engine: nothing cached across settings, synchronous steps
ENGINE_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": False, "async_scheduling": False,
                                   "compilation_cache_dir": ""}


def parse_value(text: str) -> Any:
    """``"12"`` -> 12, ``"0.5"`` -> 0.5, ``"true"`` -> True, anything else unchanged."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_settings(text: str) -> dict[str, Any]:
    """``"dtype=float32,max_num_seqs=16"`` -> ``{"dtype": "float32", "max_num_seqs": 16}``.

    Keys are ``EngineConfig`` field names (dashes become underscores).

    Raises:
      ValueError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"engine setting {item!r} must be KEY=VALUE")
        out[key.strip().replace("-", "_")] = parse_value(value.strip())
    return out


def parse_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``"bf16:dtype=bfloat16,kv_cache_dtype=bfloat16"`` -> ``("bf16", {...})``.

    Raises:
      ValueError: no name before the colon, or a malformed setting.
    """
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"--config {spec!r} needs a NAME before ':'")
    return name, parse_settings(rest)


def parse_configs(specs: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The ``--config`` flags (``add_config_flag``) as name -> settings, in their order.

    Raises:
      ValueError: as ``parse_config``, or two configs with one name.
    """
    configs = dict(parse_config(c) for c in specs)
    if len(configs) != len(specs):
        raise ValueError("--config names must differ")
    return configs


def add_config_flag(p: argparse.ArgumentParser) -> None:
    """``--config NAME:KEY=VALUE,...``, once per engine an A/B harness compares."""
    p.add_argument("--config", action="append", required=True, metavar="NAME:KEY=VALUE,...",
                   help="one engine's EngineConfig settings; give two or more")


def int_list(text: str) -> list[int]:
    """``"1,16,64"`` -> ``[1, 16, 64]``."""
    return [int(x) for x in text.split(",") if x]


def add_model_args(p: argparse.ArgumentParser,
                   defaults: dict[str, Any] | None = None) -> None:
    """``--model``, ``--load-format``, ``--engine-args`` and ``--json``; ``--engine-args``'s
    help names the settings it goes over (``defaults``; None: ``ENGINE_DEFAULTS``)."""
    p.add_argument("--model", default=None,
                   help="GGUF file, HF or orbax directory, or with --load-format dummy a "
                        "built-in config name (tiny, smollm2-135m, llama-3.1-8b); default: "
                        "jaxserve's default model")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--engine-args", type=parse_settings, default={},
                   help="EngineConfig fields for every engine, KEY=VALUE,... (over "
                        f"{ENGINE_DEFAULTS if defaults is None else defaults})")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")


def build_engine(model: str | None, load_format: str, settings: dict[str, Any]) -> LLMEngine:
    """A warmed-up ``LLMEngine`` built by ``jaxserve.LLM`` with ``ENGINE_DEFAULTS | settings``.

    Raises:
      ValueError: an unknown or invalid engine setting (from ``LLM``).
    """
    from jaxserve import LLM

    return LLM(model, load_format=load_format, **{**ENGINE_DEFAULTS, **settings}).engine


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned; floats
    with one decimal."""
    cells = [[f"{c:.1f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                        enumerate(zip(r, widths, strict=True))) for r in cells]
    return "\n".join(lines)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON to ``path`` (parents created); nothing when None."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")
