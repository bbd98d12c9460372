"""Preemption victim policy, measured on the real scheduler (pure Python, no model):
"newest" (the latest admitted running request) vs "least_progress" (the one with the fewest
computed tokens), each with and without a host tier to swap to.

Workload (fixed seed): ``--num-requests`` ShareGPT-like (prompt, output) lengths (see
``jaxserve.bench.datasets.sharegpt_like_lengths``), all submitted at once, every request running to its
drawn output length; a device pool of ``--num-kv-blocks`` blocks that is far smaller than the
running set needs, so decoding preempts. Each step is counted as one unit of time. Reported
per setting: steps to finish everything, tokens computed (prompt + recomputed prompt and
output after preemption: the wasted work), preemptions, blocks swapped, and the mean and p99
finish step per request (a latency proxy).

Usage: PYTHONPATH=. .venv/bin/python experiments/2026-12-01-preemption-policy/preemption_policy.py [--out results/preemption_policy.json]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from jaxserve.bench.datasets import sharegpt_like_lengths


def simulate(ins: np.ndarray, outs: np.ndarray, policy: str, num_blocks: int,
             num_host_blocks: int, block_size: int) -> dict[str, float]:
    """Run the workload through the scheduler; counts of work and finish steps."""
    from jaxserve.core.scheduler import Scheduler, SchedulerConfig
    from jaxserve.core.sequence import SeqState

    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, block_size=block_size,
                          max_model_len=4096, num_blocks=num_blocks,
                          enable_prefix_caching=False, num_host_blocks=num_host_blocks,
                          preemption_policy=policy)
    sched = Scheduler(cfg)
    for i, (n, m) in enumerate(zip(ins.tolist(), outs.tolist())):
        sched.add(SeqState(f"r{i}", [1] * n, n, m))
    computed = steps = 0
    finish: list[int] = []
    while sched.has_unfinished():
        out = sched.schedule()
        computed += out.num_scheduled_tokens
        res = sched.update(out, [2] * len(out.scheduled))
        steps += 1
        finish += [steps] * len(res.finished)
    st = sched.kv_stats
    useful = int(ins.sum() + outs.sum() - len(ins))  # every token but each request's last
    return {"steps": steps, "tokens_computed": computed, "wasted_tokens": computed - useful,
            "preemptions": sched.num_preemptions_total, "swaps": st.num_swaps,
            "swapped_blocks": st.num_swapped_out_blocks,
            "mean_finish_step": float(np.mean(finish)),
            "p99_finish_step": float(np.percentile(finish, 99))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--num-kv-blocks", type=int, default=600, help="device blocks (incl. 0)")
    p.add_argument("--num-host-blocks", type=int, default=2000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/preemption_policy.json")
    a = p.parse_args()
    ins, outs = sharegpt_like_lengths(a.num_requests, np.random.default_rng(a.seed))
    source = "jaxserve.bench.datasets.sharegpt_like_lengths"
    ok = -(-(ins + outs) // a.block_size) <= a.num_kv_blocks - 1
    ins, outs = ins[ok], outs[ok]
    print(f"{len(ins)} requests, lengths from {source}; device pool {a.num_kv_blocks - 1} blocks "
          f"of {a.block_size}")
    rows = []
    print(f"{'policy':>15} {'host':>5} {'steps':>6} {'computed':>9} {'wasted':>8} {'preempt':>7} "
          f"{'swaps':>5} {'sw blks':>7} {'mean fin':>8} {'p99 fin':>8}")
    for host in (0, a.num_host_blocks):
        for policy in ("newest", "least_progress"):
            r = {"policy": policy, "num_host_blocks": host,
                 **simulate(ins, outs, policy, a.num_kv_blocks, host, a.block_size)}
            rows.append(r)
            print(f"{policy:>15} {host:5d} {r['steps']:6d} {r['tokens_computed']:9d} "
                  f"{r['wasted_tokens']:8d} {r['preemptions']:7d} {r['swaps']:5d} "
                  f"{r['swapped_blocks']:7d} "
                  f"{r['mean_finish_step']:8.1f} {r['p99_finish_step']:8.1f}", flush=True)
    out = {"config": vars(a), "length_source": source, "rows": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
