"""Piper's first-clause synthesis with onnxruntime's threads spinning or sleeping, beside a competitor.

    python scripts/bench_tts_spin.py [--rounds 6] [--out build/tts_spin.json]

Why: onnxruntime's intra-op threads busy-wait between operators by default. On 2 cores, whatever else
runs (Smart Turn's model, the desktop app's browser, the loopback cloud model) preempts one of them
and the other spins, waiting. `TtsOptions.spin_wait` (default False) decides; this measures both, and
one thread, side by side in one run, while a separate process keeps a core busy for a share of every
10 ms (0 = idle, 1 = a full core). Reported: synthesis time p50/p90 (ms) of four short first clauses.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.voice.assets import piper_voice_path  # noqa: E402
from edge_client.voice.tts import Synthesizer, TtsOptions  # noqa: E402

CLAUSES = ["The capital of France is Paris,", "Sure,", "I can set a timer for ten minutes.", "Your balance is"]
BUSY = """
import time
d = {duty}
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.01 * d:
        pass
    time.sleep(0.01 * (1 - d))
"""


def timed(synth: Synthesizer, rounds: int) -> dict[str, float]:
    ms = []
    for _ in range(rounds):
        for text in CLAUSES:
            t = time.perf_counter()
            synth.synthesize(text)
            ms.append((time.perf_counter() - t) * 1000)
    return {"p50": round(float(np.median(ms)), 1), "p90": round(float(np.percentile(ms, 90)), 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "build" / "tts_spin.json"))
    args = ap.parse_args()
    variants = {
        "sleeping (default)": Synthesizer(TtsOptions(spin_wait=False)),
        "spinning (onnxruntime's default)": Synthesizer(TtsOptions(spin_wait=True)),
    }
    one = Synthesizer()
    so = onnxruntime.SessionOptions()
    so.intra_op_num_threads = 1
    one.voice.session = onnxruntime.InferenceSession(
        str(piper_voice_path()), sess_options=so, providers=["CPUExecutionProvider"]
    )
    variants["one thread"] = one
    result: dict = {
        "command": " ".join(["python", "scripts/bench_tts_spin.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "load_average_at_start": os.getloadavg(),
        "ms": {},
    }
    for duty in (0.0, 0.2, 0.5, 1.0):
        busy = subprocess.Popen([sys.executable, "-c", BUSY.format(duty=duty)]) if duty else None
        time.sleep(0.3)
        try:
            row = {}
            for name, synth in variants.items():
                timed(synth, 1)  # warm, and let the competitor settle
                row[name] = timed(synth, args.rounds)
                print(
                    f"competitor {duty:.0%} of a core  {name:34s} p50 {row[name]['p50']:6.1f}  p90 {row[name]['p90']:6.1f} ms"
                )
            result["ms"][f"competitor {duty:.0%}"] = row
        finally:
            if busy is not None:
                busy.kill()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
