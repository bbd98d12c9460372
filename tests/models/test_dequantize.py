"""``models.loader.dequantize`` (chunked) against gguf's own ``dequantize``, and the prefetching
tensor getter."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest

from models import loader


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0,
                                   gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.F16])
@pytest.mark.parametrize("chunk", [1 << 24, 64])  # one piece; many pieces of one row
def test_dequantize_matches_gguf(qtype, chunk, monkeypatch) -> None:
    monkeypatch.setattr(loader, "DEQUANT_CHUNK_ELEMENTS", chunk)
    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    data = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(data, qtype)
    got = loader.dequantize(data, qtype)
    assert got.dtype == np.float32 and got.shape == (6, 96)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - w).max() < 0.5  # and it is the weight, roughly


def test_getter_hands_each_tensor_and_refuses_unknown_names() -> None:
    w = np.arange(64, dtype=np.float32).reshape(2, 32)

    class T:
        def __init__(self, name, data, qtype):
            self.name, self.data, self.tensor_type = name, data, qtype

    a = T("a", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
          gguf.GGMLQuantizationType.Q8_0)
    reader = SimpleNamespace(tensors=[a, T("b", w, gguf.GGMLQuantizationType.F32)])
    want_a = gguf.quants.dequantize(a.data, a.tensor_type)
    get = loader.gguf_tensor_getter(reader, "x.gguf")
    np.testing.assert_array_equal(get("a"), want_a)
    np.testing.assert_array_equal(get("b"), w)
    np.testing.assert_array_equal(get("a"), want_a)  # asked again: dequantised again
    with pytest.raises(ValueError, match="x.gguf lacks tensor c"):
        get("c")
