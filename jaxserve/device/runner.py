"""The model runner: turns a scheduler plan into one padded step and runs its two compiled programs
(what they compute: ``jaxserve.device.step_programs``; compiling them before and after ready:
``jaxserve.device.warmup``).

Per step:
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
decoding, ``jaxserve/engine/structured_output.py``): a step with a constrained row fills
``mask_buffer(bucket)`` on the host and sends it, with a flag that makes the program read it;
any other step passes the bucket's all-ones mask, which stays on the device, and the program
skips it, so it costs no transfer, no host work and no device work.
Every bucket's model program and every row count's sampler program are compiled once by
``warmup``, plus one small program that writes a logit_bias row into the penalty state;
``execute`` only looks programs up, so serving never compiles (``num_compiles`` counts, and a test checks the jax compile events too).

Logprobs cost nothing in a step where no request asks for them: a flag in the packed buffer
selects a ``lax.cond`` branch that returns zeros. Prompt logprobs (``echo`` / ``prompt_logprobs``)
need logits at every prompt position, ``[T, vocab]`` instead of ``[S, vocab]``; they are computed
under a second flag, so ordinary steps keep computing logits for the sampled rows only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.device.buckets import Bucket, make_buckets
from jaxserve.device.executable_cache import ExecutableCache
from jaxserve.device.host_tier import HostKVTier
from jaxserve.device.sampler import (
    Logprobs,
    PenaltyState,
    new_penalty_state,
    set_bias_row,
)
from jaxserve.device.step_buffer import (
    FLAG_ALLOWED,
    FLAG_LOGPROBS,
    FLAG_PROMPT_LOGPROBS,
    Chunk,
    RowParams,
    StepChunk,
    StepPacker,
)
from jaxserve.device.step_programs import model_program, sampler_program
from jaxserve.device.warmup import run_compiles
from jaxserve.sampling_params import MAX_LOGPROBS, MAX_MIN_TOKENS_STOP_IDS
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
                 prompt_logprobs: Logprobs) -> None:
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


class ModelRunner:
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
                 vocab_limit: int | None = None,
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
                                    mid_buckets_up_to)
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
        self._mask_buffers: dict[Bucket, np.ndarray] = {}
        self.compiled: dict[Bucket, jax.stages.Compiled] = {}  # model programs
        self.samplers: dict[int, jax.stages.Compiled] = {}  # by row count (Layout.sampler_rows)
        self.max_bucket_seqs = max(self.layouts[b].sampler_rows for b in self.buckets)
        # i32[max_bucket_seqs]: the last program's sampled ids, the next one's prev_ids
        self._last_ids: jax.Array = self._to_device(np.zeros(self.max_bucket_seqs, np.int32))
        self._set_bias: jax.stages.Compiled | None = None
        self._specs: tuple | None = None  # _arg_specs
        self.num_compiles = 0

    def warmup(self, progress: bool = True,
               on_compiled: Callable[[int, int], None] | None = None,
               buckets: Sequence[Bucket] | None = None) -> dict[str, float]:
        """Compile the step programs of ``buckets`` (None: every bucket; the persistent cache
        makes reruns cheap) and the logit_bias row writer, then the host tier's copy programs
        (``HostKVTier.warmup``).

        With a subset, steps run in the smallest compiled bucket that holds them
        (``StepPacker.usable``) until ``compile_pending`` has compiled the others. Programs
        compile one after the other: XLA:CPU already spreads one compile over two threads, and
        on a shared 2-core CPU compiling two programs at once took 17-30% more CPU seconds and
        no less wall time (docs/configuration.md#compilation). ``on_compiled(done, total)`` is
        called before the first program (``done`` 0) and after each.

        Returns:
          {"num_programs", "compile_s", "compile_cpu_s", "pending_programs"}: programs
          compiled so far, wall and process CPU seconds, programs left to ``compile_pending``.
        Raises:
          ValueError: a subset without the largest bucket (a step of every size must fit),
            or a bucket that is not one of ``self.buckets``.
        """
        if buckets is not None:
            unknown = [b for b in buckets if b not in self.layouts]
            if unknown or self.buckets[-1] not in buckets:
                raise ValueError(f"warmup: buckets {list(buckets)} must be among the runner's "
                                 f"and hold the largest, {self.buckets[-1]}")
        t0, c0 = time.perf_counter(), _cpu_s()
        todo = self._programs(self.buckets if buckets is None else buckets, set_bias=True)
        run_compiles(todo, progress, on_compiled)
        self._publish_usable()
        stats = {"num_programs": float(len(self.compiled) + len(self.samplers) + 1),
                 "compile_s": time.perf_counter() - t0, "compile_cpu_s": _cpu_s() - c0}
        if self.host_tier is not None:  # its block-copy programs
            host = self.host_tier.warmup()
            stats = {k: stats[k] + host.get(k, 0.0) for k in stats}
        stats["pending_programs"] = float(self.num_pending_programs())
        return stats

    def compile_pending(self, stop: threading.Event | None = None) -> int:
        """Compile the programs ``warmup`` left out, a bucket at a time, each made usable for
        the next step as soon as its model and sampler programs are compiled. The next bucket
        is the one steps padded up for most often (``StepPacker.wanted``), else the smallest.
        Runs on another thread while steps run: it reads only the arguments' shapes, and
        publishes a bucket by replacing ``StepPacker.usable`` whole. Returns the programs
        compiled; with ``stop`` set, it returns after the program being compiled."""
        done = 0
        while not (stop is not None and stop.is_set()):
            pending = [b for b in self.buckets if self._programs([b])]
            if not pending:
                break
            wanted = self.packer.wanted
            bucket = max(pending, key=lambda b: wanted[b])  # the first (smallest) of ties
            for compile_one in self._programs([bucket]):
                if stop is not None and stop.is_set():
                    break
                compile_one()
                done += 1
            self._publish_usable()
        return done

    def num_pending_programs(self) -> int:
        """Programs ``compile_pending`` still has to compile (0 after a full ``warmup``)."""
        return len(self._programs(self.buckets))

    def _programs(self, buckets: Sequence[Bucket], set_bias: bool = False
                  ) -> list[Callable[[], None]]:
        """The compiles ``buckets`` still need, in order: a bucket's model program, then its
        row count's sampler program if no bucket compiled it yet."""
        todo: list[Callable[[], None]] = []
        if set_bias and self._set_bias is None:  # counted in the bar and in num_programs alike
            todo.append(self._compile_set_bias)
        rows = set(self.samplers)
        for b in buckets:
            if b not in self.compiled:
                todo.append(lambda b=b: self._compile_model(b))
            if self.layouts[b].sampler_rows not in rows:
                rows.add(self.layouts[b].sampler_rows)
                todo.append(lambda b=b: self._compile_sampler(b))
        return todo

    def _publish_usable(self) -> None:
        self.packer.usable = [b for b in self.buckets if b in self.compiled
                              and self.layouts[b].sampler_rows in self.samplers]

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

    def _compile_set_bias(self) -> None:
        st = self.penalty_state
        args = (st, jax.ShapeDtypeStruct((), jnp.int32),
                jax.ShapeDtypeStruct(st.bias.shape[1:], jnp.float32))
        compile_fn = lambda: jax.jit(set_bias_row, donate_argnums=(0,)).lower(*args).compile()
        self._set_bias = self._cached(("set_bias",), args, compile_fn)

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

    def compile_bucket(self, bucket: Bucket) -> None:
        """Compile one bucket's model program, and the sampler program of its row count if
        that is not compiled yet (``warmup`` compiles them all).

        Args:
          bucket: one of ``self.buckets``; its model program is compiled again if it already is.
        """
        self._compile_model(bucket)
        if self.layouts[bucket].sampler_rows not in self.samplers:
            self._compile_sampler(bucket)

    def _cached(self, what: tuple, args: tuple, compile_fn) -> jax.stages.Compiled:
        self.num_compiles += 1
        if self.executable_cache is None:
            return compile_fn()
        return self.executable_cache.get_or_compile(
            repr((*what, self.program_description, self.vocab_limit, self.max_bucket_seqs,
                  MAX_LOGPROBS, MAX_MIN_TOKENS_STOP_IDS)), args, compile_fn)

    def _arg_specs(self) -> tuple:
        """(params, kv_cache, penalty_state) as trees of ``jax.ShapeDtypeStruct``, taken once:
        all a compile reads of them, so ``compile_pending`` may compile on another thread
        while steps donate and replace the cache and the penalty state."""
        if self._specs is None:
            self._specs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                               weak_type=x.weak_type)
                if isinstance(x, jax.Array) else x,
                (self.params, self.kv_cache, self.penalty_state))
        return self._specs

    def _compile_model(self, bucket: Bucket) -> None:
        lay = self.layouts[bucket]
        packed = jax.ShapeDtypeStruct((lay.size,), jnp.int32, sharding=self._replicated)
        prev = jax.ShapeDtypeStruct((self.max_bucket_seqs,), jnp.int32,
                                    sharding=self._replicated)
        args = (*self._arg_specs(), packed, prev)
        compile_fn = lambda: jax.jit(model_program(
            self.model, lay, self.vocab_limit, self._replicated), donate_argnums=(1, 2)).lower(
            *args).compile()
        self.compiled[bucket] = self._cached(("model", bucket, lay.slices, lay.max_blocks),
                                             args, compile_fn)
        shape = (lay.sampler_rows, self.num_mask_words)
        self._all_allowed[bucket] = self._to_device(np.full(shape, -1, np.int32))

    def _compile_sampler(self, bucket: Bucket) -> None:
        """The sampler program of ``bucket``'s row count, its inputs' shapes taken from the
        bucket's compiled model program."""
        lay = self.layouts[bucket]
        s = lay.sampler_rows
        logits = self.compiled[bucket].out_info[2]
        args = (jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=self._replicated),
                self._arg_specs()[2],
                jax.ShapeDtypeStruct((lay.size - lay.sampler_start,), jnp.int32,
                                     sharding=self._replicated),
                jax.ShapeDtypeStruct((s, self.num_mask_words), jnp.int32,
                                     sharding=self._replicated))
        compile_fn = lambda: jax.jit(sampler_program(
            lay, self.vocab_limit, self.max_bucket_seqs, self._replicated)).lower(*args).compile()
        self.samplers[s] = self._cached(("sampler", s, lay.sampler_slices), args, compile_fn)

    def _to_device(self, host: np.ndarray) -> jax.Array:
        """A host array on the step programs' devices (replicated over the mesh, if any)."""
        if self._multiprocess:
            return jax.make_array_from_callback(host.shape, self._replicated,
                                                lambda idx: host[idx])
        return jax.device_put(host, self._replicated)

    def mask_buffer(self, bucket: Bucket) -> np.ndarray:
        """The bucket's host allowed-token mask ``i32[S, num_mask_words]``, every bit set
        (reused: fill it, pass it to ``execute``, and ask again for the next step)."""
        buf = self._mask_buffers.get(bucket)
        if buf is None:
            buf = self._mask_buffers[bucket] = np.empty(
                (self.layouts[bucket].sampler_rows, self.num_mask_words), np.int32)
        buf.fill(-1)
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
    def pack_step(self, chunks: Sequence[StepChunk], rows: Sequence[RowParams], *,
                  sample_index: Sequence[int] | None = None, want_logprobs: bool = False,
                  src_rows: Sequence[int] | None = None) -> tuple[Bucket, np.ndarray]:
        """Pack one ragged step into its bucket's buffer (``StepPacker.pack``, which documents
        the arguments and errors); returns (bucket, buffer)."""
        return self.packer.pack(chunks, rows, sample_index=sample_index,
                                want_logprobs=want_logprobs, src_rows=src_rows)

    def execute(self, bucket: Bucket, packed: np.ndarray,
                allowed: np.ndarray | None = None) -> StepOutput:
        """Dispatch one step and return at once; its ``StepOutput.ids`` wait for it.

        Args:
          bucket, packed: as ``pack_step`` returned them (``packed``'s mask flag is set here).
          allowed: the rows' allowed-token masks (``mask_buffer(bucket)``, filled), or None:
            every token allowed (the device-resident mask; nothing is sent).
        Raises:
          RuntimeError: if the bucket was not compiled by warmup (serving never compiles).
          ValueError: a mask when one model spans several processes.
        """
        prog = self.compiled.get(bucket)
        sampler = self.samplers.get(self.layouts[bucket].sampler_rows)
        if prog is None or sampler is None:
            raise RuntimeError(f"bucket {bucket} was not compiled; call warmup() first")
        flags = self.layouts[bucket].slices["flags"]
        packed[flags] = (packed[flags] & ~self.FLAG_ALLOWED) | (
            self.FLAG_ALLOWED if allowed is not None else 0)
        if self._multiprocess:  # process 0 drives; the followers run the same program
            if allowed is not None:
                raise ValueError("token masks are not supported when one model spans several "
                                 "processes")
            multihost_utils.broadcast_one_to_all(
                np.array([self.buckets.index(bucket)], np.int32))
            packed = multihost_utils.broadcast_one_to_all(packed)
            return self._run_global(bucket, packed)
        mask = self._all_allowed[bucket] if allowed is None else allowed
        self.kv_cache, self.penalty_state, logits, plp, inputs = prog(
            self.params, self.kv_cache, self.penalty_state, packed, self._last_ids)
        ids, lp = sampler(logits, self.penalty_state, inputs, mask)
        self._last_ids = ids
        ids.copy_to_host_async()
        return StepOutput(ids, lp, plp)

    # -- several processes (jax.distributed): process 0 schedules, the others follow ----------
    @property
    def multiprocess(self) -> bool:
        """True when the mesh spans several processes (see jaxserve.cli.multihost)."""
        return self._multiprocess

    def _run_global(self, bucket: Bucket, packed: np.ndarray) -> StepOutput:
        arr = self._to_device(np.asarray(packed))
        self.kv_cache, self.penalty_state, logits, plp, inputs = self.compiled[bucket](
            self.params, self.kv_cache, self.penalty_state, arr, self._last_ids)
        ids, lp = self.samplers[self.layouts[bucket].sampler_rows](
            logits, self.penalty_state, inputs, self._all_allowed[bucket])
        self._last_ids = ids
        local = lambda tree: jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)
        return StepOutput(np.asarray(ids.addressable_data(0)), local(lp), local(plp))

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


def _cpu_s() -> float:
    """This process's user + system CPU seconds so far (every thread)."""
    t = os.times()
    return t.user + t.system
