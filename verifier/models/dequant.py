"""GGUF tensors to float32, in torch.

`gguf.quants.dequantize` works through numpy 16 rows at a time on one thread (~0.6 s for
the bundled model, ~12 s for Qwen2.5-Coder-1.5B's Q4_K/Q6_K here). These do the same
arithmetic in torch, 64 KiB of blocks at a time (~0.3 s and ~6.5 s), writing into the
output, element for element as gguf writes it (the integer unpacking is exact, and each
float32 product or sum is one correctly rounded operation, as in numpy), so the weights
are bit for bit the same; other types (float ones included) go to gguf's.
"""

from __future__ import annotations

import warnings

import gguf.quants
import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

Q = GGMLQuantizationType
#: Bytes of blocks dequantized at a time: their temporaries stay in cache, and under
#: glibc's first mmap threshold (128 KiB), so that freeing them does not raise it, which
#: would leave the weights' later copies (packing them for oneDNN) on the heap.
CHUNK_BYTES = 1 << 16


def _f16(blocks: torch.Tensor) -> torch.Tensor:
    """A column of float16 scales (2 bytes a block) as float32, [blocks, 1]."""
    return blocks.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Each byte's low 4 bits, then its high 4 bits, per group of `width` bytes:
    [blocks, groups, 2, width]."""
    qs = qs.reshape(qs.shape[0], groups, 1, width)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2)


# Each writes its blocks' values into `out` ([blocks, block_size] float32): the integer
# quants go in as they are (the product converts them exactly), so the only temporaries
# are bytes and per-block scales.

def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    torch.mul(_nibbles(b[:, 4:], 1, 16).reshape(b.shape[0], 32), d, out=out)
    out.add_(m)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, 2:].contiguous().view(torch.int8), _f16(b[:, 0:2]), out=out)


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(n, 3, 4)
    lo, mi, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1).float()
    mn = torch.cat([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], dim=1).float()
    out = out.view(n, 8, 32)
    torch.mul(_nibbles(b[:, 16:], 4, 32).reshape(n, 8, 32), (d * sc).reshape(n, 8, 1), out=out)
    out.sub_((dmin * mn).reshape(n, 8, 1))


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    ql, qh = b[:, :QK_K // 2], b[:, QK_K // 2:QK_K // 2 + QK_K // 4]
    scales = b[:, QK_K // 2 + QK_K // 4:QK_K // 2 + QK_K // 4 + QK_K // 16].contiguous().view(torch.int8).float()
    dl = (_f16(b[:, -2:]) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql, 2, 64).reshape(n, 8, 32)
    qh = qh.reshape(n, 2, 1, 32)
    high = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    out = out.view(n, QK_K // 16, 16)
    torch.sub((low | (high << 4)).view(torch.int8).reshape(n, QK_K // 16, 16), 32, out=out)  # 0..63: int8
    out.mul_(dl)


_BITS = torch.arange(8, dtype=torch.uint8)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    high = ((b[:, 2:6].reshape(n, 4, 1) >> _BITS) & 1).reshape(n, 32)  # a little-endian uint32's bits
    q = _nibbles(b[:, 6:], 1, 16).reshape(n, 32) | (high << 4)
    torch.sub(q.view(torch.int8), 16, out=out)  # 0..31: int8
    out.mul_(d)


_BLOCKS = {Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}


def dequantize(data: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    """A tensor as `gguf.GGUFReader` (or `GGUFFile`) gives it, as a writable float32
    torch tensor of the shape `gguf.quants.dequantize` returns."""
    if kind not in _BLOCKS:  # a writable copy
        return torch.from_numpy(np.array(gguf.quants.dequantize(data, kind), dtype=np.float32))
    block_size, type_size = GGML_QUANT_SIZES[kind]
    with warnings.catch_warnings():  # the file's read-only mapping: only read here
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))
    shape = (*data.shape[:-1], data.shape[-1] // type_size * block_size)
    blocks = raw.reshape(-1, type_size)
    # numpy's memory, as gguf's arrays were: from torch.empty, `splitspec generate` ended
    # ~190 MB more resident here (glibc kept the freed weights' pages in its heaps).
    out = torch.from_numpy(np.empty((blocks.shape[0], block_size), dtype=np.float32))
    step = max(1, CHUNK_BYTES // type_size)
    for i in range(0, blocks.shape[0], step):
        _BLOCKS[kind](blocks[i:i + step], out[i:i + step])
    return out.reshape(shape)
