"""``--kv-events-config``: vLLM's KVEventsConfig JSON, checked field by field, with errors that
name the flag and the field."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig, KVEventsConfig
from jaxserve.config_args import add_engine_args, engine_config_from_args
from tests.conftest import REPO_ROOT


def parse(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_vllms_defaults_and_publisher_rule() -> None:
    cfg = parse(
        "--kv-events-config",
        '{"enable_kv_cache_events": true}',
        "--prefix-caching-hash-algo",
        "sha256_cbor",
    ).kv_events
    assert cfg == KVEventsConfig(True, "zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "",
                                 "map")
    assert cfg.publishing
    assert KVEventsConfig().publisher == "null" and not KVEventsConfig().publishing
    assert EngineConfig().kv_events is None and not EngineConfig().kv_events_enabled


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"enable_kv_cache_events": true, "hwm_size": 5}', "unknown field 'hwm_size'"),
        ('{"enable_kv_cache_events": "yes"}', "'enable_kv_cache_events' must be bool"),
        ('{"buffer_steps": 0}', "'buffer_steps' must be >= 1"),
        ('{"publisher": "kafka"}', "'publisher' must be one of"),
        ('{"event_encoding": "json"}', "'event_encoding' must be one of"),
        ('{"endpoint": "localhost:5557"}', "'endpoint' must start with"),
        ('{"topic": 1}', "'topic' must be str"),
        ('{"enable_kv_cache_events": true', "not valid JSON"),
        ("[]", "must be a JSON object"),
    ],
)
def test_bad_json_names_the_flag_and_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        parse("--kv-events-config", text)
    assert str(e.value).startswith("--kv-events-config=")


def test_unsupported_hash_algorithm_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"--prefix-caching-hash-algo='xxhash' \(vLLM's\) is "
        r"not supported",
    ):
        parse("--prefix-caching-hash-algo", "xxhash")


def test_the_engine_imports_no_zmq_msgspec_or_cbor2_until_events_are_on() -> None:
    """pyzmq and msgspec load when a publisher starts, cbor2 when sha256_cbor is chosen."""
    code = (
        "import sys, jaxserve, jaxserve.kv_events, jaxserve.engine.llm_engine\n"
        "from jaxserve.core.kv_manager import KVManager\n"
        "KVManager(4, 16, record_events=True)\n"
        "print(sorted(m for m in ('zmq', 'msgspec', 'cbor2') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert out.stdout.strip() == "[]"
