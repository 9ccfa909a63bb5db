"""`roboscale eval` end to end: MetaWorld through the rollout engine, the protocol in the report, resume after an
interruption, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from roboscale.configs.eval import EvalConfig
from roboscale.configs.rollout import RolloutConfig, RunnerConfig
from roboscale.errors import CheckpointError, ConfigError
from roboscale.eval.closed_loop import evaluate
from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig
from tests.models.helpers import tiny_policy

FAKE = "tests.rollout.fake_envs:SPEC"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tiny_policy().save_pretrained(path / "pretrained_model")
    return path


def test_the_same_seed_places_the_same_scene_in_any_process():
    """The seed protocol: reset(seed) alone fixes the initial state (here and in a fresh interpreter)."""
    code = ("from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig; import sys; "
            "e = MetaWorldEnv('pick-place', RenderConfig(16, 16, {})); "
            "sys.stdout.write(','.join(repr(float(x)) for x in e.reset(1234)['full_state']))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    with MetaWorldEnv("pick-place", RenderConfig(16, 16, {})) as env:
        here = env.reset(1234)["full_state"]
        assert np.array_equal(here, env.reset(1234)["full_state"])
        assert not np.array_equal(here, env.reset(1235)["full_state"])
    assert [float(x) for x in other.split(",")] == here.tolist()


def test_batched_and_unbatched_evaluations_of_the_real_policy_agree_in_metaworld(checkpoint, tmp_path):
    """fp32 pi0.5 (tiny) in MetaWorld: one env per worker predicting alone vs a server batching two workers'
    envs give the same episodes."""
    base = EvalConfig(checkpoint=str(checkpoint), tasks=["reach", "drawer-open"], episodes=3, max_steps=12,
                      videos_per_task=0)
    alone = evaluate(EvalConfig(**{**base.__dict__, "output_dir": str(tmp_path / "alone"),
                                   "rollout": RolloutConfig(workers=1, envs_per_worker=1, inference="worker")}),
                     progress=False)
    batched = evaluate(EvalConfig(**{**base.__dict__, "output_dir": str(tmp_path / "batched"),
                                     "rollout": RolloutConfig(workers=2, envs_per_worker=3, runner=RunnerConfig(batch_timeout_ms=50),
                                                                     inference="server")}),
                       progress=False)
    a = json.loads((tmp_path / "alone" / "report.json").read_text())["episodes"]
    b = json.loads((tmp_path / "batched" / "report.json").read_text())["episodes"]
    assert [(e["task"], e["episode"], e["seed"], e["steps"], e["success"]) for e in a] == \
           [(e["task"], e["episode"], e["seed"], e["steps"], e["success"]) for e in b]
    # float32 rounding of batched matrix products (tests/faults/test_eval_faults.py): about 1e-8..1e-6 relative
    np.testing.assert_allclose([e["sum_reward"] for e in a], [e["sum_reward"] for e in b], rtol=1e-5)
    assert batched["timing"]["mean_batch_size"] > 1.5 and alone["timing"]["mean_batch_size"] == 1.0


def test_the_report_records_the_protocol_and_keeps_videos(checkpoint, tmp_path):
    cfg = EvalConfig(checkpoint=str(checkpoint), tasks=["reach"], episodes=3, max_steps=5, videos_per_task=2,
                     output_dir=str(tmp_path / "eval"), rollout=RolloutConfig(workers=1, envs_per_worker=2))
    summary = evaluate(cfg, progress=False)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    protocol = report["protocol"]
    assert protocol["seed"] == 1000 and protocol["max_steps"] == 5 and protocol["image_size"] == 32
    assert protocol["n_action_steps"] == 3 and protocol["num_inference_steps"] == 3
    assert protocol["cameras"] == {"corner2": "corner2", "wrist": "gripperPOV"}
    assert protocol["instructions"] == {"reach-v3": "Reach a goal position"}
    assert len(report["checkpoint_sha256"]) == 64
    assert [e["steps"] for e in report["episodes"]] == [5, 5, 5] and summary["overall"]["success_rate"] == 0.0
    videos = [e["video"] for e in report["episodes"] if e["video"]]
    assert len(videos) == 2 and all((tmp_path / "eval" / v).is_file() for v in videos)
    assert len(list((tmp_path / "eval" / "videos").glob("*.mp4"))) == 2  # the third recorded one is not kept
    assert report["timing"]["env_steps"] == 15


def test_an_interrupted_evaluation_resumes_with_the_episodes_it_had(checkpoint, tmp_path, monkeypatch):
    """Kill an evaluation once some episodes are in episodes.jsonl; the rerun runs only the others and the report
    equals an uninterrupted run's."""
    out = tmp_path / "eval"
    args = [sys.executable, "-m", "roboscale", "eval", f"--checkpoint={checkpoint}", f"--env={FAKE}",
            "--tasks=[reach, reach-far]", "--episodes=4", "--max_steps=20", "--videos_per_task=0",
            "--rollout.workers=1", "--rollout.envs_per_worker=1", f"--output_dir={out}"]
    env = {**os.environ, "ROBOSCALE_FAKE_ENV_MARKERS": str(tmp_path), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    log = out / "episodes.jsonl"
    try:
        while process.poll() is None and not (log.is_file() and log.read_text().count("\n") >= 3):
            try:
                process.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        assert process.poll() is None, "the evaluation ended before it could be interrupted"
        os.killpg(process.pid, 9)
    finally:
        process.wait()
    with open(log, "ab") as f:
        f.write(b'{"task": "reach-far", "epis')  # a line torn by the kill
    finished = log.read_text().count("\n")
    assert 3 <= finished < 8
    monkeypatch.setenv("ROBOSCALE_FAKE_ENV_MARKERS", str(tmp_path))
    cfg = EvalConfig(checkpoint=str(checkpoint), env=FAKE, tasks=["reach", "reach-far"], episodes=4, max_steps=20,
                     videos_per_task=0, output_dir=str(out), rollout=RolloutConfig(workers=1, envs_per_worker=1))
    resumed = evaluate(cfg, progress=False)
    assert resumed["timing"]["episodes_resumed"] == finished and resumed["timing"]["episodes_run"] == 8 - finished
    evaluate(EvalConfig(**{**cfg.__dict__, "output_dir": str(tmp_path / "fresh")}), progress=False)
    strip = [{k: v for k, v in e.items() if k != "wall_s"}
             for e in json.loads((out / "report.json").read_text())["episodes"]]
    assert strip == [{k: v for k, v in e.items() if k != "wall_s"}
                     for e in json.loads((tmp_path / "fresh" / "report.json").read_text())["episodes"]]
    assert len(log.read_text().splitlines()) == 8
    with pytest.raises(ConfigError, match="differs in: max_steps"):
        evaluate(EvalConfig(**{**cfg.__dict__, "max_steps": 21}), progress=False)


def test_an_instruction_override_reaches_the_policy(checkpoint, tmp_path):
    cfg = EvalConfig(checkpoint=str(checkpoint), tasks=["faucet-open"], episodes=1, max_steps=3, videos_per_task=0,
                     instructions={"faucet-open": "Rotate the faucet clockwise"}, output_dir=str(tmp_path))
    evaluate(cfg, progress=False)
    protocol = json.loads((tmp_path / "report.json").read_text())["protocol"]
    assert protocol["instructions"] == {"faucet-open-v3": "Rotate the faucet clockwise"}


def test_bad_input_is_one_clear_error(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="no policy checkpoint here"):
        evaluate(EvalConfig(checkpoint=str(tmp_path)), progress=False)
    with pytest.raises(ConfigError, match="unknown MetaWorld task 'reachh'"):
        evaluate(EvalConfig(checkpoint=str(checkpoint), tasks=["reachh"]), progress=False)
    with pytest.raises(ConfigError, match="cannot be rendered by the fake-point environment"):
        evaluate(EvalConfig(checkpoint=str(checkpoint), env=FAKE, tasks=["broken-camera"],
                            output_dir=str(tmp_path / "e")), progress=False)
    with pytest.raises(ConfigError, match="unknown environment 'gazebo'"):
        evaluate(EvalConfig(checkpoint=str(checkpoint), env="gazebo"), progress=False)


def test_a_policy_reading_the_environment_state_gets_it_in_evaluation(tmp_path):
    """A policy trained on observation.environment_state (MetaWorld's 39-d observation, goal included) is given
    that vector by the env, not the 4-d proprioception; an env without it is a one-line error."""
    from roboscale.models.registry import build_policy
    from roboscale.sim.metaworld import FULL_STATE_DIM
    from tests.models.helpers import fake_meta, tiny_config

    meta = fake_meta(state_dim=FULL_STATE_DIM)
    meta.stats["observation.environment_state"] = meta.stats.pop("observation.state")
    meta.features["observation.environment_state"] = meta.features.pop("observation.state")
    policy = build_policy(tiny_config(state_key="observation.environment_state"), meta)
    assert policy.config.state_dim == FULL_STATE_DIM
    policy.save_pretrained(tmp_path / "ckpt" / "pretrained_model")
    summary = evaluate(EvalConfig(checkpoint=str(tmp_path / "ckpt"), tasks=["reach"], episodes=2, max_steps=6,
                                  videos_per_task=0, output_dir=str(tmp_path / "eval")), progress=False)
    assert summary["timing"]["env_steps"] == 12
    protocol = json.loads((tmp_path / "eval" / "report.json").read_text())["protocol"]
    assert protocol["state_feature"] == "observation.environment_state"
    with MetaWorldEnv("reach", RenderConfig(16, 16, {}), state_feature="observation.environment_state") as env:
        observation = env.reset(3)
        np.testing.assert_array_equal(observation["state"], observation["full_state"].astype(np.float32))
    with pytest.raises(ConfigError, match="state feature 'observation.environment_state'.*fake-point"):
        evaluate(EvalConfig(checkpoint=str(tmp_path / "ckpt"), env=FAKE, tasks=["reach"],
                            output_dir=str(tmp_path / "e")), progress=False)
    with pytest.raises(ConfigError, match="state feature 'observation.joints' is not one MetaWorld gives"):
        MetaWorldEnv("reach", RenderConfig(16, 16, {}), state_feature="observation.joints")


def test_the_pairs_suite_holds_the_instruction_only_pairs():
    from roboscale.sim.metaworld import INSTRUCTION_PAIRS, resolve_tasks

    tasks = resolve_tasks(["pairs"])
    assert ("faucet-open-v3", "faucet-close-v3") in INSTRUCTION_PAIRS and len(tasks) == 2 * len(INSTRUCTION_PAIRS)
    with MetaWorldEnv("door-lock", RenderConfig(32, 32, {"corner2": "corner2"})) as a, \
            MetaWorldEnv("door-unlock", RenderConfig(32, 32, {"corner2": "corner2"})) as b:
        difference = np.abs(a.reset(5)["images"]["corner2"].astype(float) - b.reset(5)["images"]["corner2"]).mean()
    assert difference < 2.0  # only the instruction tells them apart
