"""Voice subcommands of `tokenrouter-edge`: devices, listen, file.

    tokenrouter-edge devices [--json]
    tokenrouter-edge listen [--input-device NAME|INDEX] [--output-device NAME|INDEX] [--full-duplex] ...
    tokenrouter-edge file IN.wav --out OUT.wav [--json] [--fast]

`edge_client.cli.build_parser` calls `add_subcommands`; each subparser sets
`handler`, which `edge_client.cli.main` dispatches to.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from edge_client.generator import open_generator
from edge_client.options_cli import add_generation_options, options_from_args

from .app import run_app
from .assets import MissingModelError
from .audio_io import DeviceError, FileSink, FileSource, list_devices
from .endofturn import TurnDecision, TurnOptions, smart_turn_path
from .options_cli import add_voice_options, voice_options_from_args
from .pipeline import Engines, NoSpeechError, VoiceGenerator, VoiceOptions, VoicePipeline
from .timings import playback_gap_line
from .turn_record import turn_json
from .wavfile import AudioFileError


def add_subcommands(sub: Any) -> None:
    d = sub.add_parser("devices", help="list audio input and output devices")
    d.add_argument("--json", action="store_true")
    d.set_defaults(handler=cmd_devices)

    li = sub.add_parser("listen", help="talk to the assistant (terminal UI; Ctrl-C exits)")
    li.add_argument(
        "--input-device", help="microphone: name, unique part of a name, or index (default: system default)"
    )
    li.add_argument("--output-device", help="speaker: name, unique part of a name, or index")
    li.add_argument(
        "--full-duplex", action="store_true", help="listen while speaking (use headphones); enables barge-in"
    )
    add_voice_options(li)
    add_generation_options(li)
    li.set_defaults(handler=cmd_listen)

    f = sub.add_parser("file", help="one spoken turn from a WAV file, the reply to a WAV file")
    f.add_argument("input", metavar="IN.wav")
    f.add_argument("--out", required=True, metavar="OUT.wav", help="where the spoken reply is written")
    f.add_argument("--json", action="store_true", help="print one JSON object (see docs/voice.md)")
    f.add_argument(
        "--fast", action="store_true", help="as fast as possible instead of real-time pace (timings then mean little)"
    )
    add_voice_options(f)
    add_generation_options(f)
    f.set_defaults(handler=cmd_file)


def check_turn_model(opts: TurnOptions) -> None:
    """Fail before any model loads when the end-of-turn model is needed and missing (MissingModelError)."""
    if opts.mode == "smart" and opts.on_missing == "error":
        smart_turn_path()


def _fail(msg: str) -> int:
    print(f"tokenrouter-edge: {msg}", file=sys.stderr)
    return 2


def cmd_devices(args: argparse.Namespace) -> int:
    try:
        devs = list_devices()
    except DeviceError as e:
        return _fail(str(e))
    if args.json:
        print(json.dumps(devs))
        return 0
    if not devs:
        print("no audio devices found (is PulseAudio/PipeWire running?)")
    for d in devs:
        mark = ("<" if d["default_input"] else " ") + (">" if d["default_output"] else " ")
        print(
            f"{mark} {d['index']:3d}  {d['name']:40s} in={d['max_input_channels']:<3d} out={d['max_output_channels']:<3d} "
            f"{d['default_samplerate']:.0f} Hz  ({d['hostapi']})"
        )
    print("(< default input, > default output; pass a name or index to --input-device / --output-device)")
    return 0


def run_file_turn(
    gen: VoiceGenerator,
    in_path: str,
    out_path: str,
    vopts: VoiceOptions,
    realtime: bool = True,
    engines: Engines | None = None,
    reply_limit_s: float | None = None,
) -> dict:
    """One turn from IN.wav to OUT.wav; returns the `--json` object. Raises AudioFileError, NoSpeechError."""
    source = FileSource(in_path, realtime=realtime)  # validates the WAV before any model loads
    engines = engines or Engines(gen, vopts.asr, vopts.tts, vopts.dialogue.system_prompt, vopts.turn)
    sink = FileSink(engines.synth.rate, realtime=realtime)
    pipe = VoicePipeline(engines, source, sink, vopts)
    turns = pipe.run(max_turns=1, reply_limit_s=reply_limit_s)
    sink.write(out_path)
    obj = turn_json(turns[0])
    obj["out"] = out_path
    obj["reply_seconds"] = round(len(sink.audio()) / sink.rate, 3)
    obj["prefilled_tokens"] = pipe.prefilled_tokens
    t = turns[0].timings
    if source.t0 is not None:  # seconds into the input file: benchmarks compare them with the true end of speech
        obj["input_speech_end_s"] = None if t.speech_end is None else round(t.speech_end - source.t0, 4)
        obj["input_first_audio_s"] = None if t.first_audio_out is None else round(t.first_audio_out - source.t0, 4)
        obj["input_endpoint_s"] = None if t.endpoint_decided is None else round(t.endpoint_decided - source.t0, 4)
    obj["drafts"] = pipe.n_drafts
    obj["wasted_draft_tokens"] = pipe.wasted_draft_tokens
    obj["wasted_draft_cloud_tokens"] = pipe.wasted_draft_cloud_tokens
    return obj


def latency_table(obj: dict) -> str:
    rows = [f"  {k:20s} {'-' if v is None else f'{v:8.1f} ms'}" for k, v in obj["timings_ms"].items()]
    rows.append(f"  {'EoS -> first audio':20s} {obj['end_of_speech_to_first_audio_ms']} ms")
    rows.append(f"  {'endpoint -> audio':20s} {obj['endpoint_to_first_audio_ms']} ms")
    if obj.get("first_piece_cached"):
        rows.append("  first piece: from the synthesiser's cache (no Piper run)")
    rows.append("  " + playback_gap_line(obj["playback_gaps"], obj["playback_gap_ms"]))
    return "latency (relative to the end of speech):\n" + "\n".join(rows)


def turn_summary(obj: dict) -> str:
    """One line: how the end of the turn was decided and whether the drafted reply was used."""
    return TurnDecision(**obj["end_of_turn"]).summary() + f"; draft: {obj['draft']} ({obj.get('drafts', 0)} drafted)"


def cmd_file(args: argparse.Namespace) -> int:
    try:
        FileSource(args.input)  # fail fast on a bad file, before loading models
        vopts = voice_options_from_args(args)
        check_turn_model(vopts.turn)
        with open_generator(options_from_args(args)) as gen:
            obj = run_file_turn(gen, args.input, args.out, vopts, realtime=not args.fast)
    except (AudioFileError, NoSpeechError, MissingModelError) as e:
        return _fail(str(e))
    answer = obj["answer"] or {}  # None: a reset command, or no answer
    for note in answer.get("warnings", []):
        print(f"tokenrouter-edge: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(obj))
        return 0
    n, n_cloud = answer.get("n_tokens", 0), answer.get("n_cloud_tokens", 0)
    print(f"transcript: {obj['transcript']}")
    print(f"answer:     {answer.get('text', obj['spoken_text'])}")
    print(
        f"routing:    {n} tokens, {n_cloud} from the cloud ({100 * n_cloud / max(n, 1):.0f}%)"
        + (" [degraded: cloud unavailable]" if answer.get("degraded") else "")
    )
    print(latency_table(obj))
    if obj["end_of_turn"] is not None:
        print(f"turn:       {turn_summary(obj)}")
    print(f"reply:      {args.out} ({obj['reply_seconds']:.2f} s)")
    return 0


def cmd_listen(args: argparse.Namespace) -> int:
    try:
        return run_app(args)
    except (DeviceError, MissingModelError) as e:
        return _fail(str(e))
