"""``roboscale report RUN_DIR``: one self-contained HTML page for a training run.

Training curves from ``metrics.jsonl``, success vs step (with Wilson intervals) from ``evals.jsonl``, and the best
checkpoint's per-task table and videos from its evaluation report. Also where a run's files are read for
``roboscale eval compare`` (``read_evals``, ``best_evaluation``).
"""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

from roboscale.errors import ConfigError, DatasetError, one_line
from roboscale.eval.plots import LineSeries, line_chart
from roboscale.eval.records import json_lines, problem
from roboscale.eval.report import (
    html_table,
    load_report,
    page,
    per_task_html,
    protocol_html,
    protocol_of,
    success_bars,
    videos_html,
)
from roboscale.utils.io import atomic_write_bytes, read_json_lines

METRICS = "metrics.jsonl"
EVALS = "evals.jsonl"
# An evals.jsonl line as the trainer writes it (train.evaluation): (required, optional) fields; a failed
# evaluation has ``error`` instead of the numbers.
EVAL_FIELDS = ({"step": (int,)},
               {"success_rate": (float,), "error": (str,), "ci_low": (float, None), "ci_high": (float, None),
                "episodes": (int,), "per_task": (dict,), "report_dir": (str,), "checkpoint": (str,),
                "wall_s": (float,)})
TASK_RATE_FIELDS = ({"success_rate": (float,)}, {"ci_low": (float, None), "ci_high": (float, None)})
FIX_LINE = "fix or delete that line"
# (metrics.jsonl key, y label, chart title, y values are fractions shown in %)
CURVES = (
    ("loss", "loss", "Training loss", False),
    ("lr", "learning rate", "Learning rate", False),
    ("samples_per_s", "samples / s", "Throughput (samples)", False),
    ("tokens_per_s", "tokens / s", "Throughput (tokens)", False),
    ("mfu", "MFU", "Model FLOPs utilization", True),
    ("data_wait", "share of wall time", "Time waiting for data", True),
)
CURVE_KEYS = {key for key, *_ in CURVES}


def eval_records(run_dir: Path) -> list[dict[str, Any]]:
    """evals.jsonl's lines (a torn last one skipped: it is being written, or a kill cut it); a line the trainer
    did not write (not JSON, fields missing or of the wrong type) is a one-line error naming it."""
    path = Path(run_dir) / EVALS
    records = []
    for number, record in json_lines(path, FIX_LINE):
        wrong = problem(record, *EVAL_FIELDS) or _per_task_problem(record)
        if not wrong and "success_rate" not in record and "error" not in record:
            wrong = "neither 'success_rate' nor 'error'"
        if wrong:
            raise DatasetError(path, f"line {number}: {wrong}; {FIX_LINE}")
        records.append(record)
    return records


def _per_task_problem(record: dict[str, Any]) -> str | None:
    return next((wrong for task, entry in record.get("per_task", {}).items()
                 if (wrong := problem(entry, *TASK_RATE_FIELDS, prefix=f"per_task.{task}."))), None)


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The run's finished evaluations in step order; a step evaluated twice (a resumed run) keeps its last line."""
    by_step = {r["step"]: r for r in eval_records(run_dir) if "success_rate" in r}
    return [by_step[s] for s in sorted(by_step)]


def failed_evals(run_dir: Path) -> list[dict[str, Any]]:
    """Evaluations that failed (a line with ``error``) and were not later redone successfully, in step order."""
    records = eval_records(run_dir)
    done = {r["step"] for r in records if "success_rate" in r}
    failed = {r["step"]: r for r in records if r.get("error") and r["step"] not in done}
    return [failed[s] for s in sorted(failed)]


def best_step(run_dir: Path) -> int | None:
    """The step ``checkpoints/best`` points to (a symlink to the directory ``<step:06d>``); None without one."""
    best = Path(run_dir) / "checkpoints" / "best"
    if not best.is_symlink():
        return None
    name = Path(os.readlink(best)).name
    return int(name) if name.isdigit() else None


def best_evaluation(run_dir: Path, evals: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    """The evaluation of the best checkpoint and how it was chosen: the step ``checkpoints/best`` points to, or,
    without that pointer, the highest success (the earliest step among ties)."""
    step = best_step(run_dir)
    if step is not None:
        match = next((e for e in evals if e["step"] == step), None)
        return match, f"checkpoints/best (step {step})"
    if not evals:
        return None, "no evaluations"
    return max(evals, key=lambda e: (e["success_rate"], -e["step"])), "highest success in evals.jsonl"


def is_training_run(path: Path) -> bool:
    return (path / METRICS).is_file() or (path / "checkpoints").is_dir()


def write_run_report(run_dir: Path, output: Path | None = None) -> Path:
    """Write the run's page (default ``RUN_DIR/report.html``) atomically; returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory")
    if not is_training_run(run_dir):
        raise ConfigError(f"{run_dir}: not a training run (no {METRICS} and no checkpoints/)")
    output = Path(output) if output else run_dir / "report.html"
    atomic_write_bytes(output, run_report_html(run_dir, output.parent).encode())
    return output


def run_report_html(run_dir: Path, page_dir: Path) -> str:
    metrics, bad_metrics = read_json_lines(run_dir / METRICS)
    evals = read_evals(run_dir)
    best, how = best_evaluation(run_dir, evals)
    body = [f"<h1>Training run: {escape(run_dir.resolve().name)}</h1>", f"<p><code>{escape(str(run_dir))}</code></p>"]
    body += ["<h2>Training</h2>", *_curves(metrics, bad_metrics)]
    body += ["<h2>Success vs step</h2>", *_success_section(evals, best, run_dir, page_dir)]
    failed = failed_evals(run_dir)
    if failed:
        rows = [[str(r["step"]), escape(str(r["error"]))] for r in failed]
        body += ["<h3>Failed evaluations</h3>", html_table(["step", "error"], rows, numeric={0})]
    body += ["<h2>Best checkpoint</h2>", *_best_section(best, how, run_dir, page_dir)]
    return page(f"Training run {run_dir.resolve().name}", "\n".join(body))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _curves(metrics: list[dict[str, Any]], bad: int) -> list[str]:
    # training lines only: evaluation lines ({"step", "eval/success", ...}) share the file
    rows = [m for m in metrics if _number(m.get("step")) and CURVE_KEYS & m.keys()]
    if not rows:
        return ["<p class='note'>No training metrics yet (metrics.jsonl is missing or has no logged steps).</p>"]
    out = []
    if bad:
        out.append(f"<p class='note'>{bad} unreadable line{'s' if bad != 1 else ''} of metrics.jsonl skipped.</p>")
    last = max(rows, key=lambda m: m["step"])
    out.append(f"<p>{len(rows)} logged steps, last step {last['step']}"
               + (f", loss {last['loss']:.4g}" if _number(last.get("loss")) else "") + ".</p>")
    plots = []
    for key, y_label, title, percent in CURVES:
        points = sorted((m["step"], m[key]) for m in rows if _number(m.get(key)))
        if not points:
            continue  # a metric this run does not log (tokens_per_s before telemetry had it, mfu without a peak)
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        loss = key == "loss"
        plots.append(line_chart([LineSeries(key, xs, ys, markers=len(points) < 30)], title, "step", y_label,
                                log_y=None if loss else False, percent=percent, from_zero=not loss))
    out.append("<div class='plots'>" + "\n".join(plots) + "</div>")
    return out


def _success_section(evals: list[dict[str, Any]], best: dict[str, Any] | None, run_dir: Path,
                     page_dir: Path) -> list[str]:
    if not evals:
        return ["<p class='note'>No evaluations yet (evals.jsonl is missing or empty): train with "
                "<code>--eval.every=K</code>, or wait for the first evaluation to finish.</p>"]
    steps = [e["step"] for e in evals]
    mean = LineSeries("mean success", steps, [e["success_rate"] for e in evals],
                      [e.get("ci_low", e["success_rate"]) for e in evals],
                      [e.get("ci_high", e["success_rate"]) for e in evals], markers=True)
    highlight = (best["step"], best["success_rate"], f"best: step {best['step']}") if best else None
    out = [line_chart([mean], "Mean success vs step (whiskers: Wilson 95% interval)", "step", "success",
                      y_range=(0.0, 1.0), log_y=False, highlight=highlight, percent=True)]
    tasks = list(dict.fromkeys(t for e in evals for t in (e.get("per_task") or {})))
    if len(tasks) > 1:
        per_task = []
        for task in tasks:
            points = [(e["step"], e["per_task"][task]["success_rate"]) for e in evals if task in (e.get("per_task")
                                                                                              or {})]
            per_task.append(LineSeries(task, [p[0] for p in points], [p[1] for p in points], markers=True))
        out.append(line_chart(per_task, "Success per task vs step", "step", "success", y_range=(0.0, 1.0),
                              log_y=False, percent=True))
    rows = []
    for e in evals:
        mark = " ★ best" if best is not None and e["step"] == best["step"] else ""
        ci = f"{e['ci_low']:.0%}–{e['ci_high']:.0%}" if _number(e.get("ci_low")) else "—"
        report = run_dir / str(e.get("report_dir", "")) / "report.html"
        link = (f"<a href='{escape(quote(os.path.relpath(report, page_dir)))}'>report</a>"
                if e.get("report_dir") and report.is_file() else "")
        wall = f"{e['wall_s']:.0f} s" if _number(e.get("wall_s")) else ""
        rows.append([f"{e['step']}{mark}", f"{e['success_rate']:.0%}", ci, str(e.get("episodes", "")), wall, link])
    out.append(html_table(["step", "success", "95% interval", "episodes", "wall time", ""], rows,
                          numeric={1, 2, 3, 4}))
    return out


def _best_section(best: dict[str, Any] | None, how: str, run_dir: Path, page_dir: Path) -> list[str]:
    if best is None:
        why = "no evaluations yet" if how == "no evaluations" else f"{how} has no line in evals.jsonl"
        return [f"<p class='note'>No best checkpoint to show: {escape(why)}.</p>"]
    report_dir = run_dir / str(best.get("report_dir", ""))
    try:
        report = load_report(report_dir / "report.json")
    except DatasetError as exc:  # the rest of the page still holds: say what is wrong here
        return [f"<p class='note'>Step {best['step']} (chosen by {escape(how)}): its report cannot be read: "
                f"{escape(one_line(exc))}.</p>"]
    tasks = list(report.get("per_task", {}))
    out = [f"<p>Step <b>{best['step']}</b>, chosen by {escape(how)}: <b>{best['success_rate']:.0%}</b> mean success"
           + (f" (Wilson 95% interval {best['ci_low']:.0%}–{best['ci_high']:.0%})" if _number(best.get("ci_low"))
              else "") + (f"; checkpoint <code>{escape(str(best['checkpoint']))}</code>" if best.get("checkpoint")
                          else "") + ".</p>",
           success_bars(report, tasks, f"Success per task at step {best['step']} (whiskers: Wilson 95% interval)"),
           per_task_html(report, tasks), "<h3>Rollouts</h3>",
           videos_html(report.get("episodes", []), report_dir, page_dir),
           "<details><summary>Evaluation protocol</summary>", protocol_html(protocol_of(report)), "</details>"]
    return out
