"""The KV manager's record of prefix-cache changes (what KV-cache events are made of): blocks
stored when registered, evicted from either tier, offloaded to the host tier, and a reset."""

from __future__ import annotations

from jaxserve.core.cache_events import BlocksRemoved, BlocksStored, CacheCleared
from jaxserve.core.kv_manager import KVManager
from jaxserve.core.sequence import SeqState

BS = 4


def seq(rid: str, tokens: list[int], salt: str | None = None) -> SeqState:
    return SeqState(rid, tokens, len(tokens), 1, cache_salt=salt)


class RouterView:
    """What a subscriber knows from the events alone: the hashes cached per medium."""

    def __init__(self) -> None:
        self.cached: dict[str, set[bytes]] = {"GPU": set(), "CPU": set()}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, BlocksStored):
                self.cached[e.medium].update(e.block_hashes)
            elif isinstance(e, BlocksRemoved):
                assert set(e.block_hashes) <= self.cached[e.medium], "removed before stored"
                self.cached[e.medium].difference_update(e.block_hashes)
            else:
                self.cached = {"GPU": set(), "CPU": set()}


def indexed(kv: KVManager) -> dict[str, set[bytes]]:
    """The hashes the pools would find now (the truth the view must match)."""
    host = set(kv.host._block_of) if kv.host is not None else set()
    return {"GPU": set(kv.device._block_of), "CPU": host}


def run(kv: KVManager, s: SeqState, view: RouterView | None = None) -> None:
    """Admit ``s`` (with its prefix hits), compute all its tokens, register, free; then check
    that ``view``, given the events, knows exactly what the pools index."""
    hits = kv.find_prefix(s)
    kv.admit(s, hits, -(-len(s.token_ids) // BS))
    s.num_computed_tokens = len(s.token_ids)
    kv.cache_computed_blocks(s)
    kv.take_transfers()
    kv.free_seq(s)
    if view is not None:
        view.apply(kv.take_events())
        assert view.cached == indexed(kv)


def test_not_recording_builds_nothing() -> None:
    kv = KVManager(8, BS)
    run(kv, seq("a", list(range(9))))
    kv.reset_prefix_cache()
    assert kv.events is None and kv.take_events() == []


def test_stored_then_evicted_then_cleared() -> None:
    kv = KVManager(5, BS, record_events=True)  # 4 usable blocks
    a = seq("a", list(range(10)))  # 2 full blocks + 2 tokens
    run(kv, a)
    ha = a.block_hashes
    (stored,) = kv.take_events()
    assert stored == BlocksStored(tuple(ha), None, tuple(range(8)), "GPU")
    # b shares a's first block and adds a second one of its own
    b = seq("b", list(range(4)) + [50, 51, 52, 53, 54])
    run(kv, b)
    (stored_b,) = kv.take_events()
    assert stored_b == BlocksStored((b.block_hashes[1],), ha[0], (50, 51, 52, 53), "GPU")
    # c needs all 4 blocks: it evicts the cached-free ones, LRU first
    c = seq("c", list(range(200, 216)))
    run(kv, c)
    events = kv.take_events()
    removed = [e for e in events if isinstance(e, BlocksRemoved)]
    assert [e.medium for e in removed] == ["GPU"]
    assert set(removed[0].block_hashes) == {*ha, b.block_hashes[1]}
    assert isinstance(events[-1], BlocksStored) and events[-1].block_hashes == tuple(
        c.block_hashes[:4]
    )
    assert kv.reset_prefix_cache() == 4
    assert kv.take_events() == [CacheCleared()] and kv.take_events() == []


def test_salted_blocks_carry_their_extra_keys() -> None:
    kv = KVManager(8, BS, record_events=True)
    run(kv, seq("a", list(range(9)), salt="s1"))
    (stored,) = kv.take_events()
    assert stored.extra_keys == (("s1",), None)


def test_host_tier_stores_and_removes_with_medium_cpu() -> None:
    kv = KVManager(3, BS, num_host_blocks=2, record_events=True)  # 2 device, 1 host block
    a = seq("a", list(range(8)))
    run(kv, a)
    kv.take_events()
    run(kv, seq("b", list(range(100, 108))))  # evicts a's 2 blocks, tail first, via the host
    a0, a1 = a.block_hashes
    assert kv.take_events()[:4] == [
        BlocksRemoved((a1, a0), "GPU"),
        BlocksStored((a1,), None, (), "CPU"),
        BlocksRemoved((a1,), "CPU"),  # the one host block is taken again for a0
        BlocksStored((a0,), None, (), "CPU"),
    ]


def test_a_subscriber_tracks_both_tiers_exactly() -> None:
    """Requests sharing prefixes through small pools (evictions, offloads, host hits loaded
    back): after every request, the hashes known from the events are the pools' index."""
    kv = KVManager(6, BS, num_host_blocks=4, record_events=True)  # 5 device, 3 host blocks
    view = RouterView()
    base = list(range(8))
    for i, tail in enumerate([[1, 2, 3], [7] * 5, [8] * 9, [1, 2, 3], [9] * 6, [7] * 5]):
        run(kv, seq(f"r{i}", base + tail), view)
    run(kv, seq("other", list(range(500, 516))), view)
    run(kv, seq("again", base + [1, 2, 3]), view)
    kv.reset_prefix_cache()
    view.apply(kv.take_events())
    assert view.cached == indexed(kv) == {"GPU": set(), "CPU": set()}
    assert kv.stats.num_offloaded_blocks > 0 and kv.stats.host_cache_hits > 0
    assert kv.stats.num_host_evicted_blocks > 0


def test_a_host_hit_loaded_to_the_device_is_stored_on_gpu() -> None:
    kv = KVManager(4, BS, num_host_blocks=4, record_events=True)  # 3 device, 3 host blocks
    a = seq("a", list(range(8)))
    run(kv, a)
    run(kv, seq("b", list(range(100, 112))))  # a's blocks go to the host
    kv.take_events()
    run(kv, seq("a2", list(range(8)) + [9]))
    stored = [e for e in kv.take_events() if isinstance(e, BlocksStored) and e.medium == "GPU"]
    assert stored[0] == BlocksStored(tuple(a.block_hashes), None, tuple(range(8)), "GPU")
