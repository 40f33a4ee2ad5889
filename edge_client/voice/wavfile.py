"""Audio file input (any common format, through libsndfile) and WAV output, with messages that say what to do.

People have WAV files with an extensible header (sox writes one for 24-bit or multichannel audio),
float or 24-bit WAV, FLAC, OGG and MP3; Python's `wave` reads only plain integer PCM, so input goes
through soundfile (libsndfile). Output stays 16-bit PCM WAV, which everything plays.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np


class AudioFileError(ValueError):
    """The audio file cannot be used; the message says why and what to do."""


_CONVERT = "convert it with: sox IN OUT.wav (or ffmpeg -i IN OUT.wav)"
SUPPORTED = "WAV (integer, float, extensible), FLAC, OGG (Vorbis, Opus), MP3, AIFF"
# Leading bytes of the containers libsndfile reads: a file that starts like one but does not open is damaged.
_MAGIC = {
    b"RIFF": "WAV",
    b"RIFX": "WAV",
    b"RF64": "WAV",
    b"fLaC": "FLAC",
    b"OggS": "OGG",
    b"FORM": "AIFF",
    b"ID3": "MP3",
}


def read_audio(src: str | Path | bytes, name: str | None = None) -> tuple[np.ndarray, int]:
    """Return (mono float32 samples in [-1, 1], sample rate) from a file path or the file's bytes.

    Any format libsndfile reads (SUPPORTED); channels are averaged. `name` labels `bytes` input in
    messages. Anything unusable raises AudioFileError naming the problem and the fix.
    """
    try:
        import soundfile as sf
    except (ImportError, OSError) as e:  # the package, or its bundled libsndfile, is missing
        raise AudioFileError(
            f"cannot read audio files: soundfile is not available ({e}); pip install soundfile"
        ) from None
    if isinstance(src, bytes):
        label, head, f = name or "the file", src[:4], io.BytesIO(src)
    else:
        path = Path(src)
        label = str(path)
        if not path.is_file():
            raise AudioFileError(f"{path}: no such file")
        with open(path, "rb") as fh:
            head = fh.read(4)
        f = str(path)
    if not head:
        raise AudioFileError(f"{label}: the file is empty")
    try:
        x, rate = sf.read(f, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, ValueError) as e:
        msg = str(e).split(": ", 1)[-1] if ": " in str(e) else str(e)
        kind = next((k for m, k in _MAGIC.items() if head.startswith(m)), None)
        if kind is not None:
            raise AudioFileError(
                f"{label}: looks like {kind} but cannot be read: truncated or damaged ({msg}); re-record or re-export it"
            ) from None
        raise AudioFileError(
            f"{label}: not a readable audio file ({msg}); supported: {SUPPORTED}; {_CONVERT}"
        ) from None
    if rate <= 0:
        raise AudioFileError(f"{label}: invalid header (sample rate {rate})")
    if len(x) == 0:
        raise AudioFileError(f"{label}: the file holds no audio samples (truncated or empty)")
    mono = x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]
    return np.ascontiguousarray(np.clip(mono, -1.0, 1.0), dtype=np.float32), int(rate)


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Kept for callers that read "the WAV": any format `read_audio` reads."""
    return read_audio(path)


def write_wav(path: str | Path, samples: np.ndarray, rate: int) -> None:
    """Write mono float samples as 16-bit PCM."""
    pcm = (np.clip(np.asarray(samples, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(rate))
        w.writeframes(pcm.tobytes())
