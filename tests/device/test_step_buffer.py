"""The packed step buffer (jaxserve.device.step_buffer): a bucket that shares a larger sampler
program lays out that sampler's rows, and its padding rows sample nothing that matters."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.device.buckets import Bucket, make_buckets
from jaxserve.device.step_buffer import (
    Chunk,
    Layout,
    RowParams,
    StepPacker,
    sampler_rows_for,
)


def test_a_bucket_samples_with_the_smallest_sampler_that_holds_its_rows() -> None:
    assert sampler_rows_for(8, (1, 4, 16, 64)) == 16
    assert sampler_rows_for(16, (1, 4, 16, 64)) == 16
    assert sampler_rows_for(24, ()) == 24  # no classes: its own
    assert sampler_rows_for(96, (1, 4, 16, 64)) == 96  # above every class: its own
    with pytest.raises(ValueError, match="sampler_rows=4"):
        Layout(Bucket(8, 8), 4, sampler_rows=4)


def test_padded_sampler_rows_are_greedy_without_slots_or_suppressed_ids() -> None:
    buckets = make_buckets(64, 16, small=(1, 4))
    own = StepPacker(buckets, 4, 16, num_penalty_slots=16)
    shared = StepPacker(buckets, 4, 16, num_penalty_slots=16, sampler_rows=(1, 4, 16))
    chunks = [Chunk((5, 6, 7, 8, 9, 10), 0, (1,)), Chunk((9,), 3, (2,))]
    rows = [RowParams(0.7, 20, 0.9, 11, 3), RowParams(1.0, 0, 1.0, 12, 0)]
    b_own, buf_own = own.pack(chunks, rows)
    b_sh, buf_sh = shared.pack(chunks, rows)
    assert b_own == b_sh == Bucket(8, 8)
    lay_own, lay_sh = own.layouts[b_own], shared.layouts[b_sh]
    assert lay_own.sampler_rows == 8 and lay_sh.sampler_rows == 16
    assert lay_sh.sampler_start == lay_own.sampler_start and lay_sh.size > lay_own.size
    # the model program's fields are the same; the sampler's have 16 rows
    for name, sl in lay_own.slices.items():
        if sl.stop <= lay_own.sampler_start:
            assert (buf_own[sl] == buf_sh[lay_sh.slices[name]]).all(), name
    temp = buf_sh[lay_sh.slices["temperature"]].view(np.float32)
    assert temp.tolist()[:2] == pytest.approx([0.7, 1.0]) and not temp[2:].any()
    assert (buf_sh[lay_sh.slices["top_p"]].view(np.float32)[2:] == 1.0).all()
    assert (buf_sh[lay_sh.slices["slot"]] == 16).all()  # no penalty slot
    assert (buf_sh[lay_sh.slices["suppress_ids"]] == -1).all()
    for name in ("temperature", "top_k", "top_p", "seed_hi", "seed_lo", "sample_pos"):
        assert (buf_sh[lay_sh.slices[name]][:2] == buf_own[lay_own.slices[name]][:2]).all()
