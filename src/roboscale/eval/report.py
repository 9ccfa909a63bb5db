"""Evaluation reports: report.json (everything), report.md (the table), report.html (table, bars, videos)."""

from __future__ import annotations

import dataclasses
import html
import os
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.utils.io import atomic_write_bytes, atomic_write_json


def summarize(results: list, tasks: list[str]) -> dict[str, Any]:
    """Per-task and overall success rate and episode length (steps; successes end early)."""
    per_task = {}
    for task in tasks:
        rs = [r for r in results if r.task == task]
        wins = [r for r in rs if r.success]
        per_task[task] = {
            "episodes": len(rs),
            "success_rate": float(np.mean([r.success for r in rs])) if rs else 0.0,
            "mean_steps": float(np.mean([r.steps for r in rs])) if rs else 0.0,
            "mean_steps_success": float(np.mean([r.steps for r in wins])) if wins else None,
        }
    rates = [v["success_rate"] for v in per_task.values()]
    return {
        "per_task": per_task,
        "overall": {
            "episodes": len(results),
            "success_rate": float(np.mean(rates)) if rates else 0.0,
            "mean_steps": float(np.mean([r.steps for r in results])) if results else 0.0,
        },
    }


def success_table(columns: dict[str, dict[str, Any]], tasks: list[str]) -> str:
    """A Markdown table of success per task for one or more evaluations (e.g. untrained vs trained)."""
    names = list(columns)
    steps_header = "mean steps" if len(names) == 1 else f"mean steps ({names[-1]})"
    lines = ["| task | " + " | ".join(names) + f" | {steps_header} |"]
    lines.append("|---|" + "---:|" * (len(names) + 1))
    for task in tasks:
        cells = [f"{columns[n]['per_task'][task]['success_rate']:.0%}" for n in names]
        steps = columns[names[-1]]["per_task"][task]["mean_steps"]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {steps:.0f} |")
    cells = [f"**{columns[n]['overall']['success_rate']:.0%}**" for n in names]
    lines.append("| **mean** | " + " | ".join(cells) + f" | {columns[names[-1]]['overall']['mean_steps']:.0f} |")
    return "\n".join(lines)


def write_report(out_dir: Path, results: list, tasks: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, tasks)
    report = {**meta, **summary, "episodes": [dataclasses.asdict(r) for r in results]}
    atomic_write_json(out_dir / "report.json", report, indent=2)
    md = [
        f"# Evaluation of `{meta.get('checkpoint', '')}`",
        "",
        f"{summary['overall']['episodes']} episodes, seed {meta.get('seed')}, at most {meta.get('max_steps')} steps each; "
        "success at any step ends the episode.",
        "",
        success_table({"success": summary}, tasks),
        "",
    ]
    videos = [r for r in results if r.video]
    if videos:
        md += ["## Videos", ""] + [f"- [{Path(r.video).name}]({os.path.relpath(r.video, out_dir)})" for r in videos]
    atomic_write_bytes(out_dir / "report.md", ("\n".join(md) + "\n").encode())
    atomic_write_bytes(out_dir / "report.html", _html(summary, tasks, videos, meta, out_dir).encode())
    return summary


def _html(summary: dict, tasks: list[str], videos: list, meta: dict, out_dir: Path) -> str:
    rows = []
    for task in tasks:
        s = summary["per_task"][task]
        pct = 100 * s["success_rate"]
        rows.append(
            f"<tr><td>{html.escape(task)}</td><td>{pct:.0f}%</td>"
            f"<td><div class='bar' style='width:{pct:.0f}%'></div></td><td>{s['mean_steps']:.0f}</td></tr>"
        )
    vids = "".join(
        f"<figure><video src='{html.escape(os.path.relpath(r.video, out_dir))}' controls loop muted width='256'></video>"
        f"<figcaption>{html.escape(r.task)} #{r.episode}: {'success' if r.success else 'failure'} in {r.steps} steps"
        "</figcaption></figure>"
        for r in videos
    )
    overall = 100 * summary["overall"]["success_rate"]
    return f"""<!doctype html><meta charset="utf-8"><title>roboscale evaluation</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td{{padding:.2em .8em}}
.bar{{background:#3a7;height:1em;min-width:1px}}td:nth-child(3){{width:20em}}figure{{display:inline-block}}</style>
<h1>Evaluation: {overall:.0f}% mean success</h1>
<p>Checkpoint <code>{html.escape(str(meta.get('checkpoint', '')))}</code>, seed {meta.get('seed')},
{summary['overall']['episodes']} episodes, at most {meta.get('max_steps')} steps.</p>
<table><tr><th>task</th><th>success</th><th></th><th>mean steps</th></tr>{''.join(rows)}</table>
<h2>Rollouts</h2>{vids}
"""
