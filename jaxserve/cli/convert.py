"""``jaxserve convert SRC DST [--dtype D]``: write a model as an orbax checkpoint directory
(or, with ``--format hf``, as an HF safetensors directory for other engines; with ``--format
tokenizer``, only its tokenizer files).

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

With ``--kv-cache-dtype fp8|int8`` the converter also runs the KV calibration pass
(``jaxserve.device.kv_calibration``) and stores the scales in ``DST/kv_scales.json``, so serving DST with
an 8-bit KV cache skips it.

``--format tokenizer`` reads no weights: DST gets the tokenizer of SRC (a GGUF file or a
directory with ``tokenizer.json``) as ``tokenizer.json``, ``tokenizer_config.json`` (special
tokens, chat template) and ``generation_config.json``, the directory that Hugging Face
``AutoTokenizer.from_pretrained(DST)`` loads. Load generators that count tokens client-side
(GuideLLM, AIPerf, ``vllm bench serve``) take it where they would fetch a tokenizer from the
hub (docs/benchmarks.md#guidellm-and-aiperf).
"""

from __future__ import annotations

import argparse
import os
import time

from jaxserve.config import DTYPES, QUANTIZATION_METHODS, LoadConfig
from jaxserve.device import kv_calibration as cal
from jaxserve.loading.load import load_model, load_tokenizer
from jaxserve.loading.model_files import default_gguf_path
from jaxserve.platform import current_platform
from models.checkpoint import save_checkpoint, save_kv_scales
from models.hf import save_hf_dir
from models.quant import QuantConfig, apply_quantization
from models.registry import get_architecture
from pallas_kernels.kv_cache import KV_QUANT_DTYPES


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The ``convert`` subcommand's arguments."""
    p.add_argument("src", help="a GGUF file, an HF safetensors directory, or an orbax "
                               "checkpoint; 'default': jaxserve's default model")
    p.add_argument("dst", help="new directory for the checkpoint")
    p.add_argument("--format", default="orbax", choices=["orbax", "hf", "tokenizer"],
                   help="orbax: what jaxserve loads fastest; hf: an HF safetensors directory "
                        "(Llama family, float weights) for other engines, e.g. to run vLLM "
                        "on the same weights; tokenizer: only the tokenizer files (an HF "
                        "tokenizer directory), for load generators that count tokens")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="stored dtype; store the dtype you serve in so loading casts nothing "
                        "(auto: what 'serve --dtype auto' uses here: float32 on CPU, bfloat16 "
                        "on accelerators)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_METHODS,
                   help="store the weights quantised: int8 (per output channel), int4 "
                        "(group-wise asymmetric, two per byte) or fp8 (e4m3, per channel)")
    p.add_argument("--quantization-group-size", type=int, default=32,
                   help="input rows per int4 scale and zero point (must divide the "
                        "weights' input dims)")
    p.add_argument("--quantize-embeddings", action="store_true",
                   help="also quantise the embedding table and the LM head")
    p.add_argument("--kv-cache-dtype", default=None, choices=["fp8", "int8"],
                   help="also calibrate and store the scales of this 8-bit KV cache "
                        "(kv_scales.json; serving with either 8-bit format uses them)")
    p.add_argument("--kv-calibration-file", default=None,
                   help="text for that calibration (default: the passage shipped with jaxserve)")


def convert(src: str, dst: str, dtype: str = "auto", quantization: str = "none",
            quantization_group_size: int = 32, quantize_embeddings: bool = False,
            kv_cache_dtype: str | None = None, kv_calibration_file: str | None = None,
            format: str = "orbax") -> dict[str, float]:
    """Load ``src`` (quantising it as ``models.quant.apply_quantization`` does for serving)
    and write it to ``dst`` as an orbax checkpoint (``format="hf"``: an HF safetensors
    directory, ``models.hf.save_hf_dir``, float weights only); returns ``{"load_s", "save_s"}`` (and
    ``"calibrate_s"`` with ``kv_cache_dtype``).

    Raises:
      ValueError / FileNotFoundError: an unreadable SRC, a DST that holds a checkpoint already,
        bad quantisation settings (naming the field), an architecture without quantisation, or
        an unreadable calibration file.
    """
    qcfg = QuantConfig(quantization, quantization_group_size, quantize_embeddings)
    if format not in ("orbax", "hf"):
        raise ValueError(f"format={format!r} must be 'orbax' or 'hf' (write_tokenizer writes "
                         "the tokenizer alone)")
    if format == "hf" and (quantization != "none" or kv_cache_dtype is not None):
        raise ValueError("format='hf' writes float weights only: no --quantization or "
                         "--kv-cache-dtype")
    if kv_calibration_file is not None and kv_cache_dtype is None:
        raise ValueError("kv_calibration_file is used only with kv_cache_dtype fp8 or int8 "
                         "(--kv-cache-dtype); nothing would be calibrated")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be one of "
                         f"{sorted(KV_QUANT_DTYPES)}")
    dt = current_platform().resolve_dtype(dtype)
    t0 = time.perf_counter()
    loaded = load_model(LoadConfig(src), dt, seed=0)
    cfg, params, tokenizer = loaded.model_config, loaded.params, loaded.tokenizer
    ids = None
    if kv_cache_dtype is not None:  # a bad calibration file fails before anything is written
        ids = cal.calibration_token_ids(
            tokenizer, kv_calibration_file,
            min(cal.MAX_CALIBRATION_TOKENS, cfg.max_position_embeddings))
    arch = get_architecture(cfg.architecture)
    params = apply_quantization(params, arch.quant_targets, qcfg, arch.name,
                                delete_source=True)
    t1 = time.perf_counter()
    if format == "hf":
        save_hf_dir(dst, cfg, params, dt, tokenizer.bos_token_id, tokenizer.eos_token_id)
    else:
        save_checkpoint(dst, cfg, params, dt)
    tokenizer.save_pretrained(dst)
    times = {"load_s": t1 - t0, "save_s": time.perf_counter() - t1}
    if kv_cache_dtype is not None:
        t2 = time.perf_counter()
        _save_kv_scales(dst, cfg, params, dt, kv_cache_dtype, ids)
        times["calibrate_s"] = time.perf_counter() - t2
    return times


def write_tokenizer(src: str, dst: str) -> str:
    """Write the tokenizer of ``src`` (a GGUF file or a tokenizer directory; "default": the
    default model's GGUF) to the new directory ``dst`` as HF tokenizer files
    (``Tokenizer.save_pretrained``); returns the tokenizer's name.

    Raises:
      ValueError: ``src`` has no tokenizer jaxserve reads, or ``dst`` exists and is not empty.
    """
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ValueError(f"{dst} exists and is not an empty directory")
    tokenizer = load_tokenizer(_source(src))
    tokenizer.save_pretrained(dst)
    return tokenizer.name


def _source(src: str) -> str:
    """``src``, or the default model's GGUF for "default" (where no such file exists)."""
    return default_gguf_path() if src == "default" and not os.path.exists(src) else src


def _save_kv_scales(dst: str, cfg, params, dt, kv_cache_dtype: str, ids: list[int]) -> None:
    """Run the engine's KV calibration pass over ``ids`` on the loaded model; write
    DST/kv_scales.json."""
    model = get_architecture(cfg.architecture).model(cfg, dt)
    k_amax, v_amax = cal.calibration_amax(model, params, ids, block_size=16, dtype=dt)
    qdt = KV_QUANT_DTYPES[kv_cache_dtype]
    save_kv_scales(dst, kv_cache_dtype, cal.scales_from_amax(k_amax, qdt),
                   cal.scales_from_amax(v_amax, qdt), num_tokens=len(ids), percentile=100.0)


def run(ns: argparse.Namespace) -> int:
    """The ``convert`` command: convert and print what was written.

    Raises:
      ValueError: as ``convert`` and ``write_tokenizer``; flags that ``--format tokenizer``
        does not use.
    """
    if ns.format == "tokenizer":
        if ns.quantization != "none" or ns.kv_cache_dtype or ns.dtype != "auto":
            raise ValueError("--format tokenizer writes no weights: no --dtype, "
                             "--quantization or --kv-cache-dtype")
        name = write_tokenizer(ns.src, ns.dst)
        print(f"wrote the tokenizer of {name} to {ns.dst} (tokenizer.json, "
              "tokenizer_config.json, generation_config.json)", flush=True)
        return 0
    times = convert(_source(ns.src), ns.dst, ns.dtype, ns.quantization, ns.quantization_group_size,
                    ns.quantize_embeddings, ns.kv_cache_dtype, ns.kv_calibration_file,
                    ns.format)
    flags = ""
    if ns.quantization != "none":
        flags = f" --quantization {ns.quantization}"
        if ns.quantization == "int4":
            flags += f" --quantization-group-size {ns.quantization_group_size}"
        if ns.quantize_embeddings:
            flags += " --quantize-embeddings"
    if ns.kv_cache_dtype:  # the stored scales serve only an 8-bit cache
        flags += f" --kv-cache-dtype {ns.kv_cache_dtype}"
    kv = (f", KV scales for {ns.kv_cache_dtype} calibrated in {times['calibrate_s']:.1f} s"
          if ns.kv_cache_dtype else "")
    print(f"wrote {ns.dst} (read {times['load_s']:.1f} s, wrote {times['save_s']:.1f} s{kv}); "
          f"serve it with: jaxserve serve {ns.dst}{flags}", flush=True)
    return 0
