"""The CPU: bfloat16 weights where the CPU has a bfloat16 dot, the native C++ kernels where they
load, and the extra step shapes that pay for themselves on XLA:CPU.

**dtype.** "auto" is bfloat16 on CPUs with a native bfloat16 dot (``CPU_BF16_FLAGS``), float32
elsewhere; bfloat16 weights compute with float32 activations (XLA:CPU runs bfloat16 elementwise
work through float32 conversions, slower than float32 itself, while a bfloat16 dot with float32
accumulation runs at up to twice the float32 rate). On an AVX512-BF16 CPU bfloat16 weights are
as good as float32 on the eval set (perplexity -0.03%, top-1 agreement 0.99) and the step is
20-40% faster: docs/configuration.md#dtype.

**Native kernels** (``EngineConfig.cpu_kernels``): "auto" runs each native CPU kernel where it
applies and loads (``cpu_kernels``: built ahead by ``jaxserve build-kernels``, the library for
the best ISA variant this CPU runs) — attention's decode and prefill rows
(``cpu_kernels.attention``), bfloat16 matmuls over packed weights where the avx512bf16 build
loads (``cpu_kernels.bf16_matmul``), int4 matmuls of up to ``NATIVE_INT4_MAX_ROWS`` rows
(``cpu_kernels.int4_matmul``); "on" the same, an error where they cannot load; "off" XLA's paths only. The matmul kernels are custom calls XLA cannot
partition: with tensor parallelism only attention runs natively.

**Buckets.** ``SMALL_BUCKETS``, 1 and 4 tokens, for one to four requests decoding: XLA:CPU runs
a 1-row weight matmul as a matrix-vector product, and a step's attention gathers every slot's
pages (padding slots' too). SmolLM2-135M, bfloat16 weights, context 300 (``jaxserve bench
step``): one decode 24 ms in the 1-token bucket against 32 ms in the 8-token one; four decodes
30-32 ms in the 4-token bucket against 36 ms. A 2-token bucket was no faster for two decodes.
The mid buckets ``3 * 2**k`` from 24 up to ``max_num_seqs``: a decode step's cost grows with its
padded rows and slots, so a step of 33 decodes padded to 64 cost what 64 do. Measured in one
process, decode steps interleaved (SmolLM2-135M, bfloat16, context 300;
docs/decisions/0024-decode-mid-buckets.md): 48 live sequences 100.3 ms a step with the powers of
two against 86.9 ms with the 48 bucket, 33 live 127.4 against 95.7, 24 live 90.0 against 77.2, 12
live 51.4 against 40.6 (a 12 bucket); 64 live the same. Each bucket costs a model program, about
1.2 s of a cold start's compile: few steps run 9-12 decodes, so a 12 bucket would not repay it.
The sampler programs are the dearer ones (2.5-4.6 s each, 2-core Zen 3): only the small buckets'
row counts and 16, 32, 64, ... get one (``cpu_sampler_rows``); a bucket of 8, 24 or 48 rows samples
with the next, its logits padded with zero rows. That took a cold start's compile from 21 programs
in 43.1 s to 18 in 34.4 s; an extra sampler pass over 8 (or 16) padding rows of the vocabulary is
about 1 (2.5) ms against decode steps of 60-200 ms, below the noise of interleaved ``bench step``
runs (docs/decisions/0037-sampler-row-counts.md).
Even so, 18 programs took 45-53 s of a cold start, so the CPU defers (``defer_compile``): a server
is ready once the 1-token, the ``max_num_seqs`` and the largest bucket are compiled (6 programs
with their samplers and the logit_bias writer) and compiles the other 12 on a background thread,
each usable as soon as it is compiled (docs/decisions/0039-deferred-compile.md).

**Batch invariance** (``batch_invariant``; docs/configuration.md#batch-invariance): XLA:CPU's
dot picks its kernel by row count, so the mode compiles no bucket below ``dot_row_floor``
(``DOT_ROW_FLOORS``: 2 rows for the mixed bfloat16 dot, 64 for float32; 1 for the native
bfloat16 kernel, which sums each row alone) and runs attention in the native kernel's one
reduction order. It is opt-in: "auto" leaves it off, because it cost up to 19% of a closed loop's
tokens on an AVX512-BF16 CPU (docs/decisions/0046-batch-invariance-opt-in.md).

**Step cost.** ~30 ms a step against ~0.75 ms a prompt token (SmolLM2-135M, 2 cores;
docs/decisions/0005-bucket-fit.md): ``step_overhead_tokens`` 32, ``prompt_token_s`` 0.75 ms
(the step-cost model's prior; the scheduler refits it from measured steps). The service
objectives default to ``config.DEFAULT_SLOS_MS["cpu"]`` (docs/configuration.md#slos).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from cpu_kernels import attention as cpu_attention
from cpu_kernels import bf16_matmul as cpu_bf16_matmul
from cpu_kernels import build as cpu_kernels_build
from cpu_kernels import int4_matmul as cpu_int4_matmul
from jaxserve.config import DEFAULT_SLOS_MS, EngineConfig
from jaxserve.platform.base import BucketSet, Platform
from jaxserve.platform.cpu_weights import NATIVE_INT4_MAX_ROWS, use_native_int4, use_packed_bf16
from models.quant import QuantTargets

SMALL_BUCKETS = (1, 4)  # token buckets below 8 compiled on the CPU
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (``/proc/cpuinfo``'s names) of x86 CPUs with a native bfloat16 dot (XLA:CPU's
YNNPACK dots use it); without one a bfloat16 dot is converted to float32 and gains nothing."""
DOT_ROW_FLOORS = {"bfloat16": 2, "float32": 64, "float16": 64}
"""Per weight dtype, the fewest rows from which XLA:CPU's dot of SmolLM2's weight shapes gives
each row bit-identical results at every row count up to 1024 (2-core Zen 3, YNNPACK dots): a
1-row bfloat16 dot (float32 accumulation) runs as a matrix-vector product; float32 dots of 2-48
rows use other kernels than those of 64 and more (docs/decisions/0040-batch-invariance.md)."""


def cpu_has_bf16_dot(cpuinfo: Path | str = cpu_kernels_build.CPUINFO) -> bool:
    """Whether this CPU has a native bfloat16 dot (``CPU_BF16_FLAGS`` among the flags
    ``cpu_kernels.build.cpu_flags`` reads from ``cpuinfo``); False where they cannot be read
    (not Linux)."""
    flags = cpu_kernels_build.cpu_flags(cpuinfo)
    return flags is not None and not flags.isdisjoint(CPU_BF16_FLAGS)


class CpuPlatform(Platform):
    """XLA:CPU (the module docstring gives the measurements behind each answer)."""

    name = "cpu"
    step_overhead_tokens = 32
    prompt_token_s = 0.75e-3
    prefill_pair_s = 1.0e-6
    default_slos_ms = DEFAULT_SLOS_MS["cpu"]

    def resolve_dtype(self, name: str) -> jnp.dtype:
        if name == "auto":
            return jnp.dtype(jnp.bfloat16 if cpu_has_bf16_dot() else jnp.float32)
        return jnp.dtype(name)

    def compute_dtype(self, dtype: jnp.dtype) -> jnp.dtype:
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.float32) if dtype == jnp.bfloat16 else dtype

    def attention_backend(self, config: EngineConfig) -> str:
        backend = config.attention_backend
        if backend in ("pallas", "mosaic"):
            raise ValueError(f"attention_backend={backend!r} (a compiled Pallas kernel) runs on "
                             f"GPUs only, not on 'cpu'; use 'auto' or 'reference' there "
                             f"('{backend}-interpret' runs the kernel interpreted, for tests, "
                             f"too slow to serve: minutes for a few tokens)")
        if config.cpu_kernels == "on" and not cpu_attention.available():
            raise RuntimeError("cpu_kernels='on' needs the native CPU kernels, which are not "
                               "built for this CPU (see the log; run `jaxserve build-kernels` "
                               "with a C++17 compiler)")
        if backend != "auto":
            return backend
        native = config.cpu_kernels != "off" and cpu_attention.available()
        return "native" if native else "reference"

    def prepare_weights(self, params, config: EngineConfig, dtype: jnp.dtype,
                        targets: QuantTargets | None):
        """int4 weights run by the native int4 matmul, bfloat16 weights packed for the native
        bfloat16 one (``jaxserve.platform.cpu_weights``; the module docstring says where each
        applies).

        Raises:
          RuntimeError: ``cpu_kernels="on"`` where a kernel that applies cannot load.
        """
        if config.cpu_kernels == "off" or config.tensor_parallel_size > 1:
            return params
        on = config.cpu_kernels == "on"
        if config.quantization == "int4" and (on or cpu_int4_matmul.available()):
            params = use_native_int4(params, NATIVE_INT4_MAX_ROWS)
        if self._packs_bf16(config, dtype) and targets is not None:
            params = use_packed_bf16(params, targets)
        return params

    @staticmethod
    def _packs_bf16(config: EngineConfig, dtype: jnp.dtype) -> bool:
        """Whether bfloat16 weights are packed for the native bfloat16 matmul."""
        return (config.cpu_kernels != "off" and config.tensor_parallel_size == 1
                and config.quantization == "none" and jnp.dtype(dtype) == jnp.bfloat16
                and (config.cpu_kernels == "on" or cpu_bf16_matmul.vectorized()))

    def batch_invariant(self, config: EngineConfig) -> bool:
        """"on" only: "auto" and "off" leave the mode off. It costs up to 19% of a closed
        loop's tokens on an AVX512-BF16 CPU (greedy, 16 streams; its decode rows are summed in
        the prefill tiles' order), so it is a choice, as vLLM's and SGLang's are
        (docs/configuration.md#batch-invariance). It needs the native attention kernel,
        unquantised weights (a quantised dot changes dtype with its row count) and one device.

        Raises:
          ValueError: "on" with another attention backend, quantisation or tensor parallelism.
        """
        if config.batch_invariant != "on":
            return False
        why = None
        if self.attention_backend(config) != "native":
            why = "the native attention kernel (" + (
                "got cpu_kernels='off'" if config.cpu_kernels == "off" else
                f"got attention_backend={config.attention_backend!r}"
                if config.attention_backend != "auto" else
                "not built for this CPU: run `jaxserve build-kernels`") + ")"
        elif config.quantization != "none":
            why = f"quantization='none' (got {config.quantization!r})"
        elif config.tensor_parallel_size > 1:
            why = f"tensor_parallel_size=1 (got {config.tensor_parallel_size})"
        if why is not None:
            raise ValueError(f"batch_invariant='on' needs {why}")
        return True

    def dot_row_floor(self, config: EngineConfig) -> int:
        """The fewest rows from which every matmul of a step is in one row class (a row's
        result bit-identical whatever the row count): 1 for the native bfloat16 kernel (each
        row summed alone), 2 for XLA's mixed bfloat16 dot (one row runs as a matrix-vector
        product), 64 for XLA's float32 and float16 dots (``DOT_ROW_FLOORS``)."""
        dtype = self.resolve_dtype(config.dtype)
        if self._packs_bf16(config, dtype):
            return 1
        return DOT_ROW_FLOORS[jnp.dtype(dtype).name]

    def buckets(self, config: EngineConfig) -> BucketSet:
        floor = self.dot_row_floor(config) if self.batch_invariant(config) else 1
        return BucketSet(small=SMALL_BUCKETS, mid_up_to=config.max_num_seqs,
                         sampler_rows=cpu_sampler_rows(config.max_num_seqs, floor),
                         defer_compile=True, min_tokens=floor)


def cpu_sampler_rows(max_num_seqs: int, min_rows: int = 1) -> tuple[int, ...]:
    """The row counts with a sampler program on the CPU (the module docstring): the small
    buckets', then 16, 32, 64, ... below ``max_num_seqs``, and ``max_num_seqs``; none below
    ``min_rows`` but ``max_num_seqs``."""
    rows = {r for r in SMALL_BUCKETS if r < max_num_seqs}
    r = 16
    while r < max_num_seqs:
        rows.add(r)
        r *= 2
    return tuple(sorted({r for r in rows if r >= min_rows} | {max_num_seqs}))
