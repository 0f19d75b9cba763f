"""A GGUF file's header, read without its weights: what a worker needs to know of a model it offers
before it loads it (issue 37: its name, its shape, so its memory need).

Owns: parsing GGUF's header (magic, version 2 or 3, the tensor count and every metadata key with its
typed value), bounded: a key, a string, an array or the header as a whole larger than its limit is a
`GgufError` naming it, as are a wrong magic, an unknown version or type, and a file that ends early.
Arrays are skipped, not kept (a vocabulary's 50,000 strings): their element count is what is kept.
Must not: read tensor data, or know which keys a model must have (worker/catalog.py decides that).

The layout (llama.cpp's `gguf.h`): "GGUF", uint32 version, uint64 tensor count, uint64 metadata count,
then per key a string (uint64 length, UTF-8 bytes), a uint32 type and the value; an array is a uint32
element type, a uint64 count and the elements. Little-endian throughout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 24  # a chat template is tens of KB; 16 MB is far past any real one
MAX_KEYS = 1 << 16
MAX_ARRAY = 1 << 28
MAX_HEADER_BYTES = 1 << 30  # the metadata of the largest vocabularies is tens of MB
# type id -> struct format of a fixed-size scalar
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
Scalar = int | float | bool | str


class GgufError(ValueError):
    """The file is not a GGUF this reader can read, with why."""


@dataclass
class GgufHeader:
    version: int
    tensor_count: int
    metadata: dict[str, Scalar] = field(default_factory=dict)  # scalar and string values
    arrays: dict[str, int] = field(default_factory=dict)  # array keys -> element count
    header_bytes: int = 0  # bytes from the start of the file to the end of the metadata

    def int_of(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def str_of(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF at `path`; `GgufError` when it is not one, or OSError when it cannot be read."""
    with path.open("rb") as f:
        reader = _Reader(f, path.stat().st_size)
        if reader.take(4) != MAGIC:
            raise GgufError("not a GGUF file (its first bytes are not GGUF)")
        version = reader.scalar(4)
        if version not in VERSIONS:
            raise GgufError(f"GGUF version {version}: only versions 2 and 3 are read")
        header = GgufHeader(version=int(version), tensor_count=int(reader.scalar(10)))
        count = int(reader.scalar(10))
        if count > MAX_KEYS:
            raise GgufError(f"{count} metadata keys: more than {MAX_KEYS}")
        for _ in range(count):
            key = reader.string(MAX_KEY_BYTES, "a metadata key")
            kind = int(reader.scalar(4))
            if kind == ARRAY:
                header.arrays[key] = reader.skip_array(key)
            else:
                header.metadata[key] = reader.value(kind, key)
        header.header_bytes = reader.at
        return header


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f, self._size, self.at = f, size, 0

    def take(self, n: int) -> bytes:
        if self.at + n > min(self._size, MAX_HEADER_BYTES):
            raise GgufError("the file ends inside its header" if self.at + n > self._size
                            else f"a header past {MAX_HEADER_BYTES} bytes")
        data = self._f.read(n)
        if len(data) != n:
            raise GgufError("the file ends inside its header")
        self.at += n
        return data

    def seek(self, n: int) -> None:
        if self.at + n > self._size:
            raise GgufError("the file ends inside its header")
        self._f.seek(n, 1)
        self.at += n

    def scalar(self, kind: int) -> int | float | bool:
        fmt = SCALARS[kind]
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def string(self, limit: int, what: str) -> str:
        n = int(self.scalar(10))
        if n > limit:
            raise GgufError(f"{what} of {n} bytes: more than {limit}")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str) -> Scalar:
        if kind == STRING:
            return self.string(MAX_STRING_BYTES, f"{key}'s value")
        if kind not in SCALARS:
            raise GgufError(f"{key}: unknown value type {kind}")
        return self.scalar(kind)

    def skip_array(self, key: str) -> int:
        kind, count = int(self.scalar(4)), int(self.scalar(10))
        if count > MAX_ARRAY:
            raise GgufError(f"{key}: an array of {count} elements, more than {MAX_ARRAY}")
        if kind in SCALARS:
            self.seek(count * struct.calcsize(SCALARS[kind]))
        elif kind == STRING:
            for _ in range(count):
                n = int(self.scalar(10))
                if n > MAX_STRING_BYTES:
                    raise GgufError(f"{key}: a string of {n} bytes, more than {MAX_STRING_BYTES}")
                self.seek(n)
        else:
            raise GgufError(f"{key}: an array of type {kind} (nested arrays are not read)")
        return count
