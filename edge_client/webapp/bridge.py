"""The browser as the voice pipeline's microphone and speaker, over the tab's WebSocket.

The page captures the microphone with the browser's echo cancellation and sends 16 kHz PCM
frames; it plays the reply with WebAudio and reports how much it has played. The pipeline keeps
only what was played in the history after a barge-in, so "played" here is what the page says it
played, never what was merely sent: `BrowserPlayback` is a `Playback` (edge_client/voice/audio_io.py)
whose counters the page's reports drive.

`InputGate` sits in front of any source (the browser's or a local microphone): push-to-talk
silences the input unless the key is held, and a dropped file replaces the input while it plays,
so it goes through exactly the path speech takes.
"""

from __future__ import annotations

import math
import queue
import struct
import threading
import time
from collections import deque
from typing import Any, Callable, Iterator

import numpy as np

from edge_client.voice.audio_io import PIPELINE_RATE, Frame
from edge_client.voice.pipeline import Source

Send = Callable[[Any], None]  # a JSON-able dict or bytes to the page; thread-safe, never blocks
FRAME_S = 0.02  # the page sends 20 ms frames


class BrowserPlayback:
    """The pipeline's playback buffer for audio the page plays.

    `put` sends the audio at once (the page queues it); `played`, `pending` and `first_out_t` follow
    the page's progress reports. Each turn has a sequence number, so a late report about an earlier
    turn's audio is ignored. Pausing, resuming and flushing are commands to the page.
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._seq = 0
        self._sent = 0  # samples sent this turn
        self._flushed = False
        self._paused = False
        self.played = 0
        self.pending = 0
        self.first_out_t: float | None = None
        self.last_report_t: float | None = None
        self.first_sent_t: float | None = None  # when this turn's first audio left for the page

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        if value != self._paused:
            self._send({"type": "play_pause", "paused": bool(value)})
        self._paused = bool(value)

    def start_turn(self) -> None:
        with self._lock:
            self._seq += 1
            self._sent = self.played = self.pending = 0
            self.first_out_t = self.first_sent_t = None
            self._flushed = False
            self._paused = False
            self._send({"type": "play_turn", "seq": self._seq})

    def put(self, audio: np.ndarray) -> None:
        pcm = (np.clip(np.asarray(audio, np.float32), -1.0, 1.0) * 32767.0).astype("<i2")
        with self._lock:
            if self._flushed:
                return
            if not self._sent:
                self.first_sent_t = time.monotonic()
            self._sent += len(pcm)
            self.pending = self._sent - self.played
            self._send(struct.pack("<I", self._seq) + pcm.tobytes())

    def flush(self) -> int:
        with self._lock:
            self._flushed = True
            self.pending = 0
            self._send({"type": "play_flush", "seq": self._seq})
            return self.played

    def on_progress(self, seq: int, played: int, first: bool, t: float | None = None) -> None:
        """A report from the page: `played` samples of turn `seq` have gone to its audio output at
        monotonic time `t` (`page_time`; now when unknown, never before the audio was sent nor after now)."""
        now = time.monotonic()
        t = now if t is None else min(t, now)
        with self._lock:
            if self.first_sent_t is not None:
                t = max(t, self.first_sent_t)
            self.last_report_t = now
            if seq != self._seq or played < self.played:
                return
            self.played = min(int(played), self._sent)
            if (first or self.played) and self.first_out_t is None:
                self.first_out_t = t
            if not self._flushed:
                self.pending = self._sent - self.played


def page_time(at_ms: Any) -> float | None:
    """Our monotonic time for the page's wall-clock stamp `at_ms` (performance.timeOrigin + now(), in ms).

    The page reports when its player took the first sample; the report then takes a few ms to reach us
    (socket, event loop), which is not the person's wait. Page and app share the machine's clock (the
    app serves loopback only), so the stamp converts directly. None for a missing or non-number stamp.
    """
    if isinstance(at_ms, bool) or not isinstance(at_ms, (int, float)) or not math.isfinite(at_ms):
        return None
    return time.monotonic() - (time.time() - at_ms / 1000.0)


class BrowserSink:
    """The pipeline's `Sink` for the page: the reply at the synthesiser's rate, unchanged."""

    def __init__(self, send: Send, rate: int) -> None:
        self.rate = self.source_rate = int(rate)
        self.buffer = BrowserPlayback(send)  # a Playback the page's reports drive

    def put(self, audio: np.ndarray) -> int:
        self.buffer.put(audio)
        return len(audio)

    def start(self) -> None:
        pass

    def close(self) -> None:
        self.buffer.flush()


class FrameClock:
    """Capture times for frames that arrive over a socket.

    A frame reaches the server some delay after its last sample was captured; the least delay seen
    over the last few seconds is the best estimate of the fixed part, so each frame is stamped at
    (receipt - that least excess delay). Frames that arrive bunched (a busy browser) keep their
    real spacing; the window follows clock drift between the page's audio clock and ours.
    """

    def __init__(self, rate: int = PIPELINE_RATE, window_s: float = 2.0) -> None:
        self.rate, self.window_s = rate, window_s
        self.n = 0
        self._mins: deque[tuple[float, float]] = deque()  # (receipt time, start-time estimate), increasing estimates

    def stamp(self, n_samples: int, t_recv: float) -> float:
        self.n += n_samples
        start = t_recv - self.n / self.rate  # the stream's start time, if this frame had no extra delay
        while self._mins and self._mins[-1][1] >= start:
            self._mins.pop()
        self._mins.append((t_recv, start))
        while self._mins[0][0] < t_recv - self.window_s:
            self._mins.popleft()
        return self._mins[0][1] + self.n / self.rate


class BrowserMicrophone:
    """The pipeline's `Source` for the page's microphone: 16 kHz int16 frames from the socket.

    While the page has no microphone (refused, not started, or stalled for `stall_s`), silence is
    generated at real-time pace: the pipeline runs on frames, and a dropped file still needs them.
    """

    def __init__(self, stall_s: float = 0.5) -> None:
        self._q: queue.SimpleQueue[Frame] = queue.SimpleQueue()
        self.mic_on = False
        self.stall_s = stall_s
        self._clock = FrameClock()
        self._last_t: float | None = None
        self._last_rx: float | None = None
        self.frames_in = 0
        self.lateness_ms: deque[float] = deque(
            maxlen=4000
        )  # receipt minus capture estimate: the jitter the pipeline sees

    def set_mic(self, on: bool) -> None:
        if on and not self.mic_on:
            self._clock = FrameClock()
        self.mic_on = on

    def push(self, data: bytes, t_recv: float | None = None) -> None:
        """One binary message from the page (int16 little-endian mono at 16 kHz)."""
        t_recv = time.monotonic() if t_recv is None else t_recv
        x = np.frombuffer(data[: len(data) - len(data) % 2], "<i2").astype(np.float32) / 32768.0
        if len(x):
            self._last_rx = t_recv
            self.frames_in += 1
            t_end = self._clock.stamp(len(x), t_recv)
            self.lateness_ms.append((t_recv - t_end) * 1000)
            self._q.put(Frame(x, t_end))

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def frames(self, stop: threading.Event) -> Iterator[Frame]:
        block = int(PIPELINE_RATE * FRAME_S)
        silence = np.zeros(block, np.float32)
        while not stop.is_set():
            try:
                f = self._q.get(timeout=FRAME_S)
            except queue.Empty:
                now = time.monotonic()
                stalled = self._last_rx is None or now - self._last_rx > self.stall_s
                if self.mic_on and not stalled:
                    continue
                t = self._last_t if self._last_t is not None else now - FRAME_S
                while t + FRAME_S <= now and not stop.is_set():  # catch up to real time
                    t += FRAME_S
                    self._last_t = t
                    yield Frame(silence, t)
                continue
            t = f.t_end if self._last_t is None else max(f.t_end, self._last_t)  # never before generated silence
            self._last_t = t
            yield Frame(f.samples, t)


class InputGate:
    """Push-to-talk and dropped files in front of a source (the page's microphone or a local one).

    With push-to-talk the input is silence unless the key is held (the endpointer then ends the
    turn after its stop delay, as for a pause). A dropped file's samples replace the input frame by
    frame, at the pace the frames come, so the file is heard in real time like speech.
    """

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.push_to_talk = False
        self.talking = False
        self._file: np.ndarray | None = None
        self._file_pos = 0
        self._lock = threading.Lock()

    def inject(self, audio: np.ndarray) -> None:
        """Play 16 kHz mono `audio` into the pipeline instead of the input, starting now."""
        with self._lock:
            self._file, self._file_pos = np.asarray(audio, np.float32), 0

    @property
    def playing_file(self) -> bool:
        return self._file is not None

    def start(self) -> None:
        self.inner.start()

    def close(self) -> None:
        self.inner.close()

    def frames(self, stop: threading.Event) -> Iterator[Frame]:
        for f in self.inner.frames(stop):
            x = f.samples
            with self._lock:
                if self._file is not None:
                    seg = self._file[self._file_pos : self._file_pos + len(x)]
                    self._file_pos += len(x)
                    x = np.concatenate([seg, np.zeros(len(x) - len(seg), np.float32)]) if len(seg) < len(x) else seg
                    if self._file_pos >= len(self._file):
                        self._file = None
                elif self.push_to_talk and not self.talking:
                    x = np.zeros_like(x)
            yield Frame(x, f.t_end)
