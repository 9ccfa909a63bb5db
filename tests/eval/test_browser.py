"""The report pages in a real browser (headless chromium): the plots are laid out with visible marks and every
rollout video decodes (H.264 mp4s, as rollout.write_video writes them). The pages' own script records both on
the html element (data-plots-drawn, data-videos-loaded/-failed, data-ready), which --dump-dom serializes.

Skipped where chromium is not installed (Debian: apt-get install chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.eval.test_report import make_report
from tests.eval.test_run_report import make_training_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")


def render(page: Path, profile: Path) -> str:
    """The page's DOM after its scripts ran and its media loaded (virtual time: no sleeping on a wall clock)."""
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--mute-audio", "--no-first-run",
         f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _root(dom: str) -> dict[str, str]:
    tag = re.search(r"<html[^>]*>", dom).group(0)
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', tag))


def _videos(dom: str) -> list[dict[str, str]]:
    return [dict(re.findall(r'([a-z-]+)="([^"]*)"', tag)) for tag in re.findall(r"<video [^>]*>", dom)]


def test_eval_report_plots_draw_and_videos_decode(tmp_path: Path):
    report = tmp_path / "eval"
    make_report(report, {"drawer-open-v3": (7, 10), "faucet-open-v3": (2, 10)}, videos=2, real_videos=True)
    dom = render(report / "report.html", tmp_path / "profile")
    root = _root(dom)
    assert root.get("ready") == "1" and root["plots-drawn"] == "1"
    assert (root["videos-loaded"], root["videos-failed"]) == ("4", "0")
    videos = _videos(dom)
    assert len(videos) == 4
    # decoded: the browser knows each video's frame size (write_mp4 writes 32x32 frames)
    assert all(v["data-state"] == "loaded" and v["data-size"] == "32x32" for v in videos), videos

    # the check can fail: a missing file and one that is not a video are reported as such, in the page too
    (report / videos[0]["src"]).unlink()
    (report / videos[1]["src"]).write_bytes(b"not an mp4" * 100)
    dom = render(report / "report.html", tmp_path / "profile")
    assert (_root(dom)["videos-loaded"], _root(dom)["videos-failed"]) == ("2", "2")
    assert [v["data-state"] for v in _videos(dom)] == ["failed", "failed", "loaded", "loaded"]
    captions = re.findall(r"<figcaption>(.*?)</figcaption>", dom)
    assert [c.endswith('<b class="bad">(video could not be played)</b>') for c in captions] == [True, True, False,
                                                                                                  False]


def test_run_report_plots_draw_and_the_best_checkpoints_videos_decode(tmp_path: Path):
    run = make_training_run(tmp_path, real_videos=True)
    from roboscale.eval.run_report import write_run_report

    page = write_run_report(run, tmp_path / "pages" / "run.html")  # videos linked from another directory
    root = _root(render(page, tmp_path / "profile"))
    # six training curves, mean and per-task success vs step, the best checkpoint's bars
    assert root.get("ready") == "1" and root["plots-drawn"] == "9"
    assert (root["videos-loaded"], root["videos-failed"]) == ("2", "0")
