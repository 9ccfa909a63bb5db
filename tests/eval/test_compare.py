"""`roboscale eval compare`: side-by-side success with intervals, significance marks only where the difference
is significant, training runs read through evals.jsonl + checkpoints/best, protocol warnings, one-line errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from roboscale.errors import ConfigError, DatasetError
from roboscale.eval.compare import compare, comparison_markdown, load_run, write_comparison
from roboscale.utils.stats import two_proportion_test, wilson_interval
from tests.eval.test_report import PROTOCOL, make_report


def _row(md: str, task: str) -> list[str]:
    line = next(line for line in md.splitlines() if line.startswith(f"| {task} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.fixture
def two_reports(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    make_report(a, {"pick-place-v3": (19, 20), "push-v3": (10, 20)}, label="baseline")
    make_report(b, {"pick-place-v3": (2, 20), "push-v3": (10, 20), "reach-v3": (20, 20)}, label="candidate")
    return a, b


def test_only_the_significant_difference_is_marked(two_reports):
    a, b = two_reports
    comparison = compare([load_run(a), load_run(b)])
    diff, p = comparison.deltas["pick-place-v3"][1]
    assert diff == pytest.approx(2 / 20 - 19 / 20) and p == pytest.approx(two_proportion_test(19, 20, 2, 20))
    assert comparison.deltas["push-v3"][1] == (0.0, 1.0)
    md = comparison_markdown(comparison)
    assert _row(md, "task") == ["task", "baseline", "candidate", "Δ candidate − baseline"]
    low, high = wilson_interval(19, 20)
    assert _row(md, "pick-place-v3") == [
        "pick-place-v3", f"95% ({low:.0%}–{high:.0%})", "10% (3%–30%)", "−85 pp (p<0.001) *"]
    assert _row(md, "push-v3") == ["push-v3", "50% (30%–70%)", "50% (30%–70%)", "±0 pp (p=1.00)"]
    # a task only one run has: a dash, and no test
    assert _row(md, "reach-v3") == ["reach-v3", "—", "100% (84%–100%)", "—"]
    task_rows = [line for line in md.splitlines() if line.startswith("| ") and "**mean**" not in line]
    assert [line.split(" | ")[0] for line in task_rows if line.endswith("* |")] == ["| pick-place-v3"]
    # the mean row's difference is over the shared tasks: (50% + 10%) / 2 - (95% + 50%) / 2, tested on 12/40
    # vs 29/40 episodes (reach-v3's 20/20 would otherwise flatter the candidate)
    diff, p = comparison.deltas["overall"][1]
    assert diff == pytest.approx(-0.425) and p == pytest.approx(two_proportion_test(29, 40, 12, 40))
    assert _row(md, "**mean**")[3] == "−42 pp (p<0.001; over the 2 shared tasks) *"
    # the task sets differ, nothing else
    assert [line for line in md.splitlines() if line.startswith("> - ")] == [
        "> - tasks: baseline = `pick-place-v3, push-v3`; candidate = `pick-place-v3, push-v3, reach-v3`"]


def test_protocol_differences_are_listed(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_report(a, {"push-v3": (5, 10)}, label="a")
    make_report(b, {"push-v3": (5, 10)}, label="b", seed=7, max_steps=100, video_camera="corner3",
                instructions={**PROTOCOL["instructions"], "push-v3": "Push it"})
    md = comparison_markdown(compare([load_run(a), load_run(b)]))
    warning = [line for line in md.splitlines() if line.startswith("> - ")]
    assert "> - seed: a = `1000`; b = `7`" in warning and "> - max_steps: a = `250`; b = `100`" in warning
    assert "> - instructions.push-v3: a = `—`; b = `Push it`" in warning
    # fields that agree (image size, episodes, the other instructions) are not listed, nor the video camera
    assert len(warning) == 3
    same = comparison_markdown(compare([load_run(a), load_run(a)]))
    assert "protocols differ" not in same and "| a | a (2) |" in same


def _training_run(root: Path) -> Path:
    """A run with evaluations at steps 300, 100, 200 (out of order) and checkpoints/best -> 000200."""
    run = root / "run"
    lines = []
    for step, wins in ((300, 12), (100, 3), (200, 18)):
        summary = make_report(run / "evals" / f"{step:06d}", {"push-v3": (wins, 20)}, label=f"step {step}")
        lines.append({"step": step, "checkpoint": f"checkpoints/{step:06d}", "report_dir": f"evals/{step:06d}",
                      "success_rate": summary["overall"]["success_rate"], "ci_low": summary["overall"]["ci_low"],
                      "ci_high": summary["overall"]["ci_high"], "episodes": 20,
                      "per_task": {"push-v3": {k: summary["per_task"]["push-v3"][k]
                                               for k in ("success_rate", "ci_low", "ci_high")}}, "wall_s": 30.0})
    (run / "evals.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    for step in (100, 200, 300):
        (run / "checkpoints" / f"{step:06d}").mkdir(parents=True)
    os.symlink("000200", run / "checkpoints" / "best")
    return run


def test_a_training_run_is_compared_by_its_best_checkpoints_evaluation(tmp_path: Path):
    run = _training_run(tmp_path)
    loaded = load_run(run)
    assert loaded.name == "run@200" and loaded.report_path == run / "evals" / "000200" / "report.json"
    assert loaded.report["per_task"]["push-v3"]["successes"] == 18
    make_report(tmp_path / "baseline", {"push-v3": (3, 20)}, label="baseline")
    md = comparison_markdown(compare([load_run(tmp_path / "baseline"), loaded]))
    assert _row(md, "push-v3")[2].startswith("90% ") and _row(md, "push-v3")[3].endswith("*")


def test_bad_runs_are_one_line_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such directory"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"neither an evaluation report \(no report.json\) nor a training run"):
        load_run(tmp_path)
    run = _training_run(tmp_path)
    os.remove(run / "checkpoints" / "best")
    os.symlink("000400", run / "checkpoints" / "best")
    with pytest.raises(ConfigError, match="checkpoints/best points to step 400, which evals.jsonl has no evaluation"):
        load_run(run)
    (run / "evals.jsonl").write_text("")
    with pytest.raises(ConfigError, match="a training run without evaluations"):
        load_run(run)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "report.json").write_text('{"per_task": ')
    with pytest.raises(DatasetError, match="report.json: not valid JSON"):  # a damaged file: exit code 1
        load_run(tmp_path / "broken")


def test_write_comparison_writes_markdown_and_self_contained_html(two_reports, tmp_path: Path):
    md, md_path, html_path = write_comparison(list(two_reports), tmp_path / "out")
    assert md_path.read_text() == md + "\n"
    html = html_path.read_text()
    # grouped bars: one per run and task the run has, whiskers on each
    bars = re.findall(r"<rect class='bar' data-category='([^']+)' data-series='([^']+)'", html)
    assert bars == [("pick-place-v3", "baseline"), ("pick-place-v3", "candidate"), ("push-v3", "baseline"),
                    ("push-v3", "candidate"), ("reach-v3", "candidate")]
    assert html.count("class='whisker'") == 5
    assert html.count("<span class='sig'>") == 3  # pick-place-v3's and the mean's differences, the legend's mark
    assert "<span class='sig'>−85 pp (p&lt;0.001) *</span>" in html
    assert "<link" not in html and "<script src" not in html


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "roboscale", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def test_cli_eval_compare(two_reports, tmp_path: Path):
    a, b = two_reports
    proc = _cli("eval", "compare", str(a), str(b), "--output_dir", str(tmp_path / "cmp"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "| pick-place-v3 |" in proc.stdout and "−85 pp (p<0.001) *" in proc.stdout
    assert (tmp_path / "cmp" / "compare.md").read_text().strip() == proc.stdout.strip()
    assert (tmp_path / "cmp" / "compare.html").is_file()
    # default output directory: the current one
    proc = _cli("eval", "compare", str(a), str(b), cwd=b)
    assert proc.returncode == 0 and (b / "compare.md").is_file() and (b / "compare.html").is_file()
    proc = _cli("eval", "compare", str(a), str(tmp_path / "missing"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing'}: no such directory (expected an "
                                                  "evaluation report or a training run)"]
    proc = _cli("eval", "compare", str(a), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: usage: roboscale eval compare")
