"""KV-cache events from a real engine (the tiny dummy model, a 23-block cache and a 6-block host
tier): a scripted run of requests that share a prefix, a salted request, evictions, offloads to
the host tier and a prefix-cache reset. Every message is decoded by vLLM 0.32's own subscriber
(``msgspec.msgpack.Decoder(KVEventBatch)`` from the released wheel, and from a full vLLM
install when ``$JAXSERVE_VLLM_PYTHON`` names one), and every stored block's hash equals the
one vLLM's request block hasher (``sha256_cbor``) computes for the same tokens."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import zmq

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT
from tests.kv_events.test_publisher import subscriber, wait_subscribed
from tests.support.vllm_wheel import block_hashes, run_full_vllm

BS = 16
SEED = "0"
HOST_BLOCKS = 6
BLOCK_BYTES = 2 * 2 * BS * 4 * 16 * 2  # K and V, 2 layers, 4 kv heads of 16 (bfloat16 here)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONHASHSEED", SEED)
    ipc = tmp_path_factory.mktemp("kv")
    cfg = EngineConfig(
        max_model_len=128,
        num_kv_blocks=24,
        kv_offloading_size=(HOST_BLOCKS + 0.5) * BLOCK_BYTES / 2**30,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_order="fcfs",
        itl_slo_ms=0, ttft_slo_ms=0,
        prefix_caching_hash_algo="sha256_cbor",
        compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
        kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{ipc}/pub", '
        f'"replay_endpoint": "ipc://{ipc}/replay", "topic": "kv"}}',
    )
    eng = LLMEngine(
        cfg, LoadConfig(model="tiny", load_format="dummy"), metrics=EngineMetrics("tiny")
    )
    mp.undo()
    assert eng.scheduler.kv.num_host_blocks == HOST_BLOCKS + 1
    eng.warmup(progress=False)
    yield eng
    eng.close()


@pytest.fixture
def vllm_hashes(vllm, monkeypatch):
    """vLLM's hashes of a prompt's full blocks (its NONE_HASH seeded as the engine's)."""
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    vllm.kv_cache_utils.init(vllm.hashing.sha256_cbor)
    return lambda tokens, salt=None: block_hashes(vllm, tokens, BS, salt)


def drive(eng: LLMEngine, rid: str, prompt: list[int], salt: str | None = None) -> list[int]:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0,
                                                ignore_eos=True, cache_salt=salt))
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    eng.step()  # the async loop's last read
    return list(prompt) + out.outputs[0].token_ids


def scripted_run(engine: LLMEngine, v) -> tuple[list[tuple[int, bytes]], list, set[int]]:
    """Drive the script (``v``: vLLM's kv_events module, to see the reset's message); returns
    the messages ``(seq, payload)`` up to the reset, the
    ``(tokens, salt)`` of each finished sequence, and the device pool's index before the reset
    (64-bit hashes)."""
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, engine.reporter.kv_events.endpoint, b"kv")
        wait_subscribed(engine.reporter.kv_events, sub)
        base = [(7 * i) % 500 + 1 for i in range(48)]  # 3 full blocks shared
        script = [(base + [600 + i] * 20, None) for i in range(2)]
        script += [([(31 * i + 13 * k) % 900 + 1 for i in range(70)], None) for k in range(1, 6)]
        script += [(base + [700] * 20, None), (base + [800] * 20, "tenant-a")]
        seqs = [(drive(engine, f"r{k}", p, salt), salt) for k, (p, salt) in enumerate(script)]
        indexed = {int.from_bytes(h[-8:], "big") for h in engine.scheduler.kv.device._block_of}
        engine.reset_prefix_cache()
        messages, last = [], None
        decode = msgspec.msgpack.Decoder(v.KVEventBatch).decode
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        while not isinstance(last, v.AllBlocksCleared):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            messages.append((int.from_bytes(seq, "big"), payload))
            last = decode(payload).events[-1]
    finally:
        ctx.destroy(linger=0)
    return messages, seqs, indexed


@pytest.fixture(scope="module")
def scripted(engine: LLMEngine, vllm):
    """The scripted run's messages, sequences and device index (``scripted_run``), once."""
    return scripted_run(engine, vllm.kv_events)


def test_vllms_decoder_reads_every_message_of_a_scripted_run(
    engine: LLMEngine, vllm, vllm_hashes, scripted
) -> None:
    v = vllm.kv_events
    messages, seqs, indexed = scripted
    decode = msgspec.msgpack.Decoder(v.KVEventBatch).decode
    batches = [decode(p) for _, p in messages]  # every message, with vLLM 0.32's structs
    assert all(b == a + 1 for a, b in itertools.pairwise(s for s, _ in messages))
    assert {b.data_parallel_rank for b in batches} == {0}
    events = [e for b in batches for e in b.events]
    assert isinstance(events[-1], v.AllBlocksCleared)
    # each block a router can hash: vLLM's hasher over every sequence's tokens (and salt)
    chains = {}  # 64-bit hash -> (parent's hash or None, the block's tokens)
    for tokens, salt in seqs:
        hs = vllm_hashes(tokens, salt)
        for i, h in enumerate(hs):
            chains[h] = (hs[i - 1] if i else None, tokens[i * BS:(i + 1) * BS])
    stored = [e for e in events if isinstance(e, v.BlockStored)]
    assert {e.medium for e in stored} == {"GPU", "CPU"}  # the host tier took evicted blocks
    for e in stored:
        assert (e.block_size, e.lora_id, e.lora_name, e.group_idx) == (BS, None, None, 0)
        assert e.kv_cache_spec_kind == "full_attention" and e.token_ids
        for i, h in enumerate(e.block_hashes):
            parent, tokens = chains[h]
            assert parent == (e.block_hashes[i - 1] if i else e.parent_block_hash)
            assert tokens == e.token_ids[i * BS:(i + 1) * BS]
    # the salted request's first block says its salt, untagged, as vLLM's events do
    salted = vllm_hashes(*seqs[-1])
    assert next(e for e in stored if salted[0] in e.block_hashes).extra_keys[0] == ("tenant-a",)
    assert salted[0] not in vllm_hashes(seqs[-1][0])
    removed = [e for e in events if isinstance(e, v.BlockRemoved)]
    assert {e.medium for e in removed} == {"GPU", "CPU"} and all(e.group_idx == 0
                                                                 for e in removed)
    # a subscriber's device view, replayed from the events, is the pool's index before the reset
    view: set[int] = set()
    for e in events[:-1]:
        if isinstance(e, v.BlockStored) and e.medium == "GPU":
            view |= set(e.block_hashes)
        elif isinstance(e, v.BlockRemoved) and e.medium == "GPU":
            assert set(e.block_hashes) <= view
            view -= set(e.block_hashes)
    assert view == indexed and len(indexed) > 0
    stats = engine.scheduler.kv.stats
    assert stats.num_evicted_blocks == sum(len(e.block_hashes) for e in removed
                                           if e.medium == "GPU")
    assert stats.num_offloaded_blocks == sum(len(e.block_hashes) for e in stored
                                             if e.medium == "CPU")
    # the counter on /metrics: every event sent (the last step's included)
    engine.reporter.record_gauges()
    got = engine.metrics.registry.get_sample_value(
        "jaxserve:kv_events_published_total", {"model_name": "tiny"}
    )
    assert got == engine.reporter.kv_events.num_events_published >= len(events)
    assert engine.metrics.registry.get_sample_value(
        "jaxserve:kv_events_dropped_total", {"model_name": "tiny"}) == 0


def test_a_full_vllm_install_reads_the_same_run(vllm, vllm_hashes, scripted, tmp_path) -> None:
    """The scripted run's messages and prompts through a full vLLM install's own imports
    (``$JAXSERVE_VLLM_PYTHON``): the same decoded batches, the same block hashes."""
    messages, seqs, _ = scripted
    full = run_full_vllm([p for _, p in messages], [(t, s) for t, s in seqs], BS, tmp_path)
    assert full["version"].startswith("0.32")
    decode = msgspec.msgpack.Decoder(vllm.kv_events.KVEventBatch).decode
    mine = [msgspec.to_builtins(decode(p)) for _, p in messages]
    assert full["batches"] == msgspec.json.decode(msgspec.json.encode(mine))  # tuples as lists
    assert full["hashes"] == [vllm_hashes(t, s) for t, s in seqs]


def test_events_off_builds_no_publisher_and_records_nothing() -> None:
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": false}')
    assert not cfg.kv_events_enabled
    cfg = EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "null"}')
    assert cfg.kv_events_enabled and not cfg.kv_events.publishing


def test_a_data_parallel_replica_stamps_its_rank_on_its_own_endpoint(vllm) -> None:
    """Replica 1 publishes on the endpoint offset by its rank (inproc: ``_dp1``) and stamps
    ``data_parallel_rank=1`` on every batch, as vLLM's replicas."""
    cfg = EngineConfig(
        max_model_len=128,
        num_kv_blocks=24,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        itl_slo_ms=0, ttft_slo_ms=0,
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
        batch = msgspec.msgpack.Decoder(vllm.kv_events.KVEventBatch).decode(payload)
        assert batch.data_parallel_rank == 1
        assert isinstance(batch.events[0], vllm.kv_events.BlockStored)
        sub.close(linger=0)
    finally:
        eng.close()


def test_a_salted_request_does_not_share_an_unsalted_prefix(engine: LLMEngine,
                                                            vllm_hashes) -> None:
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
    first = int.from_bytes(seq.block_hashes[0][-8:], "big")
    assert first not in vllm_hashes(prompt) and first == vllm_hashes(prompt, "abc")[0]
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    for bad in ("", 5):
        with pytest.raises(InvalidRequest) as exc:
            SamplingParams(cache_salt=bad)
        assert exc.value.param == "cache_salt"
