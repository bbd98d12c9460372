"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from ``ai-dynamo-runtime``,
a test extra) reads the KV events of two data-parallel replicas of a real engine (the tiny dummy
model, a 15-block device pool and a 6-block host tier each) and, asked before each of 20
scripted prompts is sent, scores exactly the prefix-cache hits the replica then finds: through
evictions (``BlockRemoved``), offloads to the host tier (self-describing host ``BlockStored``)
and a reset (``AllBlocksCleared``). Dynamo registers the replicas as vLLM's: one worker, one
``dp_rank`` each, on the endpoint port plus the rank."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time

import httpx

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT

assert importlib.util.find_spec("dynamo.indexer"), "ai-dynamo-runtime (a test extra) is missing"

BS = 16
BLOCK_BYTES = 2 * 2 * BS * 4 * 16 * 2  # K and V, 2 layers, 4 kv heads of 16 (bfloat16 here)
SETTLE_S = 0.3  # a score unchanged this long is the indexer's settled answer
WAIT_S = 20.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(port: int, rank: int) -> LLMEngine:
    cfg = EngineConfig(
        max_model_len=128, num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=64,
        kv_offloading_size=6.5 * BLOCK_BYTES / 2**30, prefill_order="fcfs", itl_slo_ms=0, ttft_slo_ms=0,
        prefix_caching_hash_algo="sha256_cbor",
        compilation_cache_dir=str(REPO_ROOT / ".jax_cache"),
        # '*': the replica binds (the indexer connects); replica 1 on the port plus one
        kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}',
    )
    eng = LLMEngine(cfg, LoadConfig(model="tiny", load_format="dummy"),
                    metrics=EngineMetrics("tiny"), data_parallel_rank=rank)
    assert eng.scheduler.kv.num_host_blocks == 6 + 1  # as the module docstring says
    return eng


def hits(eng: LLMEngine) -> tuple[float, float]:
    """(prefix-cache hit tokens in either tier, of those on the host tier) so far."""
    get = eng.metrics.registry.get_sample_value
    return (get("jaxserve:prefix_cache_hits_total", {"model_name": "tiny"}),
            get("jaxserve:host_prefix_cache_hits_total", {"model_name": "tiny"}))


def drive(eng: LLMEngine, rid: str, prompt: list[int]) -> None:
    eng.add_request(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.step()  # the async loop's last read


def settled(client: httpx.Client, tokens: list[int]) -> dict:
    """The indexer's /query answer once it stops changing (its event processing is async)."""
    deadline, last, since = time.monotonic() + WAIT_S, None, time.monotonic()
    while time.monotonic() < deadline:
        r = client.post("/query", json={"model_name": "default", "token_ids": tokens})
        r.raise_for_status()
        got = r.json()
        if got != last:
            last, since = got, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            return got
        time.sleep(0.05)
    raise AssertionError(f"the indexer's answer kept changing: {last}")


def script() -> list[tuple[int, list[int]]]:
    """20 (replica, prompt) pairs. ``A``/``B``/``C`` are 3-block prefixes, ``u(k)`` unrelated
    prompts that fill the 15-block pool and evict (to the host tier) what came before; every
    prompt ends 5 tokens past a block boundary, so the engine's cap of ``(len - 1) // 16``
    cached blocks is every full block the indexer scores. A reset of replica 0 comes before
    prompt 14."""
    fam = {f: [(97 * i + 31 * n) % 3000 + 5 for i in range(48)] for n, f in enumerate("ABC")}

    def p(prefix: str, n_blocks: int, k: int) -> list[int]:
        return fam[prefix][: 16 * n_blocks] + [4100 + k] * 21

    def u(k: int) -> list[int]:
        return [(53 * i + 7 * k) % 4000 + 11 for i in range(69)]

    return [
        (0, p("A", 3, 0)), (1, p("B", 3, 1)), (0, p("A", 2, 2)),  # device hits
        (1, p("A", 3, 3)),  # replica 1 has no A: the indexer scores replica 0 only
        (0, u(4)), (0, u(5)), (0, u(6)),  # A leaves replica 0's device for its host tier
        (0, p("A", 3, 7)),  # host-tier hits, loaded back
        (1, p("B", 2, 8)), (1, u(9)), (1, u(10)), (1, u(11)), (1, u(12)),  # and on replica 1
        (1, p("B", 3, 13)),
        (0, p("A", 3, 14)),  # after replica 0's reset: nothing on replica 0
        (0, p("C", 3, 15)), (1, p("C", 2, 16)), (0, u(17)), (0, p("C", 1, 18)),
        (1, p("B", 3, 19)),
    ]


def start_indexer(workers: str, log_path) -> tuple[subprocess.Popen, httpx.Client]:
    """Dynamo's indexer on a free port, its HTTP client once it answers."""
    http_port = free_port()
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--block-size", str(BS), "--threads", "1",
         "--port", str(http_port), "--workers", workers], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    client = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=10)
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            client.get("/dump").raise_for_status()
            return proc, client
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(log_path.read_text()[-2000:]) from None
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_dynamos_indexer_scores_what_each_replica_hits(tmp_path) -> None:
    """Per prompt, asked before it is sent: the replica's device-tier score (``gpu``, and its
    ``dp_rank``'s score) equals the tokens the replica then finds on its device, and the
    score through the host tier (``cpu``) the tokens it finds in either tier."""
    port = free_port()
    engines = [make_engine(port, rank) for rank in (0, 1)]
    proc, client = start_indexer(f"1=tcp://127.0.0.1:{port},2=tcp://127.0.0.1:{port + 1}",
                                 tmp_path / "indexer.log")
    rows = []
    try:
        for e in engines:
            e.warmup(progress=False)
        for k, (rank, prompt) in enumerate(script()):
            if k == 14:  # replica 0's reset: the indexer forgets its blocks, keeps replica 1's
                cached = settled(client, prompt)["instances"]["1"]["gpu"]
                engines[0].reset_prefix_cache()
                engines[0].step()  # publishes it
            scores = settled(client, prompt)
            before = hits(engines[rank])
            drive(engines[rank], f"r{k}", prompt)
            total, host = (a - b for a, b in zip(hits(engines[rank]), before, strict=True))
            worker = str(rank + 1)
            inst = scores["instances"].get(worker, {})
            rows.append((k, rank, total, host, inst))
            assert scores["scores"].get(worker, {}).get(str(rank), 0) == total - host, rows[-1]
            assert (inst.get("gpu", 0), inst.get("cpu", 0)) == (total - host, total), rows[-1]
        # the script went where it says: host-tier hits on both replicas, device hits, evictions
        # of device and host blocks, and a reset that dropped blocks the indexer had scored
        assert {r for _, r, _, host, _ in rows if host > 0} == {0, 1}
        assert sum(total - host for _, _, total, host, _ in rows) > 0
        assert cached == 48 and rows[14][2] == 0
        for e in engines:
            get = e.metrics.registry.get_sample_value
            assert get("jaxserve:kv_cache_evictions_total", {"model_name": "tiny"}) > 0
            assert e.scheduler.kv.stats.num_host_evicted_blocks > 0
    finally:
        stop(proc)
        for e in engines:
            e.close()


def test_dynamo_reads_the_array_encoding_too(tmp_path) -> None:
    """With ``event_encoding: "array"`` (for llm-d-kv-cache <= v0.8) Dynamo's indexer still
    scores stored blocks, forgets removed ones and a reset."""
    from jaxserve.config import KVEventsConfig
    from jaxserve.core.block_hash import BlockHasher
    from jaxserve.core.cache_events import BlocksRemoved, BlocksStored, CacheCleared
    from jaxserve.kv_events.publisher import ZmqEventPublisher

    port = free_port()
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                           endpoint=f"tcp://*:{port}", event_encoding="array"),
                            block_size=BS)
    proc, client = start_indexer(f"1=tcp://127.0.0.1:{port}", tmp_path / "indexer.log")
    try:
        tokens = list(range(1, 54))
        h = BlockHasher("sha256_cbor")
        hashes = [h(None, tokens[:16])]
        hashes += [h(hashes[-1], tokens[16:32]), h(h(hashes[-1], tokens[16:32]), tokens[32:48])]

        def score() -> int:
            return settled(client, tokens)["scores"].get("1", {}).get("0", 0)

        deadline = time.monotonic() + WAIT_S  # a SUB misses what is sent before it connects
        while True:
            pub.publish([BlocksStored(tuple(hashes), None, tuple(tokens[:48]), "GPU")])
            if score() == 48 or time.monotonic() > deadline:
                break
        assert score() == 48
        pub.publish([BlocksRemoved((hashes[2],), "GPU")])
        assert score() == 32
        pub.publish([CacheCleared()])
        assert score() == 0
    finally:
        stop(proc)
        pub.shutdown()
