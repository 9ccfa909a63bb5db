"""A long-lived engine (RL's loop: roll out, train, publish weights, roll out again): one pool across runs, weights
published on its channel with a version reaching every process that predicts, and a pool restarted after a crash
that predicts with the published weights, not the checkpoint's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from roboscale.configs.rollout import RolloutConfig, RunnerConfig
from roboscale.errors import CheckpointError
from roboscale.rollout import engine as engine_module
from roboscale.rollout.engine import RolloutEngine
from roboscale.rollout.weights import WeightChannel
from tests.models.helpers import tiny_policy
from tests.rollout.helpers import CountingLauncher, jobs_for, outcomes, setup_for

EXACT = {"runner": RunnerConfig(max_batch_size=1, threads=1)}  # every policy call the same computation: bit-identical


@pytest.fixture
def launcher(monkeypatch) -> CountingLauncher:
    launcher = CountingLauncher()
    monkeypatch.setattr(engine_module, "launcher_for", lambda address, resources=None: launcher)
    return launcher


def perturbed_state(scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The checkpoint's state with every parameter moved a little (what a training step publishes)."""
    policy = tiny_policy()
    generator = torch.Generator().manual_seed(1)
    state = policy.state_dict()
    for name, parameter in policy.named_parameters():
        state[name] = parameter.detach() + scale * torch.randn(parameter.shape, generator=generator)
    return state


def published(state: dict[str, torch.Tensor], version: int) -> WeightChannel:
    channel = WeightChannel()
    channel.publish(state, version)
    return channel


def chunks(results) -> list[np.ndarray]:
    return [c.chunk for r in results for c in r.trajectory.chunks]


def versions(results) -> set[int]:
    return {c.version for r in results for c in r.trajectory.chunks}


def same_trajectories(a, b) -> bool:
    return outcomes(a) == outcomes(b) and all(
        x.executed == y.executed and np.array_equal(x.chunk, y.chunk) and np.array_equal(x.rewards, y.rewards)
        for ra, rb in zip(a, b, strict=True)
        for x, y in zip(ra.trajectory.chunks, rb.trajectory.chunks, strict=True))


@pytest.mark.parametrize("inference", ["server", "worker"])
def test_a_started_engine_keeps_its_pool_across_runs_and_takes_new_weights(checkpoint, launcher, inference):
    """Servers (or, with inference=worker, the workers that predict) load the policy once for three runs; the
    published weights change the actions, and every chunk says which weights predicted it."""
    jobs = jobs_for(["reach"], 2, record_trajectory=True)
    cfg = RolloutConfig(workers=2, envs_per_worker=1, inference=inference, **EXACT)
    channel = WeightChannel()
    with RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=channel) as engine:
        first, _ = engine.run(jobs)
        again, _ = engine.run(jobs)
        channel.publish(perturbed_state(), version=7)  # returns at once: the next run takes them
        assert not channel.wait_acknowledged(7, timeout=0)
        updated, stats = engine.run(jobs)
        assert engine.version == 7 and channel.wait_acknowledged(7, timeout=0)
    expected = {"rollout-worker0": 1, "rollout-worker1": 1}
    if inference == "server":
        expected["rollout-server0"] = 1
    assert launcher.starts == expected  # one pool: the policy was loaded once per process
    assert same_trajectories(first, again) and versions(first) == {0}
    assert versions(updated) == {7}
    assert not np.array_equal(chunks(first)[0], chunks(updated)[0])
    # each run reports its own work, though the processes live on
    assert stats.env_steps == sum(r.steps for r in updated) and stats.inference_calls == len(chunks(updated))


def test_a_pool_restarted_after_a_crash_predicts_with_the_published_weights(checkpoint, launcher):
    """A worker dies in the first run after an update: the new pool loads the published weights before it gets a
    job, so every episode, the restarted ones too, is what a run without the crash gives with those weights."""
    state = perturbed_state()
    jobs = jobs_for(["crash-once", "reach"], 1, record_trajectory=True)
    cfg = RolloutConfig(workers=2, envs_per_worker=1, inference="server", **EXACT)
    channel = WeightChannel()
    with RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=channel) as engine:
        channel.publish(state, version=3)
        crashed, stats = engine.run(jobs)
    assert stats.restarts == 1 and launcher.starts["rollout-server0"] == 2
    assert [r.attempts for r in crashed] == [2, 1] and versions(crashed) == {3}
    # the reference: a one-shot engine given the weights before it starts (the crash marker is left: no crash)
    reference = RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=published(state, 3))
    clean, clean_stats = reference.run(jobs)
    assert clean_stats.restarts == 0
    assert same_trajectories(crashed, clean) and versions(clean) == {3}


def test_a_generator_killed_mid_run_is_replaced_by_one_with_the_published_weights(checkpoint, launcher):
    """The inference server (RL's generator) dies after the first episode of a run that follows an update: the
    new pool's server loads the published weights, the unfinished episodes start again, no attempt is charged,
    and every trajectory is the one a run without the kill gives."""
    from tests.rollout.test_engine import _kill_servers

    state = perturbed_state()
    jobs = jobs_for(["reach", "reach-far"], 2, record_trajectory=True)
    cfg = RolloutConfig(workers=2, envs_per_worker=1, inference="server", **EXACT)
    killed: list[int] = []
    channel = WeightChannel()
    with RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=channel) as engine:
        channel.publish(state, version=4)
        results, stats = engine.run(jobs, on_result=lambda r: killed or killed.extend(_kill_servers()))
    assert len(killed) == 1 and stats.restarts == 1 and launcher.starts["rollout-server0"] == 2
    assert all(r.attempts == 1 for r in results) and versions(results) == {4}
    reference = RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=published(state, 4))
    clean, _ = reference.run(jobs)
    assert same_trajectories(results, clean)


def test_weights_the_policy_refuses_are_an_error_and_the_last_good_ones_stay_published(checkpoint):
    good, bad = perturbed_state(), perturbed_state()
    missing = min(bad)
    del bad[missing]
    jobs = jobs_for(["reach"], 1, record_trajectory=True)
    channel = WeightChannel()
    refusal = f"1 tensors missing for this policy \\(first: '{missing}'\\)"
    with RolloutEngine(RolloutConfig(workers=1, envs_per_worker=1), setup_for(checkpoint, max_steps=6),
                       weights=channel) as engine:
        channel.publish(good, version=1)
        assert versions(engine.run(jobs)[0]) == {1}
        channel.publish(bad, version=2)
        with pytest.raises(CheckpointError, match=refusal):
            engine.run(jobs)
        assert engine.version == 1 and channel.version == 1
        with pytest.raises(CheckpointError, match=refusal):  # whoever waits for them is told
            channel.wait_acknowledged(2, timeout=0)
        results, _ = engine.run(jobs)  # on a new pool (the refusing server ended), with version 1
    assert versions(results) == {1}


def test_run_is_not_reentrant_and_weights_published_during_a_run_wait_for_the_next(checkpoint):
    """A run acts with the weights it started with, whatever is published meanwhile (from ``on_result`` here,
    which does not wait)."""
    channel = WeightChannel()
    engine = RolloutEngine(RolloutConfig(workers=1, envs_per_worker=1), setup_for(checkpoint, max_steps=3),
                           weights=channel)
    refused = []

    def on_result(result):
        with pytest.raises(RuntimeError, match="between runs") as info:
            engine.run(jobs_for(["reach"], 1))
        refused.append(info.value)
        channel.publish(perturbed_state(), version=1)

    jobs = jobs_for(["reach"], 2, record_trajectory=True)
    results, _ = engine.run(jobs, on_result)
    assert len(results) == 2 and len(refused) == 2 and versions(results) == {0} and engine.version == 0
    assert not channel.wait_acknowledged(1, timeout=0)
    again, _ = engine.run(jobs)
    assert versions(again) == {1} and engine.version == 1 and channel.wait_acknowledged(1, timeout=0)


@pytest.mark.parametrize("inference", ["server", "worker"])
def test_a_stream_takes_jobs_and_weights_as_they_come(checkpoint, launcher, inference):
    """RL's asynchronous driver: one stream fed a first batch of jobs, then, once an episode of it has ended, new
    weights and a second batch. The new weights reach every process before any later job is dealt: those jobs act
    with them from their first chunk, and are what a run that starts with those weights gives; the results go to
    on_result as they come."""
    state = perturbed_state()
    first = jobs_for(["reach"], 2, record_trajectory=True)
    later = [dataclasses.replace(job, episode=job.episode + 10) for job in first]
    cfg = RolloutConfig(workers=2, envs_per_worker=1, inference=inference, **EXACT)
    channel = WeightChannel()
    arrived, batches = [], [later, first]

    def jobs():
        if len(batches) == 2:
            return batches.pop()
        if not arrived:
            return []
        if batches:  # the engine takes the weights after this call, before it deals these jobs
            channel.publish(state, 5)
            return batches.pop()
        return None

    with RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=channel) as engine:
        stats = engine.stream(jobs, on_result=arrived.append)
    assert len(arrived) == 4 and channel.wait_acknowledged(5, timeout=0)
    by_episode = {r.episode: r for r in arrived}
    assert all(versions([by_episode[j.episode]]) == {5} for j in later)  # acted with the new weights throughout
    reference = RolloutEngine(cfg, setup_for(checkpoint, max_steps=9), weights=published(state, 5))
    clean, _ = reference.run(later)
    assert same_trajectories([by_episode[j.episode] for j in later], clean)
    assert stats.env_steps == sum(r.steps for r in arrived)
