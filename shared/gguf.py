"""Read a GGUF file's header (metadata and tensor layout) without loading weights.

Why our own reader: fingerprints must be computed before a model is loaded
(the cloud compares them at `hello`) and must not depend on which llama.cpp
build is installed. The format is small and stable (GGUF v2/v3):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key, u32 type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)

Strings are a u64 length followed by UTF-8 bytes; everything is little-endian.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"

# value type -> struct format for scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a readable GGUF model."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int


@dataclass(slots=True)
class GGUFHeader:
    """Decoded metadata plus the raw bytes of each value (for hashing)."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError("file ends inside the GGUF header (truncated download?)")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise GGUFError(f"implausible string length {n} in GGUF header")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.unpack("<I")
            n = self.unpack("<Q")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{n}{fmt[1]}", self.take(n * size)))
            return [self.value(item_type) for _ in range(n)]
        raise GGUFError(f"unknown GGUF value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the header of the GGUF file at `path`."""
    path = Path(path)
    try:
        f = path.open("rb")
    except OSError as exc:
        raise GGUFError(f"cannot open model file {path}: {exc.strerror}") from exc
    with f:
        r = _Reader(f)
        if r.take(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (bad magic); pass a .gguf model")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version}")
        n_tensors = r.unpack("<Q")
        n_kv = r.unpack("<Q")
        header = GGUFHeader(version=version)
        for _ in range(n_kv):
            key = r.string()
            vtype = r.unpack("<I")
            start = f.tell()
            header.metadata[key] = r.value(vtype)
            end = f.tell()
            f.seek(start)
            header.raw[key] = struct.pack("<I", vtype) + f.read(end - start)
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            ggml_type = r.unpack("<I")
            r.unpack("<Q")  # offset: derived from the types and shapes
            header.tensors.append(TensorInfo(name, shape, ggml_type))
    return header


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return "sha256:" + h.hexdigest()[:32]


def model_fingerprint(header: GGUFHeader) -> str:
    """Identifies a model: all metadata plus the tensor layout (names, shapes, types).

    Two files with the same weights format and metadata get the same value even if
    their names differ on disk; a requantized file gets a different one.
    """
    parts = [k.encode() + header.raw[k] for k in sorted(header.raw)]
    parts += [f"{t.name}:{t.shape}:{t.ggml_type}".encode() for t in header.tensors]
    return _digest(parts)


def tokenizer_fingerprint(header: GGUFHeader) -> str:
    """Identifies a vocabulary: equal values mean token ids are interchangeable."""
    keys = sorted(k for k in header.raw if k.startswith("tokenizer.ggml."))
    if not keys:
        raise GGUFError("GGUF file has no tokenizer.ggml.* metadata")
    return _digest([k.encode() + header.raw[k] for k in keys])
