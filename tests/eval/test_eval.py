import json

import pytest

from roboscale.configs.eval import EvalConfig
from roboscale.eval.closed_loop import evaluate
from roboscale.eval.rollout import RolloutJob, run_episode
from roboscale.errors import CheckpointError
from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig
from tests.models.helpers import tiny_policy


def test_an_episode_runs_in_closed_loop_and_is_reproducible(tmp_path):
    policy = tiny_policy().eval()
    cams = {"corner2": "corner2", "wrist": "gripperPOV"}
    job = RolloutJob("", "reach-v3", 0, seed=3, max_steps=12, record_video=True, video_dir=str(tmp_path),
                     image_size=32, cameras=cams, video_camera="corner2")
    with MetaWorldEnv("reach-v3", RenderConfig(32, 32, cams), max_episode_steps=12) as env:
        first = run_episode(policy, env, job)
        second = run_episode(policy, env, job)
    assert first.steps == 12 and not first.success  # an untrained policy does not reach the goal in 12 steps
    assert (first.sum_reward, first.steps) == (second.sum_reward, second.steps)  # same seed, same episode
    assert first.video and (tmp_path / first.video.split("/")[-1]).stat().st_size > 0


def test_evaluate_writes_reports_for_a_saved_checkpoint(tmp_path):
    policy = tiny_policy()
    policy.save_pretrained(tmp_path / "ckpt" / "pretrained_model")
    cfg = EvalConfig(checkpoint=str(tmp_path / "ckpt"), tasks=["reach"], episodes=2, max_steps=5, workers=1,
                     videos_per_task=1, output_dir=str(tmp_path / "eval"))
    summary = evaluate(cfg, progress=False)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["per_task"]["reach-v3"]["episodes"] == 2
    assert [e["steps"] for e in report["episodes"]] == [5, 5]
    assert summary["overall"]["success_rate"] == 0.0
    assert "| reach-v3 |" in (tmp_path / "eval" / "report.md").read_text()
    assert "<video" in (tmp_path / "eval" / "report.html").read_text()
    assert len(list((tmp_path / "eval" / "videos").glob("*.mp4"))) == 1


def test_evaluate_refuses_a_directory_without_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no policy checkpoint here"):
        evaluate(EvalConfig(checkpoint=str(tmp_path)), progress=False)


def test_an_instruction_override_reaches_the_policy(tmp_path, monkeypatch):
    policy = tiny_policy().eval()
    seen = []
    original = policy.predict_action_chunk

    def spy(obs):
        seen.append(obs["task"][0])
        return original(obs)

    monkeypatch.setattr(policy, "predict_action_chunk", spy)
    cams = {"corner2": "corner2", "wrist": "gripperPOV"}
    with MetaWorldEnv("faucet-open", RenderConfig(32, 32, cams), max_episode_steps=4) as env:
        job = RolloutJob("", "faucet-open-v3", 0, seed=1, max_steps=4, record_video=False, video_dir="",
                         image_size=32, cameras=cams, instruction="Rotate the faucet clockwise")
        run_episode(policy, env, job)
        run_episode(policy, env, RolloutJob("", "faucet-open-v3", 0, 1, 4, False, "", 32, cams))
    assert seen[0] == "Rotate the faucet clockwise"
    assert seen[-1] == "Rotate the faucet counter-clockwise"  # the task's own description by default
