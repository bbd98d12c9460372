"""GuideLLM 0.8.1, unchanged, against jaxserve: its ``replay`` profile over a Mooncake trace
with the chat SLO (TTFT <= 200 ms, inter-token latency <= 50 ms) as goodput objectives, counting
tokens with the tokenizer directory jaxserve writes (no hub lookup: ``HF_HUB_OFFLINE=1``).
GuideLLM runs from a venv of its own, with torch (tests/support/tool_venv.py).
"""

from __future__ import annotations

import json
import os
import subprocess

from tests.peer_tools.conftest import TRACE
from tests.support.tool_venv import GUIDELLM, requires, tool_bin

pytestmark = requires(GUIDELLM)


def test_guidellm_replays_a_trace_against_jaxserve(served, tokenizer_dir, trace_file, tmp_path
                                                   ) -> None:
    bin_dir = tool_bin(GUIDELLM)
    url, engine = served
    out = tmp_path / "guidellm.json"
    data = {"kind": "mooncake", "source": {"kind": "json_file", "path": str(trace_file)},
            "time_scale": 0.001}  # Mooncake's timestamps are milliseconds, GuideLLM's seconds
    slo = {"kind": "generative", "slo": {"ttft_ms": 200, "tpot_ms": 50}}
    r = subprocess.run(
        [str(bin_dir / "guidellm"), "run", "--backend", f"kind=openai_http,target={url}",
         "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}", "--data", json.dumps(data),
         "--profile", "kind=replay", "--metrics", json.dumps(slo),
         "--output", f"kind=json,path={out}", "--disable-console-interactive"],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    reqs = bench["requests"]
    assert not reqs["errored"] and not reqs["incomplete"]
    # GuideLLM may leave the last request out of its count when the trace ends on it
    assert len(TRACE) - 1 <= len(reqs["successful"]) <= len(TRACE)
    outputs = sorted(q["output_metrics"]["text_tokens"] for q in reqs["successful"])
    assert set(outputs) <= {o for _, _, o, _ in TRACE}  # max_tokens with ignore_eos honoured
    for q in reqs["successful"]:  # the server's usage: the prompt plus the chat template
        assert q["input_metrics"]["text_tokens"] >= min(n for _, n, _, _ in TRACE)
    attainment = bench["metrics"]["slo_attainment"]
    assert attainment is not None and 0.0 <= attainment <= 1.0
    assert not engine.has_unfinished_requests()
