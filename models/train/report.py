"""The training report: JSON (everything) and Markdown (what a person reads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(report: dict[str, Any], stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(str(stem) + ".json").write_text(json.dumps(report, indent=1))
    Path(str(stem) + ".md").write_text(markdown(report))


def markdown(r: dict[str, Any]) -> str:
    m, d = r["metrics"], r["data"]
    lines = [
        f"# Router training report: {Path(r['router_file']).name}",
        "",
        f"- models: edge `{r['edge_model']}`, cloud `{r['cloud_model']}`",
        f"- data: {d['train_positions']} training positions ({d['train_prompts']} prompts, sources {', '.join(d['sources'])}), "
        f"{d['val_positions']} validation positions ({d['val_prompts']} prompts)",
        f"- label rates (train): mismatch {d['train_rates']['mismatch']:.1%}, divergent {d['train_rates']['divergent']:.1%}; "
        f"trained on `{m['label']}` ({d['train_rates']['target']:.1%} positive)",
        f"- best epoch {r['best_epoch']} of {r['epochs_run']}; fit took {r['fit_seconds']} s; file {r['size_bytes'] / 1e3:.0f} kB",
        "",
        "| validation AUC | learned | entropy heuristic |",
        "|---|---|---|",
        f"| divergent tokens | {m['auc_divergent']} | {m['entropy_auc_divergent']} |",
        f"| mismatching tokens | {m['auc_mismatch']} | {m['entropy_auc_mismatch']} |",
        "",
        "| target cloud fraction | threshold | recall of divergent | recall of mismatch | regret captured |",
        "|---|---|---|---|---|",
    ]
    for row in r["calibration"]:
        lines.append(
            f"| {row['cloud_fraction']:.0%} | {row['threshold']:.4f} | {row['recall_divergent']} | {row['recall_mismatch']} | {row['regret_captured']} |"
        )
    lines.append("")
    return "\n".join(lines)
