"""The robustness section of an evaluation report (``roboscale eval --robustness=true``): success on each
perturbation of the standard tasks (LIBERO-Pro's suites), with its Wilson interval and its drop from the standard
tasks it perturbs, tested with the pooled two-proportion z-test.

A perturbed suite's row compares its tasks with exactly the standard tasks they perturb, both sides as the mean of
per-task rates (the report's convention) and the test on the pooled episodes. The same numbers per task make the
task x perturbation matrix. Everything is computed from ``per_task`` and the variants the evaluation recorded, so a
report can be re-rendered, and two reports compared (``eval compare``), without the simulator.
"""

from __future__ import annotations

from html import escape
from typing import Any

from roboscale.eval.plots import BarSeries, bar_chart
from roboscale.eval.tables import html_table
from roboscale.utils.stats import two_proportion_test, wilson_interval
from roboscale.utils.text import markdown_text

ALPHA = 0.05
VARIANT_FIELDS = ("task", "perturbation", "suite", "standard", "base_suite", "description")


def _pooled(entries: list[dict[str, Any]]) -> dict[str, Any]:
    successes = sum(int(e["successes"]) for e in entries)
    episodes = sum(int(e["episodes"]) for e in entries)
    low, high = wilson_interval(successes, episodes)
    rate = sum(e["success_rate"] for e in entries) / len(entries) if entries else 0.0
    return {"tasks": len(entries), "episodes": episodes, "successes": successes, "success_rate": rate,
            "ci_low": low, "ci_high": high}


def _against(perturbed: dict[str, Any], standard: dict[str, Any]) -> dict[str, Any]:
    """``perturbed`` with its drop from ``standard`` (positive: worse under the perturbation) and the p-value."""
    p = two_proportion_test(standard["successes"], standard["episodes"], perturbed["successes"],
                            perturbed["episodes"])
    return {**perturbed, "standard_rate": standard["success_rate"], "drop": standard["success_rate"]
            - perturbed["success_rate"], "p_value": p}


def summarize_robustness(per_task: dict[str, dict[str, Any]], variants: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"suites": {base suite: {"standard_tasks": [...], "standard": pooled, "standard_rates": {task: rate},
    "perturbations": [row per perturbed suite]}}}``; a row has the suite, its perturbation and description, pooled
    success, ``drop``, ``p_value`` and ``per_task`` (standard task -> the perturbed task's success, drop and
    p-value)."""
    suites: dict[str, dict[str, Any]] = {}
    by_suite: dict[str, list[dict[str, Any]]] = {}
    for variant in variants:
        by_suite.setdefault(variant["suite"], []).append(variant)
    for suite, members in by_suite.items():
        first = members[0]
        base = suites.setdefault(first["base_suite"], {"standard_tasks": [], "perturbations": []})
        pairs = [(v, per_task[v["task"]], per_task[v["standard"]]) for v in members
                 if v["task"] in per_task and v["standard"] in per_task]
        for v, _, _ in pairs:
            if v["standard"] not in base["standard_tasks"]:
                base["standard_tasks"].append(v["standard"])
        row = _against(_pooled([p for _, p, _ in pairs]), _pooled([s for _, _, s in pairs]))
        row.update(suite=suite, perturbation=first["perturbation"], description=first["description"],
                   per_task={v["standard"]: {"task": v["task"], **_against(_pooled([p]), _pooled([s]))}
                             for v, p, s in pairs})
        base["perturbations"].append(row)
    for base in suites.values():
        base["standard"] = _pooled([per_task[t] for t in base["standard_tasks"]])
        base["standard_rates"] = {t: per_task[t]["success_rate"] for t in base["standard_tasks"]}
    return {"suites": suites}


def _drop_text(row: dict[str, Any]) -> tuple[str, bool]:
    pp = round(100 * row["drop"])
    p = row["p_value"]
    p_text = "p<0.001" if p < 0.001 else f"p={p:.3f}" if p < 0.1 else f"p={p:.2f}"
    return f"{'−' if pp > 0 else '+' if pp < 0 else '±'}{abs(pp)} pp ({p_text})", p < ALPHA


def _rate(entry: dict[str, Any]) -> str:
    return f"{entry['success_rate']:.0%} ({entry['ci_low']:.0%}–{entry['ci_high']:.0%})"


def _matrix_cell(entry: dict[str, Any] | None) -> tuple[str, bool]:
    if entry is None:
        return "—", False
    drop, significant = _drop_text(entry)
    return f"{entry['success_rate']:.0%} ({drop.split(' (')[0]})", significant


def robustness_markdown(robustness: dict[str, Any]) -> list[str]:
    md = ["## Robustness", "",
          "Success on each perturbation of the standard tasks, with its Wilson 95% interval, and the change from the "
          "standard tasks it perturbs in percentage points (− : a drop), with the p-value of a pooled "
          f"two-proportion z-test; * significant at p < {ALPHA} (no multiple-test correction)."]
    for base, entry in robustness["suites"].items():
        md += ["", f"### {markdown_text(base)}", "", "| suite | perturbation | success (95% interval) | successes "
               "| change from standard |", "|---|---|---:|---:|---:|"]
        std = entry["standard"]
        md.append(f"| {markdown_text(base)} | none (standard) | {_rate(std)} | {std['successes']}/{std['episodes']} "
                  "| |")
        for row in entry["perturbations"]:
            drop, significant = _drop_text(row)
            md.append(f"| {markdown_text(row['suite'])} | {markdown_text(row['description'])} | {_rate(row)} | "
                      f"{row['successes']}/{row['episodes']} | {drop}{' *' if significant else ''} |")
        names = [row["perturbation"] for row in entry["perturbations"]]
        md += ["", f"Per task ({markdown_text(base)}): success, and its change from the standard task.", "",
               "| task | standard | " + " | ".join(map(markdown_text, names)) + " |",
               "|---|---:|" + "---:|" * len(names)]
        for task in entry["standard_tasks"]:
            cells = []
            for row in entry["perturbations"]:
                text, significant = _matrix_cell(row["per_task"].get(task))
                cells.append(f"{text} *" if significant else text)
            md.append(f"| {markdown_text(task)} | {entry['standard_rates'][task]:.0%} | " + " | ".join(cells) + " |")
    return md


def robustness_html(robustness: dict[str, Any]) -> str:
    out = ["<h2>Robustness</h2>",
           "<p>Success on each perturbation of the standard tasks (whiskers and brackets: Wilson 95% interval), and "
           "the change from the standard tasks it perturbs in percentage points (− : a drop), with the p-value of a "
           f"pooled two-proportion z-test; <span class='sig'>*</span> significant at p &lt; {ALPHA}.</p>"]
    for base, entry in robustness["suites"].items():
        std = entry["standard"]
        rows_ = [{"suite": base, "description": "none (standard)", **std}, *entry["perturbations"]]
        series = BarSeries("success", [r["success_rate"] for r in rows_], [r["ci_low"] for r in rows_],
                           [r["ci_high"] for r in rows_])
        out += [f"<h3>{escape(base)}</h3>",
                bar_chart([r["suite"] for r in rows_], [series], f"{base}: success per perturbation")]
        rows = [[escape(base), "none (standard)", escape(_rate(std)), f"{std['successes']}/{std['episodes']}", ""]]
        for row in entry["perturbations"]:
            drop, significant = _drop_text(row)
            rows.append([escape(row["suite"]), escape(row["description"]), escape(_rate(row)),
                         f"{row['successes']}/{row['episodes']}",
                         f"<span class='sig'>{escape(drop)} *</span>" if significant else escape(drop)])
        out.append(html_table(["suite", "perturbation", "success (95% interval)", "successes",
                               "change from standard"], rows, numeric={2, 3, 4}))
        names = [row["perturbation"] for row in entry["perturbations"]]
        matrix = []
        for task in entry["standard_tasks"]:
            cells = []
            for row in entry["perturbations"]:
                text, significant = _matrix_cell(row["per_task"].get(task))
                cells.append(f"<span class='sig'>{escape(text)} *</span>" if significant else escape(text))
            matrix.append([escape(task), f"{entry['standard_rates'][task]:.0%}", *cells])
        out += ["<p>Per task: success, and its change from the standard task.</p>",
                html_table(["task", "standard", *map(escape, names)], matrix, numeric=set(range(1, len(names) + 2)))]
    return "\n".join(out)


def _rows_by_suite(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Suite name -> its row (standard suites too: their pooled standard tasks), over every base suite."""
    rows: dict[str, dict[str, Any]] = {}
    for base, entry in report.get("robustness", {}).get("suites", {}).items():
        rows[base] = {**entry["standard"], "suite": base, "description": "none (standard)"}
        rows.update({row["suite"]: row for row in entry["perturbations"]})
    return rows


def compare_robustness(names: list[str], reports: list[dict[str, Any]]) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """Headers and rows (cells as (text, significant)) comparing the robustness sections of ``reports``: per
    suite, each run's success and change from its standard tasks, and each later run's difference in success from
    the first (pooled two-proportion z-test). Empty when no report has a robustness section."""
    by_run = [_rows_by_suite(r) for r in reports]
    suites = list(dict.fromkeys(s for rows in by_run for s in rows))
    if not suites:
        return [], []
    headers = ["suite", "perturbation"]
    for i, name in enumerate(names):
        headers += [name, f"{name}: change from standard"] + ([f"Δ {name} − {names[0]}"] if i else [])
    table = []
    for suite in suites:
        first = by_run[0].get(suite)
        described = next(rows[suite] for rows in by_run if suite in rows)
        cells = [(suite, False), (described["description"], False)]
        for i, rows in enumerate(by_run):
            row = rows.get(suite)
            cells.append((_rate(row), False) if row else ("—", False))
            cells.append(_drop_text(row) if row and "drop" in row else ("", False))
            if i:
                if row and first:
                    p = two_proportion_test(first["successes"], first["episodes"], row["successes"], row["episodes"])
                    cells.append(_drop_text({"drop": first["success_rate"] - row["success_rate"], "p_value": p}))
                else:
                    cells.append(("—", False))
        table.append(cells)
    return headers, table
