"""NVIDIA AIPerf 0.13.0, unchanged, against jaxserve: its Mooncake trace replay (fixed schedule)
with the chat SLO (TTFT <= 200 ms, inter-token latency <= 50 ms) as goodput, server token
counts, and the prompt-cache metrics jaxserve's ``--enable-prompt-tokens-details`` feeds.

AIPerf's trace loader tokenises in worker processes that force ``HF_HUB_OFFLINE=1``, where 0.13
finds a tokenizer only in the Hugging Face hub cache, by hub id (a local directory is refused as
an invalid repo id); so the tokenizer directory jaxserve writes is placed in a hub cache of the
test's own (``HF_HOME``) under the default model's id.
AIPerf's pins need a venv of its own (tests/support/tool_venv.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.peer_tools.conftest import HUB_ID, TRACE
from tests.support.tool_venv import AIPERF, requires, tool_bin

pytestmark = requires(AIPERF)


def hub_cache(home: Path, repo_id: str, files: Path) -> None:
    """Put ``files`` where ``huggingface_hub`` looks for ``repo_id`` offline:
    ``HF_HOME/hub/models--ORG--NAME/snapshots/REV`` with ``refs/main`` naming REV."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    rev = "0" * 40
    shutil.copytree(files, repo / "snapshots" / rev)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)


def test_aiperf_replays_a_trace_against_jaxserve(served, tokenizer_dir, trace_file, tmp_path
                                                 ) -> None:
    bin_dir = tool_bin(AIPERF)
    url, engine = served
    hub_cache(tmp_path / "hf", HUB_ID, tokenizer_dir)
    out = tmp_path / "aiperf"
    r = subprocess.run(
        [str(bin_dir / "aiperf"), "profile", "--model", "tiny", "--url", url,
         "--endpoint-type", "chat", "--streaming", "--tokenizer", HUB_ID,
         "--input-file", str(trace_file), "--custom-dataset-type", "mooncake_trace",
         "--goodput", "time_to_first_token:200 inter_token_latency:50",
         "--use-server-token-count", "--ui-type", "none", "--artifact-dir", str(out)],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
             "AIPERF_DATASET_MMAP_CACHE_ENABLED": "false"})  # tokenise every run, in tmp
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == len(TRACE)
    assert not result.get("error_summary")
    assert result["total_osl"]["avg"] == sum(o for _, _, o, _ in TRACE)  # the server's counts
    assert result["goodput"]["avg"] >= 0.0
    # requests 3, 5, 6 and 8 share a first 512-token block with an earlier one
    assert result["total_usage_prompt_cache_read_tokens"]["avg"] >= 4 * 512
    assert not engine.has_unfinished_requests()
