"""Block hashes by algorithm: ``sha256`` keeps jaxserve's hashes; ``sha256_cbor`` equals a
reference written here from vLLM's definition (SHA-256 of canonical CBOR of
``(parent, tuple(tokens), extra_keys)``, the first parent ``sha256_cbor(seed)``, the salt tagged
``("cache_salt", salt)`` as vLLM 0.31+). tests/kv_events/test_engine_events.py checks the same
hashes against vLLM's own hasher, from its released wheel."""

from __future__ import annotations

import hashlib

import cbor2
import pytest

from jaxserve import config
from jaxserve.core import block_hash
from jaxserve.core.block_hash import BlockHasher, check_hash_algo
from jaxserve.core.block_pool import hash_block_tokens
from jaxserve.core.kv_manager import KVManager
from jaxserve.core.sequence import SeqState

SEED = "12345"  # as PYTHONHASHSEED would give it
BLOCKS = [list(range(100, 116)), [49151, 0, 1, 255, 256, 65535, 65536, 7] * 2, [3] * 16]


def ref_sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def ref_chain(blocks: list[list[int]], seed: str, salt: str | None = None) -> list[bytes]:
    parent = ref_sha256_cbor(seed)  # vLLM's NONE_HASH
    out = []
    for i, tokens in enumerate(blocks):
        extra = (("cache_salt", salt),) if salt and i == 0 else None
        parent = ref_sha256_cbor((parent, tuple(tokens), extra))
        out.append(parent)
    return out


def test_names_match_the_config_copies() -> None:
    assert config.PREFIX_CACHING_HASH_ALGOS == block_hash.HASH_ALGOS
    assert config.UNSUPPORTED_HASH_ALGOS == block_hash.UNSUPPORTED_HASH_ALGOS


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_sha256_cbor_matches_an_independent_reference(salt: str | None) -> None:
    h = BlockHasher("sha256_cbor", seed=SEED)
    got, parent = [], None
    for i, tokens in enumerate(BLOCKS):
        parent = h(parent, tokens, (salt,) if salt and i == 0 else None)
        got.append(parent)
    assert got == ref_chain(BLOCKS, SEED, salt)
    assert h.none_hash == ref_sha256_cbor(SEED)
    # the first block's hash by hand: a CBOR array of (bytes, array of ints, null)
    first = cbor2.dumps((ref_sha256_cbor(SEED), tuple(BLOCKS[0]), None), canonical=True)
    assert first[0] == 0x83 and got[0] != ref_chain(BLOCKS, "other")[0]
    if salt is None:
        assert got[0] == hashlib.sha256(first).digest()


def test_sha256_cbor_seed_comes_from_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    assert BlockHasher("sha256_cbor")(None, BLOCKS[0]) == ref_chain(BLOCKS, SEED)[0]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockHasher("sha256_cbor")(None, BLOCKS[0]) == ref_chain(BLOCKS, "vllm-none-hash")[0]


def test_sha256_keeps_jaxserves_hashes() -> None:
    h = BlockHasher("sha256")
    first = hash_block_tokens(None, BLOCKS[0], b"salt")
    assert h(None, BLOCKS[0], ("salt",)) == first
    assert h(first, BLOCKS[1]) == hash_block_tokens(first, BLOCKS[1])
    assert h.none_hash is None


def test_kv_manager_hashes_a_sequence_with_its_algorithm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A salted request's block hashes as a router recomputes them from its tokens."""
    monkeypatch.setenv("PYTHONHASHSEED", SEED)
    kv = KVManager(8, 16, hash_algo="sha256_cbor")
    tokens = [t for b in BLOCKS for t in b] + [9, 9]
    seq = SeqState("a", tokens, len(tokens), 4, cache_salt="tenant-a")
    assert kv.block_hashes(seq, 3) == ref_chain(BLOCKS, SEED, "tenant-a")


def test_unsupported_algorithms_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'xxhash_cbor' \\(vLLM's\\) is not supported"):
        check_hash_algo("xxhash_cbor")
    with pytest.raises(ValueError, match="'md5' must be one of"):
        BlockHasher("md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo='xxhash'"):
        config.EngineConfig(prefix_caching_hash_algo="xxhash")
