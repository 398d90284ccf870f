"""`verifier/models/gguf_file.py` against the gguf package's own reader and writer (the
reference): the same metadata values and tensors, on the bundled model and on a small
file holding every value type; bad files are errors that say so."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from verifier.errors import ModelLoadError
from verifier.models.gguf_file import GGUFFile


def _same_as_reader(path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # its header fields
    assert list(ours.metadata) == keys
    for key in keys:
        want = ref.fields[key].contents()
        assert ours.value(key) == want and type(ours.value(key)) is type(want), key
    assert ours.data_offset == ref.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert (t.tensor_type, t.shape) == (r.tensor_type, tuple(r.shape.tolist())), t.name
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert np.array_equal(t.data, np.asarray(r.data)), t.name
    return ours


def test_the_bundled_model_reads_as_the_gguf_package_reads_it():
    from verifier.models.bundled import bundled_model_path

    f = _same_as_reader(bundled_model_path())
    assert f.value("general.architecture") == "llama" and len(f.value("tokenizer.ggml.tokens")) == 49152
    assert f.value("no.such.key", 7) == 7


def _write(path, alignment: int | None = None):
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo <|im_end|>")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return q


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_reads_as_written(tmp_path, alignment):
    q = _write(tmp_path / "t.gguf", alignment)
    f = _same_as_reader(tmp_path / "t.gguf")
    assert (f.value("t.u64"), f.value("t.i16"), f.value("t.str")) == (2**63 + 5, -30000, "héllo <|im_end|>")
    assert f.value("t.strs") == ["a", "", "ü"] and f.value("t.bools") == [True, False]
    assert f.data_offset % (alignment or 32) == 0
    q8 = next(t for t in f.tensors if t.name == "q8")
    assert np.abs(gguf.quants.dequantize(q8.data, q8.tensor_type) - q).max() < 0.02  # Q8_0's rounding


def test_a_string_that_is_not_utf8_fails_when_asked_for(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    data = path.read_bytes()
    at = data.index("héllo".encode())
    path.write_bytes(data[:at] + b"\xff" + data[at + 1:])
    f = GGUFFile(path)
    assert f.value("t.u8") == 200
    with pytest.raises(ModelLoadError, match=r"t\.gguf: GGUF metadata 't\.str' is not valid UTF-8"):
        f.value("t.str")


def test_bad_files_are_errors(tmp_path):
    path = tmp_path / "t.gguf"
    _write(path)
    data = path.read_bytes()
    for bad, match in ((b"", "not a GGUF file"), (b"GGML" + data[4:], "magic"),
                       (data[:300], "cut short|runs past"),
                       (data[:4] + (3).to_bytes(4, "big") + data[8:], "big-endian"), (data[:-40], "runs past the end")):
        path.write_bytes(bad)
        with pytest.raises(ValueError, match=match):
            GGUFFile(path)
    from verifier.models.loader import load_model

    path.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(path)
