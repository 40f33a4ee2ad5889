"""Open speakers, for real: how often the app's reply takes itself for the person (false barge-in).

    python scripts/bench_echo.py [--n 30] [--n-off 10] [--out build/echo_bench.json]

One headless Chromium on a private PulseAudio: its microphone hears each spoken question and, through
`module-loopback` (30 ms, full level: a microphone next to the loudspeaker), everything the page plays.
Each question is played into the microphone with paplay; the reply is generated and played to its end
(or until it is interrupted), with barge-in on. Arm "on": the browser's echo cancellation (the app's
default), `--n` questions; arm "off": without it, `--n-off` questions, to show the difference.

Reported per arm: replies, false barge-ins (an Interruption while no one spoke: every one here is
false), replies with at least one, times the reply was held by a speech-like onset (`ReplyHeld`: a
pause that a false start then resumes; heard as a stutter), seconds of reply played, and the question's
WER. Questions: CLINC150 val (Larson et al., EMNLP 2019, CC BY 3.0), every len/n-th, spoken by the
bundled Piper voice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_webapp_browser import chromium, pulse_env, ready, served_app  # noqa: E402
from voice_audio import spoken_wav, virtual_devices, wer  # noqa: E402

from edge_client.voice.events import Interruption, ReplyHeld  # noqa: E402
from edge_client.webapp.core import AppCore  # noqa: E402
from edge_client.webapp.server import AppServer  # noqa: E402

DATA = Path("/work/shared/datasets/clinc150/data_full.json")


def one_reply(core: AppCore, srv: AppServer, d, dev, wav: Path, timeout_s: float = 90.0) -> dict:
    """Reload the page, play the question into the microphone, wait for the turn (reply played to its end)."""
    d.get(srv.url)
    s = ready(d, core)
    t_end = time.monotonic() + 20
    while s.mic.frames_in < 25:
        if time.monotonic() > t_end:
            raise RuntimeError("the page's microphone sends nothing")
        time.sleep(0.05)
    core.dialogue.reset()
    n0 = len(s.turns)
    subprocess.run(["paplay", "--device=mic", str(wav)], env=dev.env, check=True, timeout=30)
    t_end = time.monotonic() + timeout_s
    while len(s.turns) <= n0:
        if time.monotonic() > t_end:
            raise RuntimeError(f"no turn within {timeout_s} s for {wav.name}")
        time.sleep(0.1)
    time.sleep(0.3)
    events = list(s.pipe.events) if s.pipe else []
    turn = s.turns[n0]
    rate = core.engines.synth.rate
    return {
        "transcript": turn.transcript,
        "interruptions": sum(isinstance(e, Interruption) for e in events),
        "held": sum(isinstance(e, ReplyHeld) and e.held for e in events),
        "played_s": round(d.execute_script("return window.trStats.played") / rate, 2),
        "answer_chars": len(turn.answer.text) if turn.answer else 0,
        "interrupted": turn.interrupted,
    }


def summary(rows: list[dict]) -> dict:
    return {
        "replies": len(rows),
        "false_barge_ins": sum(r["interruptions"] for r in rows),
        "replies_interrupted": sum(r["interruptions"] > 0 for r in rows),
        "held_total": sum(r["held"] for r in rows),
        "replies_held": sum(r["held"] > 0 for r in rows),
        "played_s_total": round(sum(r["played_s"] for r in rows), 1),
        "wer_mean": round(float(np.mean([r["wer"] for r in rows])), 3) if rows else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30, help="questions with echo cancellation on")
    ap.add_argument("--n-off", type=int, default=10, help="questions with it off (the difference)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out", default=str(ROOT / "build" / "echo_bench.json"))
    args = ap.parse_args()
    val = json.load(open(args.data))["val"]
    step = max(1, len(val) // max(args.n, args.n_off))
    queries = [val[i * step][0] for i in range(max(args.n, args.n_off))]
    tmp = Path(tempfile.mkdtemp(prefix="echo-bench-"))
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    with contextlib.ExitStack() as stack:
        dev = stack.enter_context(virtual_devices())
        env = pulse_env(dev, room=True)
        core, srv = served_app(stack, tmp / "app.json")
        d = stack.enter_context(chromium("about:blank", env=env, fake_mic=False))
        for arm, n in (("on", args.n), ("off", args.n_off)):
            core.apply({"echo_cancellation": arm == "on"})
            for i, q in enumerate(queries[:n]):
                wav = spoken_wav(core.engines.synth, q, tmp / f"q{i}.wav")
                r = one_reply(core, srv, d, dev, wav)
                r["query"], r["wer"] = q, wer(q, r["transcript"])
                rows[arm].append(r)
                print(
                    f"{arm:3s} {i:2d} played {r['played_s']:5.1f} s, interruptions {r['interruptions']}, "
                    f"held {r['held']:2d}  {q!r}",
                    flush=True,
                )
    out = {
        "machine": f"{platform.machine()} {platform.processor() or ''} ({__import__('os').cpu_count()} cores)",
        "echo_cancellation_on": summary(rows["on"]),
        "echo_cancellation_off": summary(rows["off"]),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
