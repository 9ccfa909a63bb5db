"""``roboscale eval compare RUN_A RUN_B [...]``: success per task side by side, with Wilson 95% intervals, the
difference to the first run and whether it is significant (pooled two-proportion z-test, p < 0.05).

A RUN is an evaluation report directory (``report.json``) or a training run, whose best checkpoint's evaluation
is used (the ``evals.jsonl`` line of the step ``checkpoints/best`` points to). Runs evaluated under different
protocols (seeds, max steps, episodes, image size...) are still compared, under a warning that lists the fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from roboscale.errors import ConfigError
from roboscale.eval.plots import BarSeries, bar_chart
from roboscale.eval.report import load_report, page, protocol_of, rate_with_interval
from roboscale.eval.robustness import compare_robustness
from roboscale.eval.tables import html_table
from roboscale.eval.run_report import EVALS, best_evaluation, best_step, is_training_run, read_evals
from roboscale.utils.io import atomic_write_bytes
from roboscale.utils.stats import two_proportion_test
from roboscale.utils.text import markdown_code, markdown_text

# Protocol fields that change what is recorded, not what is measured: not a reason to warn.
NOT_COMPARED = ("videos_per_task", "video_camera")

ALPHA = 0.05
"""Significance level of the per-task test (no correction for testing many tasks: read marks as leads)."""


@dataclass
class LoadedRun:
    name: str
    """Column header: the report's label, or the directory name (training runs: ``name@step``)."""
    path: Path
    """What the user passed."""
    report_path: Path
    """The report.json read."""
    report: dict[str, Any]
    source: str
    """Where the numbers come from, in words."""


@dataclass
class Comparison:
    runs: list[LoadedRun]
    tasks: list[str]
    """Every task of any run, the first run's first."""
    deltas: dict[str, list[tuple[float, float] | None]] = field(default_factory=dict)
    """Task (and "overall") -> per run (None for the first run and where a side lacks the task): (difference in
    success rate vs the first run, two-sided p-value)."""
    protocol_diffs: dict[str, list[Any]] = field(default_factory=dict)
    """Protocol field (``instructions.<task>`` for mapping fields) -> each run's value, for fields that differ."""
    shared_tasks: list[int] = field(default_factory=list)
    """Per run: how many tasks it shares with the first run (the mean row's difference is over those)."""


def load_run(path: str | Path) -> LoadedRun:
    """An evaluation report directory (or its report.json), or a training run's best evaluation."""
    path = Path(path)
    if path.is_file() and path.name == "report.json":
        return LoadedRun(path.parent.name, path, path, load_report(path), "evaluation report")
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory (expected an evaluation report or a training run)")
    if (path / "report.json").is_file():
        report = load_report(path / "report.json")
        return LoadedRun(str(report.get("label") or path.resolve().name), path, path / "report.json", report,
                         "evaluation report")
    if not is_training_run(path) and not (path / EVALS).is_file():
        raise ConfigError(f"{path}: neither an evaluation report (no report.json) nor a training run "
                          f"(no {EVALS}, no checkpoints/)")
    evals = read_evals(path)
    if not evals:
        raise ConfigError(f"{path}: a training run without evaluations ({EVALS} is missing or empty)")
    best, how = best_evaluation(path, evals)
    if best is None:
        raise ConfigError(f"{path}: checkpoints/best points to step {best_step(path)}, which {EVALS} has no "
                          "evaluation of")
    if not best.get("report_dir"):
        raise ConfigError(f"{path / EVALS}: the line of step {best['step']} has no report_dir")
    report_path = path / str(best["report_dir"]) / "report.json"
    if not report_path.is_file():
        raise ConfigError(f"{report_path}: missing (the evaluation of step {best['step']} in {EVALS} names it)")
    return LoadedRun(f"{path.resolve().name}@{best['step']}", path, report_path, load_report(report_path),
                     f"training run, step {best['step']} ({how})")


def _counts(entry: dict[str, Any]) -> tuple[int, int]:
    n = int(entry["episodes"])
    successes = entry.get("successes")
    return (int(successes) if successes is not None else round(entry["success_rate"] * n)), n


def _flatten(protocol: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for key, value in protocol.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def protocol_differences(reports: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Protocol fields whose values are not the same in every report (a missing field counts as None), except
    those that only change what is recorded (``NOT_COMPARED``)."""
    flats = [_flatten({k: v for k, v in protocol_of(r).items() if k not in NOT_COMPARED}) for r in reports]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    return {k: [f.get(k) for f in flats] for k in keys if any(f.get(k) != flats[0].get(k) for f in flats)}


def compare(runs: list[LoadedRun]) -> Comparison:
    if len(runs) < 2:
        raise ConfigError(f"compare needs at least two runs, got {len(runs)}")
    names: dict[str, int] = {}
    for run in runs:  # two runs that share a label still need two columns
        names[run.name] = names.get(run.name, 0) + 1
        if names[run.name] > 1:
            run.name = f"{run.name} ({names[run.name]})"
    tasks = list(dict.fromkeys(t for run in runs for t in run.report["per_task"]))
    result = Comparison(runs, tasks, protocol_diffs=protocol_differences([r.report for r in runs]))
    first = runs[0].report["per_task"]
    for task in tasks:
        row: list[tuple[float, float] | None] = [None]
        for run in runs[1:]:
            other = run.report["per_task"].get(task)
            row.append(None if task not in first or other is None else _delta([first[task]], [other]))
        result.deltas[task] = row
    # the mean row's difference: over the tasks both runs have, or it would compare different task mixes
    result.deltas["overall"] = [None]
    result.shared_tasks = [len(tasks)]
    for run in runs[1:]:
        shared = [t for t in first if t in run.report["per_task"]]
        result.shared_tasks.append(len(shared))
        result.deltas["overall"].append(_delta([first[t] for t in shared], [run.report["per_task"][t] for t in shared])
                                        if shared else None)
    return result


def _delta(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> tuple[float, float]:
    """(difference of the mean per-task rates, p-value of the test on the pooled episodes)."""
    s1, n1 = map(sum, zip(*(_counts(e) for e in base), strict=True))
    s2, n2 = map(sum, zip(*(_counts(e) for e in other), strict=True))
    diff = sum(e["success_rate"] for e in other) / len(other) - sum(e["success_rate"] for e in base) / len(base)
    return diff, two_proportion_test(s1, n1, s2, n2)


def _entry(run: LoadedRun, key: str) -> dict[str, Any] | None:
    return run.report["overall"] if key == "overall" else run.report["per_task"].get(key)


def _delta_text(delta: tuple[float, float] | None, note: str = "") -> tuple[str, bool]:
    if delta is None:
        return "—", False
    diff, p = delta
    # three decimals near the threshold, so 0.047 (significant) never reads as 0.05
    p_text = "p<0.001" if p < 0.001 else f"p={p:.3f}" if p < 0.1 else f"p={p:.2f}"
    pp = round(100 * diff)
    return f"{'+' if pp > 0 else '−' if pp < 0 else '±'}{abs(pp)} pp ({p_text}{note})", p < ALPHA


def _short(value: Any) -> str:
    text = "—" if value is None else ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _headers(c: Comparison) -> list[str]:
    first = c.runs[0].name
    headers = [c.runs[0].name]
    for run in c.runs[1:]:
        headers += [run.name, f"Δ {run.name} − {first}"]
    return headers


def _cells(c: Comparison, key: str) -> list[tuple[str, bool]]:
    """(text, significant) for each column after the task name."""
    cells = []
    for i, run in enumerate(c.runs):
        entry = _entry(run, key)
        cells.append((rate_with_interval(entry) if entry is not None else "—", False))
        if i:
            shared = c.shared_tasks[i]
            note = ""
            if key == "overall" and not shared == len(c.runs[0].report["per_task"]) == len(run.report["per_task"]):
                note = f"; over the {shared} shared tasks"
            cells.append(_delta_text(c.deltas[key][i], note))
    return cells


def comparison_markdown(c: Comparison) -> str:
    md = ["# Evaluation comparison", ""]
    md += [f"- **{markdown_text(run.name)}**: {markdown_code(run.path)} ({markdown_text(run.source)}; "
           f"{markdown_code(run.report_path)})" for run in c.runs]
    md.append("")
    if c.protocol_diffs:
        md += ["> **Warning: the protocols differ**, so differences may come from the protocol, not the policy:", ">"]
        md += [f"> - {markdown_text(k)}: " + "; ".join(f"{markdown_text(run.name)} = {markdown_code(_short(v))}"
                                                       for run, v in zip(c.runs, values, strict=True))
               for k, values in c.protocol_diffs.items()]
        md.append("")
    md += ["| task | " + " | ".join(map(markdown_text, _headers(c))) + " |", "|---|" + "---:|" * len(_headers(c))]
    for key in [*c.tasks, "overall"]:
        cells = [f"{text} *" if sig else text for text, sig in _cells(c, key)]
        md.append(f"| {'**mean**' if key == 'overall' else markdown_text(key)} | " + " | ".join(cells) + " |")
    md += ["", f"Success with its Wilson 95% interval; Δ in percentage points vs {markdown_text(c.runs[0].name)}, "
               "with the p-value "
               f"of a pooled two-proportion z-test; * significant at p < {ALPHA} (per task, no multiple-test "
               "correction). — : the run has no result for the task. The mean row is the mean of per-task rates with "
               "the interval of all episodes pooled; its difference is over the tasks both runs have."]
    headers, rows = compare_robustness([run.name for run in c.runs], [run.report for run in c.runs])
    if rows:
        md += ["", "## Robustness", "", "| " + " | ".join(map(markdown_text, headers)) + " |",
               "|---|---|" + "---:|" * (len(headers) - 2)]
        md += ["| " + " | ".join(f"{markdown_text(text)} *" if sig else markdown_text(text) for text, sig in row) + " |"
               for row in rows]
        md += ["", "Each run's success on each suite and its change from the standard tasks it perturbs (− : a drop); "
                   "Δ: the difference in success from the first run, pooled two-proportion z-test."]
    return "\n".join(md)


def comparison_html(c: Comparison) -> str:
    body = ["<h1>Evaluation comparison</h1>", "<ul>"]
    body += [f"<li><b>{escape(run.name)}</b>: <code>{escape(str(run.path))}</code> ({escape(run.source)})</li>"
             for run in c.runs]
    body.append("</ul>")
    if c.protocol_diffs:
        items = "".join(f"<li>{escape(k)}: " + "; ".join(f"{escape(run.name)} = <code>{escape(_short(v))}</code>"
                                                          for run, v in zip(c.runs, values, strict=True)) + "</li>"
                        for k, values in c.protocol_diffs.items())
        body.append(f"<div class='note warning'><b>Warning: the protocols differ</b>, so differences may come from "
                    f"the protocol, not the policy:<ul>{items}</ul></div>")
    series = []
    for run in c.runs:
        entries = [run.report["per_task"].get(t) for t in c.tasks]
        series.append(BarSeries(run.name, [e["success_rate"] if e else None for e in entries],
                                [e.get("ci_low") if e else None for e in entries],
                                [e.get("ci_high") if e else None for e in entries]))
    body.append(bar_chart(c.tasks, series, "Success per task (whiskers: Wilson 95% interval)"))
    rows = []
    for key in [*c.tasks, "overall"]:
        cells = [f"<span class='sig'>{escape(text)} *</span>" if sig else escape(text) for text, sig in _cells(c, key)]
        name = "<b>mean</b>" if key == "overall" else escape(key)
        rows.append([name, *cells])
    headers = [escape(h) for h in ["task", *_headers(c)]]
    body.append(html_table(headers, rows, numeric=set(range(1, len(headers)))))
    body.append(f"<p>Success with its Wilson 95% interval; Δ in percentage points vs {escape(c.runs[0].name)}, with "
                f"the p-value of a pooled two-proportion z-test; <span class='sig'>*</span> significant at "
                f"p &lt; {ALPHA} (per task, no multiple-test correction). —: no result for the task.</p>")
    headers, rows = compare_robustness([run.name for run in c.runs], [run.report for run in c.runs])
    if rows:
        cells = [[f"<span class='sig'>{escape(text)} *</span>" if sig else escape(text) for text, sig in row]
                 for row in rows]
        body += ["<h2>Robustness</h2>", html_table([escape(h) for h in headers], cells,
                                                   numeric=set(range(2, len(headers))))]
    return page("Evaluation comparison", "\n".join(body))


def write_comparison(paths: list[str | Path], output_dir: str | Path = ".") -> tuple[str, Path, Path]:
    """Compare the runs at ``paths``; write compare.md and compare.html in ``output_dir`` atomically. Returns the
    Markdown and the two files' paths."""
    comparison = compare([load_run(p) for p in paths])
    md = comparison_markdown(comparison)
    out = Path(output_dir)
    atomic_write_bytes(out / "compare.md", (md + "\n").encode())
    atomic_write_bytes(out / "compare.html", comparison_html(comparison).encode())
    return md, out / "compare.md", out / "compare.html"
