"""A resolved model file: where it is and what identifies it (both sides hold one per model).

`models.registry.model_info` resolves a name and builds one; anything that only needs a
file's identity (the llama.cpp backend, the cloud link, the server) takes it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.gguf import GGUFHeader, model_fingerprint, read_header, tokenizer_fingerprint

BASE_MODEL_NOTE = "it continues text and was not tuned to answer, so what it writes may not read as an answer"
ALLOW_BASE_MODEL_HINT = "pass --allow-base-model (GeneratorOptions.allow_base_model) to let it write answers anyway"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A resolved model: where it is and what identifies it."""

    name: str
    path: Path
    fingerprint: str
    tokenizer_fingerprint: str
    header: GGUFHeader

    @property
    def chat(self) -> bool:
        """The model carries a chat template: it was tuned to answer as an assistant. A model
        without one is a base model: it continues text, so what it writes as an assistant's
        answer reads as a continued transcript (shared/text_history.py renders its prompt)."""
        return self.header.get("tokenizer.chat_template") is not None

    @property
    def kind(self) -> str:
        """ "chat" or "base" (see `chat`), for listings and warnings."""
        return "chat" if self.chat else "base"

    @classmethod
    def from_file(cls, path: Path, name: str) -> ModelInfo:
        """Read the GGUF header at `path` and compute its fingerprints."""
        header = read_header(path)
        return cls(name, path, model_fingerprint(header), tokenizer_fingerprint(header), header)
