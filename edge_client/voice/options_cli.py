"""The voice options of `tokenrouter-edge listen` and `file`: the parser group and what it builds.

Used by the subcommands (cli.py) and the terminal UI (app.py).
"""

from __future__ import annotations

import argparse

from .dialogue import MEMORY_MODES, DialogueOptions
from .endofturn import TurnOptions
from .pipeline import VoiceOptions
from .tts import TtsOptions
from .vad import VadOptions

# every flag's default is the option's, written once in its dataclass
V, T, TTS, VAD, DLG = VoiceOptions(), TurnOptions(), TtsOptions(), VadOptions(), DialogueOptions()


def add_voice_options(p: argparse.ArgumentParser) -> None:
    """The `voice` flag group of `listen`, `file` and `app`; `voice_options_from_args` reads it."""
    g = p.add_argument_group("voice")
    _add_listening_options(g)
    _add_turn_options(g)
    _add_reply_options(g)


def _add_listening_options(g: argparse._ArgumentGroup) -> None:
    """When speech opens and closes a turn (VAD), when it interrupts the reply, and what partial
    transcripts start early."""
    g.add_argument(
        "--stop-delay-ms", type=int, default=VAD.stop_delay_ms, help="silence that ends a turn (default %(default)s)"
    )
    g.add_argument(
        "--min-speech-ms",
        type=int,
        default=VAD.min_speech_ms,
        help="speech needed to open a turn (default %(default)s)",
    )
    g.add_argument("--vad-threshold", type=float, default=VAD.threshold, help="Silero speech probability threshold")
    g.add_argument(
        "--barge-in-ms",
        type=int,
        default=V.barge_in_min_ms,
        help="speech needed to interrupt the reply (default %(default)s)",
    )
    g.add_argument(
        "--no-rejoin",
        action="store_true",
        help="a barge-in soon after your last word is a new request (default: within --max-wait-ms it goes on "
        "with the request the reply answered: the reply stops and the whole is answered)",
    )
    g.add_argument(
        "--no-speculative", action="store_true", help="wait for the endpoint before recognising and answering"
    )
    g.add_argument(
        "--no-prefill",
        action="store_true",
        help="do not prefill the prompt from partial transcripts (they also reach the cloud early, words the person may still change)",
    )


def _add_turn_options(g: argparse._ArgumentGroup) -> None:
    """The end of a turn: Smart Turn, the transcript's cues and the device model's P(end), and the waits they set."""
    g.add_argument(
        "--turn-mode",
        choices=("smart", "silence"),
        default=T.mode,
        help="end of turn: 'smart' (Smart Turn model + transcript, adaptive wait; default) or 'silence' (--stop-delay-ms)",
    )
    g.add_argument(
        "--min-wait-ms",
        type=int,
        default=T.min_wait_ms,
        help="silence that ends a turn that sounds finished (default %(default)s)",
    )
    g.add_argument(
        "--max-wait-ms",
        type=int,
        default=T.max_wait_ms,
        help="silence that ends a turn that sounds unfinished (default %(default)s)",
    )
    g.add_argument(
        "--turn-threshold", type=float, default=T.threshold, help="Smart Turn probability that counts as finished"
    )
    g.add_argument(
        "--sure-end-prob",
        type=float,
        default=T.sure_end_prob,
        help="a transcript ending on '?' with Whisper at least this sure of its last word ends the turn after "
        "--min-wait-ms without asking Smart Turn (1: always ask; default 0.95)",
    )
    g.add_argument(
        "--unsure-word-prob",
        type=float,
        default=T.unsure_word_prob,
        help="a last word like 'that' or 'too' (a function word misheard at a hesitation) under this Whisper "
        "probability counts as mid-phrase (0: never; default 0.9)",
    )
    g.add_argument(
        "--misheard-word-prob",
        type=float,
        default=T.misheard_word_prob,
        help="a last word Whisper gave under this probability is likely misheard: the wait grows as it falls, "
        "to --max-wait-ms at a tenth of it (0: never; default %(default)s)",
    )
    g.add_argument(
        "--no-text-model",
        action="store_true",
        help="end turns without the device model's P(end of request) after the transcript's last word "
        "(the function-word rule and Smart Turn only)",
    )
    g.add_argument(
        "--text-unfinished-below",
        type=float,
        default=T.text_unfinished_below,
        help="a transcript whose P(end) is under this reads as unfinished: the longest wait (default %(default)s)",
    )
    g.add_argument(
        "--text-finished-from",
        type=float,
        default=T.text_finished_from,
        help="a transcript whose P(end) is at least this reads as a whole request; under it the wait grows "
        "(default %(default)s)",
    )
    g.add_argument(
        "--turn-model-missing",
        choices=("error", "silence"),
        default=T.on_missing,
        help="when the Smart Turn file is missing: stop with what to install (default), or fall back to silence, visibly",
    )


def _add_reply_options(g: argparse._ArgumentGroup) -> None:
    """The spoken reply: drafting while the person speaks, the pieces speech is cut into, the history and length."""
    g.add_argument(
        "--draft",
        action="store_true",
        help="draft the reply from partial transcripts while you speak (see docs/voice.md)",
    )
    g.add_argument(
        "--first-words",
        type=_words,
        default=TTS.first_max_words,
        help="words in the first spoken piece when no clause has ended yet: speech starts sooner with fewer, "
        "flows more smoothly with more (default %(default)s; 4: 40-65 ms later first audio, docs/voice.md)",
    )
    g.add_argument(
        "--piece-growth",
        type=float,
        default=TTS.piece_growth,
        help="a spoken piece after the first has at most this many times the words already spoken, so each is "
        "synthesised while the audio before it plays (0: whole clauses and sentences; default %(default)s)",
    )
    g.add_argument(
        "--synth-low-water-s",
        type=float,
        default=V.synth_low_water_s,
        help="pause generation while a piece is synthesised with less than this many seconds of audio queued "
        "ahead of it (0: only for the first piece; default %(default)s)",
    )
    g.add_argument("--max-history-tokens", type=int, default=DLG.max_history_tokens)
    g.add_argument(
        "--memory",
        choices=MEMORY_MODES,
        default=DLG.memory,
        help="which earlier exchanges an answer's prompt carries: follow-ups: a follow-up (and on Sunday? how long "
        "does it take?) gets the exchanges it follows, any other request none, so the small model does not copy "
        "the last answer's words; all: the whole history; none: no history (default %(default)s)",
    )
    g.add_argument("--voice-max-tokens", type=int, default=V.max_tokens, help="token cap of a spoken answer")


def _words(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 word, not {n}")
    return n


def voice_options_from_args(args: argparse.Namespace) -> VoiceOptions:
    return VoiceOptions(
        vad=VadOptions(
            threshold=args.vad_threshold, min_speech_ms=args.min_speech_ms, stop_delay_ms=args.stop_delay_ms
        ),
        dialogue=DialogueOptions(
            system_prompt=DLG.system_prompt if args.system_prompt is None else args.system_prompt,
            max_history_tokens=args.max_history_tokens,
            memory=args.memory,
        ),
        max_tokens=args.voice_max_tokens,
        full_duplex=getattr(args, "full_duplex", False),
        barge_in_min_ms=args.barge_in_ms,
        rejoin_cut_off=not args.no_rejoin,
        speculative=not args.no_speculative,
        prefill_partials=not args.no_prefill,
        turn=TurnOptions(
            mode=args.turn_mode,
            min_wait_ms=args.min_wait_ms,
            max_wait_ms=args.max_wait_ms,
            threshold=args.turn_threshold,
            sure_end_prob=args.sure_end_prob,
            unsure_word_prob=args.unsure_word_prob,
            misheard_word_prob=args.misheard_word_prob,
            text_model=not args.no_text_model,
            text_unfinished_below=args.text_unfinished_below,
            text_finished_from=args.text_finished_from,
            on_missing=args.turn_model_missing,
        ),
        draft=args.draft,
        tts=TtsOptions(first_max_words=args.first_words, piece_growth=args.piece_growth),
        synth_low_water_s=args.synth_low_water_s,
    )
