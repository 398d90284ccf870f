"""A GGUF file's metadata and tensors, read fast.

`gguf.GGUFReader` builds a numpy memmap view for every item of every metadata array:
SmolLM2's 49,152 token texts, their types and 48,900 merges take it ~1.8 s a file on
this CPU, which every process that loads the model (`splitspec generate`, each verifier
replica) paid. `GGUFFile` reads the header with `struct` into Python values (~0.035 s)
and gives each tensor as a plain numpy view of the mapped file, in the layout
`GGUFReader` gives it (what `gguf.quants.dequantize` and `verifier.models.dequant` take). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(little-endian files, versions 2 and 3).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from verifier.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

#: Scalar value types (GGUF's ids) and their struct formats.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: The numpy types of scalar arrays, read in one go.
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                 11: "<i8", 12: "<f8"}
#: Tensor types stored as their numpy items; the others as bytes (`GGUFReader`'s split).
_ITEM_DTYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


class InvalidMetadata:
    """A metadata value that did not decode (a string that is not UTF-8): the error comes
    when the value is asked for, so a file is refused only for a value it needs."""

    def __init__(self, error: UnicodeDecodeError) -> None:
        self.error = error


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `data` is a read-only view of the file, shaped as `gguf.GGUFReader`
    shapes it (numpy order; quantized types as rows of bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest dimension first
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata (`metadata`: key to Python value, in the file's order: str,
    int, float, bool or a list) and tensors (`tensors`, in the file's order). Raises
    ValueError for a file that is not GGUF, is cut short, or has two tensors of one name.

    The file stays mapped while the tensors' views are alive; `value` raises a
    ModelLoadError naming a string that is not UTF-8 (`open_gguf` opens one as the loader
    and the tokenizer do, with a ModelLoadError for a file it cannot read).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as exc:  # an empty file
                raise ValueError(f"not a GGUF file ({exc})") from None
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        self._buf, self._pos = buf, 4
        try:
            self.version = self._scalar("<I")
            if self.version & 0xFFFF == 0:  # GGUFReader's test: a version written the other way round
                raise ValueError("a big-endian GGUF file: only little-endian ones are read")
            if self.version not in (2, 3):
                raise ValueError(f"GGUF version {self.version} is not supported (2 and 3 are)")
            tensor_count, kv_count = self._scalar("<Q"), self._scalar("<Q")
            self.metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = self._bytes().decode("utf-8")
                self.metadata[key] = self._value(self._scalar("<I"))
            infos = []
            for _ in range(tensor_count):
                name = self._bytes().decode("utf-8")
                dims = struct.unpack_from(f"<{self._scalar('<I')}Q", buf, self._pos)
                self._pos += 8 * len(dims)
                infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        except struct.error as exc:
            raise ValueError(f"GGUF header cut short ({exc})") from None
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment must be a power of two, got {alignment!r}")
        self.data_offset = -(-self._pos // alignment) * alignment
        whole = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            kind = GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            block_size, type_size = GGML_QUANT_SIZES[kind]
            shape = tuple(reversed(dims))
            start = self.data_offset + offset
            item = _ITEM_DTYPES.get(kind)
            if item is None:
                n_bytes = n_elems * type_size // block_size
                shape = quant_shape_to_byte_shape(shape, kind)
            else:
                n_bytes = n_elems * np.dtype(item).itemsize
            if start + n_bytes > len(buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            data = whole[start:start + n_bytes]
            data = (data if item is None else data.view(item)).reshape(shape)
            self.tensors.append(GGUFTensor(name, kind, tuple(dims), data))
        del self._buf

    def value(self, key: str, default: Any = None) -> Any:
        """The value of `key`, or `default` when the file has none."""
        value = self.metadata.get(key, default)
        if isinstance(value, InvalidMetadata):
            raise ModelLoadError(f"{os.path.basename(self.path)}: GGUF metadata {key!r} is not valid UTF-8: "
                                 f"{value.error}") from None
        return value

    # --- the header, read at self._pos ------------------------------------------------

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _bytes(self) -> bytes:
        n = self._scalar("<Q")
        data = self._buf[self._pos:self._pos + n]
        if len(data) != n:
            raise struct.error("a string runs past the end of the file")
        self._pos += n
        return data

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return _decoded(self._bytes())
        if kind == _ARRAY:
            item_kind, count = self._scalar("<I"), self._scalar("<Q")
            dtype = _ARRAY_DTYPES.get(item_kind)
            if dtype is not None:
                size = np.dtype(dtype).itemsize * count
                if self._pos + size > len(self._buf):
                    raise struct.error("an array runs past the end of the file")
                items = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).tolist()
                self._pos += size
                return items
            if item_kind == _STRING:
                return self._strings(count)
            return [self._value(item_kind) for _ in range(count)]
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._scalar(fmt)

    def _strings(self, count: int) -> list[Any] | InvalidMetadata:
        buf, pos, out = self._buf, self._pos, []
        length = struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                (n,) = length(buf, pos)
                out.append(buf[pos + 8:pos + 8 + n])
                pos += 8 + n
        finally:
            self._pos = pos
        if pos > len(buf):
            raise struct.error("a string runs past the end of the file")
        try:
            return [b.decode("utf-8") for b in out]
        except UnicodeDecodeError as exc:
            return InvalidMetadata(exc)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """`GGUFFile(path)`, a file it cannot read (missing, not GGUF, cut short) a ModelLoadError."""
    try:
        return GGUFFile(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF {os.fspath(path)!r}: {exc}") from None


def _decoded(data: bytes) -> str | InvalidMetadata:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return InvalidMetadata(exc)
