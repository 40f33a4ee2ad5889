"""`tokenrouter-train`: label | fit | eval | recheck | reproduce | drop-rows.

tokenrouter-train label --split train:240 --split oos_train:40 --out labels/train
tokenrouter-train fit --train labels/train --val labels/val --out router.npz
tokenrouter-train eval --split val --limit 40 --json
tokenrouter-train eval --limit 8 --fraction 0.3 --lookahead learned --verify learned \
    --verify-from after-first-clause --cloud-engine http://127.0.0.1:8000/v1   # + the remote engine's decisions
tokenrouter-train reproduce      # label + fit the shipped router for the default pair
tokenrouter-train drop-rows records/ --key sha256:...   # the flywheel's rows of one key (or --session ID)
tokenrouter-train label --edge-model smollm2-135m-q3_k_s --cloud-model gemma3-270m ...  # a mixed pair:
    labels in the cloud's NLL of the text (text_label.py); fit as usual; eval runs the text-mode curve
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from models.registry import (
    DEFAULT_CLOUD_MODEL,
    DEFAULT_EDGE_MODEL,
    ROUTERS_DIR,
    ModelNotFoundError,
    cache_dir,
    model_info,
)
from models.train.answer_set import SPLITS, add_right_answers, load_questions
from models.train.evaluate import EvalOptions, evaluate, plot, write_json
from models.train.features import LABELS
from models.train.fit import FitOptions, fit
from models.train.label import LabelOptions, label
from models.train.prompts import clinc_prompts, file_prompts, parse_split_spec
from models.train.recheck import rerecord
from models.train.report import write_report
from models.train.shards import drop_rows
from models.train.text_eval import TextEvalOptions, evaluate_text
from shared.decision import TIE_NATS
from shared.decision_engine import BUILTIN_ENGINE

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROUTER = ROUTERS_DIR / f"{DEFAULT_EDGE_MODEL}__{DEFAULT_CLOUD_MODEL}.npz"
BUILD_DIR = REPO_ROOT / "build" / "train"
"""Where the tools write unless told otherwise (ignored by git): a fit never overwrites a shipped
router by default; ship one with `--out models/routers/EDGE__CLOUD.npz`."""


def pair_router(edge_model: str, cloud_model: str) -> Path:
    """Where the router shipped for a (device, cloud) pair lives (what `--router auto` loads)."""
    return ROUTERS_DIR / f"{edge_model}__{cloud_model}.npz"


# what `reproduce` labels: CLINC150 train + oos_train for fitting (two disjoint strides of train),
# val (offset 1) for early stopping: (shard subdirectory, split specs, stride offset)
SHIP_GROUPS = (
    ("val", ("val:64",), 1),
    ("train", ("train:160", "oos_train:32"), 0),
    ("train-extra", ("train:480",), 7),
)
# then DAgger-style rounds: each labels new train prompts along the paths the previous round's
# router routes (`label --routed-by`), and the next router is fitted on everything so far
SHIP_ROUTED_ROUNDS = (("train-routed", ("train:640",), 3),)


def _prompts(args: argparse.Namespace) -> tuple[list[str], str]:
    if args.prompts:
        return file_prompts(args.prompts)[: args.limit] if args.limit else file_prompts(args.prompts), str(args.prompts)
    out: list[str] = []
    for spec in args.split:
        name, n = parse_split_spec(spec)
        out += clinc_prompts(name, n if n is not None else args.limit, offset=args.offset)
    return out, ",".join(args.split)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tokenrouter-train", description="train and evaluate TokenRouter's learned router"
    )
    ap.add_argument("--log-level", default="warning")
    sub = ap.add_subparsers(dest="command", required=True)
    _add_label_parser(sub)
    _add_fit_parser(sub)
    _add_eval_parser(sub)
    _add_recheck_parser(sub)
    _add_reproduce_parser(sub)
    _add_drop_rows_parser(sub)
    return ap


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The model pair and how long each answer runs: what `label` and `eval` decode with."""
    p.add_argument("--edge-model", default=DEFAULT_EDGE_MODEL)
    p.add_argument("--cloud-model", default=DEFAULT_CLOUD_MODEL)
    p.add_argument("--max-tokens", type=int, default=48, help="answer tokens per prompt")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1 is fastest on a busy 2-core machine)")


def _add_prompt_source(p: argparse.ArgumentParser, default_split: str) -> None:
    """Which prompts `label` and `eval` read: CLINC150 splits or a file (`_prompts` reads them)."""
    p.add_argument(
        "--split", action="append", help=f"CLINC150 split, NAME or NAME:COUNT, repeatable (default {default_split})"
    )
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line (instead of CLINC150)")
    p.add_argument("--limit", type=int, default=None, help="prompts per split (even stride through it)")
    p.add_argument("--offset", type=int, default=0, help="shift the stride (keeps two selections of one split apart)")


def _add_label_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("label", help="run both models over prompts and write labelled shards")
    _add_model_options(p)
    _add_prompt_source(p, "train")
    p.add_argument("--out", required=True, type=Path, help="shard directory (existing shards are kept: resumable)")
    p.add_argument("--prompts-per-shard", type=int, default=16)
    p.add_argument("--window", type=int, default=8, help="cloud rollout tokens per mismatch (divergence label)")
    p.add_argument(
        "--routed-by",
        type=Path,
        default=None,
        metavar="ROUTER",
        help="label the paths this router file routes (at 10-50%% cloud) instead of the cloud's path (DAgger-style)",
    )
    p.add_argument(
        "--judge",
        default=None,
        metavar="MODEL",
        help="a pool's top model: label this tier in its unit, on its path (its NLL of the text; text_label.py)",
    )


def _add_fit_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="train the router MLP and export a numpy router file")
    p.add_argument("--train", nargs="+", required=True, help="shard files or directories (labelled or live)")
    p.add_argument(
        "--val", nargs="*", default=[], help="validation shards (default: hold out 15%% of training prompts)"
    )
    p.add_argument("--out", type=Path, default=BUILD_DIR / "router.npz", help="default: build/train/router.npz")
    p.add_argument(
        "--label",
        default="regret",
        choices=LABELS,
        help="training target (default regret: best on the cloud-NLL measure, see docs/router.md; gain: a pool's"
        " signed gain, models/train/features.py)",
    )
    p.add_argument(
        "--regret-nats",
        type=float,
        default=1.0,
        help="regret: the threshold; soft-regret: the scale of 1 - exp(-regret / N); gain: of sigmoid(regret / N)",
    )
    p.add_argument(
        "--early-stop",
        default="auc",
        choices=("auc", "regret"),
        help="validation criterion: AUC of the label, or the share of regret captured at 10-50%% cloud",
    )
    p.add_argument("--hidden-units", type=int, default=32)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--dropout", type=float, default=0.3, help="input dropout")
    p.add_argument("--weight-decay", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=Path, default=None, help="training report path stem (default: next to --out)")


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="quality vs cloud fraction by real routed decoding")
    _add_model_options(p)
    _add_prompt_source(p, "val")
    p.add_argument(
        "--router",
        type=Path,
        default=None,
        help="the learned router (default: the shipped one for the pair, models/routers/EDGE__CLOUD.npz)",
    )
    p.add_argument(
        "--out", type=Path, default=BUILD_DIR / "eval", help="writes OUT.json and OUT.png (default: build/train/eval)"
    )
    p.add_argument("--json", action="store_true", help="print the result object on stdout")
    p.add_argument(
        "--question-set",
        choices=SPLITS,
        default=None,
        help="ask the questions of models/train/answers (this split) and count right answers per point "
        "(a word of every needed group, no first-glance failure): the measure a reader signs, beside the likelihood",
    )
    p.add_argument(
        "--answers", action="store_true", help="also list every answer (text, tokens, decisions) in OUT.json"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=2, help="prompts decoded together (29 configurations each)")
    p.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        metavar="ROUTER",
        help="another learned router file to evaluate side by side in the same run (repeatable)",
    )
    _add_eval_rule_options(p)
    p.add_argument(
        "--fraction",
        type=float,
        action="append",
        default=[],
        metavar="F",
        help="evaluate only these target cloud fractions (repeatable; default 0.1 ... 0.9)",
    )
    _add_eval_engine_options(p)


def _add_eval_rule_options(p: argparse.ArgumentParser) -> None:
    """The generator's rule on top of a method: the cloud's lookahead guess and its check (shared/decision.py)."""
    p.add_argument(
        "--lookahead",
        action="append",
        default=[],
        choices=["learned", "entropy", "random"],
        help="also run METHOD with the cloud's next-token guess after each routed token, as METHOD+lookahead@NATS (repeatable; docs/router.md)",
    )
    p.add_argument(
        "--lookahead-nats",
        type=float,
        action="append",
        default=[],
        metavar="NATS",
        help="take a guess only where the device's token is NATS less likely to the cloud (repeatable; default 1)",
    )
    p.add_argument(
        "--verify",
        action="append",
        default=[],
        choices=["learned", "entropy", "random"],
        help="also run METHOD with the cloud checking every device token, as METHOD+verify@NATS (repeatable; docs/router.md)",
    )
    p.add_argument(
        "--verify-nats",
        type=float,
        action="append",
        default=[],
        metavar="NATS",
        help="the check rejects a device token NATS less likely to the cloud than its own choice (repeatable; default 1)",
    )
    p.add_argument(
        "--tie-nats",
        type=float,
        default=TIE_NATS,
        metavar="NATS",
        help=f"a device token within NATS of the cloud's best counts as the cloud's choice (default {TIE_NATS}; "
        "shared/decision.py; 0 reproduces evaluations made before the tie rule)",
    )
    p.add_argument(
        "--verify-from",
        action="append",
        default=[],
        choices=["all", "after-first-clause"],
        help="where the check starts: the whole answer (METHOD+verify@NATS, the default) or after the first clause, which "
        "is written with lookahead (METHOD+verify@NATS:after-first-clause; the generator's --check after-first-clause); repeatable",
    )


def _add_eval_engine_options(p: argparse.ArgumentParser) -> None:
    """Who takes the decisions in `eval`: a decision engine for the router's positions, a remote cloud engine."""
    p.add_argument(
        "--decision-engine",
        default=BUILTIN_ENGINE,
        metavar="NAME[:KEY=VALUE,...]",
        help="who decides the router's positions in every routed method, as on the device: the built-in 'router' "
        "or an installed engine (docs/architecture.md, 'The token hook')",
    )
    p.add_argument(
        "--cloud-engine",
        metavar="URL",
        help="an OpenAI-compatible completions server of the cloud model (e.g. http://127.0.0.1:8000/v1): every "
        "lookahead and check method also runs as METHOD@remote with that engine's decisions (docs/server.md)",
    )
    p.add_argument(
        "--cloud-engine-format",
        choices=("ids", "text"),
        default="ids",
        help="prompt format of --cloud-engine: ids (vLLM, SGLang) or text (llama-cpp-python's server)",
    )


def _add_recheck_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "recheck", help="re-record a router file's check block on this machine (weights unchanged; tests/test_train.py)"
    )
    p.add_argument("router", type=Path, nargs="?", default=DEFAULT_ROUTER, help="default: the shipped router")
    p.add_argument("--out", type=Path, default=BUILD_DIR / "recheck" / DEFAULT_ROUTER.name)
    p.add_argument("--edge-model", default=DEFAULT_EDGE_MODEL)
    p.add_argument("--cloud-model", default=DEFAULT_CLOUD_MODEL)


def _add_reproduce_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="label CLINC150 and fit the shipped router for the default pair")
    p.add_argument("--work", type=Path, default=None, help="shard directory (default: the model cache)")
    p.add_argument(
        "--out",
        type=Path,
        default=BUILD_DIR / DEFAULT_ROUTER.name,
        help=f"default: build/train/{DEFAULT_ROUTER.name} (the shipped one is {DEFAULT_ROUTER.relative_to(REPO_ROOT)})",
    )
    p.add_argument("--threads", type=int, default=1)


def _add_drop_rows_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drop-rows", help="remove one key's (or one session's) rows from the flywheel's shards, in place"
    )
    p.add_argument("shards", nargs="+", help="shard files or directories (the server's --record-dir)")
    p.add_argument(
        "--key", help="the API key, or its digest as `tokenrouter-cloud hash-key` and the audit log print it"
    )
    p.add_argument("--session", help="a session id (the audit log's session_id)")


def cmd_drop_rows(args: argparse.Namespace) -> None:
    dropped, changed = drop_rows(args.shards, key=args.key, session=args.session)
    print(f"dropped {dropped} rows from {changed} shards")


def cmd_label(args: argparse.Namespace) -> None:
    if not args.split and not args.prompts:
        args.split = ["train"]
    prompts, source = _prompts(args)
    t0 = time.perf_counter()
    opts = LabelOptions(
        args.edge_model,
        args.cloud_model,
        args.out,
        max_tokens=args.max_tokens,
        prompts_per_shard=args.prompts_per_shard,
        window=args.window,
        threads=args.threads,
        route_with=args.routed_by,
        judge=args.judge,
    )
    paths = label(prompts, opts)
    print(
        f"labelled {len(prompts)} prompts from {source} into {len(paths)} shards in {args.out} ({time.perf_counter() - t0:.0f}s)",
        file=sys.stderr,
    )


def cmd_fit(args: argparse.Namespace) -> dict:
    opts = FitOptions(
        train=args.train,
        val=args.val,
        out=args.out,
        label=args.label,
        regret_nats=args.regret_nats,
        hidden_units=args.hidden_units,
        epochs=args.epochs,
        seed=args.seed,
        dropout=args.dropout,
        weight_decay=args.weight_decay,
        early_stop=args.early_stop,
    )
    report = fit(opts)
    stem = args.report or args.out.with_suffix("")
    write_report(report, Path(str(stem) + ".report"))
    m = report["metrics"]
    print(
        f"wrote {args.out} ({report['size_bytes'] / 1e3:.0f} kB): val AUC {m['auc']} ({m['label']}), divergent {m['auc_divergent']} vs entropy {m['entropy_auc_divergent']}",
        file=sys.stderr,
    )
    return report


def cmd_eval(args: argparse.Namespace) -> None:
    questions = load_questions(args.question_set)[: args.limit] if args.question_set else []
    if questions and (args.split or args.prompts):
        raise SystemExit("tokenrouter-train eval: --question-set replaces --split and --prompts; give one of them")
    if not args.split and not args.prompts:
        args.split = ["val"]
    prompts, source = (
        ([q.question for q in questions], f"question-set:{args.question_set}") if questions else _prompts(args)
    )
    if model_info(args.edge_model).tokenizer_fingerprint != model_info(args.cloud_model).tokenizer_fingerprint:
        if args.router is None:
            shipped = pair_router(args.edge_model, args.cloud_model)
            args.router = shipped if shipped.is_file() else None
        return cmd_eval_text(args, prompts, source)
    if args.router is None:
        args.router = DEFAULT_ROUTER
    opts = EvalOptions(
        args.router,
        args.edge_model,
        args.cloud_model,
        max_tokens=args.max_tokens,
        threads=args.threads,
        seed=args.seed,
        prompts_per_batch=args.batch,
        also=tuple(args.also),
        lookahead=tuple(args.lookahead),
        lookahead_nats=tuple(args.lookahead_nats or [1.0]),
        verify=tuple(args.verify),
        verify_nats=tuple(args.verify_nats or [1.0]),
        verify_from=tuple(args.verify_from or ["all"]),
        tie_nats=args.tie_nats,
        cloud_engine=args.cloud_engine,
        cloud_engine_format=args.cloud_engine_format,
        decision_engine=args.decision_engine,
        keep_answers=args.answers or bool(questions),
        **({"fractions": tuple(args.fraction)} if args.fraction else {}),
    )
    bar = None
    if not args.json:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), unit="prompt", desc="eval")
        except ImportError:
            pass
    result = evaluate(prompts, opts, on_progress=bar.update if bar is not None else None)
    if bar is not None:
        bar.close()
    result["split"] = source
    if questions:
        add_right_answers(result, questions)
    write_json(result, args.out.with_suffix(".json"))
    plot(result, args.out.with_suffix(".png"))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        gap = result["gap_recovered_at_30"]
        ci = result["gap_recovered_at_30_ci95"]
        print(
            f"{len(prompts)} prompts ({source}) in {result['seconds']}s; gap recovered at 30% cloud tokens (95% interval over prompts): "
            + ", ".join(
                f"{k} {v:.0%} ({ci[k][0]:.0%}..{ci[k][1]:.0%})" if not math.isnan(v) else f"{k} n/a"
                for k, v in gap.items()
            )
        )
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")


def cmd_eval_text(args: argparse.Namespace, prompts: list[str], source: str) -> None:
    """A mixed pair (different tokenizers): the text-mode curve (models/train/text_eval.py) with the
    pair's learned router (trained on text labels), entropy and random, and `--lookahead` methods
    with the cloud's text guess (the first `--lookahead-nats`); the check and --also are not run
    in text mode's eval."""
    opts = TextEvalOptions(
        args.edge_model,
        args.cloud_model,
        max_tokens=args.max_tokens,
        threads=args.threads,
        seed=args.seed,
        router=args.router,
        lookahead=tuple(args.lookahead),
        lookahead_nats=(args.lookahead_nats or [1.0])[0],
        decision_engine=args.decision_engine,
        keep_answers=args.answers,
        **({"fractions": tuple(args.fraction)} if args.fraction else {}),
    )
    result = evaluate_text(prompts, opts)
    result["split"] = source
    write_json(result, args.out.with_suffix(".json"))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    e0, c1 = result["points"]["edge-only"][0], result["points"]["cloud-only"][0]
    print(
        f"{len(prompts)} prompts ({source}) in {result['seconds']}s, text mode ({result['edge_model']} -> "
        f"{result['cloud_model']}): cloud NLL per byte edge-only {e0['nll_per_byte']}, cloud-only "
        f"{c1['nll_per_byte']}; gap recovered at 30% cloud bytes (95% interval over prompts): "
        + ", ".join(
            f"{k} {v:.0%} ({ci[0]:.0%}..{ci[1]:.0%})"
            for (k, v), ci in zip(
                result["gap_recovered_at_30_bytes"].items(), result["gap_recovered_at_30_bytes_ci95"].values()
            )
        )
    )
    print(f"wrote {args.out.with_suffix('.json')}")


def cmd_recheck(args: argparse.Namespace) -> None:
    block = rerecord(args.router, args.out, args.edge_model, args.cloud_model)
    for c in block["prompts"]:
        print(
            f"{c['prompt']!r}: {c['n_positions']} positions, {c['n_mismatch']} mismatches, mean score {c['mean_score']}"
        )
    print(f"wrote {args.out}")


def cmd_reproduce(args: argparse.Namespace) -> None:
    work = args.work or cache_dir() / "labels" / f"{DEFAULT_EDGE_MODEL}__{DEFAULT_CLOUD_MODEL}"
    t0 = time.perf_counter()

    def label_group(sub: str, specs: tuple[str, ...], offset: int, routed_by: Path | None = None) -> None:
        prompts = [q for spec in specs for q in clinc_prompts(*parse_split_spec(spec), offset=offset)]
        label(
            prompts,
            LabelOptions(
                DEFAULT_EDGE_MODEL,
                DEFAULT_CLOUD_MODEL,
                work / sub,
                prompts_per_shard=16,
                threads=args.threads,
                route_with=routed_by,
            ),
        )

    def fit_on(subs: list[str], out: Path) -> None:
        cmd_fit(
            build_parser().parse_args(
                ["fit", "--train", *(str(work / s) for s in subs), "--val", str(work / "val"), "--out", str(out)]
            )
        )

    for sub, specs, offset in SHIP_GROUPS:
        label_group(sub, specs, offset)
    subs = [sub for sub, _, _ in SHIP_GROUPS if sub != "val"]
    rounds = [
        (work / f"router-round{i}.npz", group) for i, group in enumerate(SHIP_ROUTED_ROUNDS)
    ]  # intermediate routers
    router = rounds[0][0] if rounds else args.out
    fit_on(subs, router)
    for i, (router, (sub, specs, offset)) in enumerate(rounds):
        label_group(sub, specs, offset, routed_by=router)
        subs.append(sub)
        fit_on(subs, rounds[i + 1][0] if i + 1 < len(rounds) else args.out)
    print(
        f"reproduced {args.out} in {time.perf_counter() - t0:.0f}s (intermediate routers: {', '.join(str(r) for r, _ in rounds) or 'none'})",
        file=sys.stderr,
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        commands = {
            "label": cmd_label,
            "fit": cmd_fit,
            "eval": cmd_eval,
            "recheck": cmd_recheck,
            "reproduce": cmd_reproduce,
            "drop-rows": cmd_drop_rows,
        }
        commands[args.command](args)
    except (ValueError, FileNotFoundError, ModelNotFoundError) as exc:
        sys.exit(f"tokenrouter-train {args.command}: {exc}")


if __name__ == "__main__":
    main()
