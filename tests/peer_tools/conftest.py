"""A tiny dummy-weights engine served over real HTTP, the default model's tokenizer as the HF
tokenizer directory ``jaxserve convert --format tokenizer`` writes, and a Mooncake-format trace,
for the GuideLLM and AIPerf smoke tests (``tests/support/tool_venv.py``: each from a venv
of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.server.routes import build_app
from jaxserve.server_config import ServerConfig
from tests.conftest import REPO_ROOT
from tests.support.http_server import serve_app

MODEL = "tiny"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the hub id of the default model's tokenizer
# (timestamp ms, prompt tokens, output tokens, hash ids): requests 2.., sharing the first
# 512-token block of earlier ones, hit the prefix cache
TRACE = [(0, 530, 12, [1, 101]), (150, 600, 8, [2, 102]), (300, 520, 16, [1, 103]),
         (450, 700, 10, [3, 104]), (600, 560, 12, [2, 105]), (750, 515, 9, [1, 106]),
         (900, 640, 14, [4, 107]), (1050, 580, 11, [3, 108])]


@pytest.fixture(scope="module")
def served():
    """``(base URL, engine)``: the ``tiny`` dummy model behind the app, with
    ``--enable-prompt-tokens-details``; the engine is left idle."""
    engine = LLMEngine(EngineConfig(compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
                                    max_model_len=1024),
                       LoadConfig(model=MODEL, load_format="dummy"))
    engine.warmup(progress=False)
    aeng = AsyncEngine(engine)
    aeng.start(warmup=False)
    try:
        cfg = ServerConfig(enable_prompt_tokens_details=True)
        with serve_app(build_app(aeng, MODEL, cfg)) as url:
            yield url, engine
    finally:
        aeng.shutdown()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer as an HF tokenizer directory (``jaxserve convert``)."""
    from jaxserve.cli.main import main as cli_main

    dst = tmp_path_factory.mktemp("tok") / "smollm2"
    assert cli_main(["convert", "default", str(dst), "--format", "tokenizer"]) == 0
    return dst


@pytest.fixture
def trace_file(tmp_path) -> Path:
    """``TRACE`` as Mooncake JSONL."""
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                        "hash_ids": h}) + "\n" for t, n, o, h in TRACE))
    return path
