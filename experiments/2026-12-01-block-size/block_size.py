"""KV-cache block size: memory waste on ShareGPT-like request lengths, and engine throughput,
for block sizes 8 .. 256.

Waste is allocated-but-unused token slots over allocated slots, averaged over the steps of a
run of the real scheduler (pure Python, no model: every request runs to its drawn output
length, ``max_num_seqs`` 64, ``max_num_batched_tokens`` 512, a pool large enough that nothing is
preempted): at each step ``sum(len(block_ids)) * block_size`` slots are allocated to running
requests and ``sum(num_computed_tokens)`` of them hold K/V. Also reported: the waste at each
request's end, ``(ceil(L / bs) * bs - L) / (ceil(L / bs) * bs)`` summed over requests.

Lengths: ShareGPT-like (prompt, output) pairs from ``jaxserve.bench.datasets`` when it has
``sharegpt_like_lengths``; otherwise this script's own draw with the same published statistics
(vLLM paper, Kwon et al. SOSP 2023, Sec. 6.1: mean prompt 161.31 and output 337.99 tokens) as
lognormals with sigma 1.0 / 0.8, kept where prompt >= 4, output >= 4, prompt <= 1024 and
prompt + output <= 2048. The shape is an assumption (the paper gives means and histograms).

Throughput (unless ``--skip-throughput``): one in-process engine per block size on a dummy model
runs ``--throughput-requests`` of those requests, lengths divided by ``--length-divisor`` to keep
CPU runs short, all submitted at once; output tokens/s and total (prompt + output) tokens/s.

Usage: PYTHONPATH=. .venv/bin/python experiments/2026-12-01-block-size/block_size.py [--out results/block_size.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def sharegpt_like(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(prompt lengths, output lengths, source) of ``n`` ShareGPT-like requests."""
    rng = np.random.default_rng(seed)
    try:
        from jaxserve.bench.datasets import sharegpt_like_lengths
    except ImportError:
        pass
    else:
        ins, outs = sharegpt_like_lengths(n, rng)
        return ins, outs, "jaxserve.bench.datasets.sharegpt_like_lengths"
    ins, outs = [], []
    while len(ins) < n:  # mu solved so that the kept draws have the published means
        i, o = round(rng.lognormal(4.6864, 1.0)), round(rng.lognormal(5.5451, 0.8))
        if i >= 4 and o >= 4 and i <= 1024 and i + o <= 2048:
            ins.append(i)
            outs.append(o)
    return np.array(ins), np.array(outs), "this script's lognormal draw"


def simulated_waste(ins: np.ndarray, outs: np.ndarray, block_size: int) -> dict[str, float]:
    """Time-averaged and end-of-request KV waste of the scheduler on these lengths."""
    from jaxserve.core.scheduler import Scheduler, SchedulerConfig
    from jaxserve.core.sequence import SeqState

    total = int((ins + outs).sum())
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, block_size=block_size,
                          max_model_len=4096, num_blocks=total // block_size + len(ins) + 2,
                          enable_prefix_caching=False)
    sched = Scheduler(cfg)
    for i, (n, m) in enumerate(zip(ins.tolist(), outs.tolist())):
        sched.add(SeqState(f"r{i}", [1] * n, n, m))
    allocated = used = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, [2] * len(out.scheduled))
        allocated += sum(len(q.block_ids) for q in sched.running) * block_size
        used += sum(q.num_computed_tokens for q in sched.running)
    assert sched.num_preemptions_total == 0
    lens = ins + outs
    alloc_end = -(-lens // block_size) * block_size
    return {"waste_time_avg": 1 - used / allocated,
            "waste_at_end": float((alloc_end - lens).sum() / alloc_end.sum())}


def throughput(model: str, block_size: int, ins: np.ndarray, outs: np.ndarray) -> dict[str, float]:
    """Tokens/s of one engine with this block size on these requests (submitted at once)."""
    from jaxserve.config import EngineConfig, LoadConfig
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    max_len = int((ins + outs).max()) + block_size
    engine = LLMEngine(EngineConfig(block_size=block_size, max_model_len=max_len,
                                    enable_prefix_caching=False),
                       LoadConfig(model, "dummy"))
    compile_s = engine.warmup(progress=False)["compile_s"]
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    for i, (n, m) in enumerate(zip(ins.tolist(), outs.tolist())):
        engine.add_request(f"t{i}", rng.integers(100, 49000, n).tolist(),
                           SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    return {"output_tokens_per_s": float(outs.sum() / dt),
            "total_tokens_per_s": float((ins.sum() + outs.sum()) / dt), "wall_s": dt,
            "steps": steps, "compile_s": compile_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=1000, help="for the waste simulation")
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    p.add_argument("--model", default="smollm2-135m", help="dummy model of the throughput runs")
    p.add_argument("--throughput-requests", type=int, default=16)
    p.add_argument("--length-divisor", type=int, default=8)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/block_size.json")
    a = p.parse_args()
    ins, outs, source = sharegpt_like(a.num_requests, a.seed)
    print(f"lengths from {source}: mean prompt {ins.mean():.1f}, mean output {outs.mean():.1f}")
    t_ins = np.maximum(1, ins[:a.throughput_requests] // a.length_divisor)
    t_outs = np.maximum(1, outs[:a.throughput_requests] // a.length_divisor)
    rows = []
    print(f"{'block':>5} {'waste avg':>9} {'at end':>7} {'out tok/s':>9} {'all tok/s':>9}")
    for bs in a.block_sizes:
        row = {"block_size": bs, **simulated_waste(ins, outs, bs)}
        if not a.skip_throughput:
            row.update(throughput(a.model, bs, t_ins, t_outs))
        rows.append(row)
        print(f"{bs:5d} {row['waste_time_avg']:9.2%} {row['waste_at_end']:7.2%} "
              f"{row.get('output_tokens_per_s', float('nan')):9.1f} "
              f"{row.get('total_tokens_per_s', float('nan')):9.1f}", flush=True)
    out = {"config": vars(a), "length_source": source, "mean_prompt_len": float(ins.mean()),
           "mean_output_len": float(outs.mean()), "rows": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
