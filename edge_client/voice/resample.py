"""Sample-rate conversion: windowed-sinc low-pass (when lowering the rate) + linear interpolation.

Good enough for speech recognition and playback; no SciPy needed. The
streaming form keeps filter and phase state, so block edges do not click.
"""

from __future__ import annotations

import numpy as np


def _lowpass_taps(ratio: float, n_taps: int = 63) -> np.ndarray:
    """FIR taps for a cut-off at 0.9 x the new Nyquist frequency (ratio = src/dst > 1)."""
    cutoff = 0.45 / ratio  # in cycles per source sample
    n = np.arange(n_taps) - (n_taps - 1) / 2
    h = 2 * cutoff * np.sinc(2 * cutoff * n) * np.hanning(n_taps)
    return (h / h.sum()).astype(np.float32)


class StreamResampler:
    """Convert a stream of float32 blocks from src_rate to dst_rate."""

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        self.src_rate, self.dst_rate = int(src_rate), int(dst_rate)
        self.step = self.src_rate / self.dst_rate
        self.taps = _lowpass_taps(self.step) if self.step > 1 else None
        self._hist = np.zeros(0 if self.taps is None else len(self.taps) - 1, np.float32)
        self._buf = np.zeros(0, np.float32)
        self._pos = 0.0

    def process(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if self.src_rate == self.dst_rate:
            return x
        if self.taps is not None:
            ext = np.concatenate([self._hist, x])
            self._hist = ext[len(ext) - len(self._hist) :] if len(self._hist) else self._hist
            x = np.convolve(ext, self.taps, mode="valid").astype(np.float32)
        buf = np.concatenate([self._buf, x])
        n_out = int(np.floor((len(buf) - 1 - self._pos) / self.step)) + 1 if len(buf) > 1 + self._pos else 0
        if n_out <= 0:
            self._buf = buf
            return np.zeros(0, np.float32)
        t = self._pos + self.step * np.arange(n_out)
        out = np.interp(t, np.arange(len(buf)), buf).astype(np.float32)
        nxt = self._pos + self.step * n_out
        k = int(nxt)
        self._buf, self._pos = buf[k:], nxt - k
        return out


def resample(x: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample a whole signal (one call of a fresh StreamResampler plus its tail)."""
    if int(src_rate) == int(dst_rate):
        return np.asarray(x, np.float32)
    r = StreamResampler(src_rate, dst_rate)
    pad = 0 if r.taps is None else len(r.taps) // 2
    y = r.process(np.concatenate([np.asarray(x, np.float32), np.zeros(pad + 2, np.float32)]))
    delay = 0 if r.taps is None else int(round(pad / r.step))
    n = int(round(len(x) * dst_rate / src_rate))
    return y[delay : delay + n]
