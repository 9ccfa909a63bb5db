"""Trajectory records for RL: what the policy saw and sampled, chunk by chunk, with the executed steps and their
rewards; the stochastic sampler (sde) against the deterministic one (ode); records independent of the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roboscale.configs.rollout import ODESampler, RolloutConfig, RunnerConfig, SDESampler
from roboscale.errors import ConfigError
from roboscale.models.policy import Policy
from roboscale.rollout.engine import RolloutEngine
from roboscale.rollout.episode import EpisodeJob
from tests.rollout.helpers import jobs_for, setup_for

MAX_STEPS, N_ACTION_STEPS = 12, 3
EXACT = {"runner": RunnerConfig(max_batch_size=1, threads=1)}


def rl_jobs() -> list[EpisodeJob]:
    """Seeds 0-5 (some succeed early, some end on the env's own limit, seed 5 is cut at max_steps), and a GRPO-like
    pair: episode 3's initial state with other noise, and with its own seed given as the noise seed."""
    jobs = jobs_for(["reach"], 6, record_trajectory=True)
    return [*jobs, EpisodeJob("reach", 6, seed=3, noise_seed=1003, record_trajectory=True),
            EpisodeJob("reach", 7, seed=3, noise_seed=3, record_trajectory=True), EpisodeJob("reach", 8, seed=4)]


def rollout(checkpoint: str, sampler: str, workers: int, envs: int, on_result=None):
    chosen = SDESampler(noise_level=0.5, sde_steps=0) if sampler == "sde" else ODESampler()  # every step noisy
    cfg = RolloutConfig(workers=workers, envs_per_worker=envs, sampler=chosen, **EXACT)
    results, _ = RolloutEngine(cfg, setup_for(checkpoint, max_steps=MAX_STEPS)).run(rl_jobs(), on_result)
    return results


@pytest.fixture(scope="module")
def sde(checkpoint):
    seen = []
    results = rollout(checkpoint, "sde", workers=1, envs=2, on_result=seen.append)
    return results, seen


def same_chunks(a, b) -> bool:
    return len(a) == len(b) and all(
        x.executed == y.executed and x.version == y.version and x.instruction == y.instruction
        and all(np.array_equal(u, v) for u, v in ((x.state, y.state), (x.chunk, y.chunk), (x.rewards, y.rewards)))
        and (x.chain is None if y.chain is None else np.array_equal(x.chain, y.chain))
        for x, y in zip(a, b, strict=True))


def test_a_trajectory_covers_its_episode_chunk_by_chunk(sde, checkpoint):
    results, seen = sde
    policy = Policy.from_pretrained(checkpoint)
    steps = policy.config.num_inference_steps
    for result in results[:8]:
        trajectory = result.trajectory
        assert (trajectory.task, trajectory.episode, trajectory.seed) == (result.task, result.episode, result.seed)
        assert trajectory.success == result.success
        records = trajectory.chunks
        assert sum(c.executed for c in records) == result.steps
        assert all(c.executed == N_ACTION_STEPS for c in records[:-1]) and 1 <= records[-1].executed <= 3
        rewards = np.concatenate([c.rewards for c in records])
        assert rewards.dtype == np.float32 and len(rewards) == result.steps
        assert rewards.sum() == pytest.approx(result.sum_reward, rel=1e-5)
        assert rewards.max() == pytest.approx(result.max_reward, rel=1e-5)
        for record in records:
            assert record.chain.shape == (steps + 1, policy.config.chunk_size, policy.config.action_dim)
            assert record.chunk.shape == (policy.config.chunk_size, 4) and record.version == 0
            normalized = policy.action_normalizer.normalize(torch.from_numpy(record.chunk)).numpy()
            np.testing.assert_allclose(record.chain[-1], normalized, rtol=0, atol=1e-5)
            assert record.instruction == "Reach the goal" and set(record.images) == {"corner2", "wrist"}
            assert record.images["corner2"].shape == (32, 32, 3) and record.state.shape == (4,)
        # ended by success or the env's own limit (seed % 5 steps before max_steps), or cut at max_steps
        assert trajectory.terminated == (result.success or result.steps < MAX_STEPS)
    assert {r.trajectory.terminated for r in results[:8]} == {True, False}  # both kinds occurred
    assert results[8].trajectory is None  # not asked for
    assert all("trajectory" not in r.to_dict() for r in results)  # episodes.jsonl's record is as it was
    assert sorted(map(id, seen)) == sorted(map(id, results))  # on_result got the same results, trajectories too


def test_the_noise_seed_changes_the_sampling_not_the_scene(sde):
    results, _ = sde
    own, other, explicit = results[3].trajectory, results[6].trajectory, results[7].trajectory
    assert (own.noise_seed, other.noise_seed, explicit.noise_seed) == (3, 1003, 3)
    assert np.array_equal(own.chunks[0].state, other.chunks[0].state)  # the same initial state
    assert not np.array_equal(own.chunks[0].chain, other.chunks[0].chain)
    assert same_chunks(own.chunks, explicit.chunks)  # noise_seed=None draws from the seed


def test_sde_trajectories_do_not_depend_on_the_layout_and_differ_from_ode(sde, checkpoint):
    """1 worker of 2 envs vs 2 workers of 1 env, one observation per policy call: bit for bit the same chains,
    actions and rewards. The deterministic sampler, from the same starting noise, predicts other actions."""
    results, _ = sde
    spread = rollout(checkpoint, "sde", workers=2, envs=1)
    for a, b in zip(results[:8], spread[:8], strict=True):
        assert same_chunks(a.trajectory.chunks, b.trajectory.chunks)
    ode = rollout(checkpoint, "ode", workers=1, envs=2)
    first = ode[0].trajectory.chunks[0]
    assert first.chain is None
    assert np.array_equal(first.state, results[0].trajectory.chunks[0].state)
    assert not np.allclose(first.chunk, results[0].trajectory.chunks[0].chunk, atol=1e-3)


def test_the_sde_sampler_needs_a_positive_noise_level_and_ode_has_no_noise_options():
    from roboscale.config import parse

    with pytest.raises(ConfigError, match=r"^--rollout.sampler.noise_level must be > 0, got 0"):
        parse(RolloutConfig, ["--sampler=sde", "--sampler.noise_level=0"])
    with pytest.raises(ConfigError, match=r"sampler.type: 'euler' is not one of \['ode', 'sde'\]"):
        parse(RolloutConfig, ["--sampler=euler"])
    with pytest.raises(ConfigError, match=r"sampler: unknown option\(s\) \['noise_level'\]"):  # ode has none
        parse(RolloutConfig, ["--sampler.noise_level=0.3"])
