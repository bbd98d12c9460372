"""The model runner: turns a scheduler plan into one padded step and runs its two compiled programs
(what they compute: ``jaxserve.device.step_programs``; compiling them, before and after ready:
``jaxserve.device.compiling`` and ``jaxserve.device.warmup``).

Per step, one call from the engine (``run``):
  ``SchedulerOutput`` -> ``pack_step`` (numpy, into a preallocated ``i32`` buffer of the bucket's
  layout, floats bit-cast) -> one host-to-device transfer -> the bucket's model program
  ``model_step(params, kv_cache, penalty_state, packed, prev_ids) -> (kv_cache, penalty_state,
  logits f32[S, vocab], prompt logprobs, sampler inputs)`` with ``kv_cache`` and
  ``penalty_state`` donated -> the sampler program of the bucket's row count ``S``
  ``sample_rows(logits, penalty_state, sampler inputs, allowed) -> (sampled
  i32[max_num_seqs_bucket], sample logprobs)``. Every intermediate stays on the device. The
  sampler is its own program, shared by the buckets with as many rows (four of the default
  seven have 64), so it compiles once per row count: about 2 CPU-s of each bucket's 4-5 on the
  2-core CPU. ``execute`` returns as soon as both are dispatched (JAX runs them
  asynchronously); the sampled ids reach the host when ``StepOutput.ids`` is first read.
  Logprobs stay on the device unless the engine asks for them.
Async scheduling: a token whose value is the previous step's sample for some row (not yet
known on the host) is packed with that row in ``src_row``; the program reads it from
``prev_ids``, the previous program's sampled ids, which stay on the device (a gather, no host
round trip). Every program takes and returns the ids at the largest bucket's row count, so any
bucket can follow any other.
``allowed`` (``i32[S, ceil(V / 32)]``) is each row's allowed-token bitmask (constrained
decoding, ``jaxserve/engine/structured_output.py``): a step with a constrained row comes with
its rows' masks (``run``'s ``masks``, computed by the grammar layer), which the runner pads to
the bucket's rows and sends, with a flag that makes the program read it; any other step passes
the bucket's all-ones mask, which stays on the device, and the program skips it, so it costs
no transfer, no host work and no device work.
Every bucket's model program and every row count's sampler program are compiled once by
``warmup``, plus one small program that writes a logit_bias row into the penalty state;
``execute`` only looks programs up, so serving never compiles (``num_compiles`` counts, and a test checks the jax compile events too).

Logprobs cost nothing in a step where no request asks for them: a flag in the packed buffer
selects a ``lax.cond`` branch that returns zeros. Prompt logprobs (``echo`` / ``prompt_logprobs``)
need logits at every prompt position, ``[T, vocab]`` instead of ``[S, vocab]``; they are computed
under a second flag, so ordinary steps keep computing logits for the sampled rows only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.device.buckets import Bucket, make_buckets
from jaxserve.device.compiling import ProgramCompiler
from jaxserve.device.executable_cache import ExecutableCache
from jaxserve.device.host_tier import HostKVTier
from jaxserve.device.penalties import PenaltyState, new_penalty_state
from jaxserve.device.sampler import Logprobs
from jaxserve.device.step_buffer import (
    FLAG_ALLOWED,
    FLAG_LOGPROBS,
    FLAG_PROMPT_LOGPROBS,
    Chunk,
    RowParams,
    StepChunk,
    StepPacker,
)
from models.interface import CausalLM
from pallas_kernels import KVCache


class StepOutput:
    """One step's results, on the device until fetched.

    ``ids`` (``i32[max_num_seqs_bucket]`` on the host, rows past the step's bucket 0) are the
    sampled tokens; the first read waits for the step to finish. ``logprobs()`` (rows of
    the batch) and ``prompt_logprobs()`` (tokens of the batch) fetch the ``Logprobs`` as numpy
    arrays; they hold data only when the step was packed with the matching flag.
    """

    def __init__(self, ids: jax.Array | np.ndarray, logprobs: Logprobs,
                 prompt_logprobs: Logprobs, bucket: Bucket | None = None,
                 t_dispatch: float = 0.0) -> None:
        self.bucket = bucket  # the step's shape
        self.t_dispatch = t_dispatch  # time.perf_counter() when its programs were started
        self._ids = ids
        self._host_ids: np.ndarray | None = None
        self._lp = logprobs
        self._plp = prompt_logprobs

    @property
    def ids(self) -> np.ndarray:
        """``i32[S]`` sampled ids on the host; the first read waits for the step to finish
        (``execute`` returns at dispatch), later reads reuse that copy."""
        if self._host_ids is None:
            self._host_ids = np.asarray(self._ids)
        return self._host_ids

    def logprobs(self) -> Logprobs:
        """Per row: top ids / logprobs ``[S, MAX_LOGPROBS]``, the sampled id's logprob, rank."""
        return Logprobs(*(np.asarray(x) for x in self._lp))

    def prompt_logprobs(self) -> Logprobs:
        """Per token: top ids / logprobs ``[T, MAX_LOGPROBS]``, the target's logprob, rank."""
        return Logprobs(*(np.asarray(x) for x in self._plp))


class ModelRunner(ProgramCompiler):
    """Owns params, the KV cache (with its host tier) and the compiled step programs.

    Args:
      model: the model (``models/interface.py:CausalLM``).
      params: its params pytree, on the device.
      kv_cache: the paged cache; donated to every step and replaced by the result.
      max_num_batched_tokens, max_num_seqs: bucket limits.
      small_buckets: token buckets below 8 to compile as well (``jaxserve.device.buckets``;
        the platform's ``buckets``).
      mid_buckets_up_to: compile the buckets ``3 * 2**k`` (24, 48, ...) up to this many tokens
        too (``buckets.token_buckets``; the engine asks for them up to ``max_num_seqs`` on the
        CPU); 0: none.
      min_bucket_tokens: no token bucket below this many tokens but the largest
        (``BucketSet.min_tokens``: batch invariance).
      max_blocks_per_seq: block-table width (``cdiv(max_model_len, block_size)``).
      vocab_limit: ids at or above it are never sampled (tokenizer smaller than the embedding).
      num_penalty_slots: rows of the penalty state (default ``max_num_seqs``: every running
        request may use penalties).
      mesh: the tensor-parallel mesh when params and cache are sharded (jaxserve.sharding);
        the step's host inputs, the penalty state and the outputs are then replicated over it,
        and the logits are gathered once before sampling so the sampler runs without
        collectives.
      executable_cache: where compiled programs are loaded from and stored (None: compile
        every one; jaxserve.device.executable_cache), keyed with ``program_description``,
        which must name everything about ``model`` that its programs depend on and their
        arguments' avals do not show (its class, config, dtype, attention op).
      host_tier: the KV cache's host tier (``HostKVTier``, built over ``kv_cache``), whose
        copies ``copy_blocks`` runs; None: no host tier.
    """

    FLAG_LOGPROBS = FLAG_LOGPROBS
    FLAG_PROMPT_LOGPROBS = FLAG_PROMPT_LOGPROBS
    FLAG_ALLOWED = FLAG_ALLOWED

    def __init__(self, model: CausalLM, params, kv_cache: KVCache, *,
                 max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 small_buckets: tuple[int, ...] = (), mid_buckets_up_to: int = 0,
                 min_bucket_tokens: int = 1, vocab_limit: int | None = None,
                 num_penalty_slots: int | None = None,
                 mesh: jax.sharding.Mesh | None = None,
                 executable_cache: ExecutableCache | None = None,
                 program_description: str = "", host_tier: HostKVTier | None = None,
                 sampler_rows: tuple[int, ...] = ()) -> None:
        self.model = model
        self.host_tier = host_tier
        self.executable_cache = executable_cache
        self.program_description = program_description
        self.params = params
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_blocks = max_blocks_per_seq
        self.buckets = make_buckets(max_num_batched_tokens, max_num_seqs, small_buckets,
                                    mid_buckets_up_to, min_bucket_tokens)
        self.num_penalty_slots = num_penalty_slots or max_num_seqs
        self.packer = StepPacker(self.buckets, max_blocks_per_seq, self.block_size,
                                 self.num_penalty_slots, sampler_rows)
        self.layouts = self.packer.layouts
        self.vocab_limit = vocab_limit
        self.mesh = mesh
        self._replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
                            if mesh is not None else None)
        self._multiprocess = mesh is not None and jax.process_count() > 1
        self.penalty_state: PenaltyState = jax.jit(
            lambda: new_penalty_state(self.num_penalty_slots, model.cfg.vocab_size),
            out_shardings=self._replicated)()
        self.num_mask_words = -(-model.cfg.vocab_size // 32)
        self._all_allowed: dict[Bucket, jax.Array] = {}  # i32[S, num_mask_words], all bits set
        self._masks: dict[Bucket, np.ndarray] = {}  # host staging of ``run``'s masks
        self.compiled: dict[Bucket, jax.stages.Compiled] = {}  # model programs
        self.samplers: dict[int, jax.stages.Compiled] = {}  # by row count (Layout.sampler_rows)
        self.max_bucket_seqs = max(self.layouts[b].sampler_rows for b in self.buckets)
        # i32[max_bucket_seqs]: the last program's sampled ids, the next one's prev_ids
        self._last_ids: jax.Array = self._to_device(np.zeros(self.max_bucket_seqs, np.int32))
        self._set_bias: jax.stages.Compiled | None = None
        self._specs: tuple | None = None  # _arg_specs
        self.num_compiles = 0

    def copy_blocks(self, offloads: Sequence[tuple[int, int]],
                    loads: Sequence[tuple[int, int]]) -> None:
        """Run a plan's host-tier copies, offloads (device block, host block) then loads (host
        block, device block), before its forward pass; asynchronous. Raises RuntimeError when
        there are copies and no host tier."""
        if (offloads or loads) and self.host_tier is None:
            raise RuntimeError("copy_blocks without a host tier")
        if offloads:
            self.host_tier.offload(self.kv_cache, offloads)
        if loads:
            self.kv_cache = self.host_tier.load(self.kv_cache, loads)

    def probe(self, num_tokens: int = 1) -> tuple[float, int]:
        """Run one step of a ``num_tokens``-token prompt chunk in the padding block (block 0,
        which no request holds, every position of the chunk in it) with one greedy sample, and
        wait for the sampled id. Returns (seconds, the bucket's token count). With the default
        1 token it proves that a compiled program runs, not only that it compiled; larger
        chunks time a step for the engine's step-cost model.

        Raises:
          ValueError: ``num_tokens`` outside 1..the largest token bucket.
        """
        most = min(max(b.num_tokens for b in self.buckets),
                   self.max_blocks * self.block_size)
        if not 1 <= num_tokens <= most:
            raise ValueError(f"probe: {num_tokens=} must be in 1..{most}")
        t0 = time.perf_counter()
        blocks = (0,) * -(-num_tokens // self.block_size)
        bucket, packed = self.pack_step([Chunk((0,) * num_tokens, 0, blocks)],
                                        [RowParams(0.0, 0, 1.0, 0, 0)])
        self.execute(bucket, packed).ids  # noqa: B018 (waits for the step)
        return time.perf_counter() - t0, bucket.num_tokens

    def _to_device(self, host: np.ndarray) -> jax.Array:
        """A host array on the step programs' devices (replicated over the mesh, if any)."""
        if self._multiprocess:
            return jax.make_array_from_callback(host.shape, self._replicated,
                                                lambda idx: host[idx])
        return jax.device_put(host, self._replicated)

    def _padded_masks(self, bucket: Bucket, masks: np.ndarray) -> np.ndarray:
        """``masks`` (``i32[n, num_mask_words]``, the step's first ``n`` rows) in the bucket's
        ``i32[S, num_mask_words]`` host buffer, the other rows all allowed (reused)."""
        buf = self._masks.get(bucket)
        if buf is None:
            buf = self._masks[bucket] = np.empty(
                (self.layouts[bucket].sampler_rows, self.num_mask_words), np.int32)
        n = masks.shape[0]
        if masks.ndim != 2 or masks.shape[1] != self.num_mask_words or n > buf.shape[0]:
            raise ValueError(f"masks must be i32[n <= {buf.shape[0]}, {self.num_mask_words}], "
                             f"got {list(masks.shape)}")
        buf[:n] = masks
        buf[n:] = -1
        return buf

    def set_logit_bias(self, slot: int, bias: dict[int, float]) -> None:
        """Write a penalty slot's logit_bias row (zeros but for ``bias``; ids must be in range).

        Raises RuntimeError before warmup (serving never compiles).
        """
        if self._set_bias is None:
            raise RuntimeError("set_logit_bias before warmup()")
        if self._multiprocess:  # a program on process 0 alone would leave the followers behind
            raise ValueError("logit_bias is not supported when one model spans several "
                             "processes")
        row = np.zeros(self.penalty_state.bias.shape[1], np.float32)
        for t, v in bias.items():
            row[t] = v
        self.penalty_state = self._set_bias(self.penalty_state, np.int32(slot), row)

    # -- host side -----------------------------------------------------------------------------
    def run(self, chunks: Sequence[StepChunk], rows: Sequence[RowParams], *,
            want_logprobs: bool = False, src_rows: Sequence[int] | None = None,
            masks: np.ndarray | None = None) -> StepOutput:
        """Pack one ragged step into its bucket and start it (``pack_step``, then ``execute``):
        the engine's one hand-off per step. Returns at dispatch; ``StepOutput.ids`` waits.

        Args:
          chunks, rows, want_logprobs, src_rows: as ``pack_step`` (``StepPacker.pack``).
          masks: ``i32[n, num_mask_words]``, the allowed-token bitmasks of the step's first
            ``n`` rows (the others allow every token); None: every row allows every token.
        Raises:
          ValueError, RuntimeError: as ``pack_step`` and ``execute``.
        """
        bucket, packed = self.pack_step(chunks, rows, want_logprobs=want_logprobs,
                                        src_rows=src_rows)
        return self.execute(bucket, packed, masks)

    def pack_step(self, chunks: Sequence[StepChunk], rows: Sequence[RowParams], *,
                  sample_index: Sequence[int] | None = None, want_logprobs: bool = False,
                  src_rows: Sequence[int] | None = None) -> tuple[Bucket, np.ndarray]:
        """Pack one ragged step into its bucket's buffer (``StepPacker.pack``, which documents
        the arguments and errors); returns (bucket, buffer)."""
        return self.packer.pack(chunks, rows, sample_index=sample_index,
                                want_logprobs=want_logprobs, src_rows=src_rows)

    def execute(self, bucket: Bucket, packed: np.ndarray,
                masks: np.ndarray | None = None) -> StepOutput:
        """Dispatch one step and return at once; its ``StepOutput.ids`` wait for it.

        Args:
          bucket, packed: as ``pack_step`` returned them (``packed``'s mask flag is set here).
          masks: the first rows' allowed-token masks (as ``run``), or None: every token
            allowed (the device-resident mask; nothing is sent).
        Raises:
          RuntimeError: if the bucket was not compiled by warmup (serving never compiles).
          ValueError: a mask when one model spans several processes, or of the wrong shape.
        """
        prog = self.compiled.get(bucket)
        sampler = self.samplers.get(self.layouts[bucket].sampler_rows)
        if prog is None or sampler is None:
            raise RuntimeError(f"bucket {bucket} was not compiled; call warmup() first")
        flags = self.layouts[bucket].slices["flags"]
        packed[flags] = (packed[flags] & ~self.FLAG_ALLOWED) | (
            self.FLAG_ALLOWED if masks is not None else 0)
        t_dispatch = time.perf_counter()
        if self._multiprocess:  # process 0 drives; the followers run the same program
            if masks is not None:
                raise ValueError("token masks are not supported when one model spans several "
                                 "processes")
            multihost_utils.broadcast_one_to_all(
                np.array([self.buckets.index(bucket)], np.int32))
            packed = multihost_utils.broadcast_one_to_all(packed)
            return self._run_global(bucket, packed, t_dispatch)
        mask = self._all_allowed[bucket] if masks is None else self._padded_masks(bucket, masks)
        self.kv_cache, self.penalty_state, logits, plp, inputs = prog(
            self.params, self.kv_cache, self.penalty_state, packed, self._last_ids)
        ids, lp = sampler(logits, self.penalty_state, inputs, mask)
        self._last_ids = ids
        ids.copy_to_host_async()
        return StepOutput(ids, lp, plp, bucket, t_dispatch)

    # -- several processes (jax.distributed): process 0 schedules, the others follow ----------
    @property
    def multiprocess(self) -> bool:
        """True when the mesh spans several processes (see jaxserve.cli.multihost)."""
        return self._multiprocess

    def _run_global(self, bucket: Bucket, packed: np.ndarray, t_dispatch: float = 0.0
                    ) -> StepOutput:
        arr = self._to_device(np.asarray(packed))
        self.kv_cache, self.penalty_state, logits, plp, inputs = self.compiled[bucket](
            self.params, self.kv_cache, self.penalty_state, arr, self._last_ids)
        ids, lp = self.samplers[self.layouts[bucket].sampler_rows](
            logits, self.penalty_state, inputs, self._all_allowed[bucket])
        self._last_ids = ids
        local = lambda tree: jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)
        return StepOutput(np.asarray(ids.addressable_data(0)), local(lp), local(plp), bucket,
                          t_dispatch)

    def follow(self) -> int:
        """On processes other than 0: run every step process 0 broadcasts, until it calls
        ``stop_followers``. Returns the number of steps run. Programs must be warm."""
        steps = 0
        while True:
            idx = int(multihost_utils.broadcast_one_to_all(np.zeros(1, np.int32))[0])
            if idx < 0:
                return steps
            bucket = self.buckets[idx]
            buf = multihost_utils.broadcast_one_to_all(
                np.zeros(self.layouts[bucket].size, np.int32))
            self._run_global(bucket, buf)
            steps += 1

    def stop_followers(self) -> None:
        """On process 0: release the processes blocked in ``follow``."""
        if self._multiprocess:
            multihost_utils.broadcast_one_to_all(np.array([-1], np.int32))
