"""Quality against GPU cost: a pool of three tiers against each of its pairs, on the same prompts.

    python scripts/bench_pool.py --split val --n 20 [--spend 2,6,20,40] [--json] [--out build/pool/val]
    python scripts/bench_pool.py --device D.gguf --small M8.gguf --small-b 8 --top M70.gguf --top-b 70.6   # real models

Three real models on loopback, the stand-ins of docs/architecture.md ("Tiers"): the device
(SmolLM2-135M Q3_K_S), an "8B" cloud (SmolLM2-135M Q4_1, tokens) and a "70B" tier
(Gemma-3-270M base, text mode), each server on one thread. Every configuration runs the built-in
`cost` engine (shared/cost_engine.py) at the same spend targets (GPU-ms per answer position):

- `device+8B`: the pair device -> Q4_1 (its shipped router);
- `device+70B`: the pair device -> Gemma (its shipped router);
- `pool`: device -> Q4_1 -> Gemma, the engine reading an expected gain per tier, in one unit: for
  each tier the router whose labels Gemma judged (`tokenrouter-train label --judge`, `fit --label
  gain`; the pair's router where none ships, `tier_routers`). Each point's `gains` says which;

plus the anchors: the device alone and each cloud model alone (every position asked). No
lookahead and no check: the decision alone is compared.

The x axis is **measured** GPU-seconds per 1k answer tokens: each tier's reported work (passes and
tokens, protocol v2), priced by the GPU cost model at its stand-in size (shared/gpu_cost.py: an
8B on one H100, a 70B on four). Quality has no one true judge among these models, so two are
reported for every answer: the NLL per byte of the answer text under each cloud model (Q4_1, a chat
model; Gemma, a base model whose likelihood favours continued transcripts), with the person check
(models/train/person_check.py: answers that speak as the user, say the question back or continue
the transcript). `gap_recovered_<model>`: the share of the gap between the device alone and that
model alone that a point closes, by that model's judgement. A configuration's point is on the Pareto front when no other point is at most as
costly and better by both judges.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cloud_server.local import LocalCloudServer  # noqa: E402
from edge_client.cloud_link import CloudLink  # noqa: E402
from edge_client.generator import RoutedGenerator  # noqa: E402
from edge_client.options import GeneratorOptions  # noqa: E402
from edge_client.replay.sessions import clinc_sessions  # noqa: E402
from models.registry import model_info  # noqa: E402
from models.train.person_check import person_counts  # noqa: E402
from models.train.text_eval import TextSide  # noqa: E402
from shared.gpu_cost import GpuCostModel  # noqa: E402
from shared.llama_backend import LlamaModel  # noqa: E402
from shared.prompting import DEFAULT_SYSTEM_PROMPT  # noqa: E402


@dataclass(frozen=True)
class Pool:
    """The models of a run and the sizes the cost model prices the cloud tiers at (the defaults: the stand-ins)."""

    device: str = "smollm2-135m-q3_k_s"
    small: str = "smollm2-135m-q4_1"
    top: str = "gemma3-270m"
    small_b: float = 8.0
    top_b: float = 70.6

    def size(self, model: str) -> float:
        return self.small_b if model == self.small else self.top_b

    @property
    def judges(self) -> tuple[str, str]:
        return (self.small, self.top)


@dataclass
class Config:
    name: str
    cloud: str  # the tier-1 model
    tier: str | None = None  # the tier-2 model (a pool)
    policy: str = "router"
    spend: float | None = None  # the cost engine's target, GPU-ms per position
    rows: list[dict] = field(default_factory=list)
    gains: list[str] = field(default_factory=list)  # per cloud tier, what its expected gain reads (a pool)


def configs(pool: Pool, spends: list[float]) -> list[Config]:
    small, top = f"{pool.small_b:g}B", f"{pool.top_b:g}B"
    out = [Config("device", pool.small, policy="edge"), Config(f"{small}-only", pool.small, policy="cloud")]
    out.append(Config(f"{top}-only", pool.top, policy="cloud"))
    for r in spends:
        out += [
            Config(f"device+{small}@{r:g}", pool.small, spend=r),
            Config(f"device+{top}@{r:g}", pool.top, spend=r),
            Config(f"pool@{r:g}", pool.small, pool.top, spend=r),
        ]
    return out


def generator(
    pool: Pool, edge: LlamaModel, cfg: Config, servers: dict[str, LocalCloudServer], max_tokens: int
) -> RoutedGenerator:
    sizes = "/".join(f"{pool.size(m):g}" for m in (cfg.cloud, cfg.tier) if m)
    engine = f"cost:sizes={sizes},gpu_ms_per_token={cfg.spend:g}" if cfg.spend is not None else "router"
    opts = GeneratorOptions(
        edge_model=pool.device,
        cloud_model=cfg.cloud,  # names the pair's shipped router (`--router auto`)
        tiers=(f"local:{cfg.tier}",) if cfg.tier else (),  # names the tier's shipped router
        policy=cfg.policy,
        decision_engine=engine,
        lookahead=False,
        check="off",
        max_tokens=max_tokens,
        allow_base_model=True,  # the 70B stand-in is a base model: measured, not shown to a person
        cloud_timeout_s=30.0,
    )

    def link(model: str):
        return lambda: CloudLink(servers[model].url, servers[model].api_key, timeout_s=30.0)

    return RoutedGenerator(edge, opts, link(cfg.cloud), tier_connects=[link(cfg.tier)] if cfg.tier else [])


def gain_source(router: object) -> str:
    """What a tier's expected gain reads: the pair's score, or a router and whose labels it learned."""
    meta = getattr(router, "meta", None)
    if meta is None:
        return "the pair's score"
    return f"{meta.get('cloud_model')} judged by {meta.get('judge_model') or meta.get('cloud_model')}"


def run(pool: Pool, cfg: Config, gen: RoutedGenerator, question: str) -> dict:
    sessions = {cfg.cloud: gen.cloud} | ({cfg.tier: gen.tiers[0]} if cfg.tier else {})
    before = {m: s.traffic() for m, s in sessions.items()}
    answer = gen.generate([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}])
    gpu_s = 0.0
    for model, session in sessions.items():
        work = (session.traffic() - before[model]).work
        gpu_s += GpuCostModel.for_size(pool.size(model)).gpu_seconds(work.passes, work.tokens)
    return {
        "question": question,
        "text": answer.text,
        "n_tokens": answer.n_tokens,
        "tiers": answer.tiers,
        "gpu_s": gpu_s if cfg.policy != "edge" else 0.0,
        "degraded": answer.degraded,
    }


def judge(pool: Pool, rows_by_config: list[Config], questions: list[str]) -> None:
    """Each answer's NLL per byte under each cloud model, added to its row (`nll_<model>`, `bytes`)."""
    for model in pool.judges:
        m = LlamaModel(model_info(model))
        side = TextSide(m, 2048, 1, embeddings=False)
        try:
            prompts = {
                q: m.chat_tokens([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}])
                for q in questions
            }
            for cfg in rows_by_config:
                for row in cfg.rows:
                    side.start(prompts[row["question"]])
                    text = row["text"].encode()
                    row[f"nll_{model}"] = side.nll(text) if text else 0.0
                    row["bytes"] = len(text)
        finally:
            side.close()
            m.close()


def summarise(pool: Pool, cfgs: list[Config]) -> list[dict]:
    points = []
    for cfg in cfgs:
        rows = cfg.rows
        n_bytes = max(sum(r["bytes"] for r in rows), 1)
        n_tokens = max(sum(r["n_tokens"] for r in rows), 1)
        tiers = [t for r in rows for t in r["tiers"]]
        point = {
            "config": cfg.name,
            "spend_target_gpu_ms_per_token": cfg.spend,
            "gpu_s_per_1k_tokens": round(1000 * sum(r["gpu_s"] for r in rows) / n_tokens, 2),
            **{f"nll_per_byte_{m}": round(sum(r[f"nll_{m}"] for r in rows) / n_bytes, 4) for m in pool.judges},
            "gains": cfg.gains,
            "tier_shares": [round(tiers.count(t) / max(len(tiers), 1), 3) for t in range(3)],
            "degraded": sum(r["degraded"] for r in rows),
            **person_counts((r["question"], r["text"]) for r in rows),
        }
        points.append(point)
    judges = [f"nll_per_byte_{m}" for m in pool.judges]
    by_name = {p["config"]: p for p in points}
    for model, key in zip(pool.judges, judges):  # the share of the device -> judge-alone gap each point recovers
        device, alone = by_name["device"][key], by_name[f"{pool.size(model):g}B-only"][key]
        for p in points:
            p[f"gap_recovered_{model}"] = round((device - p[key]) / (device - alone), 3) if device != alone else None
    for p in points:  # dominated: another point no costlier and at least as good by both judges, better by one
        p["pareto"] = not any(
            q is not p
            and q["gpu_s_per_1k_tokens"] <= p["gpu_s_per_1k_tokens"]
            and all(q[j] <= p[j] for j in judges)
            and any(q[j] < p[j] for j in judges)
            for q in points
        )
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", default="val", help="CLINC150 split (tune on val; test once, at the end)")
    ap.add_argument("--n", type=int, default=20, help="questions")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--spend", default="1,3,6,12", help="the cost engine's targets, GPU-ms per position")
    ap.add_argument("--max-tokens", type=int, default=32)
    d = Pool()
    ap.add_argument("--device", default=d.device, help="the device's model (registered name or .gguf)")
    ap.add_argument("--small", default=d.small, help="the first cloud tier's model")
    ap.add_argument("--small-b", type=float, default=d.small_b, help="its size in the cost model (billions)")
    ap.add_argument("--top", default=d.top, help="the top tier's model")
    ap.add_argument("--top-b", type=float, default=d.top_b, help="its size in the cost model (billions)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write OUT.json (every answer included)")
    args = ap.parse_args()
    pool = Pool(args.device, args.small, args.top, args.small_b, args.top_b)
    t0 = time.perf_counter()
    questions = [s.turns[0].text for s in clinc_sessions(args.split, args.n, seed=args.seed)]
    cfgs = configs(pool, [float(x) for x in args.spend.split(",")])
    edge = LlamaModel(model_info(pool.device))
    threads = ["--threads", "1"]
    try:
        with (
            LocalCloudServer(model=pool.small, extra_args=threads) as small,
            LocalCloudServer(model=pool.top, extra_args=threads) as top,
        ):
            servers = {pool.small: small, pool.top: top}
            for cfg in cfgs:
                gen = generator(pool, edge, cfg, servers, args.max_tokens)
                cfg.gains = [gain_source(r) for r in gen.tier_routers[1:]]
                try:
                    cfg.rows = [run(pool, cfg, gen, q) for q in questions]
                finally:
                    gen.close()
                print(f"{cfg.name}: done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    finally:
        edge.close()
    judge(pool, cfgs, questions)
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
        "split": args.split,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "pool": asdict(pool),
        "points": summarise(pool, cfgs),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        full = report | {"answers": {c.name: c.rows for c in cfgs}}
        args.out.with_suffix(".json").write_text(json.dumps(full, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
        return
    cols = [
        "gpu_s_per_1k_tokens",
        *(f"gap_recovered_{m}" for m in pool.judges),
        "speaks_as_user",
        "says_question_back",
        "recites_instructions",
        "loops",
    ]
    print(f"{'config':18s}" + "".join(f"{c[:22]:>24s}" for c in cols) + "  pareto")
    for p in report["points"]:
        print(f"{p['config']:18s}" + "".join(f"{p[c]!s:>24s}" for c in cols) + ("  *" if p["pareto"] else ""))


if __name__ == "__main__":
    main()
