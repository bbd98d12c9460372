"""Write the validation trace: a ramp of the request rate with Poisson bursts, as the JSONL that
``jaxserve bench serve --dataset-name trace`` replays (arrival_time s, input_length, output_length).

    python experiments/2026-12-01-autoscaling/make_trace.py OUT.jsonl
"""

from __future__ import annotations

import json
import sys

import numpy as np

from jaxserve.autoscaling.simulate import ramp_trace

# one replica of SmolLM2 on the 2-core CPU: 1.8 req/s at concurrency 4, 2.7 at 8 (the sweep)
KNOTS = [(0.0, 0.4), (75.0, 2.4)]
BURSTS = {"burst_every_s": 20.0, "burst_size": 4, "burst_len_s": 1.0}
INPUT_LEN, OUTPUT_LEN = 128, 32


def main(path: str) -> None:
    times = ramp_trace(KNOTS, np.random.default_rng(7), burstiness=1.0, **BURSTS)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"arrival_time": round(float(t), 4), "input_length": INPUT_LEN,
                                 "output_length": OUTPUT_LEN}) + "\n" for t in times)
    print(f"{len(times)} requests over {times[-1]:.1f} s -> {path}")


if __name__ == "__main__":
    main(sys.argv[1])
