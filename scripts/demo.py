"""`make demo`: one question through the whole assistant with a local cloud server.

Runs the spoken demo (bundled question -> speech recognition -> routed answer -> speech) when
the voice pipeline is installed, else the same question as text.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "What is the capital of France?"


def main() -> int:
    try:
        from edge_client.voice.demo import run_demo  # the voice pipeline
    except ImportError:
        run_demo = None
    if run_demo is not None:
        return run_demo(out_dir=ROOT / "out")
    from edge_client.cli import main as edge_main

    edge_main(["ask", QUESTION])
    return 0


if __name__ == "__main__":
    sys.exit(main())
