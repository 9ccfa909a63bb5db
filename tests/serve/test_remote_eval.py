"""`roboscale eval --rollout.server=ws://...`: env workers against a running `roboscale serve` end every episode as
local inference does; what is evaluated comes from the server, and a --checkpoint that is not its policy is
refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from roboscale.configs.eval import EvalConfig
from roboscale.configs.rollout import RolloutConfig, RunnerConfig, SDESampler
from roboscale.errors import ConfigError
from roboscale.eval.closed_loop import evaluate
from tests.models.helpers import tiny_policy
from tests.serve.conftest import served

FAKE = "tests.rollout.fake_envs:SPEC"


def _episodes(directory):
    report = json.loads((directory / "report.json").read_text())
    return report, [(e["task"], e["episode"], e["seed"], e["steps"], e["success"]) for e in report["episodes"]]


def test_remote_inference_ends_every_episode_as_local_inference(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ROBOSCALE_FAKE_ENV_MARKERS", str(tmp_path))
    protocol = {"env": FAKE, "tasks": ["reach", "reach-far"], "episodes": 4, "max_steps": 20, "videos_per_task": 0}
    evaluate(EvalConfig(checkpoint=checkpoint, output_dir=str(tmp_path / "local"), **protocol,
                        rollout=RolloutConfig(workers=1, envs_per_worker=2, inference="worker")), progress=False)
    (tmp_path / "key").write_text("eval-key\n")
    with served(checkpoint=checkpoint, api_key_file=str(tmp_path / "key"),
                runner=RunnerConfig(batch_timeout_ms=20)) as (server, url):
        remote = evaluate(EvalConfig(output_dir=str(tmp_path / "remote"), **protocol, rollout=RolloutConfig(
            workers=2, envs_per_worker=2, server=url, server_api_key_file=str(tmp_path / "key"))), progress=False)
        batches = server.batcher.stats().sizes
    local_report, local = _episodes(tmp_path / "local")
    remote_report, served_episodes = _episodes(tmp_path / "remote")
    assert served_episodes == local and len(local) == 8
    np.testing.assert_allclose([e["sum_reward"] for e in remote_report["episodes"]],
                               [e["sum_reward"] for e in local_report["episodes"]], rtol=1e-5)
    assert remote_report["checkpoint_sha256"] == local_report["checkpoint_sha256"]
    assert remote_report["server"] == url and remote["overall"]["episodes"] == 8
    assert max(batches) > 1  # the environments of both workers were predicted together


def test_what_is_evaluated_comes_from_the_server(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ROBOSCALE_FAKE_ENV_MARKERS", str(tmp_path))
    other_config = tmp_path / "other-config" / "pretrained_model"
    tiny_policy(chunk_size=8).save_pretrained(other_config)  # the same weights (none depends on the chunk size)
    other_weights = tiny_policy()
    with torch.no_grad():
        next(other_weights.parameters()).add_(1.0)
    other_weights.save_pretrained(tmp_path / "other-weights" / "pretrained_model")
    with served(checkpoint=checkpoint) as (_, url):
        # the command, in a fresh interpreter: the policy's config type is known from the metadata alone
        run = subprocess.run([sys.executable, "-m", "roboscale", "eval", f"--rollout.server={url}", f"--env={FAKE}",
                              "--tasks=[reach]", "--episodes=2", "--max_steps=10", "--rollout.workers=1",
                              f"--output_dir={tmp_path / 'cli'}"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads((tmp_path / "cli" / "report.json").read_text())["server"] == url
        assert list((tmp_path / "cli").rglob("*.mp4"))  # the fake env has no video camera: the policy's first one
        rollout = RolloutConfig(workers=1, envs_per_worker=1, server=url)
        with pytest.raises(ConfigError, match="--output_dir is required with --rollout.server"):
            evaluate(EvalConfig(env=FAKE, tasks=["reach"], episodes=1, rollout=rollout), progress=False)
        for other, differ in (("other-config", "configs"), ("other-weights", "weights")):
            with pytest.raises(ConfigError, match=f"is not the policy .* serves .*: their {differ} differ"):
                evaluate(EvalConfig(checkpoint=str(tmp_path / other), env=FAKE, tasks=["reach"], episodes=1,
                                    rollout=rollout, output_dir=str(tmp_path / "eval")), progress=False)
        evaluate(EvalConfig(checkpoint=checkpoint, env=FAKE, tasks=["reach"], episodes=1, rollout=rollout,
                            videos_per_task=0, output_dir=str(tmp_path / "same")), progress=False)  # its own: runs
    with pytest.raises(ConfigError, match="--rollout.server must be a ws://HOST:PORT address"):
        RolloutConfig(server="http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match="--rollout.sampler=sde needs the policy here"):
        RolloutConfig(server="ws://127.0.0.1:8000", sampler=SDESampler())
