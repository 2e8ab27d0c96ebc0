"""One parsed GGUF file per process, whoever reads it: its metadata as Python values, its tensors as
numpy views of a memory map.

gguf's GGUFReader keeps every metadata element as a numpy view of the map, the tokenizer's ~49k
tokens and merges among them: seconds for the shipped model, paid by every worker, tensor-parallel
rank and gateway at start-up. This reader decodes the metadata straight to Python values (a
fraction of that) and leaves the format's facts (value types, block sizes) to the gguf package.
A worker reads the file for its weights and again for its tokenizer, a gateway for each version's
tokenizer and context length, so they share one parse. Torch-free: the gateway uses it.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Tensors stored element by element; every other type is blocks of bytes (GGML_QUANT_SIZES).
_ELEMENT_TYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` as the file lists it (fastest dimension first); `data` a read-only view,
    in its element type, or for block-quantized types uint8 rows of its blocks' bytes."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data: np.ndarray


class GGUFFile:
    """A GGUF file (versions 2 and 3, little-endian) parsed: `metadata` and `tensors`.
    ValueError naming the file when it is not one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._buffer = memoryview(self._map)
        self._offset = 0
        magic, version = self._unpack("<II")
        if magic != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {magic:#x})")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        tensor_count, kv_count = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(GGUFValueType(self._unpack("<I")[0]))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value under `key` (str, int, float, bool or a list of them), else `default`."""
        return self.metadata.get(key, default)

    def _unpack(self, layout: str) -> tuple[Any, ...]:
        values = struct.unpack_from(layout, self._buffer, self._offset)
        self._offset += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start = self._offset
        self._offset += length
        return str(self._buffer[start:self._offset], "utf-8")

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = self._unpack("<IQ")
            item_kind = GGUFValueType(item_kind)
            if item_kind in _SCALARS:  # one frombuffer for the whole array
                dtype = np.dtype(_SCALARS[item_kind])
                start = self._offset
                self._offset += count * dtype.itemsize
                return np.frombuffer(self._buffer[start:self._offset], dtype=dtype).tolist()
            return [self._value(item_kind) for _ in range(count)]
        return self._unpack(_SCALARS[kind])[0]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (dims,) = self._unpack("<I")
        shape = self._unpack(f"<{dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, shape, GGMLQuantizationType(kind), offset

    def _tensor(self, data_start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        n_elements = int(np.prod(shape))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block_size
        start = data_start + offset
        if start + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} ends past the end of the file (truncated?)")
        rows_first = tuple(reversed(shape))
        raw = self._map[start:start + n_bytes]
        if kind in _ELEMENT_TYPES:
            data = raw.view(_ELEMENT_TYPES[kind]).reshape(rows_first)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(rows_first, kind))
        return GGUFTensor(name, kind, shape, n_elements, n_bytes, data)


def gguf_reader(path: str | os.PathLike[str]) -> GGUFFile:
    """The parsed file at `path`, opened once per process (again when the file changes)."""
    status = os.stat(path)
    return _open(os.path.realpath(path), status.st_mtime_ns, status.st_size)


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)
