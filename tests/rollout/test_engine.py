"""The rollout engine on a toy environment: results independent of batching and worker counts, crashes and hangs
retried, failures reported rather than hung on."""

from __future__ import annotations

import time

import numpy as np
import pytest

from roboscale.configs.rollout import RolloutConfig, RunnerConfig
from roboscale.errors import CheckpointError
from roboscale.rollout.engine import RolloutEngine, task_turns
from roboscale.rollout.episode import EpisodeJob
from roboscale.rollout.noise import chunk_noise
from roboscale.rollout.queues import ActionQueue
from tests.rollout.helpers import jobs_for, outcomes, setup_for


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
    batched, stats = RolloutEngine(RolloutConfig(workers=2, envs_per_worker=3, inference="server",
                                                 runner=RunnerConfig(max_batch_size=8, batch_timeout_ms=20)),
                                   setup_for(checkpoint)).run(jobs)
    assert outcomes(alone) == outcomes(batched)
    np.testing.assert_allclose([r.sum_reward for r in alone], [r.sum_reward for r in batched], rtol=1e-5)
    assert stats.mean_batch_size > 1.5  # it did batch
    assert stats.env_steps == sum(r.steps for r in batched)
    assert len({r.steps for r in batched}) > 1  # episodes of different lengths: queues out of step
    # a worker that predicts for itself batches all its environments at once (its sub-batches could not overlap)
    local, local_stats = RolloutEngine(RolloutConfig(workers=1, envs_per_worker=3, sub_batches=3,
                                                     inference="worker"), setup_for(checkpoint)).run(jobs)
    assert outcomes(local) == outcomes(alone)
    assert local_stats.mean_batch_size > 1.5


def test_a_batch_goes_as_soon_as_every_group_with_episodes_has_asked(checkpoint):
    """A minute-long batch timeout is never waited out: not while all groups step, not at the end of the run when
    groups run out of episodes (each worker says how many of its groups have some), and not with fewer jobs than
    the workers' credits (dealt to every worker, not all to the first)."""
    start = time.monotonic()
    results, stats = RolloutEngine(RolloutConfig(workers=2, envs_per_worker=2, sub_batches=1, inference="server",
                                                 runner=RunnerConfig(batch_timeout_ms=60_000)),
                                   setup_for(checkpoint)).run(jobs_for(["reach", "reach-far"], 3))
    assert time.monotonic() - start < 60
    assert set(stats.batching.reasons) == {"all_waiting"} and stats.inference_calls > 0
    assert stats.batching.sizes[4] > 0  # both workers' requests in one batch


def test_jobs_are_dealt_in_turns_over_their_tasks_each_task_in_its_order():
    jobs = jobs_for(["reach", "reach-far"], 3) + jobs_for(["crash-once"], 1)
    assert [(j.task, j.episode) for j in task_turns(jobs)] == [
        ("reach", 0), ("reach-far", 0), ("crash-once", 0), ("reach", 1), ("reach-far", 1), ("reach", 2),
        ("reach-far", 2)]


def test_environments_are_built_once_per_slot_and_task(checkpoint):
    """Runs of several tasks, again and again (RL steps, evaluations): an environment keeps to its task where the
    jobs allow, and one that had to change tasks keeps the last as a spare; episodes on kept environments are the
    same."""
    mixed = jobs_for(["reach", "reach-far"], 2)
    with RolloutEngine(RolloutConfig(workers=1, envs_per_worker=2, spare_envs=0), setup_for(checkpoint)) as engine:
        first, first_stats = engine.run(mixed)
        again, again_stats = engine.run(mixed)
    assert outcomes(again) == outcomes(first)
    assert (first_stats.envs_made, again_stats.envs_made) == (2, 0)  # one environment per task, not per episode

    near, far = jobs_for(["reach"], 2), jobs_for(["reach-far"], 2)
    made = {}
    for spare in (1, 0):
        with RolloutEngine(RolloutConfig(workers=1, envs_per_worker=1, spare_envs=spare),
                           setup_for(checkpoint)) as engine:
            before, _ = engine.run(near)
            engine.run(far)
            after, stats = engine.run(near)
        assert outcomes(after) == outcomes(before)
        made[spare] = stats.envs_made
    assert made == {1: 0, 0: 1}


def test_results_do_not_depend_on_the_number_of_workers_or_envs(checkpoint):
    jobs = jobs_for(["reach"], 6)
    one, _ = RolloutEngine(RolloutConfig(workers=1, envs_per_worker=2), setup_for(checkpoint)).run(jobs)
    three, _ = RolloutEngine(RolloutConfig(workers=3, envs_per_worker=1, sub_batches=1),
                             setup_for(checkpoint)).run(jobs)
    assert outcomes(one) == outcomes(three)
    assert [r.episode for r in one] == list(range(6))  # in job order


@pytest.mark.parametrize("task, reason", [("crash-once", "died (killed by signal 9)"),
                                          pytest.param("hang-once", "silent for 4 s", marks=pytest.mark.slow)])
def test_a_crashed_or_hung_simulator_is_retried_and_reported(checkpoint, task, reason):
    """One env per worker, so that each crash is charged to the episode that caused it (dealt in turns over
    tasks and workers, both misbehaving episodes go to one worker, one after the other)."""
    jobs = jobs_for([task, "reach"], 2)
    clean, _ = RolloutEngine(RolloutConfig(workers=2, envs_per_worker=1), setup_for(checkpoint)).run(
        [EpisodeJob("reach", i, j.seed) for i, j in enumerate(jobs)])  # distinct keys, the same seeds
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


def _kill_servers() -> list[int]:
    import multiprocessing
    import os
    import signal

    killed = []
    for process in multiprocessing.active_children():
        if process.name.startswith("rollout-server"):
            os.kill(process.pid, signal.SIGKILL)
            killed.append(process.pid)
    return killed


def test_a_killed_inference_server_is_replaced_and_every_episode_ends_as_without_it(checkpoint):
    """The server dies after the first episode's result: a new pool starts, the unfinished episodes start again
    (no attempt charged to them) and every episode ends as in an undisturbed run."""
    jobs = jobs_for(["reach", "reach-far"], 3)
    cfg = RolloutConfig(workers=2, envs_per_worker=2, inference="server")
    clean, _ = RolloutEngine(cfg, setup_for(checkpoint)).run(jobs)
    killed: list[int] = []

    def kill_once(result) -> None:
        if not killed:
            killed.extend(_kill_servers())

    start = time.monotonic()
    results, stats = RolloutEngine(cfg, setup_for(checkpoint)).run(jobs, on_result=kill_once)
    assert len(killed) == 1 and stats.restarts == 1 and time.monotonic() - start < 120
    assert outcomes(results) == outcomes(clean)
    np.testing.assert_allclose([r.sum_reward for r in results], [r.sum_reward for r in clean], rtol=1e-5)
    assert all(r.error is None and r.attempts == 1 for r in results) and not stats.retries


def test_servers_that_keep_dying_end_the_run_with_an_error(checkpoint):
    from roboscale.errors import WorkerError

    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"the inference servers keep failing .*server0: the inference server "
                                          r"died \(killed by signal 9\)\); gave up after 2 restarts"):
        RolloutEngine(RolloutConfig(workers=1, envs_per_worker=2, max_retries=1, inference="server"),
                      setup_for(checkpoint)).run(jobs_for(["reach"], 8), on_result=lambda result: _kill_servers())
    assert time.monotonic() - start < 120
