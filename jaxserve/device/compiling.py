"""The compiling half of ``ModelRunner``: which programs a bucket needs, compiling them (through
the executable cache) before ready or after it, and publishing each bucket for the packer.

``ProgramCompiler`` is a mixin of ``ModelRunner``, whose ``__init__`` sets what it reads:
``model``, ``params``, ``kv_cache``, ``penalty_state``, ``buckets``, ``layouts``, ``packer``,
``compiled``, ``samplers``, ``_set_bias``, ``_specs``, ``_all_allowed``, ``num_compiles``,
``executable_cache``, ``program_description``, ``vocab_limit``, ``max_bucket_seqs``,
``num_mask_words``, ``host_tier``, ``_replicated`` and ``_to_device``; what the programs compute is
``step_programs``, and running them is ``runner``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.device.buckets import Bucket
from jaxserve.device.penalties import set_bias_row
from jaxserve.device.step_programs import model_program, sampler_program
from jaxserve.device.warmup import run_compiles
from jaxserve.sampling_params import MAX_LOGPROBS, MAX_MIN_TOKENS_STOP_IDS


class ProgramCompiler:
    """Compiling ``ModelRunner``'s step programs (the module docstring)."""

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

    @property
    def usable_buckets(self) -> list[Bucket]:
        """The buckets steps may be packed into now, ascending (``StepPacker.usable``); a new
        list (not changed in place) whenever more are compiled or ``restrict_buckets`` runs."""
        return self.packer.usable

    def restrict_buckets(self, buckets: Sequence[Bucket] | None) -> None:
        """Pack steps into the compiled ones of ``buckets`` only (None: every compiled
        bucket), until the next bucket a compile publishes.

        Raises:
          ValueError: ``buckets`` without the largest compiled one (a step of every size
            must fit).
        """
        self._publish_usable(None if buckets is None else set(buckets))

    def _publish_usable(self, only: set[Bucket] | None = None) -> None:
        usable = [b for b in self.buckets if b in self.compiled
                  and self.layouts[b].sampler_rows in self.samplers
                  and (only is None or b in only)]
        if only is not None and (not usable or usable[-1] != self.packer.usable[-1]):
            raise ValueError(f"restrict_buckets: {sorted(only)} must hold the largest compiled "
                             f"bucket, {self.packer.usable[-1]}")
        self.packer.usable = usable

    def _compile_set_bias(self) -> None:
        st = self.penalty_state
        args = (st, jax.ShapeDtypeStruct((), jnp.int32),
                jax.ShapeDtypeStruct(st.bias.shape[1:], jnp.float32))
        compile_fn = lambda: jax.jit(set_bias_row, donate_argnums=(0,)).lower(*args).compile()
        self._set_bias = self._cached(("set_bias",), args, compile_fn)

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



def _cpu_s() -> float:
    """This process's user + system CPU seconds so far (every thread)."""
    t = os.times()
    return t.user + t.system
