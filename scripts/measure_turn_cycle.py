"""How long a voice stream thinks between two cloud turns: the fleet simulator's `--think-ms`, measured.

    python scripts/measure_turn_cycle.py [--n 20] [--max-tokens 48] [--json]

In a spoken conversation the cloud is idle for a stream from the end of one
answer's generation to the request of the next one. Generation runs far ahead
of speech, so that gap is about: the rest of the reply being spoken, the
person's pause before answering, the next question spoken, and the time the
assistant takes to decide the person has finished. Each term is measured here
or cited:

- the reply's audio: the device model's answers (default options, device
  alone) to CLINC150 val questions, synthesised by the bundled Piper voice
  at its default pace; minus the answer's generation time on this CPU;
- the next question's audio: the same voice speaking the next CLINC150 val
  question (a stand-in for a person's speech rate: Piper's joe voice);
- the person's pause before taking the turn: ~200 ms, the mode of the gaps
  between turns across ten languages (Stivers et al., "Universals and
  cultural variation in turn-taking in conversation", PNAS 106(26), 2009);
- the end-of-turn decision: `--endpoint-ms` (default 300 ms, the turn wait
  this project measures: docs/voice.md).

CLINC150: Larson et al., EMNLP-IJCNLP 2019, CC BY 3.0.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.generator import open_generator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.replay.sessions import clinc_sessions  # noqa: E402
from edge_client.voice.tts import Synthesizer  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402

TURN_GAP_MS = 200.0  # Stivers et al. 2009 (PNAS): the mode of between-turn gaps, ten languages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="CLINC150 val questions")
    ap.add_argument("--max-tokens", type=int, default=48, help="answer tokens (as the replay traces)")
    ap.add_argument("--endpoint-ms", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    questions = [s.turns[0].text for s in clinc_sessions("val", limit=args.n + 1, seed=args.seed)]
    synth = Synthesizer()
    opts = GeneratorOptions(policy="edge", cloud="none", max_tokens=args.max_tokens)
    rows = []
    with open_generator(opts) as gen:
        for q, nxt in zip(questions, questions[1:]):
            t0 = time.perf_counter()
            a = gen.generate([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}])
            gen_ms = (time.perf_counter() - t0) * 1000.0
            reply_ms = 1000.0 * len(synth.synthesize(a.text)) / synth.rate
            question_ms = 1000.0 * len(synth.synthesize(nxt)) / synth.rate
            think = max(0.0, reply_ms - gen_ms) + TURN_GAP_MS + question_ms + args.endpoint_ms
            rows.append(
                {
                    "tokens": a.n_tokens,
                    "gen_ms": gen_ms,
                    "reply_ms": reply_ms,
                    "question_ms": question_ms,
                    "think_ms": think,
                }
            )
    med = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
    out = {
        "machine": f"{platform.machine()} {platform.platform()}",
        "n": len(rows),
        "median": med,
        "mean_think_ms": round(statistics.mean(r["think_ms"] for r in rows), 1),
        "reply_ms_per_token": round(statistics.mean(r["reply_ms"] / max(1, r["tokens"]) for r in rows), 1),
        "turn_gap_ms": TURN_GAP_MS,
        "endpoint_ms": args.endpoint_ms,
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
