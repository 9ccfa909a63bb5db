"""Evaluation statistics (Wilson intervals, the two-proportion test) and the report files, from synthetic
episode results (no simulator, no policy). The helpers here also build the reports of test_compare,
test_run_report and test_browser."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from roboscale.eval.report import success_table, summarize, write_report
from roboscale.utils.text import markdown_text
from roboscale.rollout.episode import EpisodeResult
from roboscale.utils.stats import two_proportion_test, wilson_interval

PROTOCOL = {
    "env": "metaworld",
    "tasks": ["drawer-open-v3", "faucet-open-v3"],
    "episodes_per_task": 10,
    "seed": 1000,
    "placement": "reset(episode_seed(seed, task, i)): MetaWorld's randomized object and goal positions",
    "max_steps": 250,
    "success_rule": "info['success'] at any step ends the episode",
    "cameras": {"top": "topview", "wrist": "gripperPOV"},
    "image_size": 64,
    "video_camera": "corner2",
    "n_action_steps": 4,
    "chunk_size": 8,
    "num_inference_steps": 10,
    "noise": "drawn per episode from its seed and chunk index",
    "instructions": {"drawer-open-v3": "Open the drawer", "faucet-open-v3": "Rotate the faucet counter-clockwise"},
}


def episode_results(task: str, successes: int, episodes: int, *, videos: int = 0, errors: int = 0,
                    steps_success: int = 40, steps_fail: int = 250) -> list[EpisodeResult]:
    """``episodes`` results of ``task``, the first ``successes`` of them successful (lengths ``steps_success +
    i``), the last ``errors`` failed on every attempt; videos for the first ``videos`` episodes."""
    out = []
    for i in range(episodes):
        won = i < successes
        failed_all = i >= episodes - errors
        out.append(EpisodeResult(
            task=task, episode=i, seed=1000 + i, success=won, steps=steps_success + i if won else steps_fail,
            sum_reward=float(i), max_reward=1.0 if won else 0.5,
            video=f"videos/{task}_ep{i:03d}_{'success' if won else 'fail'}.mp4" if i < videos else None,
            attempts=3 if failed_all else 1, error="simulator hung for 60 s" if failed_all else None, wall_s=1.5))
    return out


def report_meta(label: str = "trained", **protocol_changes) -> dict:
    return {
        "label": label,
        "checkpoint": "/runs/a/checkpoints/000500/pretrained_model",
        "checkpoint_sha256": "ab" * 32,
        "policy_type": "pi05",
        "protocol": {**PROTOCOL, **protocol_changes},
        "timing": {"wall_s": 120.0, "env_steps": 4000, "env_steps_per_s": 33.3, "sim_s": 50.0, "render_s": 20.0,
                   "inference_s": 40.0, "inference_calls": 500, "mean_batch_size": 3.5, "workers": 2},
        "retries": [{"task": "faucet-open-v3", "episode": 8, "attempt": 1, "reason": "worker crashed (SIGSEGV)"}],
    }


def write_mp4(path: Path, frames: int = 8, size: int = 32) -> Path:
    """A real H.264 mp4 (what rollout.write_video writes) with a moving square."""
    from roboscale.data.lerobot.video import VideoStreamWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = VideoStreamWriter(path, 30, size, size, codec="libx264")
    for i in range(frames):
        frame = np.full((size, size, 3), 40, np.uint8)
        frame[4 + i: 12 + i, 4:12] = 255
        writer.write(frame)
    writer.close()
    return path


def make_report(out_dir: Path, counts: dict[str, tuple[int, int]], *, videos: int = 0, real_videos: bool = False,
                label: str = "trained", **protocol_changes) -> dict:
    """An evaluation report in ``out_dir`` with ``counts`` = {task: (successes, episodes)}."""
    results = [r for task, (s, n) in counts.items() for r in episode_results(task, s, n, videos=videos)]
    if real_videos:
        for r in results:
            if r.video:
                write_mp4(out_dir / r.video)
    meta = report_meta(label, **{"tasks": list(counts), **protocol_changes})
    return write_report(out_dir, results, list(counts), meta)


# --- statistics ---------------------------------------------------------------------------------------------


def test_wilson_interval_matches_the_hand_formula():
    """z = 1.959964, z^2 = 3.841459. Wilson: center = (p + z^2/2n) / (1 + z^2/n),
    half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2). With n = 10, 1 + z^2/n = 1.3841459:

    - 0/10: center = 0.1920729 / 1.3841459 = 0.1387664 = half -> (0, 0.2775328)
    - 10/10: the mirror image -> (0.7224672, 1)
    - 5/10: center 0.5, half = 1.4160089 * sqrt(0.025 + 0.0096036) = 0.2634069 -> (0.2365931, 0.7634069)
    - 0/0: nothing known -> (0, 1)
    """
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775328), abs=1e-6)
    assert wilson_interval(10, 10) == pytest.approx((0.7224672, 1.0), abs=1e-6)
    assert wilson_interval(5, 10) == pytest.approx((0.2365931, 0.7634069), abs=1e-6)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0  # exact, not 1e-17 off
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low90, high90 = wilson_interval(5, 10, confidence=0.90)  # a lower confidence gives a narrower interval
    assert 0.2366 < low90 < 0.5 < high90 < 0.7634
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_two_proportion_test_matches_hand_computed_p_values():
    """Pooled z-test, p = erfc(|z| / sqrt 2):

    - 19/20 vs 2/20: pooled 21/40 = 0.525, se = sqrt(0.525 * 0.475 * (1/20 + 1/20)) = 0.1579161,
      z = 0.85 / 0.1579161 = 5.382605 -> p = 7.34e-8
    - 7/10 vs 5/10: pooled 0.6, se = sqrt(0.24 * 0.2) = 0.2190890, z = 0.9128709 -> p = 0.3613104
    - 10/10 vs 0/10: pooled 0.5, se = sqrt(0.25 * 0.2) = 0.2236068, z = 4.472136 -> p = 7.744e-6
    - equal rates: z = 0 -> p = 1; all failed or all succeeded on both sides (se = 0) -> 1; an empty side -> 1
    """
    assert two_proportion_test(19, 20, 2, 20) == pytest.approx(7.34e-8, rel=0.01)
    assert two_proportion_test(7, 10, 5, 10) == pytest.approx(0.3613104, abs=1e-6)
    assert two_proportion_test(5, 10, 7, 10) == pytest.approx(0.3613104, abs=1e-6)  # two-sided: symmetric
    assert two_proportion_test(10, 10, 0, 10) == pytest.approx(7.744e-6, rel=0.001)
    assert two_proportion_test(10, 20, 10, 20) == 1.0
    assert two_proportion_test(0, 10, 0, 10) == 1.0
    assert two_proportion_test(10, 10, 20, 20) == 1.0
    assert two_proportion_test(0, 0, 5, 10) == 1.0


# --- report files -------------------------------------------------------------------------------------------


@pytest.fixture
def report_dir(tmp_path: Path) -> Path:
    results = (episode_results("drawer-open-v3", 7, 10, videos=2)
               + episode_results("faucet-open-v3", 0, 10, videos=1, errors=2))
    write_report(tmp_path, results, PROTOCOL["tasks"], report_meta())
    return tmp_path


def test_report_json_has_the_summary_protocol_and_episodes(report_dir: Path):
    report = json.loads((report_dir / "report.json").read_text())
    drawer, faucet = report["per_task"]["drawer-open-v3"], report["per_task"]["faucet-open-v3"]
    assert (drawer["episodes"], drawer["successes"], drawer["success_rate"]) == (10, 7, 0.7)
    assert (drawer["ci_low"], drawer["ci_high"]) == pytest.approx(wilson_interval(7, 10))
    drawer_steps = [40, 41, 42, 43, 44, 45, 46, 250, 250, 250]
    assert drawer["mean_steps"] == pytest.approx(np.mean(drawer_steps))
    assert drawer["median_steps"] == pytest.approx(np.median(drawer_steps))
    assert drawer["mean_steps_success"] == pytest.approx(43.0)
    assert drawer["errors"] == 0
    assert (faucet["successes"], faucet["success_rate"], faucet["mean_steps_success"]) == (0, 0, None)
    assert faucet["errors"] == 2
    assert (faucet["ci_low"], faucet["ci_high"]) == pytest.approx((0.0, 0.2775328), abs=1e-6)
    overall = report["overall"]
    assert (overall["episodes"], overall["successes"], overall["success_rate"]) == (20, 7, pytest.approx(0.35))
    assert (overall["ci_low"], overall["ci_high"]) == pytest.approx(wilson_interval(7, 20))  # pooled episodes
    assert overall["median_steps"] == pytest.approx(250.0)
    # the meta is kept as given, and each episode round-trips
    assert report["protocol"] == PROTOCOL and report["checkpoint_sha256"] == "ab" * 32
    assert report["retries"][0]["reason"] == "worker crashed (SIGSEGV)"
    episodes = [EpisodeResult.from_dict(e) for e in report["episodes"]]
    assert len(episodes) == 20 and episodes[-1].error == "simulator hung for 60 s" and episodes[-1].attempts == 3


def test_report_md_records_the_whole_protocol_and_the_table_with_intervals(report_dir: Path):
    md = (report_dir / "report.md").read_text()
    for key, value in PROTOCOL.items():
        if isinstance(value, dict):
            for name, text in value.items():
                assert re.search(rf"\| {re.escape(markdown_text(name))} \| {re.escape(markdown_text(text))} \|",
                                 md), (key, name)
        elif isinstance(value, list):
            assert markdown_text(", ".join(value)) in md
        else:
            assert f"| {markdown_text(value)} |" in md, key  # as text: `info['success']` is not a link
    low, high = wilson_interval(7, 10)
    assert f"| drawer-open-v3 | 70% ({low:.0%}–{high:.0%}) | 7/10 | 105 | 44 | 43 | 0 |" in md
    assert "| faucet-open-v3 | 0% (0%–28%) | 0/10 |" in md
    assert "ab" * 32 in md and "| env steps / s | 33.3 |" in md and "| inference | 40.0 s (33% of wall time) |" in md
    assert "| faucet-open-v3 | 8 | 1 | worker crashed (SIGSEGV) |" in md  # the retry
    assert "| faucet-open-v3 | 9 | 3 | simulator hung for 60 s |" in md  # an episode that failed every attempt
    assert "(videos/drawer-open-v3_ep001_success.mp4)" in md


def test_report_html_has_bars_with_whiskers_the_protocol_and_the_videos(report_dir: Path):
    html = (report_dir / "report.html").read_text()
    bars = re.findall(r"<rect class='bar' data-category='([^']+)'[^>]*data-value='([\d.]+)'", html)
    assert bars == [("drawer-open-v3", "0.7000"), ("faucet-open-v3", "0.0000")]
    whiskers = [(float(a), float(b)) for a, b in re.findall(r"class='whisker' data-low='([\d.]+)' "
                                                              r"data-high='([\d.]+)'", html)]
    assert whiskers[0] == pytest.approx(wilson_interval(7, 10), abs=1e-4)
    assert whiskers[1] == pytest.approx(wilson_interval(0, 10), abs=1e-4)
    assert len(whiskers) == 2
    assert "success rate (%)" in html  # the axis is labelled
    videos = re.findall(r"<video src='([^']+)'", html)
    assert videos == ["videos/drawer-open-v3_ep000_success.mp4", "videos/drawer-open-v3_ep001_success.mp4",
                      "videos/faucet-open-v3_ep000_fail.mp4"]
    assert "Rotate the faucet counter-clockwise" in html and "gripperPOV" in html and "SIGSEGV" in html
    # self-contained: nothing fetched from elsewhere
    assert "<link" not in html and not re.search(r"(src|href)=['\"]https?:", html)


def test_summary_keeps_the_callers_keys_and_tolerates_a_task_without_episodes():
    summary = summarize(episode_results("reach-v3", 3, 4), ["reach-v3", "push-v3"])
    assert summary["per_task"]["push-v3"]["episodes"] == 0
    assert (summary["per_task"]["push-v3"]["ci_low"], summary["per_task"]["push-v3"]["ci_high"]) == (0.0, 1.0)
    assert summary["overall"]["success_rate"] == pytest.approx((0.75 + 0.0) / 2)
    assert summary["overall"]["episodes"] == 4 and math.isfinite(summary["per_task"]["reach-v3"]["mean_steps"])


def test_success_table_shows_intervals_and_a_dash_for_a_missing_task():
    before = summarize(episode_results("reach-v3", 1, 10), ["reach-v3"])
    after = summarize(episode_results("reach-v3", 9, 10) + episode_results("push-v3", 5, 10), ["reach-v3", "push-v3"])
    table = success_table({"untrained": before, "trained": after}, ["reach-v3", "push-v3"])
    low, high = wilson_interval(9, 10)
    assert f"| reach-v3 | 10% (2%–40%) | 90% ({low:.0%}–{high:.0%}) |" in table
    assert "| push-v3 | — | 50% (24%–76%) |" in table
    assert "| **mean** | **10%** (2%–40%) | **70%**" in table
    assert "| reach-v3 | 10% | 90% |" in success_table({"untrained": before, "trained": after}, ["reach-v3"],
                                                      intervals=False)


def test_older_absolute_video_paths_become_relative_links(tmp_path: Path):
    results = episode_results("reach-v3", 1, 1)
    results[0].video = str(tmp_path / "videos" / "reach-v3_ep000_success.mp4")
    write_report(tmp_path, results, ["reach-v3"], {"checkpoint": "c", "seed": 3, "max_steps": 9})
    assert "<video src='videos/reach-v3_ep000_success.mp4'" in (tmp_path / "report.html").read_text()
    md = (tmp_path / "report.md").read_text()
    assert "(videos/reach-v3_ep000_success.mp4)" in md and "| max steps | 9 |" in md  # a meta without `protocol`
