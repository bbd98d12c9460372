"""``jaxserve convert SRC DST [--dtype D]``: write a model as an orbax checkpoint directory.

SRC is anything ``jaxserve serve`` loads (a GGUF file, an HF safetensors directory, another
orbax checkpoint). DST gets the params pytree as an orbax checkpoint in ``--dtype`` (weights
dequantised, q/k rows in HF's rotate-half order, linear weights ``[in, out]``), ``config.json``,
and the tokenizer files with the chat template (``models/checkpoint.py`` and the README describe
the layout). ``jaxserve serve DST`` then loads without reading the source format again.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.config import DTYPES


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The ``convert`` subcommand's arguments."""
    p.add_argument("src", help="a GGUF file, an HF safetensors directory, or an orbax checkpoint")
    p.add_argument("dst", help="new directory for the orbax checkpoint")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="stored dtype; store the dtype you serve in so loading casts nothing "
                        "(auto: what 'serve --dtype auto' uses here: float32 on CPU, bfloat16 "
                        "on accelerators)")


def convert(src: str, dst: str, dtype: str = "auto") -> dict[str, float]:
    """Load ``src`` and write it to ``dst`` as an orbax checkpoint; returns
    ``{"load_s", "save_s"}``.

    Raises:
      ValueError / FileNotFoundError: an unreadable SRC, or a DST that holds a checkpoint already.
    """
    from jaxserve.config import LoadConfig
    from jaxserve.engine import load_model, resolve_dtype
    from models.checkpoint import save_checkpoint

    dt = resolve_dtype(dtype)
    t0 = time.perf_counter()
    cfg, params, tokenizer, _ = load_model(LoadConfig(src), dt, seed=0)
    t1 = time.perf_counter()
    save_checkpoint(dst, cfg, params, dt)
    tokenizer.save_pretrained(dst)
    return {"load_s": t1 - t0, "save_s": time.perf_counter() - t1}


def run(ns: argparse.Namespace) -> int:
    """The ``convert`` command: convert and print what was written."""
    times = convert(ns.src, ns.dst, ns.dtype)
    print(f"wrote {ns.dst} (read {times['load_s']:.1f} s, wrote {times['save_s']:.1f} s); "
          f"serve it with: jaxserve serve {ns.dst}", flush=True)
    return 0
