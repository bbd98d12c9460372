"""models.gguf_reader.GGUFFile against gguf's own GGUFReader on a small file written with
gguf.GGUFWriter (every metadata kind, plain and quantised tensors), and its error cases."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from models.gguf_reader import GGUFFile
from models.loader import gguf_name


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    rng = np.random.default_rng()
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_string("general.name", "small ✓")
    w.add_uint32("gemma3.block_count", 2)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_int64("test.i64", -5)
    w.add_array("tokenizer.ggml.tokens", ["<pad>", "▁a", "  ", "世界", ""])
    w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 4, 1])
    w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.0, -3.0, -4.0])
    w.add_tensor("norm.weight", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((3, 5)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                             gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_matches_gguf_reader(small_gguf: Path) -> None:
    ours, theirs = GGUFFile(str(small_gguf)), gguf.GGUFReader(str(small_gguf))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert sorted(ours.fields) == sorted(keys)
    for k in keys:
        a, b = theirs.fields[k].contents(), ours.fields[k].contents()
        b = b.tolist() if isinstance(b, np.ndarray) else b
        assert a == pytest.approx(b) if isinstance(a, float) else a == b, k
        assert len(ours.fields[k].data) == len(theirs.fields[k].data), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(theirs.tensors, ours.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and tuple(a.shape.tolist()) == b.shape
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(gguf.quants.dequantize(a.data, a.tensor_type),
                                      gguf.quants.dequantize(b.data, b.tensor_type))


def test_rejects_non_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(bad))


def test_rejects_truncated_header(small_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(small_gguf.read_bytes()[:60])
    with pytest.raises(ValueError, match="malformed GGUF header"):
        GGUFFile(str(cut))


@pytest.mark.parametrize("file,name", [
    ("dir/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("gemma-3-270m-q4_k_m.gguf", "gemma-3-270m"),
    ("Llama-3.1-8B-Instruct-Q8_0.gguf", "Llama-3.1-8B-Instruct"),
    ("qwen2-7b.gguf", "qwen2-7b"),
])
def test_gguf_name_drops_the_quantisation(file: str, name: str) -> None:
    assert gguf_name(file) == name
