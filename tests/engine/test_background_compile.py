"""Deferred warm-up: ready after the ready buckets, the other programs compiled after it.

The tiny dummy model, ``max_num_batched_tokens`` 32 and 4 sequences: buckets of 1, 4, 8, 16 and
32 tokens; the ready ones are 1 (one decode), 4 (a full decode batch) and 32 (any step), so the
model programs of 8 and 16 tokens are left for after ready (their samplers' row count, 4, is
already compiled).
"""

from __future__ import annotations

import logging
import threading

import pytest

from jaxserve.config import EngineConfig, LoadConfig
from jaxserve.device.buckets import Bucket, ready_buckets
from jaxserve.device.warmup import BackgroundCompile
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.sampling_params import SamplingParams

TINY = LoadConfig(model="tiny", load_format="dummy")
READY = [Bucket(1, 1), Bucket(4, 4), Bucket(32, 4)]
ALL = [Bucket(1, 1), Bucket(4, 4), Bucket(8, 4), Bucket(16, 4), Bucket(32, 4)]
PROMPTS = [list(range(3, 3 + n)) for n in (3, 6, 5)]  # one prefill step of 14 tokens, decodes


def _engine(tmp_path, **kw) -> LLMEngine:
    kw = {"itl_slo_ms": 0, "ttft_slo_ms": 0, **kw}
    cfg = EngineConfig(max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                       max_num_batched_tokens=32, compilation_cache_dir=str(tmp_path / "cache"),
                       **kw)
    return LLMEngine(cfg, TINY, metrics=EngineMetrics("tiny"))


def _run(eng: LLMEngine, buckets: list[Bucket]) -> list[list[int]]:
    """Greedy outputs of ``PROMPTS`` run together; the bucket of every step lands in
    ``buckets``."""
    execute = eng.runner.execute

    def spy(bucket, packed, allowed=None):
        buckets.append(bucket)
        return execute(bucket, packed, allowed)

    eng.runner.execute = spy
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, params)
        out: dict[str, list[int]] = {}
        for _ in range(200):
            if not eng.has_unfinished_requests():
                break
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
        return [out[f"r{i}"] for i in range(len(PROMPTS))]
    finally:
        eng.runner.execute = execute


def test_ready_buckets_are_the_smallest_the_full_decode_and_the_largest() -> None:
    assert ready_buckets(ALL) == READY
    cpu = [Bucket(t, min(t, 64)) for t in (1, 4, 8, 16, 24, 32, 48, 64, 128, 256, 1024)]
    assert [b.num_tokens for b in ready_buckets(cpu)] == [1, 64, 1024]
    assert ready_buckets([Bucket(8, 8)]) == [Bucket(8, 8)]


def test_deferred_warmup_pads_up_then_compile_pending_adds_the_rest(tmp_path) -> None:
    eng = _engine(tmp_path)
    stats = eng.warmup(progress=False, defer=True)
    assert stats["pending_programs"] == 2 and stats["num_programs"] == 6  # 3 + 2 samplers + bias
    assert eng.runner.packer.usable == READY
    used: list[Bucket] = []
    before = _run(eng, used)
    assert set(used) <= set(READY) and Bucket(32, 4) in used  # the 14-token prefill padded up
    assert eng.scheduler.token_buckets == (1, 4, 32)  # it plans for what is compiled
    calls: list[int] = []
    probe = eng.runner.probe
    eng.runner.probe = lambda n=1: calls.append(n) or probe(n)
    eng.calibrate_step_cost((1, 20))  # no ITL target: nothing is probed
    assert calls == []
    assert eng.runner.compile_pending() == 2
    assert eng.runner.packer.usable == ALL and eng.runner.compile_pending() == 0
    used.clear()
    assert _run(eng, used) == before  # the same tokens, in the buckets that fit
    assert eng.scheduler.token_buckets == (1, 4, 8, 16, 32)
    assert Bucket(32, 4) not in used and Bucket(16, 4) in used


def test_calibration_never_probes_a_size_that_would_pad_up(tmp_path) -> None:
    eng = _engine(tmp_path, itl_slo_ms=50)
    eng.warmup(progress=False, defer=True)
    sizes: list[int] = []
    probe = eng.runner.probe
    eng.runner.probe = lambda n=1: (sizes.append(n), probe(n))[1]
    model = eng.calibrate_step_cost((1, 20))
    assert model is not None and sorted(set(sizes)) == [1, 4]  # 20 is lowered to the 4 bucket


def test_warmup_subset_must_hold_the_largest_bucket(tmp_path) -> None:
    eng = _engine(tmp_path)
    with pytest.raises(ValueError, match="hold the largest"):
        eng.runner.warmup(progress=False, buckets=[Bucket(1, 1)])
    with pytest.raises(ValueError, match="must be among"):
        eng.runner.warmup(progress=False, buckets=[Bucket(2, 2), Bucket(32, 4)])


def test_background_compile_runs_beside_steps_and_stops_when_asked(tmp_path, caplog) -> None:
    eng = _engine(tmp_path)
    eng.warmup(progress=False, defer=True)
    stopped = BackgroundCompile(eng.runner)
    assert stopped.stop()  # asked to stop before it started: compiles nothing
    with caplog.at_level(logging.INFO, logger="jaxserve.device.warmup"):
        stopped.start().done.wait(60)
    assert stopped.num_programs == 0 and eng.runner.packer.usable == READY
    assert "background compile stopped after 0 step program(s)" in caplog.text
    bg = BackgroundCompile(eng.runner).start()
    outs = _run(eng, [])  # steps on this thread while the other compiles
    assert bg.done.wait(300) and bg.error is None
    assert bg.num_programs == 2 and bg.seconds > 0
    assert eng.runner.packer.usable == ALL
    assert _run(eng, []) == outs


@pytest.mark.parametrize("background", [True, False])
def test_async_engine_is_ready_before_the_background_compile_ends(tmp_path, background) -> None:
    eng = _engine(tmp_path, background_compile=background)
    aeng = AsyncEngine(eng)
    gate = threading.Event()
    compile_pending = eng.runner.compile_pending
    eng.runner.compile_pending = lambda stop=None: gate.wait(60) and compile_pending(stop)
    aeng.start(progress=False)
    try:
        assert aeng.ready
        if not background:
            assert aeng.background is None and aeng.warmup_stats["pending_programs"] == 0
            assert eng.runner.packer.usable == ALL
            return
        pending = eng.metrics.step_programs_pending._value
        assert aeng.warmup_stats["pending_programs"] == 2 and pending.get() == 2
        assert eng.runner.packer.usable == READY and not aeng.background.done.is_set()
        gate.set()
        assert aeng.background.done.wait(300) and aeng.background.num_programs == 2
        assert eng.runner.packer.usable == ALL and pending.get() == 0
        # compiles off the engine thread are not the ones the alert counts
        assert eng.metrics.num_compiles_after_warmup._value.get() == 0
    finally:
        gate.set()
        aeng.shutdown()
