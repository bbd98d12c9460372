"""Block hashes of the prefix cache, by algorithm (``--prefix-caching-hash-algo``).

A block's hash covers its parent's hash (so equal hashes mean equal prefixes), its tokens and
its extra keys: whatever else changes its K/V. jaxserve's only extra key is a request's
``cache_salt``, on the first block. Two algorithms:

``sha256``
  jaxserve's own layout: SHA-256 over the parent's digest (32 zero bytes for the first block),
  the extra keys' length (4 bytes little-endian) and UTF-8 bytes, and the tokens as
  little-endian int64 (``block_pool.hash_block_tokens``). The default. vLLM's ``sha256``
  hashes a Python pickle instead; neither can be recomputed outside the engine that made it.
``sha256_cbor``
  vLLM's (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens`` with
  ``vllm/utils/hashing.py`` ``sha256_cbor``): SHA-256 over the canonical CBOR encoding of
  ``(parent_hash, tuple(token_ids), extra_keys)``, where the first block's parent is
  ``NONE_HASH = sha256_cbor(seed)``, the seed being ``$PYTHONHASHSEED`` when set, else vLLM's
  fixed ``"vllm-none-hash"``, and ``extra_keys`` is None or ``(("cache_salt", salt),)`` (as
  vLLM 0.31 and 0.32; KV events publish the salt untagged, ``(salt,)``). A router that
  knows the block size and the seed recomputes these from token ids (llm-d's kv-cache indexer
  does), so they are the hashes to publish KV events with.

vLLM's ``xxhash`` and ``xxhash_cbor`` are not offered (a non-cryptographic hash would need a
secret per-process seed, which no router can share). Pure Python; ``cbor2`` is imported only
when ``sha256_cbor`` is chosen.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence

from jaxserve.core.block_pool import BlockHash, hash_block_tokens

HASH_ALGOS = ("sha256", "sha256_cbor")
UNSUPPORTED_HASH_ALGOS = ("xxhash", "xxhash_cbor")  # vLLM's, refused with a message
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset

ExtraKeys = tuple[str, ...] | None


def check_hash_algo(algo: str) -> None:
    """Raises ValueError naming ``algo`` unless it is one of ``HASH_ALGOS``."""
    if algo in UNSUPPORTED_HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo={algo!r} (vLLM's) is not supported by "
            f"jaxserve; use one of {HASH_ALGOS} (sha256_cbor for routers)"
        )
    if algo not in HASH_ALGOS:
        raise ValueError(f"prefix_caching_hash_algo={algo!r} must be one of {HASH_ALGOS}")


def none_hash_seed() -> str:
    """The seed of ``sha256_cbor``'s first-block parent: ``$PYTHONHASHSEED`` or vLLM's fixed
    default, as vLLM's ``resolve_none_hash_seed`` for cryptographic hashes."""
    return os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


class BlockHasher:
    """Hashes full blocks with one algorithm (module docstring).

    Args:
      algo: one of ``HASH_ALGOS``.
      seed: ``sha256_cbor``'s NONE_HASH seed; None: ``none_hash_seed()`` at construction.
    Raises:
      ValueError: an unknown or unsupported ``algo`` (``check_hash_algo``).
    """

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        check_hash_algo(algo)
        self.algo = algo
        self.none_hash: BlockHash | None = None  # sha256_cbor's first-block parent
        self._hash: Callable[[BlockHash | None, Sequence[int], ExtraKeys], BlockHash]
        if algo == "sha256_cbor":
            import cbor2  # only this algorithm needs it

            def sha256_cbor(obj: object) -> bytes:
                return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

            none_hash = self.none_hash = sha256_cbor(none_hash_seed() if seed is None else seed)
            # vLLM tags each extra key with its source: ("cache_salt", salt)
            self._hash = lambda parent, tokens, extra: sha256_cbor(
                (parent or none_hash, tuple(tokens),
                 tuple(("cache_salt", k) for k in extra) if extra else None)
            )
        else:
            self._hash = lambda parent, tokens, extra: hash_block_tokens(
                parent, tokens, "\x1f".join(extra).encode() if extra else b""
            )

    def __call__(
        self, parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = None
    ) -> BlockHash:
        """The 32-byte hash of one full block.

        Args:
          parent: the previous block's hash; None for the first block.
          token_ids: the block's ``block_size`` tokens.
          extra_keys: None, or the strings besides the tokens that change the K/V
            (``(cache_salt,)`` on a salted request's first block).
        """
        return self._hash(parent, token_ids, extra_keys)
