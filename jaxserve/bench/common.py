"""What the in-process ``jaxserve bench`` commands share: the model flags, percentiles, the JSON
file."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_model_flags(p: argparse.ArgumentParser, *, model: str | None = None,
                    load_format: str = "auto") -> None:
    """``--model``, ``--load-format`` and ``--config`` of an in-process benchmark.

    Args:
      p: the subcommand's parser.
      model: the default ``--model`` (None: SmolLM2-135M-Instruct).
      load_format: the default ``--load-format``.
    """
    p.add_argument("--model", default=model,
                   help="a GGUF file, an HF safetensors or orbax directory, or a built-in config "
                        "with --load-format dummy"
                        + ("" if model else " (default: SmolLM2-135M-Instruct)"))
    p.add_argument("--load-format", default=load_format, choices=["auto", "gguf", "dummy"],
                   help="dummy: random weights of a built-in config")
    p.add_argument("--config", default=None, help="YAML file with engine settings (flag names)")


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank, q in [0, 1]) of a non-empty list."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (parents created) and say so; nothing when path is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    print(f"Saved result to {path}")
