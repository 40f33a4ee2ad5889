"""A resolved model file: where it is and what identifies it (both sides hold one per model).

`models.registry.model_info` resolves a name and builds one; anything that only needs a
file's identity (the llama.cpp backend, the cloud link, the server) takes it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.gguf import GGUFHeader, model_fingerprint, read_header, tokenizer_fingerprint


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A resolved model: where it is and what identifies it."""

    name: str
    path: Path
    fingerprint: str
    tokenizer_fingerprint: str
    header: GGUFHeader

    @classmethod
    def from_file(cls, path: Path, name: str) -> ModelInfo:
        """Read the GGUF header at `path` and compute its fingerprints."""
        header = read_header(path)
        return cls(name, path, model_fingerprint(header), tokenizer_fingerprint(header), header)
