"""KV-cache events from a real engine (the tiny dummy model, a 23-block cache): a scripted run
of requests that share a prefix, evictions and a prefix-cache reset, read by a subscriber that
decodes with vLLM's structs (``test_publisher``) and recomputes the ``sha256_cbor`` hashes from
the prompts' tokens."""

from __future__ import annotations

import hashlib
import itertools

import cbor2
import pytest
import zmq

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT
from tests.kv_events.test_publisher import (
    DECODE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    subscriber,
    wait_subscribed,
)

BS = 16
SEED = "0"


def ref_hashes(tokens: list[int]) -> list[int]:
    """A router's hashes of ``tokens``' full blocks: vLLM's sha256_cbor chain, as 64-bit ints."""

    def h(obj: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    parent, out = h(SEED), []
    for i in range(len(tokens) // BS):
        parent = h((parent, tuple(tokens[i * BS : (i + 1) * BS]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONHASHSEED", SEED)
    ipc = tmp_path_factory.mktemp("kv")
    cfg = EngineConfig(
        max_model_len=128,
        num_kv_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_order="fcfs",
        itl_slo_ms=0,
        prefix_caching_hash_algo="sha256_cbor",
        compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
        kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{ipc}/pub", '
        f'"replay_endpoint": "ipc://{ipc}/replay", "topic": "kv"}}',
    )
    eng = LLMEngine(
        cfg, LoadConfig(model="tiny", load_format="dummy"), metrics=EngineMetrics("tiny")
    )
    mp.undo()
    eng.warmup(progress=False)
    yield eng
    eng.close()


def drive(eng: LLMEngine, rid: str, prompt: list[int]) -> list[int]:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    eng.step()  # the async loop's last read
    return list(prompt) + out.outputs[0].token_ids


def test_a_scripted_run_streams_stored_removed_and_cleared(engine: LLMEngine) -> None:
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, engine.reporter.kv_events.endpoint, b"kv")
        wait_subscribed(engine.reporter.kv_events, sub)
        base = [(7 * i) % 500 + 1 for i in range(48)]  # 3 full blocks shared
        prompts = [base + [600 + i] * 20 for i in range(2)]
        prompts += [[(31 * i + 13 * k) % 900 + 1 for i in range(70)] for k in range(1, 6)]
        seqs = [drive(engine, f"r{k}", p) for k, p in enumerate(prompts)]
        indexed = {int.from_bytes(h[-8:], "big") for h in engine.scheduler.kv.device._block_of}
        engine.reset_prefix_cache()
        batches = []
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        while not batches or not isinstance(batches[-1][1].events[-1], AllBlocksCleared):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            batches.append((int.from_bytes(seq, "big"), DECODE(payload)))
    finally:
        ctx.destroy(linger=0)
    numbers = [s for s, _ in batches]
    assert all(b > a for a, b in itertools.pairwise(numbers))
    events = [e for _, b in batches for e in b.events]
    assert {b.data_parallel_rank for _, b in batches} == {0}
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and {(e.medium, e.block_size, e.lora_id) for e in stored} == {("GPU", BS, None)}
    # request 0 stores its whole blocks, hashed as a router hashes its tokens
    assert stored[0].parent_block_hash is None
    assert stored[0].block_hashes == ref_hashes(seqs[0])[: len(stored[0].block_hashes)]
    assert stored[0].token_ids == seqs[0][: BS * len(stored[0].block_hashes)]
    # request 1 finds the shared 3 blocks: its first new block's parent is the third
    mine = [e for e in stored if e.block_hashes[0] in ref_hashes(seqs[1])[3:]]
    assert mine[0].parent_block_hash == ref_hashes(seqs[1])[2]
    every_hash = {h for s in seqs for h in ref_hashes(s)}
    assert {h for e in stored for h in e.block_hashes} <= every_hash
    # 23 blocks cannot hold all seven requests: cached blocks were evicted, then all cleared
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed and all(e.medium == "GPU" for e in removed)
    assert {h for e in removed for h in e.block_hashes} <= every_hash
    assert isinstance(events[-1], AllBlocksCleared)
    # a subscriber's view, replayed from the events, is the pool's index before the reset
    view: set[int] = set()
    for e in events[:-1]:
        if isinstance(e, BlockStored):
            view |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= view
            view -= set(e.block_hashes)
        else:
            view = set()
    assert view == indexed and len(indexed) > 0
    assert engine.scheduler.kv.stats.num_evicted_blocks == sum(len(e.block_hashes) for e in removed)
    # the counter on /metrics: every event the subscriber got (the last step's included)
    engine.reporter.record_gauges()
    got = engine.metrics.registry.get_sample_value(
        "jaxserve:kv_events_published_total", {"model_name": "tiny"}
    )
    assert got == engine.reporter.kv_events.num_events_published >= len(events)
    assert (
        engine.metrics.registry.get_sample_value(
            "jaxserve:kv_events_dropped_total", {"model_name": "tiny"}
        )
        == 0
    )


def test_events_off_builds_no_publisher_and_records_nothing() -> None:
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": false}')
    assert not cfg.kv_events_enabled
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}')
    assert cfg.kv_events_enabled and not cfg.kv_events.publishing


def test_a_data_parallel_replica_stamps_its_rank_on_its_own_endpoint() -> None:
    """Replica 1 publishes on the endpoint offset by its rank (inproc: ``_dp1``) and stamps
    ``data_parallel_rank=1`` on every batch, as vLLM's replicas."""
    cfg = EngineConfig(
        max_model_len=128,
        num_kv_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        itl_slo_ms=0,
        compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
        kv_events_config='{"enable_kv_cache_events": true, "endpoint": "inproc://kv-dp"}',
    )
    eng = LLMEngine(cfg, LoadConfig(model="tiny", load_format="dummy"), data_parallel_rank=1)
    try:
        assert eng.reporter.kv_events.endpoint == "inproc://kv-dp_dp1"
        sub = subscriber(zmq.Context.instance(), eng.reporter.kv_events.endpoint)  # inproc: one context
        wait_subscribed(eng.reporter.kv_events, sub)
        eng.warmup(progress=False)
        drive(eng, "a", list(range(1, 40)))
        _, _, payload = sub.recv_multipart()
        batch = DECODE(payload)
        assert batch.data_parallel_rank == 1
        assert isinstance(batch.events[0], BlockStored)
        sub.close(linger=0)
    finally:
        eng.close()


def test_a_salted_request_does_not_share_an_unsalted_prefix(engine: LLMEngine) -> None:
    """vLLM's ``cache_salt`` reaches the scheduler's sequence and its first block's hash: the
    same prompt salted neither hits the unsalted blocks nor hashes as a router would unsalted;
    a bad salt is refused naming the field."""
    from jaxserve.errors import InvalidRequest

    prompt = [(11 * i) % 700 + 3 for i in range(40)]
    drive(engine, "plain", prompt)
    salted = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, cache_salt="abc")
    engine.add_request("salted", prompt, salted)
    seq = engine.requests.choice("salted").seq
    assert seq.cache_salt == "abc"
    engine.step()
    assert seq.block_hashes and int.from_bytes(seq.block_hashes[0][-8:], "big") \
        not in ref_hashes(prompt)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    for bad in ("", 5):
        with pytest.raises(InvalidRequest) as exc:
            SamplingParams(cache_salt=bad)
        assert exc.value.param == "cache_salt"
