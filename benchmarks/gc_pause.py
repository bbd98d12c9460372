"""How long does a collection of the oldest generation stop a serving process? (0047)

    python -m benchmarks.gc_pause --json gc.json

One engine through ``jaxserve.LLM`` (every step program compiled, as a server's once its
background compile has ended; the serving defaults but for ``--engine-args``), ``--requests``
short requests run through it, then ``--repeats`` full collections (``gc.collect()``) timed
twice: with the heap as it is, and after a full collection and ``gc.freeze()`` (what
``jaxserve serve`` does, ``jaxserve.platform.process.freeze_heap``). A full collection holds
the GIL throughout, so in a server its wall time is how long the engine thread cannot prepare
or finish a step. A server's heap also holds the HTTP stack's objects: ~340k objects against
this harness's ~330k for SmolLM2-135M. The heap is unfrozen again at the end.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

from benchmarks.common import add_model_args, format_table, median, write_json

SERVING: dict[str, Any] = {"max_model_len": 4096}


def build_parser() -> argparse.ArgumentParser:
    """The harness's flags (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gc_pause",
                                description=__doc__.split("\n")[0])
    add_model_args(p, SERVING)
    p.add_argument("--requests", type=int, default=8, help="requests served before timing")
    p.add_argument("--repeats", type=int, default=5, help="full collections timed per state")
    return p


def _serve(llm: Any, n: int) -> int:
    """Run ``n`` 32-token requests at once; returns the tokens generated."""
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.7, seed=0)
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def _collections(repeats: int) -> dict[str, float]:
    """``repeats`` timed ``gc.collect()`` calls: objects walked, wall ms (median, max)."""
    walked = len(gc.get_objects())
    ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {"objects_walked": walked, "median_ms": median(ms), "max_ms": max(ms)}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    """Build the engine, run the requests, time the collections; print the table and return
    the result dict.

    Raises:
      ValueError: ``--requests`` or ``--repeats`` below 1, or a bad engine setting.
    """
    from jaxserve import LLM

    if ns.requests < 1 or ns.repeats < 1:
        raise ValueError("--requests and --repeats must be >= 1")
    llm = LLM(ns.model, load_format=ns.load_format, **{**SERVING, **ns.engine_args})
    tokens = _serve(llm, ns.requests)
    rows = {"as it is": _collections(ns.repeats)}
    try:
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        freeze_ms = (time.perf_counter() - t0) * 1e3
        frozen = gc.get_freeze_count()
        rows["frozen"] = _collections(ns.repeats)
    finally:
        gc.unfreeze()
    print(format_table(["heap", "objects walked", "full collection ms (median)", "max ms"],
                       [[k, v["objects_walked"], v["median_ms"], v["max_ms"]]
                        for k, v in rows.items()]))
    print(f"collect and freeze: {frozen} objects frozen in {freeze_ms:.1f} ms; "
          f"{tokens} tokens served first")
    result = {"model": llm.engine.model_name, "requests": ns.requests, "tokens": tokens,
              "frozen_objects": frozen, "freeze_ms": freeze_ms, "collections": rows}
    write_json(ns.json, result)
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
