"""`tokenrouter-edge listen`: the terminal UI (rich) over a device-backed VoicePipeline.

The pipeline runs in a worker thread and reports events; this module only
keeps a small view state and redraws it ten times a second. Ctrl-C stops the
pipeline, which closes the streams, so the devices are released.
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from edge_client.generator import RoutedGenerator, open_generator
from edge_client.options_cli import options_from_args

from .audio_io import Microphone, Speaker, resolve_device
from .endofturn import smart_turn_path
from .events import (
    AnswerToken,
    Event,
    FinalTranscript,
    Interruption,
    Listening,
    Notice,
    PartialTranscript,
    SpeechStarted,
    TurnDone,
    TurnJudged,
)
from .options_cli import voice_options_from_args
from .pipeline import Engines, VoicePipeline
from .timings import playback_gap_line


@dataclass
class ViewState:
    status: str = "loading models..."
    partial: tuple[str, str] = ("", "")
    transcript: str = ""
    answer: list[tuple[str, str]] = field(default_factory=list)  # (text, route)
    last: TurnDone | None = None
    notices: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_event(self, ev: Event) -> None:
        with self.lock:
            if isinstance(ev, Listening):
                self.status = "listening"
            elif isinstance(ev, SpeechStarted):
                self.status = "hearing you"
                self.partial = ("", "")
            elif isinstance(ev, PartialTranscript):
                self.partial = (ev.stable, ev.unstable)
                self.status = "hearing you"
            elif isinstance(ev, TurnJudged):
                d = ev.decision
                p = "" if d.probability is None else f"Smart Turn p={d.probability:.2f}"
                p += ("; " if p else "") + ("" if d.text_end is None else f"text P(end)={d.text_end:.3f}")
                cue = "transcript mid-phrase" if d.text_unfinished else ""
                cue = cue or ("last word likely misheard" if d.text_misheard else "")
                cue = cue or ("the transcript closed itself" if d.text_sure_end else "")
                why = ", ".join(x for x in (p, cue) if x)
                self.status = (
                    f"pause: sounds {'finished' if d.finished else 'unfinished'} ({why}); "
                    f"the turn ends after {d.wait_ms} ms of silence"
                )
            elif isinstance(ev, FinalTranscript):
                self.transcript, self.partial, self.answer = ev.text, ("", ""), []
                self.status = "answering"
            elif isinstance(ev, AnswerToken):
                self.answer.append((ev.token.text, ev.token.route))
            elif isinstance(ev, Interruption):
                self.notices.append(
                    "you went on: the reply stops and your whole request is answered"
                    if ev.rejoined
                    else f"interrupted; kept in history: {ev.heard!r}"
                )
            elif isinstance(ev, TurnDone):
                self.last = ev
            elif isinstance(ev, Notice):
                self.notices.append(f"{ev.level}: {ev.message}")
            self.notices = self.notices[-4:]


def cloud_state(gen: RoutedGenerator, last: TurnDone | None) -> Text:
    """The header's cloud line: connected, off (no cloud for this device), or not connected and why."""
    if gen.link is not None and gen.link.connected:
        t = Text("cloud: connected", style="green")
    elif not gen.cloud_configured:
        t = Text("cloud: off (edge only)", style="yellow")
    else:
        t = Text("cloud: not connected" + (f" ({gen.last_cloud_error})" if gen.last_cloud_error else ""), style="red")
    if last is not None and last.answer is not None and last.answer.degraded:
        t.append("  last answer degraded (edge finished alone)", style="red")
    if last is not None and last.answer is not None and last.answer.warnings:
        t.append("  warning: " + "; ".join(last.answer.warnings), style="yellow")
    return t


def render(state: ViewState, gen: RoutedGenerator, devices: str) -> Panel:
    with state.lock:
        head = Text(f"{state.status}   ", style="bold")
        head.append_text(cloud_state(gen, state.last))
        you = Text("you: ", style="bold")
        if state.partial != ("", ""):
            you.append(state.partial[0] + " ", style="white")
            you.append(state.partial[1], style="dim")
        else:
            you.append(state.transcript)
        bot = Text("assistant: ", style="bold")
        for text, route in state.answer:
            bot.append(text, style="bold cyan" if route == "cloud" else "")
        parts: list[Any] = [head, Text(devices, style="dim"), Text(""), you, bot]
        if state.last is not None:
            parts.append(latency_table(state.last))
        for n in state.notices:
            parts.append(Text(n, style="yellow"))
    return Panel(
        Group(*parts),
        title='TokenRouter voice (Ctrl-C to quit; say "start over" to reset)',
        subtitle="[bold cyan]cyan[/] = written by the cloud model",
    )


def latency_table(done: TurnDone) -> Table:
    t = Table(title="last turn latency (ms after end of speech)", show_header=True, box=None)
    rel = done.timings.relative_ms()
    for k in rel:
        t.add_column(k.replace("_", " "), justify="right")
    t.add_column("EoS->audio", justify="right", style="bold")
    e2a = done.timings.end_of_speech_to_first_audio_ms
    t.add_row(*["-" if v is None else f"{v:.0f}" for v in rel.values()], "-" if e2a is None else f"{e2a:.0f}")
    caption = []
    if done.answer is not None:
        a = done.answer
        caption.append(
            f"{a.n_tokens} tokens, {a.n_cloud_tokens} from the cloud" + (" (interrupted)" if done.interrupted else "")
        )
    if done.end_of_turn is not None:
        caption.append(done.end_of_turn.summary() + f"; drafted reply: {done.draft}")
    if done.timings.playback_gaps:
        caption.append(playback_gap_line(done.timings.playback_gaps, done.timings.playback_gap_ms))
    t.caption = "\n".join(caption) or None
    return t


def run_app(args: argparse.Namespace) -> int:
    resolve_device(args.input_device, "input")  # fail before loading models
    resolve_device(args.output_device, "output")
    vopts = voice_options_from_args(args)
    if vopts.turn.mode == "smart" and vopts.turn.on_missing == "error":
        smart_turn_path()  # fail before loading models, naming the file and the install command
    state = ViewState()
    stop = threading.Event()
    with open_generator(options_from_args(args)) as gen:
        engines = Engines(gen, vopts.asr, vopts.tts, vopts.dialogue.system_prompt, vopts.turn)
        mic = Microphone(args.input_device)
        spk = Speaker(args.output_device, engines.synth.rate)
        devices = (
            f"mic: {args.input_device or 'default'} @ {mic.rate} Hz   "
            f"speaker: {args.output_device or 'default'} @ {spk.rate} Hz   "
            + ("full duplex (barge-in on)" if vopts.full_duplex else "half duplex (mic muted while speaking)")
        )
        pipe = VoicePipeline(engines, mic, spk, vopts, on_event=state.on_event)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                pipe.run(stop)
            except BaseException as e:  # shown after the UI closes
                errors.append(e)
                stop.set()

        th = threading.Thread(target=work, name="voice-pipeline", daemon=True)
        th.start()
        try:
            with Live(render(state, gen, devices), refresh_per_second=10, transient=False) as live:
                while not stop.is_set():
                    time.sleep(0.1)
                    live.update(render(state, gen, devices))
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            th.join(timeout=5)
    if errors:
        raise errors[0]
    return 0
