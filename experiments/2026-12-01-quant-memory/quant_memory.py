"""Memory of quantised weights, by exact byte arithmetic on a model's shapes (nothing allocated).

For each method (int8, int4 at ``--group-size``, fp8), with and without
``--quantize-embeddings``: the bytes of the quantised leaves against the same leaves in float32
(the issue's goals: <= 0.27x for int8, <= 0.15x for int4), and the whole model against float32
and bfloat16 (float leaves such as norms stay in the serving dtype; here float32).

Usage: PYTHONPATH=. python experiments/2026-12-01-quant-memory/quant_memory.py [--models smollm2-135m,llama-3.1-8b] [--group-size 32]
           [--out results/quant_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--out", default="results/quant_memory.json")
    a = p.parse_args()

    from models import quant
    from models.config import builtin_config
    from models.registry import get_architecture

    rows = []
    print(f"{'model':14s} {'method':6s} {'emb':>4s} {'quantised MiB':>14s} {'of f32':>8s} "
          f"{'model MiB':>10s} {'of f32':>8s} {'of bf16':>8s}")
    for name in a.models.split(","):
        cfg = builtin_config(name)
        arch = get_architecture(cfg.architecture)
        shapes = arch.model(cfg).param_shapes()
        base = quant.param_bytes(shapes)
        for method in ("int8", "int4", "fp8"):
            for emb in (False, True):
                qcfg = quant.QuantConfig(method, a.group_size, emb)
                b = quant.param_bytes(quant.quantized_shapes(shapes, arch.quant_targets, qcfg))
                row = {"model": name, "method": method, "group_size": a.group_size,
                       "quantize_embeddings": emb, **b,
                       "model_ratio_f32": b["total_bytes"] / base["total_bytes"],
                       "model_ratio_bf16": b["total_bytes"] / (base["total_bytes"] / 2)}
                rows.append(row)
                print(f"{name:14s} {method:6s} {'yes' if emb else 'no':>4s} "
                      f"{b['quantized_bytes'] / 2**20:14.1f} {b['quantized_ratio']:8.4f} "
                      f"{b['total_bytes'] / 2**20:10.1f} {row['model_ratio_f32']:8.4f} "
                      f"{row['model_ratio_bf16']:8.4f}")
        print(f"{name:14s} {'none':6s} {'':>4s} {'':>14s} {'':>8s} "
              f"{base['total_bytes'] / 2**20:10.1f} {1.0:8.4f} {2.0:8.4f}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
