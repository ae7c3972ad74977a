"""A fast, read-only GGUF parser: header, key/values and tensor descriptors, tensor bytes as numpy views.

gguf's `GGUFReader` wraps every one of the ~100k vocabulary strings of a real model in numpy memmap
views, which takes 2-9 s and hundreds of MB; this walks the same bytes with `struct` in a fraction of a
second and decodes the big tokenizer arrays only when asked. Dequantization stays with the `gguf`
package (`gguf.quants.dequantize`). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from izh.errors import ModelLoadError

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING = 8
_ARRAY = 9
# GGUF value type -> little-endian struct format.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor descriptor; `shape` is in torch order (outermost first, GGUF's ne reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    offset: int
    """Absolute byte offset of the data in the file."""
    num_bytes: int


class _Cursor:
    """Reads little-endian GGUF values from a buffer, advancing an offset."""

    def __init__(self, buffer: mmap.mmap, offset: int) -> None:
        self.buffer = buffer
        self.offset = offset

    def u32(self) -> int:
        (value,) = _U32.unpack_from(self.buffer, self.offset)
        self.offset += 4
        return int(value)

    def u64(self) -> int:
        (value,) = _U64.unpack_from(self.buffer, self.offset)
        self.offset += 8
        return int(value)

    def _need(self, num_bytes: int, what: str) -> None:
        if num_bytes < 0 or self.offset + num_bytes > len(self.buffer):
            raise ValueError(
                f"{what} of {num_bytes} bytes at byte {self.offset} runs past the end of the file"
            )

    def string(self) -> str:
        length = self.u64()
        self._need(length, "a string")
        start = self.offset
        self.offset += length
        return self.buffer[start : self.offset].decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        length = self.u64()  # not `offset += self.u64()`: that would read offset before u64() moves it
        self._need(length, "a string")
        self.offset += length

    def value(self, value_type: int, *, decode_arrays: bool) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array(decode=decode_arrays)
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {value_type}")
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def array(self, *, decode: bool) -> list[Any] | SkippedArray:
        element_type = self.u32()
        count = self.u64()
        if element_type == _STRING:
            if decode:
                return [self.string() for _ in range(count)]
            for _ in range(count):
                self.skip_string()
            return SkippedArray(count)
        fmt = _SCALARS.get(element_type)
        if fmt is None:  # arrays of arrays: legal, unused by the models we load
            if decode:
                return [self.value(element_type, decode_arrays=True) for _ in range(count)]
            for _ in range(count):
                self.value(element_type, decode_arrays=False)
            return SkippedArray(count)
        size = struct.calcsize(fmt)
        self._need(size * count, "an array")
        start = self.offset
        self.offset += size * count
        if not decode:
            return SkippedArray(count)
        return list(struct.unpack_from(f"<{count}{fmt[1:]}", self.buffer, start))


@dataclass(frozen=True, slots=True)
class SkippedArray:
    """Stands in for an array value that was not decoded; only its length is known."""

    length: int

    def __len__(self) -> int:
        return self.length


class GGUFFile:
    """A memory-mapped GGUF file: `metadata` (key -> value) and `tensors` (descriptors, file order).

    Arrays under keys starting with `skip_arrays_prefix` (the vocabulary by default) are not decoded;
    they appear as SkippedArray. Use as a context manager, or call close().
    """

    def __init__(self, path: str | Path, *, skip_arrays_prefix: str = "tokenizer.ggml.") -> None:
        self.path = str(path)
        try:
            with open(path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
        self._cursor: _Cursor | None = None
        try:
            self._parse(skip_arrays_prefix)
        except ModelLoadError:
            self._mmap.close()
            raise
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError) as e:
            at = self._cursor.offset if self._cursor is not None else 0
            size = len(self._mmap)
            self._mmap.close()
            raise ModelLoadError(
                f"cannot read GGUF file {path}: corrupt or truncated header at byte offset {at} "
                f"(file of {size} bytes): {e}"
            ) from e

    def _parse(self, skip_arrays_prefix: str) -> None:
        buf = self._mmap
        if buf[:4] != _MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file (bad magic)")
        cur = self._cursor = _Cursor(buf, 4)
        version = cur.u32()
        if version not in _SUPPORTED_VERSIONS:
            raise ModelLoadError(
                f"{self.path}: GGUF version {version} is not supported (little-endian v2/v3 only)"
            )
        num_tensors, num_kv = cur.u64(), cur.u64()
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cur.string()
            decode = not (skip_arrays_prefix and key.startswith(skip_arrays_prefix))
            self.metadata[key] = cur.value(cur.u32(), decode_arrays=decode)
        infos = [self._tensor_info(cur) for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.offset // alignment) * alignment
        self.tensors: list[GGUFTensorInfo] = []
        if alignment <= 0:
            raise ModelLoadError(f"{self.path}: general.alignment is {alignment}")
        for name, shape, ggml_type, rel_offset in infos:
            num_bytes = _num_bytes(name, shape, ggml_type)
            offset = data_start + rel_offset
            if rel_offset % alignment:
                raise ModelLoadError(
                    f"{self.path}: tensor {name} starts at byte offset {offset}, not aligned to {alignment} "
                    "(corrupt file)"
                )
            if offset + num_bytes > len(buf):
                raise ModelLoadError(
                    f"{self.path}: tensor {name} ({ggml_type.name}, {num_bytes} bytes at byte offset {offset}) "
                    f"runs past the end of the file at byte {len(buf)}: truncated?"
                )
            self.tensors.append(GGUFTensorInfo(name, shape, ggml_type, offset, num_bytes))

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = cur.string()
        num_dims = cur.u32()
        ne = [cur.u64() for _ in range(num_dims)]
        type_id = cur.u32()
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(
                f"GGUF tensor {name} has type id {type_id}, which izh does not know (descriptor before byte "
                f"offset {cur.offset})"
            ) from None
        return name, tuple(reversed(ne)), ggml_type, cur.u64()

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view [*outer dims, bytes per row], the layout
        `gguf.quants.dequantize` takes."""
        data = np.frombuffer(self._mmap, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], -1) if info.shape else data

    def close(self) -> None:
        # numpy views may still reference the map; closing then raises BufferError, and the map is freed
        # when the last view goes.
        with contextlib.suppress(BufferError):
            self._mmap.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _num_bytes(name: str, shape: tuple[int, ...], ggml_type: gguf.GGMLQuantizationType) -> int:
    if ggml_type not in gguf.GGML_QUANT_SIZES:
        raise ModelLoadError(
            f"GGUF tensor {name} has type {ggml_type.name}, whose block size izh does not know"
        )
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    num_elements = 1
    for n in shape:
        num_elements *= n
    if shape and shape[-1] % block_size != 0:
        raise ModelLoadError(
            f"GGUF tensor {name}: row of {shape[-1]} is not a multiple of the {ggml_type.name} block ({block_size})"
        )
    return num_elements // block_size * type_size
