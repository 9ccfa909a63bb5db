"""The rollout engine on Ray: env workers and the inference server run as Ray tasks, talking through Ray queues,
with the same results as local processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from roboscale.configs.rollout import RolloutConfig
from tests.models.helpers import tiny_policy

pytest.importorskip("ray")


@pytest.mark.slow
def test_an_evaluation_on_ray_matches_the_local_one(tmp_path):
    checkpoint = tmp_path / "ckpt" / "pretrained_model"
    tiny_policy().save_pretrained(checkpoint)
    common = [sys.executable, "-m", "roboscale", "eval", f"--checkpoint={checkpoint}", "--tasks=[reach]",
              "--episodes=3", "--max_steps=10", "--videos_per_task=0", "--rollout.workers=2",
              "--rollout.envs_per_worker=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
    local = subprocess.run([*common, f"--output_dir={tmp_path / 'local'}"], env=env, capture_output=True,
                           text=True, timeout=600, check=False)
    assert local.returncode == 0, local.stderr[-2000:]
    on_ray = subprocess.run([*common, f"--output_dir={tmp_path / 'ray'}", "--rollout.ray_address=local",
                             "--rollout.worker_cpus=0.5"], env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert on_ray.returncode == 0, on_ray.stderr[-2000:]

    def episodes(name):
        report = json.loads((tmp_path / name / "report.json").read_text())
        return [(e["episode"], e["seed"], e["steps"], e["success"], round(e["sum_reward"], 4))
                for e in report["episodes"]], report["timing"]

    (local_episodes, _), (ray_episodes, ray_timing) = episodes("local"), episodes("ray")
    assert ray_episodes == local_episodes
    assert ray_timing["env_steps"] == 30 and ray_timing["inference_calls"] > 0


def test_device_auto_on_a_ray_cluster_asks_the_cluster_and_the_predicting_processes_reserve_its_gpus(monkeypatch):
    """A Ray task sees no GPU unless it reserves one: ``auto`` must be decided by the cluster's resources, and the
    servers (or, without servers, the workers that predict) must then ask Ray for the GPU."""
    import queue

    import ray

    from roboscale.rollout.engine import EnvSetup, _Pool
    from roboscale.rollout.launch import RayLauncher

    launcher = object.__new__(RayLauncher)  # no cluster needed to resolve the device
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 2.0})
    assert launcher.device("auto") == "cuda" and launcher.device("cpu") == "cpu"
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    assert launcher.device("auto") == "cpu"

    class Recording:
        def __init__(self, device):
            self.started, self._device = {}, device

        def device(self, requested):
            return self._device

        def channel(self):
            return queue.Queue()

        def start(self, target, args, *, name, cpus=1.0, gpus=0.0):
            self.started[name] = gpus

    setup = EnvSetup("metaworld", "ckpt", 4)
    for inference, device, expected in (
            ("server", "cuda", {"rollout-server0": 1.0, "rollout-worker0": 0.0, "rollout-worker1": 0.0}),
            ("worker", "cuda", {"rollout-worker0": 0.5, "rollout-worker1": 0.5}),
            ("server", "cpu", {"rollout-server0": 0.0, "rollout-worker0": 0.0, "rollout-worker1": 0.0}),
            # auto: a server where the policy runs on a GPU, the workers themselves on the CPU
            ("auto", "cuda", {"rollout-server0": 1.0, "rollout-worker0": 0.0, "rollout-worker1": 0.0}),
            ("auto", "cpu", {"rollout-worker0": 0.0, "rollout-worker1": 0.0})):
        recording = Recording(device)
        _Pool(RolloutConfig(workers=2, inference=inference), setup, recording, 0)
        assert recording.started == expected, (inference, device)
