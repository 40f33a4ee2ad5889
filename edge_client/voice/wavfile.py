"""WAV input/output with messages that say what is wrong and how to fix it."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np


class AudioFileError(ValueError):
    """The audio file cannot be used; the message says why and what to do."""


_CONVERT = "convert it with: sox IN.wav -b 16 -e signed-integer OUT.wav"


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Return (mono float32 samples in [-1, 1], sample rate).

    Accepts PCM integer WAV (8/16/24/32-bit, any rate, any channel count;
    channels are averaged). Anything else raises AudioFileError.
    """
    path = Path(path)
    if not path.is_file():
        raise AudioFileError(f"{path}: no such file")
    try:
        with wave.open(str(path), "rb") as w:
            n_ch, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            raw = w.readframes(n)
    except wave.Error as e:
        msg = str(e)
        if "unknown format" in msg:
            raise AudioFileError(
                f"{path}: unsupported sample format ({msg}); only PCM integer WAV is read; {_CONVERT}"
            ) from None
        raise AudioFileError(f"{path}: not a readable WAV file ({msg}); {_CONVERT}") from None
    except EOFError:
        raise AudioFileError(f"{path}: the WAV file is truncated (header incomplete); re-record or re-export it") from None
    if rate <= 0 or n_ch <= 0:
        raise AudioFileError(f"{path}: invalid WAV header (rate={rate}, channels={n_ch})")
    frame_bytes = n_ch * width
    usable = len(raw) - len(raw) % frame_bytes
    if usable == 0:
        raise AudioFileError(f"{path}: the WAV file holds no audio samples (truncated or empty)")
    raw = raw[:usable]
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / float(1 << 31)
    else:
        raise AudioFileError(f"{path}: unsupported sample width {width * 8} bits; {_CONVERT}")
    x = x.reshape(-1, n_ch).mean(axis=1) if n_ch > 1 else x
    return np.ascontiguousarray(x, dtype=np.float32), rate


def write_wav(path: str | Path, samples: np.ndarray, rate: int) -> None:
    """Write mono float samples as 16-bit PCM."""
    pcm = (np.clip(np.asarray(samples, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(pcm.tobytes())
