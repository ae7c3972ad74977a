"""Reading a GGUF file's key-value metadata, and nothing else.

gguf's `GGUFReader` parses every tensor descriptor and wraps each of the ~100k vocabulary strings in
numpy views, which takes seconds. The tokenizer needs only the metadata, so this reads the header and
the key-value section with `struct` from a memory map and stops before the tensor descriptors.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from izh.errors import ModelLoadError

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)

_STRING = 8
_ARRAY = 9
# GGUF value type -> struct format character (without byte order).
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Cursor:
    """Walks a buffer, unpacking GGUF values in one byte order."""

    def __init__(self, buffer: mmap.mmap, byte_order: str, offset: int) -> None:
        self._buffer = buffer
        self._byte_order = byte_order
        self.offset = offset

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        full = self._byte_order + fmt
        values = struct.unpack_from(full, self._buffer, self.offset)
        self.offset += struct.calcsize(full)
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        start = self.offset
        self.offset += length
        return self._buffer[start : self.offset].decode("utf-8")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(value_type)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {value_type}")
        return self.unpack(fmt)[0]

    def array(self) -> list[Any]:
        element_type, count = self.unpack("IQ")
        fmt = _SCALAR_FORMATS.get(element_type)
        if fmt is not None:
            # One unpack for the whole array: the 150k-entry token type arrays stay fast.
            return list(self.unpack(f"{count}{fmt}"))
        read: Callable[[], Any] = self.string if element_type == _STRING else lambda: self.value(element_type)
        return [read() for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file mapped to its value (str, int, float, bool or list).

    Raises ModelLoadError if the file is not a GGUF file of a supported version or is truncated.
    """
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _parse(buffer, str(path))
    except ModelLoadError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read GGUF metadata from {path}: {exc}") from exc


def _parse(buffer: mmap.mmap, path: str) -> dict[str, Any]:
    if buffer[:4] != _MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file (bad magic {buffer[:4]!r})")
    (version,) = struct.unpack_from("<I", buffer, 4)
    byte_order = "<"
    if version & 0xFFFF == 0:
        # A big-endian file reads as a huge little-endian version number.
        byte_order = ">"
        (version,) = struct.unpack_from(">I", buffer, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    cursor = _Cursor(buffer, byte_order, 8)
    _num_tensors, num_kv = cursor.unpack("QQ")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cursor.string()
        (value_type,) = cursor.unpack("I")
        metadata[key] = cursor.value(value_type)
    return metadata
