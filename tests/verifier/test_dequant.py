"""`verifier/models/dequant.py` against `gguf.quants.dequantize` (the reference): bit for
bit the same float32 weights, on the bundled model and on random blocks of every type it
does itself, whole and in pieces."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from verifier.models import dequant
from verifier.models.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType

#: Where each type's float16 scales sit in a block (random bytes there could be NaN,
#: whose payload numpy and torch need not keep alike).
SCALES = {Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (-2,), Q.Q5_0: (0,), Q.F16: ()}


def _same(data: np.ndarray, kind) -> torch.Tensor:
    ours = dequant.dequantize(data, kind)
    ref = np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    assert np.array_equal(ours.numpy().view(np.uint32), ref.view(np.uint32)), kind
    return ours


def _random_blocks(kind, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    for at in SCALES[kind]:
        scale = rng.uniform(-2, 2, size=(rows, blocks_per_row)).astype(np.float16).view(np.uint8)
        data[:, :, at:at + 2 if at != -2 else None] = scale.reshape(rows, blocks_per_row, 2)
    return data.reshape(rows, blocks_per_row * type_size)


def test_the_bundled_models_tensors_are_bit_for_bit_ggufs():
    from verifier.models.bundled import bundled_model_path

    f = GGUFFile(bundled_model_path())
    kinds = set()
    for t in f.tensors:
        w = _same(t.data, t.tensor_type)
        kinds.add(t.tensor_type)
        w[0] += 1  # writable: the loader permutes and casts it in place
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= kinds


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0])
def test_random_blocks_are_bit_for_bit_ggufs_whole_and_in_pieces(kind, monkeypatch):
    data = _random_blocks(kind, rows=7, blocks_per_row=3)
    whole = _same(data, kind)
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    monkeypatch.setattr(dequant, "CHUNK_BYTES", 2 * type_size)  # 21 blocks in pieces of 2, the last alone
    assert torch.equal(_same(data, kind), whole)


def test_float_tensors_are_copies():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    x.setflags(write=False)
    w = _same(x, Q.F32)
    w[0, 0] = 9
    assert x[0, 0] == 0
    _same(np.arange(6, dtype=np.float16).reshape(2, 3), Q.F16)
