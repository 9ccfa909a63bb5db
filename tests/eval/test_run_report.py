"""`roboscale report RUN_DIR`: training curves, success vs step with intervals, the best checkpoint's table and
videos, from a synthetic run directory (metrics.jsonl, evals.jsonl, checkpoints/best, evaluation reports)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from roboscale.errors import ConfigError
from roboscale.eval.run_report import read_evals, write_run_report
from tests.eval.test_report import make_report

LOGGED_STEPS = list(range(10, 210, 10))  # 20 training lines
EVALUATED = {300: (12, 10), 100: (3, 4), 200: (18, 19)}  # step -> successes of (drawer-open-v3, faucet-open-v3)


def make_training_run(root: Path, *, real_videos: bool = False, best: int | None = 200) -> Path:
    """A run directory: metrics.jsonl (training lines, evaluation lines and a torn last line), evals.jsonl out of
    step order with one failed evaluation, checkpoints/<step> with ``best`` pointing at one, and an evaluation
    report per evaluated step."""
    run = root / "run"
    run.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 2.0 * 0.97**s, "lr": 1e-4 * min(1, s / 50), "samples_per_s": 40 + s % 7,
                         "tokens_per_s": 9000.0 + s, "mfu": 0.02, "data_wait": 0.1, "padding": 0.3})
             for s in LOGGED_STEPS]
    lines += [json.dumps({"step": s, "eval/success": 0.5, "eval/success/drawer-open-v3": 0.6}) for s in EVALUATED]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 210, "lo')  # a line cut by a crash
    evals = []
    for step, (drawer, faucet) in EVALUATED.items():
        report_dir = f"eval/{step:06d}"
        summary = make_report(run / report_dir, {"drawer-open-v3": (drawer, 20), "faucet-open-v3": (faucet, 20)},
                              videos=1, real_videos=real_videos, label=f"step {step}")
        overall = summary["overall"]
        evals.append({"step": step, "checkpoint": f"checkpoints/{step:06d}", "report_dir": report_dir,
                      "success_rate": overall["success_rate"], "ci_low": overall["ci_low"],
                      "ci_high": overall["ci_high"], "episodes": overall["episodes"],
                      "per_task": {t: {k: v[k] for k in ("success_rate", "ci_low", "ci_high")}
                                   for t, v in summary["per_task"].items()}, "wall_s": 42.0})
        (run / "checkpoints" / f"{step:06d}").mkdir(parents=True)
    evals.append({"step": 400, "checkpoint": "checkpoints/000400", "report_dir": "eval/000400",
                  "error": "evaluation exited with code 1: simulator crashed"})
    (run / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    if best is not None:
        os.symlink(f"{best:06d}", run / "checkpoints" / "best")
    return run


def _svg(html: str, label: str) -> str:
    match = re.search(rf"<svg [^>]*aria-label='{re.escape(label)}'.*?</svg>", html, re.S)
    assert match, f"no plot {label!r}"
    return match.group(0)


def test_run_report_has_curves_success_vs_step_the_best_table_and_videos(tmp_path: Path):
    run = make_training_run(tmp_path)
    page = write_run_report(run)
    assert page == run / "report.html"
    html = page.read_text()
    # training curves: every logged step, not the evaluation lines or the torn one
    for title in ("Training loss", "Learning rate", "Throughput (samples)", "Throughput (tokens)",
                  "Model FLOPs utilization", "Time waiting for data"):
        assert "data-points='20'" in _svg(html, title), title
    assert "(log scale)" in _svg(html, "Training loss")  # 2.0 -> 0.005: log axis
    # success vs step: three evaluations in step order, whiskers at their intervals, the best ringed
    success = _svg(html, "Mean success vs step (whiskers: Wilson 95% interval)")
    evals = read_evals(run)
    assert [e["step"] for e in evals] == [100, 200, 300]
    whiskers = re.findall(r"data-low='([\d.]+)' data-high='([\d.]+)'", success)
    assert [float(v) for pair in whiskers for v in pair] == pytest.approx(
        [v for e in evals for v in (e["ci_low"], e["ci_high"])], abs=1e-4)
    assert "class='highlight'" in success and "best: step 200" in success
    assert "data-points='3'" in _svg(html, "Success per task vs step")
    assert re.search(r"<td>200 ★ best</td><td class='num'>92%</td>", html)  # (18 + 19) / 40
    # the best checkpoint: its per-task table and bars, and videos whose links resolve from the page
    assert "Success per task at step 200" in html
    assert re.search(r"<td>drawer-open-v3</td><td class='num'>90%</td><td class='num'>70%–97%</td>"
                     r"<td class='num'>18/20</td>", html)
    videos = re.findall(r"<video src='([^']+)'", html)
    assert videos == ["eval/000200/videos/drawer-open-v3_ep000_success.mp4",
                      "eval/000200/videos/faucet-open-v3_ep000_success.mp4"]
    links = re.findall(r"<a href='([^']+)'>report</a>", html)
    assert links == [f"eval/{s:06d}/report.html" for s in (100, 200, 300)]
    assert all((run / link).is_file() for link in links)
    assert "1 unreadable line of metrics.jsonl skipped" in html
    assert "<td class='num'>400</td><td>evaluation exited with code 1: simulator crashed</td>" in html
    assert "20 logged steps, last step 200" in html


def test_links_resolve_from_an_output_elsewhere(tmp_path: Path):
    run = make_training_run(tmp_path, real_videos=True)
    page = write_run_report(run, tmp_path / "pages" / "run.html")
    videos = re.findall(r"<video src='([^']+)'", page.read_text())
    assert videos and all((page.parent / v).resolve().is_file() for v in videos)


def test_best_without_the_pointer_is_the_highest_success(tmp_path: Path):
    run = make_training_run(tmp_path, best=None)
    html = write_run_report(run).read_text()
    assert "best: step 200" in html and "chosen by highest success in evals.jsonl" in html


def test_a_run_without_evaluations_or_metrics_gets_notes_not_errors(tmp_path: Path):
    run = tmp_path / "fresh"
    (run / "checkpoints").mkdir(parents=True)
    html = write_run_report(run).read_text()
    assert "No training metrics yet" in html and "No evaluations yet" in html and "<svg" not in html
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0, "lr": 1e-4}) + "\n")
    html = write_run_report(run).read_text()
    assert "data-points='1'" in _svg(html, "Training loss") and "No evaluations yet" in html


def test_not_a_training_run_is_a_one_line_error(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"not a training run \(no metrics.jsonl and no checkpoints/\)"):
        write_run_report(tmp_path)
    with pytest.raises(ConfigError, match="no such directory"):
        write_run_report(tmp_path / "missing")


def test_cli_report(tmp_path: Path):
    run = make_training_run(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "roboscale", "report", str(run)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"report written to {run / 'report.html'}" and (run / "report.html").is_file()
    out = tmp_path / "elsewhere.html"
    proc = subprocess.run([sys.executable, "-m", "roboscale", "report", str(run), "--output", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and out.is_file()
    proc = subprocess.run([sys.executable, "-m", "roboscale", "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {tmp_path}: not a training run (no metrics.jsonl and no checkpoints/)")
