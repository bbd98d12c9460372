"""The Mosaic GPU program of ``ragged_paged_attention_mosaic``: kernel body and builder.

One CTA per (query block, kv head, key split), three warpgroups (the FlashAttention-3 layout,
Shah et al. 2024, arXiv:2407.08608; jax's ``pallas/ops/gpu/attention_mgpu.py``):

* warpgroup 2 (memory) walks the CTA's keys ``[lo, hi)`` in steps of ``block_k``, reads the
  step's ``block_k // block_size`` block-table entries and copies each page's ``[block_size,
  head_dim]`` rows of this kv head with TMA into a ``stages``-deep shared-memory ring (``ready``
  barriers; a slot is refilled once both compute warpgroups arrive on its ``free`` barrier). An
  8-bit cache lands in a ring of its own (``stages8``) and this warpgroup converts each step to
  the compute dtype in the 16-bit ring. In the last step it zeroes the value rows past ``hi``
  (pages may hold anything, NaN included; ``0 * NaN`` would reach the output);
* warpgroups 0 and 1 (compute) each hold one 64-row query tile (``query_tiles``) and run the
  online softmax of FlashAttention (Dao et al. 2022, arXiv:2205.14135) over the ring, in base 2:
  ``S = Q K^T`` and ``O += P V`` as wgmma from shared memory (``P`` from registers, or through
  shared memory with ``p_in_smem``), scores in float32, the causal / window mask only on the
  steps that need it; a tile with no live row only releases the slots.

Every waiter waits every phase of the barriers it waits on, in order (Mosaic tracks one parity
bit per barrier and thread; GPU interpret mode checks it when a barrier is freed).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kv_cache import FP8_STORAGE, is_quantized_dtype
from pallas_kernels.query_tiles import ROWS

MASK = -1e30
_LOG2E = math.log2(math.e)
_SMEM_BUDGET = 200 * 1024  # the default tiling's share of an H100/H200 CTA's 227 KiB
SMEM_MAX = 227 * 1024 - 1024  # what a CTA may ask for, less the barriers
_REGS = (216, 80)  # max registers per thread: compute, memory warpgroups (64K a CTA); untuned


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static shape of one kernel build (``build``)."""

    group: int
    head_dim: int
    block_size: int
    block_k: int
    stages: int
    stages8: int
    num_splits: int
    max_blocks: int  # block-table columns after padding
    windowed: bool
    soft_cap: float | None
    quantized: bool
    sm_scale: float
    p_in_smem: bool  # P through shared memory (GPU interpret mode's wgmma needs it there)

    @property
    def bq(self) -> int:  # tokens per compute tile
        return ROWS // self.group


def _transforms(dtype, head_dim: int):
    """wgmma/TMA-compatible tiling and swizzle of a ``[rows, head_dim]`` shared-memory tile."""
    swizzle = min(128, head_dim * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


# -- kernel body --------------------------------------------------------------------------------
def _kernel(blk_ref, lens_ref, qsl_ref, bt_ref, scal_ref, scale_ref, q_ref, k_ref, v_ref,
            o_ref, *lse, c: KernelConfig, dt, q_smem, k16, v16, q_bar, k_ready, v_ready, k_free,
            v_free, tail_bar, k8=None, v8=None, bar8=None, lse_smem=None, p_smem=None):
    b, h, split, wg = (lax.axis_index(n) for n in ("b", "h", "p", "wg"))
    bk, bs, num_stages, ppc = c.block_k, c.block_size, c.stages, c.block_k // c.block_size
    seq, start, end = blk_ref[0, b], blk_ref[1, b], blk_ref[2, b]
    pos0 = lens_ref[seq] - qsl_ref[seq + 1]  # token t sits at position pos0 + t
    layer, window = scal_ref[0], scal_ref[1]
    hi = jnp.where(end > start, pos0 + end, 0)  # keys [lo, hi): the block's context
    lo = jnp.minimum(jnp.maximum(pos0 + start + 1 - window, 0), hi) if c.windowed else 0
    page_lo = lax.div(lo, bs)
    n_total = lax.div(hi - page_lo * bs + bk - 1, bk)
    per_split = lax.div(n_total + c.num_splits - 1, c.num_splits)
    t0 = split * per_split
    n = jnp.clip(n_total - t0, 0, per_split)  # steps of this split
    kb0 = page_lo * bs + t0 * bk  # first key of step 0

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(_REGS[1], action="decrease")

        def issue(j, *copies):  # (cache, shared-memory slot, barrier): one TMA copy a page
            row0 = seq * c.max_blocks + page_lo + (t0 + j) * ppc
            for i in range(ppc):
                page, rows = bt_ref[row0 + i], pl.ds(i * bs, bs)
                for src, dst, bar in copies:
                    plgpu.copy_gmem_to_smem(src.at[layer, page, :, h, :], dst.at[rows], bar)

        def store_converted(src, dst, j, mask_tail):  # 64-row chunks: few registers
            for ci in range(bk // ROWS):
                x = src[pl.ds(ci * ROWS, ROWS)] if src is not None else dst[pl.ds(ci * ROWS, ROWS)]
                if x.dtype == FP8_STORAGE:  # e4m3 widens exactly to float16 in hardware
                    x = lax.bitcast_convert_type(x, jnp.float8_e4m3fn).astype(jnp.float16)
                elif x.dtype == jnp.int8:
                    x = x.astype(jnp.float32)
                x = x.astype(dt)
                if mask_tail:  # value rows at or past hi: 0 (they may hold NaN)
                    r = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA)
                    x = jnp.where(r < hi - (kb0 + j * bk + ci * ROWS), x, jnp.zeros_like(x))
                dst[pl.ds(ci * ROWS, ROWS)] = x
            plgpu.commit_smem()  # order the stores before the wgmma (async proxy) reads

        if not c.quantized:
            @pl.loop(0, n)
            def _step(j):
                slot = lax.rem(j, num_stages)

                @pl.when(j >= num_stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                issue(j, (k_ref, k16.at[slot], k_ready.at[slot]))

                @pl.when(j >= num_stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                @pl.when(j < n - 1)
                def _():
                    issue(j, (v_ref, v16.at[slot], v_ready.at[slot]))

                @pl.when(j == n - 1)  # the last step: values past hi zeroed, then released
                def _():
                    issue(j, (v_ref, v16.at[slot], tail_bar))
                    plgpu.barrier_wait(tail_bar)
                    store_converted(None, v16.at[slot], j, True)
                    for _ in range(ppc):
                        plgpu.barrier_arrive(v_ready.at[slot])
        else:
            for s in range(c.stages8):
                pl.when(s < n)(lambda s=s: issue(s, (k_ref, k8.at[s], bar8.at[s]),
                                                 (v_ref, v8.at[s], bar8.at[s])))

            @pl.loop(0, n)
            def _step(j):
                slot, s8 = lax.rem(j, num_stages), lax.rem(j, c.stages8)
                plgpu.barrier_wait(bar8.at[s8])
                for src, dst, free, ready, tail in ((k8, k16, k_free, k_ready, False),
                                                    (v8, v16, v_free, v_ready, True)):
                    pl.when(j >= num_stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                    store_converted(src.at[s8], dst.at[slot], j, tail)
                    plgpu.barrier_arrive(ready.at[slot])

                @pl.when(j + c.stages8 < n)
                def _():
                    issue(j + c.stages8, (k_ref, k8.at[s8], bar8.at[s8]),
                          (v_ref, v8.at[s8], bar8.at[s8]))

        # observe the last releases too (every waiter sees every phase of a barrier it waits on)
        @pl.loop(jnp.maximum(n - num_stages, 0), n)
        def _drain(j):
            plgpu.barrier_wait(k_free.at[lax.rem(j, num_stages)])
            plgpu.barrier_wait(v_free.at[lax.rem(j, num_stages)])

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(_REGS[0], action="increase")
        tok0 = start + wg * c.bq
        n_rows = jnp.clip(end - tok0, 0, c.bq) * c.group  # live rows of this tile
        base_pos = pos0 + tok0  # position of row 0's token

        @pl.when(n_rows == 0)  # nothing to compute: release each slot as it fills
        def _pace():
            @pl.loop(0, n)
            def _(j):
                slot = lax.rem(j, num_stages)
                for ready, free in ((k_ready, k_free), (v_ready, v_free)):
                    plgpu.barrier_wait(ready.at[slot])
                    plgpu.barrier_arrive(free.at[slot])

        @pl.when(n_rows > 0)
        def _work():
            plgpu.copy_gmem_to_smem(q_ref.at[b, h, wg], q_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            score_scale = c.sm_scale * (scale_ref[0, layer, h] if c.quantized else 1.0)
            bcast = functools.partial(lax.broadcast_in_dim, broadcast_dimensions=[0])

            def step(j, carry, masked: bool):
                m, l, acc = carry
                slot = lax.rem(j, num_stages)
                plgpu.barrier_wait(k_ready.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k16.at[slot].T)
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((ROWS, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * score_scale
                if c.soft_cap is not None:
                    s = c.soft_cap * jnp.tanh(s / c.soft_cap)
                s = s * _LOG2E
                if masked:  # key kb+x sees row r iff x*g <= r (causal) and (x+W)*g > r
                    r = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    x = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    x = x + (kb0 + j * bk - base_pos)
                    ok = (x * c.group <= r) & (r < n_rows)
                    if c.windowed:
                        ok = ok & ((x + window) * c.group > r)
                    s = jnp.where(ok, s, MASK)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - bcast(m_new, s.shape))
                if masked:
                    p = jnp.where(ok, p, 0.0)
                l = l * alpha + p.sum(axis=1)
                plgpu.barrier_wait(v_ready.at[slot])

                p_op = p.astype(dt)
                if c.p_in_smem:
                    p_smem.at[wg][...] = p_op
                    plgpu.commit_smem()
                    p_op = p_smem.at[wg]

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v16.at[slot])
                    return acc_ref[...]

                o = pl.run_scoped(pv, plgpu.ACC((ROWS, c.head_dim), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return m_new, l, acc * bcast(alpha, acc.shape) + o

            row_layout = plgpu.Layout.WGMMA.reduce(1)
            carry = (plgpu.layout_cast(jnp.full((ROWS,), MASK, jnp.float32), row_layout),
                     plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), row_layout),
                     plgpu.layout_cast(jnp.full((ROWS, c.head_dim), 0.0, jnp.float32),
                                       plgpu.Layout.WGMMA))
            # leading steps whose keys precede every row need no mask (no window)
            n_full = 0 if c.windowed else jnp.clip(lax.div(base_pos + 1 - kb0, bk), 0, n)
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
            m, l, acc = lax.fori_loop(n_full, n, functools.partial(step, masked=True), carry)
            if c.quantized:
                acc = acc * scale_ref[1, layer, h]
            out = acc / bcast(jnp.where(l > 0, l, 1.0), acc.shape)
            q_smem.at[wg][...] = out.astype(dt)  # the tile is free after the last QK
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[split, b, h, wg])
            if lse:  # log2-sum-exp2 of the split, for the merge
                lse_smem.at[wg][...] = jnp.where(l > 0, m + jnp.log(l) * (1 / math.log(2)),
                                                 MASK)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse[0].at[split, b, h, wg])
            plgpu.wait_smem_to_gmem(0)


# -- pallas_call builder -------------------------------------------------------------------------
def default_tiling(head_dim: int, kv_dtype) -> tuple[int, int, int]:
    """``(block_k, stages, stages8)``: 128 keys a step (64 past head_dim 128 or for an 8-bit
    cache, whose own ring adds ``stages8`` slots), halved until shared memory fits
    ``_SMEM_BUDGET``."""
    quantized = is_quantized_dtype(kv_dtype)
    block_k = 64 if head_dim > 128 or quantized else 128
    stages, stages8 = 2, (4 if quantized else 0)
    while block_k > 64 and smem_bytes(head_dim, block_k, stages, stages8, 2) > _SMEM_BUDGET:
        block_k //= 2
    return block_k, stages, stages8


def smem_bytes(head_dim: int, block_k: int, stages: int, stages8: int, itemsize: int,
                p_in_smem: bool = True) -> int:
    """Shared memory of one CTA: q tiles, the 16-bit (and 8-bit) rings, P tiles, lse."""
    tile = block_k * head_dim
    return (2 * ROWS * head_dim * itemsize + 2 * stages * tile * itemsize + 2 * stages8 * tile
            + 2 * ROWS * block_k * itemsize * p_in_smem + 2 * ROWS * 4)


def build(c: KernelConfig, dt, kv_dtype, num_q_blocks: int, num_kv_heads: int):
    """The ``plgpu.kernel`` of one static shape, a function of ``(interpret=...)``; its inputs
    are ``ragged_paged_attention_mosaic._ragged_mosaic``'s (metadata ``i32``, scales, q tiles
    ``[B, kv, 2, ROWS, d]``, the caches), its outputs ``o [P, B, kv, 2, ROWS, d]`` and, with
    splits, ``lse f32[P, B, kv, 2, ROWS]``."""
    d, bk = c.head_dim, c.block_k
    tma_pages = bk // c.block_size  # TMA arrivals a 16-bit step makes per barrier
    scratch = {
        "q_smem": plgpu.SMEM((2, ROWS, d), dt, transforms=_transforms(dt, d)),
        "k16": plgpu.SMEM((c.stages, bk, d), dt, transforms=_transforms(dt, d)),
        "v16": plgpu.SMEM((c.stages, bk, d), dt, transforms=_transforms(dt, d)),
        "q_bar": plgpu.Barrier(num_barriers=2),
        # ready: the TMA page copies landed (16-bit cache) or the memory warpgroup converted
        "k_ready": plgpu.Barrier(num_arrivals=1 if c.quantized else tma_pages,
                                 num_barriers=c.stages),
        "v_ready": plgpu.Barrier(num_arrivals=1 if c.quantized else tma_pages,
                                 num_barriers=c.stages),
        "k_free": plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),
        "v_free": plgpu.Barrier(num_arrivals=2, num_barriers=c.stages),
        "tail_bar": plgpu.Barrier(num_arrivals=tma_pages),
    }
    if c.quantized:
        for name in ("k8", "v8"):
            scratch[name] = plgpu.SMEM((c.stages8, bk, d), kv_dtype,
                                       transforms=_transforms(kv_dtype, d))
        scratch["bar8"] = plgpu.Barrier(num_arrivals=2 * tma_pages, num_barriers=c.stages8)
    if c.num_splits > 1:
        scratch["lse_smem"] = plgpu.SMEM((2, ROWS), jnp.float32)
    if c.p_in_smem:
        scratch["p_smem"] = plgpu.SMEM((2, ROWS, bk), dt, transforms=_transforms(dt, bk))
    out_type = [jax.ShapeDtypeStruct((c.num_splits, num_q_blocks, num_kv_heads, 2, ROWS, d), dt)]
    if c.num_splits > 1:
        out_type.append(jax.ShapeDtypeStruct(
            (c.num_splits, num_q_blocks, num_kv_heads, 2, ROWS), jnp.float32))
    return functools.partial(
        plgpu.kernel, functools.partial(_kernel, c=c, dt=dt), out_type=tuple(out_type),
        scratch_types=scratch, grid=(num_q_blocks, num_kv_heads, c.num_splits),
        grid_names=("b", "h", "p"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True))
