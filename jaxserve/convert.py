"""``jaxserve convert SRC DST [--dtype D]``: write a model as an orbax checkpoint directory.

SRC is anything ``jaxserve serve`` loads (a GGUF file, an HF safetensors directory, another
orbax checkpoint). DST gets the params pytree as an orbax checkpoint in ``--dtype`` (weights
dequantised, q/k rows in HF's rotate-half order, linear weights ``[in, out]``), ``config.json``,
and the tokenizer files with the chat template (``models/checkpoint.py`` and the README describe
the layout). ``jaxserve serve DST`` then loads without reading the source format again.

With ``--quantization int8|int4|fp8`` (and ``--quantization-group-size``,
``--quantize-embeddings``) the weights are quantised after loading, as ``serve`` would, and
stored quantised (``models.quant``); ``config.json`` records the settings, and serving DST
restores the quantised leaves as stored (no quantisation runs) when given the same
``--quantization`` flags, and refuses other ones.
"""

from __future__ import annotations

import argparse
import time

from jaxserve.config import DTYPES, QUANTIZATION_METHODS


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The ``convert`` subcommand's arguments."""
    p.add_argument("src", help="a GGUF file, an HF safetensors directory, or an orbax checkpoint")
    p.add_argument("dst", help="new directory for the orbax checkpoint")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="stored dtype; store the dtype you serve in so loading casts nothing "
                        "(auto: what 'serve --dtype auto' uses here: float32 on CPU, bfloat16 "
                        "on accelerators)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_METHODS,
                   help="store the weights quantised: int8 (per output channel), int4 "
                        "(group-wise, two per byte) or fp8 (e4m3, per channel)")
    p.add_argument("--quantization-group-size", type=int, default=64,
                   help="input rows per int4 scale (must divide the weights' input dims)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="also quantise the embedding table and the LM head")


def convert(src: str, dst: str, dtype: str = "auto", quantization: str = "none",
            quantization_group_size: int = 64, quantize_embeddings: bool = False
            ) -> dict[str, float]:
    """Load ``src`` (quantising it as ``models.quant.apply_quantization`` does for serving)
    and write it to ``dst`` as an orbax checkpoint; returns ``{"load_s", "save_s"}``.

    Raises:
      ValueError / FileNotFoundError: an unreadable SRC, a DST that holds a checkpoint already,
        bad quantisation settings (naming the field), or an architecture without quantisation.
    """
    from jaxserve.config import LoadConfig
    from jaxserve.engine import load_model, resolve_dtype
    from models.checkpoint import save_checkpoint
    from models.quant import QuantConfig, apply_quantization
    from models.registry import get_architecture

    qcfg = QuantConfig(quantization, quantization_group_size, quantize_embeddings)
    dt = resolve_dtype(dtype)
    t0 = time.perf_counter()
    cfg, params, tokenizer, _ = load_model(LoadConfig(src), dt, seed=0)
    arch = get_architecture(cfg.architecture)
    params = apply_quantization(params, arch.quant_targets, qcfg, arch.name,
                                delete_source=True)
    t1 = time.perf_counter()
    save_checkpoint(dst, cfg, params, dt)
    tokenizer.save_pretrained(dst)
    return {"load_s": t1 - t0, "save_s": time.perf_counter() - t1}


def run(ns: argparse.Namespace) -> int:
    """The ``convert`` command: convert and print what was written."""
    times = convert(ns.src, ns.dst, ns.dtype, ns.quantization, ns.quantization_group_size,
                    ns.quantize_embeddings)
    flags = ""
    if ns.quantization != "none":
        flags = f" --quantization {ns.quantization}"
        if ns.quantization == "int4":
            flags += f" --quantization-group-size {ns.quantization_group_size}"
        if ns.quantize_embeddings:
            flags += " --quantize-embeddings"
    print(f"wrote {ns.dst} (read {times['load_s']:.1f} s, wrote {times['save_s']:.1f} s); "
          f"serve it with: jaxserve serve {ns.dst}{flags}", flush=True)
    return 0
