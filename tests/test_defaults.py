"""Each default is written once: a command's flags, left out, give the options' own defaults.

No models: the parsers and the option dataclasses only. If a flag re-types a default and the
dataclass later changes, the two would silently disagree; these tests catch that."""

from __future__ import annotations

import argparse

from edge_client.options import GeneratorOptions
from edge_client.options_cli import add_generation_options, options_from_args
from shared.decision import CHECK_MAX_DRAFT, SYNC_EVERY


def test_generation_flags_left_out_give_the_options_defaults():
    p = argparse.ArgumentParser()
    add_generation_options(p)
    assert options_from_args(p.parse_args([])) == GeneratorOptions()


def test_a_threshold_replaces_the_cloud_fraction():
    p = argparse.ArgumentParser()
    add_generation_options(p)
    o = options_from_args(p.parse_args(["--threshold", "0.7"]))
    assert o.threshold == 0.7 and o.cloud_fraction is None
    o = options_from_args(p.parse_args(["--cloud-fraction", "0.2"]))
    assert o.cloud_fraction == 0.2 and o.threshold == GeneratorOptions().threshold


def test_the_device_and_the_evals_work_model_share_their_draft_and_sync_defaults():
    """The eval counts the cloud passes the device causes (models/train/evaluate.py CloudWork): with the
    device's own draft length and eager sync, from one place (shared/decision.py)."""
    from models.train.evaluate import CloudWork, EvalOptions

    d = GeneratorOptions()
    assert (d.check_max_draft, d.sync_every) == (CHECK_MAX_DRAFT, SYNC_EVERY)
    w = CloudWork(10)
    assert (w.max_draft, w.sync_every, EvalOptions.__dataclass_fields__["sync_every"].default) == (
        CHECK_MAX_DRAFT,
        SYNC_EVERY,
        SYNC_EVERY,
    )


def test_voice_flags_left_out_give_the_voice_options_defaults():
    """`listen`, `file` and `app` parse the generation and the voice flags: left out, the voice options are
    `VoiceOptions()` (the voice dialogue's prompt, written for speech, included) and the generator's
    `GeneratorOptions()`; a prompt given on the command line reaches both."""
    from edge_client.voice.dialogue import DEFAULT_SYSTEM_PROMPT as VOICE_PROMPT
    from edge_client.voice.options_cli import add_voice_options, voice_options_from_args
    from edge_client.voice.pipeline import VoiceOptions

    p = argparse.ArgumentParser()
    add_generation_options(p)
    add_voice_options(p)
    args = p.parse_args([])
    assert voice_options_from_args(args) == VoiceOptions() and options_from_args(args) == GeneratorOptions()
    assert VoiceOptions().dialogue.system_prompt == VOICE_PROMPT != GeneratorOptions().system_prompt
    args = p.parse_args(["--system-prompt", "Be terse."])
    assert voice_options_from_args(args).dialogue.system_prompt == options_from_args(args).system_prompt == "Be terse."
    assert voice_options_from_args(p.parse_args(["--misheard-word-prob", "0.2"])).turn.misheard_word_prob == 0.2
