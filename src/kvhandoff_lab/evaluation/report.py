"""Rendering of result files: a Markdown table and a PNG bar chart of retention per task.

Both take one result file (one direction) or two (forward and reverse); the chart groups each task's bars by
direction, with the paired-bootstrap interval as error bars and a dashed line at retention 1.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvhandoff.errors import ConfigError
from kvhandoff.files import atomic_write_text
from kvhandoff_lab.figures import save_figure


def load_results(path: str | Path) -> dict:
    path = Path(path)
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read result file {path}: {exc}") from exc
    if not isinstance(result, dict) or "tasks" not in result or "direction" not in result:
        raise ConfigError(f"{path} is not a kvhandoff evaluation result file")
    return result


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def _fmt_ci(entry: dict | None, digits: int = 3) -> str:
    if not entry:
        return "–"
    lo, hi = entry.get("ci", [None, None])
    return f"{_fmt(entry.get('value'), digits)} [{_fmt(lo, digits)}, {_fmt(hi, digits)}]"


def direction_label(result: dict) -> str:
    d = result["direction"]
    return f"{d['source']} → {d['target']}"


def markdown_table(result: dict) -> str:
    """Markdown for one direction: a benchmark table, then perplexity and multi-turn sections if present."""
    lines = _benchmark_lines(result) + _perplexity_lines(result.get("perplexity")) + _coqa_lines(result.get("coqa"))
    return "\n".join(lines) + "\n"


def _benchmark_lines(result: dict) -> list[str]:
    d = result["direction"]
    boot = result.get("bootstrap", {})
    level = round(100 * boot.get("confidence", 0.95))
    lines = [
        f"### {direction_label(result)}",
        "",
        f"Source `{d['source']}` prefills, the mapper hands its cache to target `{d['target']}`. "
        f"Accuracy per condition; retention = transfer ÷ target; floor-normalised = (transfer − chance) ÷ "
        f"(target − chance); [{level}% paired bootstrap, {boot.get('n_resamples', '?')} resamples, "
        f"seed {result.get('seed')}].",
    ]
    if result.get("mapped") == "history":
        lines += ["", "Transfer maps the few-shot history only; the target prefills the new turn (the question) "
                      "itself on top of the mapped cache."]
    for task, reason in result.get("skipped", {}).items():
        lines += ["", f"Skipped {task}: {reason}."]
    if result["tasks"]:  # perplexity- or CoQA-only runs have no benchmark table
        lines += [
            "",
            "| Task | Metric | n | Chance | Source | Target | Transfer | Retention | Floor-normalised retention |",
            "|---|---|---:|---:|---:|---:|---:|---|---|",
        ]
    for task in result["tasks"].values():
        acc = task["accuracy"]
        lines.append(
            f"| {task['display']} | {task['primary_metric']} | {task['n']} | {_fmt(task['chance'])} "
            f"| {_fmt(acc.get('source', {}).get('value'))} | {_fmt(acc.get('target', {}).get('value'))} "
            f"| {_fmt(acc.get('transfer', {}).get('value'))} | {_fmt_ci(task.get('retention'))} "
            f"| {_fmt_ci(task.get('floor_normalised_retention'))} |"
        )
    for group, summary in result.get("summary", {}).items():
        if summary.get("tasks"):
            lines.append(
                f"| **mean ({group})** | | | | | | | {_fmt(summary['mean_retention'])} "
                f"| {_fmt(summary['mean_floor_normalised_retention'])} |"
            )
    return lines


def _perplexity_lines(ppl: dict | None) -> list[str]:
    if not ppl:
        return []
    conds = ppl["conditions"]
    return [
        "",
        f"Conditional perplexity ({ppl['prefix_len']}-token prefix in cache, next "
        f"{ppl['continuation_len']} tokens scored, {conds.get('target', {}).get('documents', '?')} documents): "
        + ", ".join(f"{name} {_fmt(c['perplexity'], 2)}" for name, c in conds.items())
        + (f"; transfer ÷ target = {_fmt(ppl.get('ratio'))}" if "ratio" in ppl else ""),
    ]


def _coqa_lines(coqa: dict | None) -> list[str]:
    if not coqa:
        return []
    lines = ["", f"CoQA model switching ({coqa['conversations']} conversations × {coqa['turns']} turns), "
                 "token F1 per turn against the serving model's standalone run (1 = no drift) and gold:", ""]
    turns = coqa["turns"]
    lines.append("| Run | " + " | ".join(f"t{t + 1}" for t in range(turns)) + " | mean |")
    lines.append("|---|" + "---:|" * (turns + 1))
    for run, entry in coqa["runs"].items():
        if "f1_vs_standalone_per_turn" in entry:
            cells = [_fmt(v, 2) for v in entry["f1_vs_standalone_per_turn"]]
            cells.append(_fmt(entry["f1_vs_standalone"], 2))
            lines.append(f"| {run} vs standalone | " + " | ".join(cells) + " |")
    for run, entry in coqa["runs"].items():
        cells = [_fmt(v, 2) for v in entry["f1_vs_gold_per_turn"]] + [_fmt(entry["f1_vs_gold"], 2)]
        lines.append(f"| {run} vs gold | " + " | ".join(cells) + " |")
    return lines


def markdown_report(results: Sequence[dict]) -> str:
    return "## KV-cache transfer evaluation\n\n" + "\n".join(markdown_table(r) for r in results)


def plot_retention(results: Sequence[dict], path: str | Path) -> Path:
    """Bar chart of retention per task (bars per direction, bootstrap interval as error bars)."""
    import matplotlib  # heavy, and only needed for the chart

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    def finite(t: dict) -> bool:
        value = (t.get("retention") or {}).get("value")
        return value is not None and math.isfinite(value)

    tasks: list[str] = []
    for r in results:
        for name, t in r["tasks"].items():
            if finite(t) and name not in tasks:
                tasks.append(name)
    displays = {name: t["display"] for r in results for name, t in r["tasks"].items()}
    width = 0.8 / max(1, len(results))
    top = 1.0
    fig_width = max(6.0, 1.1 * len(tasks) + 2)
    fig, ax = plt.subplots(figsize=(fig_width, 4.0), dpi=120)
    for j, r in enumerate(results):
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(tasks):
            ret = r["tasks"].get(name, {}).get("retention")
            if not ret or ret.get("value") is None or not math.isfinite(ret["value"]):
                continue
            v = ret["value"]
            ci = [c if c is not None and math.isfinite(c) else v for c in ret.get("ci", [v, v])]
            xs.append(i + (j - (len(results) - 1) / 2) * width)
            ys.append(v)
            lo.append(max(0.0, v - ci[0]))
            hi.append(max(0.0, ci[1] - v))
            top = max(top, ci[1], v)
        ax.bar(xs, ys, width=width, yerr=[lo, hi], capsize=3, label=direction_label(r))
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(tasks)))
    ax.set_xticklabels([displays[t] for t in tasks], rotation=20, ha="right")
    ax.set_ylabel("retention (transfer ÷ target)")
    ax.set_title("KV-cache transfer: accuracy retention per task")
    ax.set_ylim(0.0, top * 1.3)
    if results:
        ncol = len(results) if fig_width >= 8 else 1
        ax.legend(fontsize=8, loc="upper center", ncol=ncol, frameon=False)
    fig.tight_layout()
    save_figure(fig, path)
    return path


def render_results(
    result_files: Sequence[str | Path] | str | Path, out_dir: str | Path, stem: str = "summary"
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<stem>.md`` and ``<stem>.png`` from one or two result files; returns both paths."""
    files = [result_files] if isinstance(result_files, str | Path) else list(result_files)
    if not 1 <= len(files) <= 2:
        raise ConfigError(f"give one or two result files (forward, reverse), got {len(files)}")
    results = [load_results(f) for f in files]
    out_dir = Path(out_dir)
    md = out_dir / f"{stem}.md"
    atomic_write_text(md, markdown_report(results))
    png = plot_retention(results, out_dir / f"{stem}.png")
    return md, png
