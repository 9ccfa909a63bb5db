"""Evaluation reports: ``report.json`` (everything), ``report.md`` (protocol and table) and a self-contained
``report.html`` (per-task bars with Wilson intervals, the protocol, timing, retries and the rollout videos).

A success rate is printed with its Wilson 95% interval everywhere, so nobody reads 7/10 against 8/10 as a
difference. The protocol (seeds, placement, max steps, cameras, inference settings, instructions) is written in
full: two numbers are comparable only when their protocols are.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Iterator
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

from roboscale.errors import DatasetError
from roboscale.eval.episode_log import EPISODE_FIELDS
from roboscale.eval.plots import BarSeries, bar_chart
from roboscale.eval.records import problem, read_json_object
from roboscale.eval.tables import html_table
from roboscale.eval.robustness import robustness_html, robustness_markdown, summarize_robustness
from roboscale.utils.io import atomic_write_bytes, atomic_write_json
from roboscale.utils.stats import wilson_interval
from roboscale.utils.text import markdown_code, markdown_text

# Protocol fields in reading order, with their labels; fields not listed here are still shown, after these.
PROTOCOL_FIELDS = {
    "env": "environment",
    "tasks": "tasks",
    "episodes_per_task": "episodes per task",
    "seed": "seed",
    "placement": "placement",
    "max_steps": "max steps",
    "success_rule": "success rule",
    "cameras": "cameras",
    "image_size": "image size",
    "video_camera": "video camera",
    "n_action_steps": "actions executed per chunk (n_action_steps)",
    "chunk_size": "chunk size",
    "num_inference_steps": "inference steps",
    "noise": "noise",
    "instructions": "instructions",
    "videos_per_task": "videos kept per task",
}
MAPPING_HEADERS = {"cameras": ("policy camera", "simulator camera"), "instructions": ("task", "instruction")}
# Before the protocol had its own section, evaluations wrote these at the top level of the meta.
_LEGACY_PROTOCOL = ("tasks", "seed", "max_steps", "episodes_per_task", "instructions")

TIMING_FIELDS = {
    "wall_s": ("wall time", "s"),
    "env_steps": ("env steps", ""),
    "env_steps_per_s": ("env steps / s", ""),
    "sim_s": ("simulation", "s"),
    "render_s": ("rendering", "s"),
    "inference_s": ("inference", "s"),
    "inference_calls": ("inference calls", ""),
    "mean_batch_size": ("mean inference batch", ""),
    "inference": ("inference placement", ""),
    "workers": ("env workers", ""),
    "envs_per_worker": ("envs per worker", ""),
    "servers": ("inference servers", ""),
    "runner.device": ("policy device", ""),
    "runner.max_batch_size": ("max batch size", ""),
    "runner.batch_timeout_ms": ("batch timeout", "ms"),
    "runner.threads": ("torch threads per inference process (0: the cores over the processes)", ""),
    "episodes_run": ("episodes run", ""),
    "episodes_resumed": ("episodes resumed (from episodes.jsonl)", ""),
    "restarts": ("worker restarts", ""),
    "observations": ("observations predicted", ""),
    "envs_made": ("environments built", ""),
    "env_make_s": ("building environments", "s"),
    "worker_cpu_s": ("env workers' CPU", "s"),
    "worker_wait_s": ("env workers waiting for actions", "s"),
    "server_cpu_s": ("inference servers' CPU", "s"),
    "batching.calls": ("server batches", ""),
    "batching.items": ("observations in server batches", ""),
    "batching.seconds": ("server predicting", "s"),
    "batching.idle_s": ("servers without a request", "s"),
    "batching.fill_s": ("servers holding requests to fill a batch", "s"),
}
_SHARE_OF_WALL = ("sim_s", "render_s", "inference_s")  # summed over workers: may exceed wall time

# What report.json must hold for `eval compare` and `roboscale report` to read it: (required, optional) fields.
REPORT_FIELDS = ({"per_task": (dict,), "overall": (dict,)},
                 {"episodes": (list,), "protocol": (dict,), "label": (str, None), "robustness": (dict,)})
SUMMARY_FIELDS = ({"episodes": (int,), "success_rate": (float,), "mean_steps": (float,)},
                  {"successes": (int,), "ci_low": (float, None), "ci_high": (float, None), "median_steps": (float,),
                   "mean_steps_success": (float, None), "errors": (int,)})


def _get(result: Any, name: str, default: Any = None) -> Any:
    """A field of an EpisodeResult or of its dict (report.json's episodes)."""
    return result.get(name, default) if isinstance(result, dict) else getattr(result, name, default)


def summarize(results: list, tasks: list[str]) -> dict[str, Any]:
    """Per-task and overall success (with Wilson 95% intervals) and episode length (successes end early).

    ``overall.success_rate`` is the mean of the per-task rates (each task weighs the same, as in the papers'
    tables); its interval pools all episodes, which is the same thing when tasks have equal episode counts.
    """
    per_task = {}
    for task in tasks:
        rs = [r for r in results if _get(r, "task") == task]
        steps = [_get(r, "steps") for r in rs]
        wins = [_get(r, "steps") for r in rs if _get(r, "success")]
        low, high = wilson_interval(len(wins), len(rs))
        per_task[task] = {
            "episodes": len(rs),
            "successes": len(wins),
            "success_rate": len(wins) / len(rs) if rs else 0.0,
            "ci_low": low,
            "ci_high": high,
            "mean_steps": statistics.fmean(steps) if steps else 0.0,
            "median_steps": float(statistics.median(steps)) if steps else 0.0,
            "mean_steps_success": statistics.fmean(wins) if wins else None,
            "errors": sum(1 for r in rs if _get(r, "error")),
        }
    counted = [r for r in results if _get(r, "task") in per_task]
    successes = sum(1 for r in counted if _get(r, "success"))
    steps = [_get(r, "steps") for r in counted]
    low, high = wilson_interval(successes, len(counted))
    rates = [v["success_rate"] for v in per_task.values()]
    return {
        "per_task": per_task,
        "overall": {
            "episodes": len(counted),
            "successes": successes,
            "success_rate": statistics.fmean(rates) if rates else 0.0,
            "ci_low": low,
            "ci_high": high,
            "mean_steps": statistics.fmean(steps) if steps else 0.0,
            "median_steps": float(statistics.median(steps)) if steps else 0.0,
        },
    }


def load_report(path: Path) -> dict[str, Any]:
    """A report.json whose summaries and episodes have the fields (and types) its readers use; anything else is
    a one-line ``DatasetError`` naming the file and the field."""
    report = read_json_object(path)
    for record, fields, where in _report_parts(report):  # lazily: each part is reached only if its parent passed
        wrong = problem(record, *fields, prefix=where)
        if wrong:
            raise DatasetError(path, wrong)
    return report


def _report_parts(report: dict[str, Any]) -> Iterator[tuple[Any, tuple, str]]:
    yield report, REPORT_FIELDS, ""
    for task, entry in report["per_task"].items():
        yield entry, SUMMARY_FIELDS, f"per_task.{task}."
    yield report["overall"], SUMMARY_FIELDS, "overall."
    for i, episode in enumerate(report.get("episodes", [])):
        yield episode, EPISODE_FIELDS, f"episodes[{i}]."


def rate_with_interval(entry: dict[str, Any]) -> str:
    """``85% (64–95%)``, or just ``85%`` for a summary written before intervals were recorded."""
    text = f"{entry['success_rate']:.0%}"
    if entry.get("ci_low") is not None and entry.get("ci_high") is not None:
        text += f" ({entry['ci_low']:.0%}–{entry['ci_high']:.0%})"
    return text


def success_table(columns: dict[str, dict[str, Any]], tasks: list[str], intervals: bool = True) -> str:
    """A Markdown table of success per task for one or more evaluations (e.g. untrained vs trained), with the
    Wilson 95% interval in parentheses when ``intervals``; "—" where an evaluation lacks a task."""
    names = list(columns)
    last = columns[names[-1]]
    steps_header = "mean steps" if len(names) == 1 else f"mean steps ({names[-1]})"
    lines = ["| task | " + " | ".join(names) + f" | {steps_header} |"]
    lines.append("|---|" + "---:|" * (len(names) + 1))

    def cell(entry: dict[str, Any] | None, bold: bool = False) -> str:
        if entry is None:
            return "—"
        text = rate_with_interval(entry) if intervals else f"{entry['success_rate']:.0%}"
        if bold:
            rate, _, rest = text.partition(" ")
            text = f"**{rate}** {rest}".strip()
        return text

    for task in tasks:
        cells = [cell(columns[n]["per_task"].get(task)) for n in names]
        steps = last["per_task"].get(task)
        steps_text = f"{steps['mean_steps']:.0f}" if steps else "—"
        lines.append(f"| {markdown_text(task)} | " + " | ".join(cells) + f" | {steps_text} |")
    cells = [cell(columns[n]["overall"], bold=True) for n in names]
    lines.append("| **mean** | " + " | ".join(cells) + f" | {last['overall']['mean_steps']:.0f} |")
    return "\n".join(lines)


def protocol_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The evaluation protocol a report records (older reports: the fields they kept at the top level)."""
    if isinstance(meta.get("protocol"), dict):
        return meta["protocol"]
    return {k: meta[k] for k in _LEGACY_PROTOCOL if k in meta}


def _ordered(protocol: dict[str, Any]) -> list[tuple[str, Any]]:
    known = [(k, protocol[k]) for k in PROTOCOL_FIELDS if k in protocol]
    return known + [(k, v) for k, v in protocol.items() if k not in PROTOCOL_FIELDS]


def _scalar(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) if value else "—"
    if value is None or value == "":
        return "—"
    return str(value)


def _md_cell(text: str) -> str:
    return markdown_text(text)  # names and values of a dataset, a checkpoint or a crafted report: never markup


def protocol_markdown(protocol: dict[str, Any]) -> list[str]:
    """The protocol as Markdown: a field table, then one table per mapping field (cameras, instructions)."""
    lines = ["| field | value |", "|---|---|"]
    mappings = []
    for key, value in _ordered(protocol):
        if isinstance(value, dict):
            mappings.append((key, value))
            continue
        lines.append(f"| {_md_cell(PROTOCOL_FIELDS.get(key, key))} | {_md_cell(_scalar(value))} |")
    for key, value in mappings:
        lines += ["", f"**{_md_cell(PROTOCOL_FIELDS.get(key, key))}**", ""]
        if not value:
            lines.append("(none)" if key != "instructions" else "(each task's own)")
            continue
        names = MAPPING_HEADERS.get(key, ("name", "value"))
        lines += [f"| {names[0]} | {names[1]} |", "|---|---|"]
        lines += [f"| {_md_cell(str(k))} | {_md_cell(_scalar(v))} |" for k, v in value.items()]
    return lines


def _timing_rows(timing: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    keys = [k for k in TIMING_FIELDS if k in timing] + [k for k in timing if k not in TIMING_FIELDS]
    wall = timing.get("wall_s")
    for key in keys:
        value = timing[key]
        label, unit = TIMING_FIELDS.get(key, (key, ""))
        if isinstance(value, float):
            text = f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
        else:
            text = _scalar(value)
        if unit:
            text += f" {unit}"
        if key in _SHARE_OF_WALL and wall and isinstance(value, (int, float)):
            text += f" ({value / wall:.0%} of wall time)"
        rows.append((label, text))
    return rows


def video_href(video: str, out_dir: Path, page_dir: Path | None = None) -> str:
    """A page-relative URL to a video stored relative to ``out_dir`` (older reports stored absolute paths)."""
    path = Path(video) if Path(video).is_absolute() else out_dir / video
    return quote(os.path.relpath(path, page_dir or out_dir))


def write_report(out_dir: Path, results: list, tasks: list[str], meta: dict[str, Any]) -> dict[str, Any]:
    """Write report.json, report.md and report.html in ``out_dir``; returns the summary (see ``summarize``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, tasks)
    if meta.get("variants"):  # --robustness: each perturbation against the standard tasks it perturbs
        summary["robustness"] = summarize_robustness(summary["per_task"], meta["variants"])
    episodes = [r.to_dict() if hasattr(r, "to_dict") else dataclasses.asdict(r) if dataclasses.is_dataclass(r)
                else dict(r) for r in results]
    atomic_write_json(out_dir / "report.json", {**meta, **summary, "episodes": episodes}, indent=2)
    md = markdown_report(summary, tasks, episodes, meta, out_dir)
    atomic_write_bytes(out_dir / "report.md", (md + "\n").encode())
    atomic_write_bytes(out_dir / "report.html", html_report(summary, tasks, episodes, meta, out_dir).encode())
    return summary


def _title(meta: dict[str, Any]) -> str:
    return str(meta.get("label") or meta.get("checkpoint") or "evaluation")


def markdown_report(summary: dict, tasks: list[str], episodes: list[dict], meta: dict[str, Any],
                    out_dir: Path) -> str:
    overall = summary["overall"]
    md = [f"# Evaluation: {markdown_text(_title(meta))}", ""]
    for key, label in (("checkpoint", "checkpoint"), ("checkpoint_sha256", "checkpoint sha256"),
                       ("policy_type", "policy")):
        if meta.get(key):
            md.append(f"- {label}: {markdown_code(meta[key])}")
    md += ["", f"**{overall['success_rate']:.0%} mean success** over {len(tasks)} tasks, {overall['successes']}/"
               f"{overall['episodes']} episodes (Wilson 95% interval of all episodes pooled: "
               f"{overall['ci_low']:.0%}–{overall['ci_high']:.0%}).", ""]
    if summary.get("robustness"):
        md += [*robustness_markdown(summary["robustness"]), ""]
    md += ["## Results", ""]
    md.append("| task | success (95% interval) | successes | mean steps | median steps | mean steps (successes) "
              "| errors |")
    md.append("|---|---:|---:|---:|---:|---:|---:|")
    for task in tasks:
        s = summary["per_task"][task]
        win_steps = "—" if s["mean_steps_success"] is None else f"{s['mean_steps_success']:.0f}"
        md.append(f"| {markdown_text(task)} | {rate_with_interval(s)} | {s['successes']}/{s['episodes']} | "
                  f"{s['mean_steps']:.0f} "
                  f"| {s['median_steps']:.0f} | {win_steps} | {s['errors']} |")
    md.append(f"| **mean** | **{overall['success_rate']:.0%}** | {overall['successes']}/{overall['episodes']} | "
              f"{overall['mean_steps']:.0f} | {overall['median_steps']:.0f} | | |")
    md += ["", "## Protocol", "", *protocol_markdown(protocol_of(meta))]
    if meta.get("timing"):
        md += ["", "## Timing", "", "| | |", "|---|---:|"]
        md += [f"| {label} | {text} |" for label, text in _timing_rows(meta["timing"])]
    md += _problems_markdown(meta.get("retries") or [], episodes)
    videos = [e for e in episodes if e.get("video")]
    if videos:
        md += ["", "## Videos", ""]
        md += [f"- [{markdown_text(e['task'])} #{e['episode']}: {'success' if e['success'] else 'failure'}, "
               f"{e['steps']} steps]"
               f"({video_href(e['video'], out_dir)})" for e in videos]
    return "\n".join(md)


def _problems_markdown(retries: list[dict], episodes: list[dict]) -> list[str]:
    md: list[str] = []
    if retries:
        md += ["", "## Simulator retries", "", f"Attempts that crashed or hung and were retried: {len(retries)}.", "",
               "| task | episode | attempt | reason |", "|---|---:|---:|---|"]
        md += [f"| {_md_cell(r.get('task'))} | {_md_cell(r.get('episode'))} | {_md_cell(r.get('attempt'))} | "
               f"{_md_cell(str(r.get('reason')))} |"
               for r in retries]
    failed = [e for e in episodes if e.get("error")]
    if failed:
        md += ["", "## Episodes that failed every attempt (counted as failures)", "",
               "| task | episode | attempts | error |", "|---|---:|---:|---|"]
        md += [f"| {_md_cell(e['task'])} | {e['episode']} | {e.get('attempts', 1)} | {_md_cell(str(e['error']))} |"
               for e in failed]
    return md


# --- HTML ---------------------------------------------------------------------------------------------------

CSS = """body{font-family:sans-serif;max-width:72em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{padding:.25em .8em;border-bottom:1px solid #ddd;
text-align:left;vertical-align:top}td:first-child{white-space:nowrap}td.num,th.num{text-align:right}
code{background:#f4f4f4;padding:0 .2em}
.note{background:#fffbea;border-left:4px solid #d69e2e;padding:.5em 1em}.bad{color:#c53030}
.sig{color:#c53030;font-weight:bold}figure{display:inline-block;margin:.4em;vertical-align:top}
figcaption{font-size:.85em;max-width:256px}svg.plot{display:block;margin:.5em 0;max-width:100%;height:auto}
.plots{display:flex;flex-wrap:wrap;gap:0 1.5em}"""

# Marks every video loaded (a frame decoded) or failed, so a missing or undecodable file says so in its caption
# instead of showing a silent black box. On the html element, for headless checks: data-plots-drawn (plots laid
# out with visible marks) and data-ready once every video settled.
READY_SCRIPT = """<script>(function(){
var root=document.documentElement,vids=Array.prototype.slice.call(document.querySelectorAll('video'));
var loaded=0,failed=0,drawn=0;
Array.prototype.forEach.call(document.querySelectorAll('svg.plot'),function(s){
  var mark=s.querySelector('.bar,.line');
  if(s.getBoundingClientRect().width>0&&mark&&mark.getBBox().width>0)drawn++;});
root.dataset.plotsDrawn=drawn;
function settle(){root.dataset.videosLoaded=loaded;root.dataset.videosFailed=failed;
  if(loaded+failed===vids.length)root.dataset.ready='1';}
vids.forEach(function(v){
  function ok(){if(v.dataset.state)return;v.dataset.state='loaded';
    v.dataset.size=v.videoWidth+'x'+v.videoHeight;loaded++;settle();}
  function bad(){if(v.dataset.state)return;v.dataset.state='failed';failed++;
    var c=v.parentNode.querySelector('figcaption');
    if(c)c.insertAdjacentHTML('beforeend',' <b class="bad">(video could not be played)</b>');settle();}
  if(v.readyState>=2)ok();else if(v.error)bad();
  else{v.addEventListener('loadeddata',ok);v.addEventListener('error',bad);}});
settle();})();</script>"""


def page(title: str, body: str) -> str:
    """A self-contained HTML page: inline CSS, inline SVG, and the video readiness script."""
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n{body}\n{READY_SCRIPT}\n</body></html>\n")


def protocol_html(protocol: dict[str, Any]) -> str:
    rows, mappings = [], []
    for key, value in _ordered(protocol):
        if isinstance(value, dict):
            mappings.append((key, value))
        else:
            rows.append([escape(PROTOCOL_FIELDS.get(key, key)), escape(_scalar(value))])
    out = [html_table(["field", "value"], rows)]
    for key, value in mappings:
        out.append(f"<h3>{escape(PROTOCOL_FIELDS.get(key, key))}</h3>")
        if not value:
            out.append(f"<p>{'(each task’s own)' if key == 'instructions' else '(none)'}</p>")
        else:
            rows = [[escape(str(k)), escape(_scalar(v))] for k, v in value.items()]
            out.append(html_table(list(MAPPING_HEADERS.get(key, ("name", "value"))), rows))
    return "\n".join(out)


def video_figure(href: str, caption: str) -> str:
    return (f"<figure><video src='{escape(href)}' controls loop muted playsinline preload='metadata' width='256'>"
            f"</video><figcaption>{escape(caption)}</figcaption></figure>")


def episode_caption(e: dict[str, Any]) -> str:
    outcome = "success" if e.get("success") else "failure"
    return f"{e['task']} #{e['episode']} (seed {e.get('seed')}): {outcome} in {e['steps']} steps"


def per_task_html(summary: dict, tasks: list[str]) -> str:
    """The per-task results table (success with interval, counts, episode lengths, errors)."""
    rows = []
    for task in tasks:
        s = summary["per_task"][task]
        win = "—" if s.get("mean_steps_success") is None else f"{s['mean_steps_success']:.0f}"
        ci = (f"{s['ci_low']:.0%}–{s['ci_high']:.0%}" if s.get("ci_low") is not None else "—")
        rows.append([escape(task), f"{s['success_rate']:.0%}", ci,
                     f"{s.get('successes', round(s['success_rate'] * s['episodes']))}/{s['episodes']}",
                     f"{s['mean_steps']:.0f}", f"{s.get('median_steps', s['mean_steps']):.0f}", win,
                     str(s.get("errors", 0))])
    o = summary["overall"]
    ci = f"{o['ci_low']:.0%}–{o['ci_high']:.0%}" if o.get("ci_low") is not None else "—"
    rows.append(["<b>mean</b>", f"<b>{o['success_rate']:.0%}</b>", ci,
                 f"{o.get('successes', '')}/{o['episodes']}", f"{o['mean_steps']:.0f}",
                 f"{o.get('median_steps', o['mean_steps']):.0f}", "", ""])
    return html_table(["task", "success", "95% interval", "successes", "mean steps", "median steps",
                       "mean steps (successes)", "errors"], rows, numeric={1, 2, 3, 4, 5, 6, 7})


def success_bars(summary: dict, tasks: list[str], title: str) -> str:
    per = summary["per_task"]
    series = BarSeries("success", [per[t]["success_rate"] for t in tasks], [per[t].get("ci_low") for t in tasks],
                       [per[t].get("ci_high") for t in tasks])
    return bar_chart(tasks, [series], title)


def videos_html(episodes: list[dict], out_dir: Path, page_dir: Path | None = None) -> str:
    videos = [e for e in episodes if e.get("video")]
    if not videos:
        return "<p>No videos were recorded.</p>"
    return "\n".join(video_figure(video_href(e["video"], out_dir, page_dir), episode_caption(e)) for e in videos)


def html_report(summary: dict, tasks: list[str], episodes: list[dict], meta: dict[str, Any], out_dir: Path) -> str:
    overall = summary["overall"]
    head = [f"<h1>Evaluation: {escape(_title(meta))}</h1>",
            f"<p><b>{overall['success_rate']:.0%} mean success</b> over {len(tasks)} tasks; "
            f"{overall['successes']}/{overall['episodes']} episodes (Wilson 95% interval, all episodes pooled: "
            f"{overall['ci_low']:.0%}–{overall['ci_high']:.0%}).</p><ul>"]
    for key, label in (("checkpoint", "checkpoint"), ("checkpoint_sha256", "checkpoint sha256"),
                       ("policy_type", "policy")):
        if meta.get(key):
            head.append(f"<li>{label}: <code>{escape(str(meta[key]))}</code></li>")
    head.append("</ul>")
    if summary.get("robustness"):
        head.append(robustness_html(summary["robustness"]))
    body = [*head, "<h2>Results</h2>",
            success_bars(summary, tasks, "Success per task (whiskers: Wilson 95% interval)"),
            per_task_html(summary, tasks), "<h2>Protocol</h2>", protocol_html(protocol_of(meta))]
    if meta.get("timing"):
        rows = [[escape(label), escape(text)] for label, text in _timing_rows(meta["timing"])]
        body += ["<h2>Timing</h2>", html_table(["", ""], rows, numeric={1})]
    body += _problems_html(meta.get("retries") or [], episodes)
    body += ["<h2>Rollouts</h2>", videos_html(episodes, out_dir)]
    return page(f"Evaluation: {_title(meta)}", "\n".join(body))


def _problems_html(retries: list[dict], episodes: list[dict]) -> list[str]:
    out = []
    if retries:
        rows = [[escape(str(r.get("task"))), str(r.get("episode")), str(r.get("attempt")), escape(str(r.get("reason")))]
                for r in retries]
        out += ["<h2>Simulator retries</h2>",
                f"<p>{len(retries)} attempt{'s' if len(retries) != 1 else ''} crashed or hung and "
                f"{'were' if len(retries) != 1 else 'was'} retried on a new worker.</p>",
                html_table(["task", "episode", "attempt", "reason"], rows, numeric={1, 2})]
    failed = [e for e in episodes if e.get("error")]
    if failed:
        rows = [[escape(e["task"]), str(e["episode"]), str(e.get("attempts", 1)), escape(str(e["error"]))]
                for e in failed]
        out += ["<h2>Episodes that failed every attempt</h2><p>They count as failures.</p>",
                html_table(["task", "episode", "attempts", "error"], rows, numeric={1, 2})]
    return out
