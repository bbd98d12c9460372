"""``jaxserve bench step-trace FILE``: where a server's (or an offline run's) steps spent their
time, per bucket and phase, from the lines ``--step-trace FILE`` wrote.

    jaxserve serve --step-trace-file steps.jsonl &   # then drive it, e.g. jaxserve bench serve ...
    jaxserve bench step-trace steps.jsonl --output-json steps-summary.json
"""

from __future__ import annotations

import argparse
import json

from jaxserve.engine.step_trace import format_summary, read, summarize


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The command's flags."""
    p.add_argument("trace", help="a file written by --step-trace")
    p.add_argument("--since", type=float, default=None,
                   help="only steps that ended at or after this unix time (e.g. after warm-up)")
    p.add_argument("--output-json", default=None, help="write the summary here")


def run(ns: argparse.Namespace) -> int:
    """Print (and optionally save) the summary; returns the exit status.

    Raises:
      ValueError: for a file that is not a step trace, or with no step after ``--since``.
    """
    recs = [r for r in read(ns.trace) if ns.since is None or r["t"] >= ns.since]
    if not recs:
        raise ValueError(f"{ns.trace}: no steps" + ("" if ns.since is None else
                                                      f" at or after --since {ns.since}"))
    summary = summarize(recs)
    print(format_summary(summary))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"Saved result to {ns.output_json}")
    return 0
