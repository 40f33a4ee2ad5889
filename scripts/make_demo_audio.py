"""Synthesise the bundled spoken demo question with Piper (run at set-up; no audio is committed).

python scripts/make_demo_audio.py [--out build/voice/demo_question.wav] [--text "..."]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.voice.resample import resample  # noqa: E402
from edge_client.voice.tts import Synthesizer  # noqa: E402
from edge_client.voice.wavfile import write_wav  # noqa: E402

DEMO_QUESTION = "What is the capital city of France?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "build" / "voice" / "demo_question.wav"))
    ap.add_argument("--text", default=DEMO_QUESTION)
    args = ap.parse_args()
    synth = Synthesizer()
    audio = resample(synth.synthesize(args.text), synth.rate, 16000)
    pad = np.zeros(8000, np.float32)  # 0.5 s of silence either side
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_wav(args.out, np.concatenate([pad, 0.8 * audio, pad]), 16000)
    print(f"wrote {args.out} ({len(audio) / 16000:.2f} s): {args.text!r}")


if __name__ == "__main__":
    main()
