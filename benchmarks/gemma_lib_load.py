"""Start-up of a ``gemma`` library checkpoint against our orbax layout of the same weights.

Writes random weights of a Gemma 3 shape (default: the library's ``Gemma3_270M``: width 640, 18
layers, vocabulary 262144) in the library's NESTED tree with one ``StandardCheckpointer().save``
(what ``gm.ckpts.save_params`` does), beside a ``tokenizer.model`` whose pieces, scores and types
are those of the Gemma 3 270M GGUF the test extras install (a stand-in for the library's own
file, same vocabulary); converts it with ``jaxserve convert`` to our layout; then times
``load_model`` (config, tokenizer, weights onto the device) of each directory, alternating,
``--repeats`` times, and the tokenizer alone. Prints one table, writes ``--json``.

    python -m benchmarks.gemma_lib_load --dtype bfloat16 --repeats 3 --json results/load.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from benchmarks.common import SEED, format_table, median, write_json
from jaxserve.cli.convert import convert
from jaxserve.config import LoadConfig
from jaxserve.loading.load import load_model, load_tokenizer
from jaxserve.loading.model_files import gemma3_gguf_path
from models.gguf_reader import GGUFFile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gemma_lib_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=640, help="embed_dim (640: Gemma3_270M)")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--mlp", type=int, default=2048, help="hidden_dim of the MLP")
    p.add_argument("--vocab", type=int, default=262144,
                   help="rows of the embedding; the tokenizer is the GGUF's (262144 pieces) "
                        "when this is its size, else the first VOCAB of its pieces")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="stored and served dtype")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write both checkpoints (default: a "
                                               "temporary directory, removed afterwards)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    return p


def gemma_tree(ns: argparse.Namespace, dtype: np.dtype) -> dict:
    """Random params in the library's NESTED layout (``model.init()['params']`` of its
    Gemma 3 ``Transformer``)."""
    rng = np.random.default_rng(SEED)
    d, f, n, k, h = ns.width, ns.mlp, ns.heads, ns.kv_heads, ns.head_dim
    draw = lambda *shape: (0.02 * rng.standard_normal(shape, np.float32)).astype(dtype)
    tree: dict = {"embedder": {"input_embedding": draw(ns.vocab, d)},
                  "final_norm": {"scale": draw(d)}}
    for i in range(ns.layers):
        attn = {"attn_vec_einsum": {"w": draw(n, h, d)}, "_query_norm": {"scale": draw(h)},
                "_key_norm": {"scale": draw(h)}}
        if n == k:
            attn["qkv_einsum"] = {"w": draw(3, n, d, h)}
        else:
            attn["q_einsum"] = {"w": draw(n, d, h)}
            attn["kv_einsum"] = {"w": draw(2, k, d, h)}
        tree[f"layer_{i}"] = {
            "attn": attn, "mlp": {"gating_einsum": draw(2, f, d), "linear": draw(f, d)},
            **{f"{x}_norm": {"scale": draw(d)} for x in ("pre_attention", "post_attention",
                                                          "pre_ffw", "post_ffw")}}
    return tree


def write_tokenizer(path: str, vocab: int) -> None:
    """A SentencePiece BPE ``tokenizer.model`` from the Gemma 3 270M GGUF's pieces (Gemma's
    normaliser settings, its special ids)."""
    from sentencepiece import sentencepiece_model_pb2

    fields = GGUFFile(gemma3_gguf_path()).fields
    pieces = list(fields["tokenizer.ggml.tokens"].contents())[:vocab]
    scores = list(fields["tokenizer.ggml.scores"].contents())[:vocab]
    types = list(fields["tokenizer.ggml.token_type"].contents())[:vocab]
    proto = sentencepiece_model_pb2.ModelProto()
    proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.pad_id, proto.trainer_spec.eos_id = 0, 1
    proto.trainer_spec.bos_id, proto.trainer_spec.unk_id = 2, 3
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    for piece, score, kind in zip(pieces, scores, types, strict=True):
        proto.pieces.add(piece=piece, score=float(score), type=int(kind))
    with open(path, "wb") as fh:
        fh.write(proto.SerializeToString())


def run(ns: argparse.Namespace) -> dict:
    dtype = jnp.dtype(ns.dtype)
    root = ns.dir or tempfile.mkdtemp(prefix="gemma_lib_load_")
    lib, ours = os.path.join(root, "gemma-lib"), os.path.join(root, "ours")
    if not os.path.isdir(lib):
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(os.path.abspath(lib), gemma_tree(ns, dtype))
        ckpt.wait_until_finished()
        ckpt.close()
        write_tokenizer(os.path.join(lib, "tokenizer.model"), ns.vocab)
        with open(os.path.join(lib, "gemma_config.json"), "w") as fh:
            fh.write('{"sliding_window_size": 512}\n')
    if not os.path.isdir(ours):
        convert(lib, ours, ns.dtype)
    times: dict[str, list[float]] = {"gemma-lib": [], "ours": [], "gemma-lib tokenizer": [],
                                     "ours tokenizer": []}
    for _ in range(ns.repeats):
        for name, path in (("gemma-lib", lib), ("ours", ours)):
            t0 = time.perf_counter()
            loaded = load_model(LoadConfig(path), dtype, 0)
            jax.block_until_ready(loaded.params)
            times[name].append(time.perf_counter() - t0)
            del loaded
            t0 = time.perf_counter()
            load_tokenizer(path)
            times[f"{name} tokenizer"].append(time.perf_counter() - t0)
    med = {k: median(v) for k, v in times.items()}
    rows = [(k, 1000 * med[k], 1000 * min(v), 1000 * max(v)) for k, v in times.items()]
    print(format_table(["load", "median ms", "min ms", "max ms"], rows))
    ratio = med["gemma-lib"] / med["ours"]
    print(f"gemma-lib / ours (median load_model): {ratio:.2f}")
    return {"args": vars(ns), "seconds": times, "median_s": med, "ratio": ratio,
            "devices": [str(d) for d in jax.devices()]}


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    write_json(ns.json, run(ns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
