"""`make demo`: the bundled spoken question through the whole assistant, with a local cloud server.

Synthesises the question once (Piper, into build/voice/, never committed), then runs one voice
turn in file mode: recognition -> routed answer -> clause-streamed speech. Prints the transcript,
the answer with cloud-written tokens marked, routing stats and the latency table, and writes the
reply to build/voice/demo_reply.wav.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ROOT / "build" / "voice" / "demo_question.wav"
REPLY = ROOT / "build" / "voice" / "demo_reply.wav"


def main() -> int:
    if not QUESTION.is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_demo_audio.py"), "--out", str(QUESTION)], check=True
        )
    cmd = [
        sys.executable,
        "-m",
        "edge_client.cli",
        "file",
        str(QUESTION),
        "--out",
        str(REPLY),
        "--cloud",
        "local",
        *sys.argv[1:],
    ]
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
