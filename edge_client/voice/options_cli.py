"""The voice options of `tokenrouter-edge listen` and `file`: the parser group and what it builds.

Used by the subcommands (cli.py) and the terminal UI (app.py).
"""

from __future__ import annotations

import argparse

from .dialogue import DialogueOptions
from .pipeline import VoiceOptions
from .vad import VadOptions


def add_voice_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("voice")
    g.add_argument("--stop-delay-ms", type=int, default=250, help="silence that ends a turn (default 250)")
    g.add_argument("--min-speech-ms", type=int, default=200, help="speech needed to open a turn (default 200)")
    g.add_argument("--vad-threshold", type=float, default=0.5, help="Silero speech probability threshold")
    g.add_argument("--barge-in-ms", type=int, default=300, help="speech needed to interrupt the reply (default 300)")
    g.add_argument(
        "--no-speculative", action="store_true", help="wait for the endpoint before recognising and answering"
    )
    g.add_argument(
        "--no-prefill",
        action="store_true",
        help="do not prefill the prompt from partial transcripts (they also reach the cloud early, words the person may still change)",
    )
    g.add_argument("--max-history-tokens", type=int, default=768)
    g.add_argument("--voice-max-tokens", type=int, default=96, help="token cap of a spoken answer")


def voice_options_from_args(args: argparse.Namespace) -> VoiceOptions:
    return VoiceOptions(
        vad=VadOptions(
            threshold=args.vad_threshold, min_speech_ms=args.min_speech_ms, stop_delay_ms=args.stop_delay_ms
        ),
        dialogue=DialogueOptions(system_prompt=args.system_prompt, max_history_tokens=args.max_history_tokens),
        max_tokens=args.voice_max_tokens,
        full_duplex=getattr(args, "full_duplex", False),
        barge_in_min_ms=args.barge_in_ms,
        speculative=not args.no_speculative,
        prefill_partials=not args.no_prefill,
    )
