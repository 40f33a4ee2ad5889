"""One tab's session: its WebSocket, its voice pipeline, the events it shows.

The pipeline runs on its own thread, exactly as `listen` runs it; its events (emitted from the
pipeline's threads) become JSON messages queued to the socket's sender task. A tab owns the
pipeline while it is connected: closing it stops the turn and frees the pipeline, and a second
tab takes over (the first is told why and closed), so two pages never drive one microphone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
from typing import Any

import numpy as np
from starlette.websockets import WebSocket

from edge_client.voice.audio_io import DeviceError, Microphone, Speaker
from edge_client.voice.events import (
    AnswerToken,
    Event,
    FinalTranscript,
    Interruption,
    Listening,
    Notice,
    PartialTranscript,
    SpeechStarted,
    TurnDone,
)
from edge_client.voice.pipeline import Sink, Source, VoicePipeline
from shared.decision import CHECK_MODES

from .bridge import BrowserMicrophone, BrowserSink, InputGate, page_time
from .core import AppCore
from .settings import BUNDLED_VOICE, AppSettings

log = logging.getLogger(__name__)

CLOSE_TAKEN_OVER = 4001  # WebSocket close code: another tab took the assistant


def event_json(ev: Event) -> dict[str, Any] | None:
    """A pipeline event as the page's message (TurnDone is the turn log's record: conversation.py)."""
    if isinstance(ev, Listening):
        return {"type": "listening"}
    if isinstance(ev, SpeechStarted):
        return {"type": "speech_started"}
    if isinstance(ev, PartialTranscript):
        return {"type": "partial", "stable": ev.stable, "unstable": ev.unstable}
    if isinstance(ev, FinalTranscript):
        return {"type": "final", "text": ev.text}
    if isinstance(ev, AnswerToken):
        tk = ev.token
        return {
            "type": "token",
            "i": tk.index,
            "text": tk.text,
            "route": tk.route,
            "score": None if tk.score is None else round(float(tk.score), 3),
            "lookahead": tk.lookahead,
            "overruled": tk.overruled,
        }
    if isinstance(ev, Interruption):
        stop_ms = round((ev.t_stopped - ev.t_onset) * 1000, 1)
        return {"type": "interruption", "heard": ev.heard, "stop_ms": stop_ms, "rejoined": ev.rejoined}
    if isinstance(ev, Notice):
        return {"type": "notice", "level": ev.level, "message": ev.message}
    if dataclasses.is_dataclass(ev):  # events added later (e.g. the end-of-turn judgement): passed on as they are
        name = type(ev).__name__
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
        return {"type": snake, "data": json.loads(json.dumps(dataclasses.asdict(ev), default=str))}
    return None


class Session:
    """One connected tab: the socket's outgoing queue, the pipeline and its thread."""

    def __init__(self, core: AppCore, ws: WebSocket, loop: asyncio.AbstractEventLoop) -> None:
        self.core, self.ws, self.loop = core, ws, loop
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False
        self.pipe: VoicePipeline | None = None
        self.gate: InputGate | None = None
        self.mic: BrowserMicrophone | None = None
        self.sink: Sink | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._mic_on = False
        self.busy = False  # a turn is under way (speech heard, answer not finished)
        self._pending_reset = False
        self._pending_restart = False
        self.turns: list[TurnDone] = []

    # ---------------------------------------------------------------- to the page (any thread)

    def send(self, msg: Any) -> None:
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, msg)
        except RuntimeError:  # the loop is gone (shutdown)
            self.closed = True

    async def sender(self) -> None:
        while True:
            m = await self.out.get()
            if m is None:
                return
            try:
                if isinstance(m, (bytes, bytearray)):
                    await self.ws.send_bytes(bytes(m))
                else:
                    await self.ws.send_text(json.dumps(m))
            except Exception:  # the tab went away; the receive loop ends the session
                return

    def hello(self) -> dict[str, Any]:
        core = self.core
        assert core.engines is not None and core.dialogue is not None
        return {
            "type": "hello",
            "audio": core.audio,
            "rate_in": 16000,
            "rate_out": core.engines.synth.rate,
            "settings": core.settings.public(),
            "history": list(core.dialogue.turns),
            "turns": core.log.for_history(core.dialogue.turns),  # each pair's record: its marks and timings
            "cloud": core.cloud_status(),
            "devices": core.devices() if core.audio == "device" else None,
            "choices": {"check": list(CHECK_MODES), "voice": [BUNDLED_VOICE]},
        }

    # ---------------------------------------------------------------- from the page (event loop)

    def on_audio(self, data: bytes) -> None:
        if self.mic is not None:
            self.mic.push(data)

    async def on_control(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "progress":
            if isinstance(self.sink, BrowserSink):
                self.sink.buffer.on_progress(
                    int(msg.get("seq", -1)), int(msg.get("played", 0)), bool(msg.get("first")), page_time(msg.get("at"))
                )
        elif kind == "ready":  # the page's audio is running (or, with --audio device, the page is up)
            self._mic_on = bool(msg.get("mic"))
            if msg.get("mic_error"):  # the page shows it where the conversation is, from before any click
                log.info("the page has no microphone: %s", msg["mic_error"])
            if self.pipe is None:
                self.start_pipeline()
        elif kind == "mic":
            self._mic_on = bool(msg.get("on"))
            if self.mic is not None:
                self.mic.set_mic(self._mic_on)
        elif kind == "ptt":
            if self.gate is not None:
                self.gate.talking = bool(msg.get("down"))
            if not msg.get("down") and self.pipe is not None:  # key up: the person is done, no end-of-turn wait
                await asyncio.to_thread(self.pipe.end_utterance)
        elif kind == "stop_reply":
            if self.pipe is not None and not await asyncio.to_thread(self.pipe.stop_reply):
                self.send({"type": "notice", "level": "info", "message": "nothing to stop: no reply is playing"})
        elif kind == "reset":
            self.reset()

    def reset(self) -> None:
        """Clear the history now, or once the turn under way is done (it would add itself after)."""
        if self.busy:
            self._pending_reset = True
            self.send(
                {"type": "notice", "level": "info", "message": "the conversation will be reset after this answer"}
            )
            return
        self._do_reset()

    def _do_reset(self) -> None:
        assert self.core.dialogue is not None
        self.core.dialogue.reset()
        self._pending_reset = False
        self.send({"type": "conversation_reset"})
        self.send({"type": "history", "history": []})
        self.send({"type": "notice", "level": "info", "message": "conversation reset"})

    def settings_changed(self, old: AppSettings, new: AppSettings) -> None:
        """Apply what the session itself holds (talk mode, barge-in, devices) and tell the page."""
        if self.gate is not None:
            self.gate.push_to_talk = new.talk_mode == "push-to-talk"
        if self.pipe is not None and self.core.audio == "browser":
            self.pipe.opts.full_duplex = new.barge_in
        if self.core.audio == "device" and (old.input_device, old.output_device) != (
            new.input_device,
            new.output_device,
        ):
            if self.busy:
                self._pending_restart = True
            else:
                asyncio.run_coroutine_threadsafe(self.restart_pipeline(), self.loop)
        self.send({"type": "settings", "settings": new.public()})
        self.send(self.core.cloud_status())

    # ---------------------------------------------------------------- the pipeline

    def start_pipeline(self) -> None:
        core = self.core
        s = core.settings
        assert core.engines is not None
        vopts = dataclasses.replace(core.vopts)
        if core.audio == "browser":
            vopts.full_duplex = s.barge_in  # the browser cancels the echo: barge-in on open speakers
            self.mic = BrowserMicrophone()
            self.mic.set_mic(self._mic_on)
            source: Source = self.mic
            self.sink = BrowserSink(self.send, core.engines.synth.rate)
        else:
            try:
                source = Microphone(s.input_device or None)
                self.sink = Speaker(s.output_device or None, core.engines.synth.rate)
            except DeviceError as e:
                self.send({"type": "notice", "level": "error", "message": str(e)})
                return
        self.gate = InputGate(source)
        self.gate.push_to_talk = s.talk_mode == "push-to-talk"
        self._stop = threading.Event()
        self.pipe = VoicePipeline(
            core.engines, self.gate, self.sink, vopts, on_event=self._on_event, dialogue=core.dialogue
        )
        self._thread = threading.Thread(
            target=self._run, args=(self.pipe, self._stop), name="app-pipeline", daemon=True
        )
        self._thread.start()

    def _run(self, pipe: VoicePipeline, stop: threading.Event) -> None:
        try:
            pipe.run(stop, reply_limit_s=self.core.reply_limit_s)
        except Exception as e:  # reported on the page; the tab can reconnect
            log.exception("voice pipeline failed")
            self.send(
                {
                    "type": "notice",
                    "level": "error",
                    "message": f"the voice pipeline stopped: {e}; reload the page to restart it",
                }
            )

    async def stop_pipeline(self) -> None:
        self._stop.set()
        th, self._thread = self._thread, None
        if th is not None:
            await asyncio.to_thread(th.join, 15.0)
            if th.is_alive():
                log.warning("the voice pipeline did not stop within 15 s")
        self.pipe = None
        self.busy = False

    def stop_now(self) -> None:
        """Stop the pipeline from outside the event loop (the app is exiting)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15.0)

    async def restart_pipeline(self) -> None:
        """New devices (--audio device): a new pipeline on the same history."""
        self._pending_restart = False
        await self.stop_pipeline()
        if not self.closed:
            self.start_pipeline()
            self.send({"type": "notice", "level": "info", "message": "audio devices changed"})

    async def shutdown(self, code: int = 1000, reason: str = "") -> None:
        """Stop the pipeline (the turn in progress ends, the audio is released) and close the socket."""
        await self.stop_pipeline()
        if not self.closed:
            self.closed = True
            self.out.put_nowait(None)
            try:
                await self.ws.close(code=code, reason=reason)
            except Exception:
                pass

    # ---------------------------------------------------------------- events (pipeline threads)

    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, SpeechStarted):
            self.busy = True
        if isinstance(ev, TurnDone):
            self.turns.append(ev)
            self.send(self.core.log.add(ev, self.core.settings))
            self._after_turn(ev)
            return
        msg = event_json(ev)
        if msg is not None:
            self.send(msg)
        if isinstance(ev, Listening):
            self.busy = False
            if self._pending_restart:
                asyncio.run_coroutine_threadsafe(self.restart_pipeline(), self.loop)

    def _after_turn(self, done: TurnDone) -> None:
        core = self.core
        a = done.answer
        if a is not None and a.degraded and core.settings.cloud != "none":
            err = core.gen.last_cloud_error if core.gen is not None else ""
            lost = a.round_trips > 0 or a.n_cloud_tokens > 0
            what = "The cloud was lost during this answer" if lost else "The cloud could not be reached"
            self.send(
                {
                    "type": "notice",
                    "level": "warning",
                    "message": f"{what}; the device answered alone{f' ({err})' if err else ''}.",
                }
            )
        assert core.dialogue is not None
        if self._pending_reset:
            self._do_reset()
        else:
            self.send({"type": "history", "history": list(core.dialogue.turns)})
        self.send(core.cloud_status())
        for f in core.turn_listeners:
            try:
                f(done)
            except Exception:
                log.exception("turn listener failed")

    def inject_file(self, audio16k: np.ndarray) -> None:
        if self.gate is None:
            raise RuntimeError("the assistant is not listening yet")
        self.gate.inject(audio16k)
