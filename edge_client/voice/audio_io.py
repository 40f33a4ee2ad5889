"""Audio endpoints: microphone and speaker (sounddevice), WAV file source and sink.

All endpoints speak float32 mono. Sources yield `Frame`s at the pipeline rate
(16 kHz) stamped with the monotonic time their last sample was captured; sinks
take audio at the synthesiser rate and record when the first sample of each
turn reached the device. Device callbacks only copy memory: no allocation-heavy
work, no locks held for long, no I/O, no logging.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np

from .resample import StreamResampler, resample
from .wavfile import read_wav, write_wav

PIPELINE_RATE = 16000


class DeviceError(RuntimeError):
    """An audio device cannot be found or opened; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Frame:
    samples: np.ndarray  # float32 mono at PIPELINE_RATE
    t_end: float  # monotonic time the last sample was captured (or would have been, in file mode)


# --------------------------------------------------------------------------- devices


def _sd():
    try:
        import sounddevice as sd
    except OSError as e:  # PortAudio library missing
        raise DeviceError(
            f"PortAudio is not available ({e}); install it (Debian/Ubuntu: apt-get install libportaudio2)"
        ) from None
    return sd


def list_devices() -> list[dict]:
    """All devices PortAudio sees: index, name, host API, channel counts, default rate."""
    sd = _sd()
    apis = sd.query_hostapis()
    out = []
    for i, d in enumerate(sd.query_devices()):
        out.append(
            {
                "index": i,
                "name": d["name"],
                "hostapi": apis[d["hostapi"]]["name"],
                "max_input_channels": d["max_input_channels"],
                "max_output_channels": d["max_output_channels"],
                "default_samplerate": d["default_samplerate"],
                "default_input": i == sd.default.device[0],
                "default_output": i == sd.default.device[1],
            }
        )
    return out


def resolve_device(spec: str | int | None, kind: str) -> int | None:
    """Device index for `spec` (index, exact name, or unique case-insensitive substring).

    `kind` is "input" or "output". None means the system default.
    """
    if spec is None or spec == "":
        return None
    devs = list_devices()
    key = "max_input_channels" if kind == "input" else "max_output_channels"
    usable = [d for d in devs if d[key] > 0]
    if isinstance(spec, int) or str(spec).isdigit():
        idx = int(spec)
        if not any(d["index"] == idx for d in usable):
            raise DeviceError(f"no {kind} device with index {idx}; run `tokenrouter-edge devices` to list them")
        return idx
    exact = [d for d in usable if d["name"] == spec]
    if exact:
        return exact[0]["index"]
    sub = [d for d in usable if str(spec).lower() in d["name"].lower()]
    if len(sub) == 1:
        return sub[0]["index"]
    names = ", ".join(repr(d["name"]) for d in (sub or usable))
    what = "matches several" if sub else "matches no"
    raise DeviceError(f"{spec!r} {what} {kind} device ({names}); pass a name or index from `tokenrouter-edge devices`")


def _pick_rate(sd, device: int | None, kind: str, wanted: int) -> int:
    """`wanted` if the device accepts it, else the device's default rate (we resample)."""
    check = sd.check_input_settings if kind == "input" else sd.check_output_settings
    try:
        check(device=device, samplerate=wanted, channels=1, dtype="float32")
        return wanted
    except Exception:
        info = sd.query_devices(device, kind)
        return int(info["default_samplerate"])


# --------------------------------------------------------------------------- playback buffer


class Playback(Protocol):
    """Where the pipeline queues a reply's audio and learns how much of it was heard.

    Two implementations: `PlaybackBuffer` (a local speaker's callback or a file drains it) and the
    app's `BrowserPlayback` (the page plays it and reports progress). Barge-in pauses it, then
    flushes it and keeps only the `played` part of the answer in the history.
    """

    paused: bool  # hold playback where it is (a possible barge-in)
    played: int  # samples of the current turn that reached the output
    pending: int  # samples queued, not yet played
    first_out_t: float | None  # when the turn's first sample reached the output (time.monotonic)

    def start_turn(self) -> None: ...
    def put(self, audio: np.ndarray) -> None: ...
    def flush(self) -> int:
        """Drop what is queued; return the samples played this turn."""
        ...


class Sink(Protocol):
    """Where the pipeline sends a reply's audio (at the synthesiser's `source_rate`): a speaker, a file, a page."""

    buffer: Playback
    rate: int
    source_rate: int

    def put(self, audio: np.ndarray) -> int: ...
    def start(self) -> None: ...
    def close(self) -> None: ...


class Source(Protocol):
    """Where the pipeline's `Frame`s come from: a microphone, a file, a page."""

    def frames(self, stop: threading.Event): ...
    def start(self) -> None: ...
    def close(self) -> None: ...


class PlaybackBuffer:
    """Queue of audio the speaker drains; shared by the device callback and the file pacer.

    `read_into` is called from the audio thread: it copies and counts, nothing
    more. The pipeline pauses, resumes or flushes it for barge-in, and reads how
    many samples of the current turn have been played.
    """

    def __init__(self) -> None:
        self._chunks: deque[np.ndarray] = deque()
        self._offset = 0
        self._lock = threading.Lock()
        self.paused = False
        self.played = 0  # samples of the current turn handed to the device
        self.first_out_t: float | None = None  # when the turn's first sample reached the device
        self.pending = 0  # samples queued, not yet played

    def start_turn(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._offset = 0
            self.played = 0
            self.pending = 0
            self.first_out_t = None
            self.paused = False

    def put(self, audio: np.ndarray) -> None:
        with self._lock:
            self._chunks.append(audio)
            self.pending += len(audio)

    def flush(self) -> int:
        """Drop everything queued; return the samples played this turn."""
        with self._lock:
            self._chunks.clear()
            self._offset = 0
            self.pending = 0
            return self.played

    def read_into(self, out: np.ndarray, t_out: float) -> int:
        """Fill `out` (1-D) with queued audio, zeros after; return samples of real audio written."""
        n = 0
        if not self.paused and self._lock.acquire(blocking=False):
            try:
                while n < len(out) and self._chunks:
                    c = self._chunks[0]
                    k = min(len(out) - n, len(c) - self._offset)
                    out[n : n + k] = c[self._offset : self._offset + k]
                    n += k
                    self._offset += k
                    if self._offset >= len(c):
                        self._chunks.popleft()
                        self._offset = 0
                if n:
                    self.pending -= n
                    self.played += n
                    if self.first_out_t is None:
                        self.first_out_t = t_out
            finally:
                self._lock.release()
        out[n:] = 0.0
        return n


# --------------------------------------------------------------------------- microphone / speaker


def _open_stream(
    stream_cls: Any, asked: str | int | None, device: int | None, rate: int, block_ms: int, callback: Any
) -> Any:
    """A mono float32 sounddevice stream with low latency; DeviceError names the device on failure."""
    kind = "input" if stream_cls.__name__.startswith("Input") else "output"
    try:
        return stream_cls(
            device=device,
            channels=1,
            samplerate=rate,
            dtype="float32",
            blocksize=int(rate * block_ms / 1000),
            latency="low",
            callback=callback,
        )
    except Exception as e:
        raise DeviceError(f"cannot open {kind} device {asked!r}: {e}; check `tokenrouter-edge devices`") from None


class _DeviceStream:
    """start/close shared by the microphone and the speaker."""

    _stream: Any

    def start(self) -> None:
        self._stream.start()

    def close(self) -> None:
        try:
            self._stream.stop()
        finally:
            self._stream.close()


class Microphone(_DeviceStream):
    """sounddevice input stream -> 16 kHz frames. The callback only copies into a queue."""

    def __init__(self, device: str | int | None = None, block_ms: int = 20) -> None:
        sd = _sd()
        self.device = resolve_device(device, "input")
        self.rate = _pick_rate(sd, self.device, "input", PIPELINE_RATE)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._res = StreamResampler(self.rate, PIPELINE_RATE)
        self.overflows = 0
        self._stream = _open_stream(sd.InputStream, device, self.device, self.rate, block_ms, self._callback)

    def _callback(self, indata, frames, time_info, status) -> None:  # audio thread
        if status.input_overflow:
            self.overflows += 1
        self._q.put((indata[:, 0].copy(), time.monotonic()))

    def frames(self, stop: threading.Event) -> Iterator[Frame]:
        while not stop.is_set():
            try:
                block, t = self._q.get(timeout=0.1)
            except queue.Empty:
                continue
            yield Frame(self._res.process(block), t)


class Speaker(_DeviceStream):
    """sounddevice output stream draining a PlaybackBuffer."""

    def __init__(self, device: str | int | None, source_rate: int, block_ms: int = 20) -> None:
        sd = _sd()
        self.device = resolve_device(device, "output")
        self.source_rate = source_rate
        self.rate = _pick_rate(sd, self.device, "output", source_rate)
        self.buffer = PlaybackBuffer()
        self._offset = 0.0
        self._stream = _open_stream(sd.OutputStream, device, self.device, self.rate, block_ms, self._callback)

    def _callback(self, outdata, frames, time_info, status) -> None:  # audio thread
        now = time.monotonic()
        dac = time_info.outputBufferDacTime
        cur = time_info.currentTime
        t_out = now + (dac - cur) if dac and cur and 0 <= dac - cur < 1.0 else now
        self.buffer.read_into(outdata[:, 0], t_out)

    def put(self, audio: np.ndarray) -> int:
        """Queue synthesiser-rate audio (resampled here, off the audio thread); return samples queued."""
        if self.rate != self.source_rate:
            audio = resample(audio, self.source_rate, self.rate)
        self.buffer.put(audio)
        return len(audio)


# --------------------------------------------------------------------------- files


class FileSource:
    """WAV file -> 16 kHz frames, at real-time pace or as fast as possible.

    After the file, silence keeps coming (the endpointer needs it to decide the
    turn is over) until `stop` is set.
    """

    def __init__(self, path: str | Path, realtime: bool = True, block_ms: int = 20) -> None:
        x, rate = read_wav(path)
        self.audio = resample(x, rate, PIPELINE_RATE)
        self.duration_s = len(self.audio) / PIPELINE_RATE
        self.realtime = realtime
        self.block = int(PIPELINE_RATE * block_ms / 1000)
        self.t0: float | None = None

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def frames(self, stop: threading.Event) -> Iterator[Frame]:
        self.t0 = time.monotonic()
        silence = np.zeros(self.block, np.float32)
        i = 0
        while not stop.is_set():
            chunk = self.audio[i : i + self.block] if i < len(self.audio) else silence
            i += self.block
            t_end = self.t0 + i / PIPELINE_RATE
            if self.realtime:
                delay = t_end - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            else:
                t_end = time.monotonic()
            yield Frame(chunk, t_end)


class FileSink:
    """Collects the reply into a WAV; at real-time pace a pacer thread drains it like a device would.

    The file holds the reply's samples back to back (a gap, where synthesis
    fell behind playback, is not written as silence).
    """

    def __init__(self, rate: int, realtime: bool = True, block_ms: int = 10) -> None:
        self.rate = rate
        self.source_rate = rate
        self.realtime = realtime
        self.buffer = PlaybackBuffer()
        self.block = int(rate * block_ms / 1000)
        self._out: list[np.ndarray] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def put(self, audio: np.ndarray) -> int:
        self.buffer.put(audio)
        if not self.realtime:  # drain at once
            out = np.empty(self.buffer.pending, np.float32)
            self.buffer.read_into(out, time.monotonic())
            self._out.append(out)
        return len(audio)

    def _pace(self) -> None:
        t0 = time.monotonic()
        k = 0
        while not self._stop.is_set():
            k += 1
            delay = t0 + k * self.block / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            out = np.empty(self.block, np.float32)
            n = self.buffer.read_into(out, time.monotonic())
            if n:
                self._out.append(out[:n].copy())

    def start(self) -> None:
        if self.realtime:
            self._thread = threading.Thread(target=self._pace, name="file-sink", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def audio(self) -> np.ndarray:
        return np.concatenate(self._out) if self._out else np.zeros(0, np.float32)

    def write(self, path: str | Path) -> None:
        write_wav(path, self.audio(), self.rate)
