"""The reply openings Piper renders at start-up: the first pieces the assistant says most often.

    python scripts/make_openers.py [--n 400] [--top 24] [--out build/openers.txt]

It writes under build/ unless told otherwise; to ship a new list, `--out edge_client/voice/openers.txt`.

Runs the routed generator as the voice pipeline does (loopback cloud server, router policy, seed 0)
on n CLINC150 `train` queries (Larson et al. 2019, CC BY 3.0; the voice benchmark's fluent set is
`val`, so it does not measure on what chose the list), cuts each reply's first piece with the
pipeline's clause chunker and writes the `top` most frequent, with the share of replies they open.
The synthesiser renders them once at start-up (`TtsOptions.warm_openers`), so a reply that opens
with one plays its first piece with no synthesis at all (docs/voice.md).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edge_client.generator import open_generator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.voice.dialogue import Dialogue, DialogueOptions  # noqa: E402
from edge_client.voice.tts import ClauseChunker, TtsOptions, speakable  # noqa: E402
from models.train.prompts import clinc_prompts  # noqa: E402


def first_piece(gen, query: str, tts: TtsOptions) -> str:
    """The first piece the pipeline would speak in reply to `query` (one fresh dialogue)."""
    chunker, pieces = ClauseChunker(tts), []

    def on_token(ev) -> None:
        if not pieces:
            pieces.extend(chunker.feed(ev.text))

    gen.generate(Dialogue(DialogueOptions(), gen.count_tokens).messages(query), max_tokens=12, on_token=on_token)
    pieces = pieces or chunker.flush()
    return speakable(pieces[0]) if pieces else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400, help="CLINC150 train queries to answer (evenly spaced)")
    ap.add_argument("--top", type=int, default=24, help="openings to keep")
    ap.add_argument(
        "--out",
        default=str(ROOT / "build" / "openers.txt"),
        help="default build/openers.txt; the shipped list is edge_client/voice/openers.txt",
    )
    args = ap.parse_args()
    queries = clinc_prompts("train", args.n)  # an even stride through the split ($TOKENROUTER_CLINC: another copy)
    tts = TtsOptions()
    counts: collections.Counter[str] = collections.Counter()
    spelled: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    t0 = time.monotonic()
    with open_generator(GeneratorOptions(cloud="local", policy="router", max_tokens=12, seed=0)) as gen:
        for q in queries:
            piece = first_piece(gen, q, tts)
            if piece:
                counts[piece.lower()] += 1  # "I'm sorry" and "i'm sorry" sound the same (one phoneme key)
                spelled[piece.lower()][piece] += 1
    top = counts.most_common(args.top)
    share = 100 * sum(c for _, c in top) / max(1, len(queries))
    lines = [
        "# The reply openings the synthesiser renders at start-up (TtsOptions.warm_openers), most frequent first.",
        f"# Made by: python scripts/make_openers.py --n {args.n} --top {args.top}",
        f"# {len(queries)} CLINC150 train queries (CC BY 3.0), first piece of {tts.first_max_words} words;"
        f" these open {share:.0f} % of the replies.",
        *(f"{spelled[k].most_common(1)[0][0]}\t{c}" for k, c in top),
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(f"wrote {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
