"""The rollout engine on a toy environment: results independent of batching and worker counts, crashes and hangs
retried, failures reported rather than hung on."""

from __future__ import annotations

import time

import numpy as np
import pytest

from roboscale.configs.rollout import RolloutConfig
from roboscale.errors import CheckpointError
from roboscale.rollout.engine import EnvSetup, RolloutEngine
from roboscale.rollout.episode import EpisodeJob
from roboscale.rollout.noise import chunk_noise
from roboscale.rollout.queues import ActionQueue
from tests.models.helpers import tiny_policy

FAKE = "tests.rollout.fake_envs:SPEC"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy") / "pretrained_model"
    tiny_policy().save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def markers(tmp_path, monkeypatch):
    monkeypatch.setenv("ROBOSCALE_FAKE_ENV_MARKERS", str(tmp_path))  # spawned workers inherit it


def setup_for(checkpoint: str, max_steps: int = 24) -> EnvSetup:
    cams = {"corner2": "corner2", "wrist": "wrist"}
    return EnvSetup(FAKE, checkpoint, n_action_steps=3,
                    env_options={"image_size": 32, "cameras": cams, "max_steps": max_steps})


def jobs_for(tasks: list[str], episodes: int) -> list[EpisodeJob]:
    return [EpisodeJob(t, i, seed=100 * k + i) for k, t in enumerate(tasks) for i in range(episodes)]


def outcomes(results):
    return [(r.task, r.episode, r.success, r.steps) for r in results]


def test_an_action_queue_executes_n_action_steps_of_each_chunk_and_reset_drops_the_rest():
    queue = ActionQueue(3)
    queue.fill(np.arange(12).reshape(6, 2))
    assert [queue.pop().tolist() for _ in range(3)] == [[0, 1], [2, 3], [4, 5]] and not queue
    queue.fill(np.ones((6, 2)))
    queue.reset()
    assert len(queue) == 0


def test_episode_noise_depends_on_the_episode_and_chunk_only():
    assert np.array_equal(chunk_noise(7, 2, (6, 4)), chunk_noise(7, 2, (6, 4)))
    assert not np.array_equal(chunk_noise(7, 2, (6, 4)), chunk_noise(7, 3, (6, 4)))
    assert not np.array_equal(chunk_noise(7, 2, (6, 4)), chunk_noise(8, 2, (6, 4)))


def test_batched_and_unbatched_inference_give_the_same_episodes(checkpoint):
    """One env per worker predicting for itself (batches of one) vs two workers of three envs each behind a server
    that batches across them: every episode takes the same steps to the same outcome, with the same rewards."""
    jobs = jobs_for(["reach", "reach-far"], 4)
    alone, _ = RolloutEngine(RolloutConfig(workers=1, envs_per_worker=1, inference="worker"),
                             setup_for(checkpoint)).run(jobs)
    batched, stats = RolloutEngine(RolloutConfig(workers=2, envs_per_worker=3, max_batch_size=8,
                                                 batch_timeout_ms=20), setup_for(checkpoint)).run(jobs)
    assert outcomes(alone) == outcomes(batched)
    np.testing.assert_allclose([r.sum_reward for r in alone], [r.sum_reward for r in batched], rtol=1e-5)
    assert stats.mean_batch_size > 1.5  # it did batch
    assert stats.env_steps == sum(r.steps for r in batched)
    assert len({r.steps for r in batched}) > 1  # episodes of different lengths: queues out of step


def test_results_do_not_depend_on_the_number_of_workers_or_envs(checkpoint):
    jobs = jobs_for(["reach"], 6)
    one, _ = RolloutEngine(RolloutConfig(workers=1, envs_per_worker=2), setup_for(checkpoint)).run(jobs)
    three, _ = RolloutEngine(RolloutConfig(workers=3, envs_per_worker=1, sub_batches=1),
                             setup_for(checkpoint)).run(jobs)
    assert outcomes(one) == outcomes(three)
    assert [r.episode for r in one] == list(range(6))  # in job order


@pytest.mark.parametrize("task, reason", [("crash-once", "died (killed by signal 9)"),
                                          ("hang-once", "silent for 4 s")])
def test_a_crashed_or_hung_simulator_is_retried_and_reported(checkpoint, task, reason):
    """One env per worker, so that each crash is charged to the episode that caused it."""
    jobs = jobs_for([task, "reach"], 2)
    clean, _ = RolloutEngine(RolloutConfig(workers=2, envs_per_worker=1), setup_for(checkpoint)).run(
        [EpisodeJob("reach", j.episode, j.seed) for j in jobs])
    start = time.monotonic()
    results, stats = RolloutEngine(RolloutConfig(workers=2, envs_per_worker=1, watchdog_s=4),
                                   setup_for(checkpoint)).run(jobs)
    assert time.monotonic() - start < 120
    assert len(results) == 4 and all(r.error is None for r in results)
    retried = {(r.task, r.episode): r.attempts for r in results}
    assert retried[(task, 0)] == 2 and retried[(task, 1)] == 2  # each failed once, on its first attempt
    assert all(retry.task == task and reason in retry.reason for retry in stats.retries)
    assert stats.restarts >= 1
    # the retried episodes ran normally: the same steps as the well-behaved env gives for the same seeds
    assert [(r.success, r.steps) for r in results] == [(r.success, r.steps) for r in clean]


def test_an_episode_that_always_fails_counts_as_a_failure_after_its_retries(checkpoint):
    results, stats = RolloutEngine(RolloutConfig(workers=1, envs_per_worker=2, max_retries=1),
                                   setup_for(checkpoint)).run(jobs_for(["raise-always", "reach"], 1))
    failed, fine = results
    assert not failed.success and failed.attempts == 2 and "the simulator diverged" in failed.error
    assert fine.error is None and fine.attempts == 1
    assert [r.attempt for r in stats.retries] == [1, 2]


def test_a_server_that_cannot_load_the_policy_is_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    with pytest.raises(CheckpointError):
        RolloutEngine(RolloutConfig(workers=1, envs_per_worker=1), setup_for(str(tmp_path / "missing"))).run(
            jobs_for(["reach"], 1))
    assert time.monotonic() - start < 60
