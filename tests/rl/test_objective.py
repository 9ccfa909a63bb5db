"""The policy-gradient objective on hand-made chunks: its value, its gradient's direction, clipping, and the
episode-weighted metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roboscale.configs.rl import RLOptions
from roboscale.configs.rollout import SDESampler
from roboscale.models.flow_matching import sampled_log_density
from roboscale.rl.batching import chunk_batches
from roboscale.rl.objective import PolicyGradientLoss
from roboscale.rollout.trajectory import ChunkRecord, Trajectory
from tests.models.helpers import CAMERAS, tiny_policy

SAMPLER = SDESampler()  # the episodes are sampled as the objective's default sampler scores them
NOISE = SAMPLER.noise_level


class _Result:
    """What the engine returns for an episode, as far as the RL data source reads it."""

    def __init__(self, episode: int, trajectory: Trajectory):
        self.episode, self.trajectory = episode, trajectory
        self.success, self.steps = trajectory.success, sum(c.executed for c in trajectory.chunks)


def _episode(policy, episode: int, chunks: int, success: bool, seed: int) -> _Result:
    """An episode whose chunks were sampled by ``policy`` with the stochastic sampler."""
    cfg = policy.config
    g = torch.Generator().manual_seed(seed)
    records = []
    for c in range(chunks):
        images = {k.removeprefix("observation.images."): torch.randint(0, 256, (32, 32, 3), generator=g,
                                                                       dtype=torch.uint8).numpy() for k in CAMERAS}
        state = torch.randn(4, generator=g).numpy()
        observation = {"observation.state": torch.from_numpy(state[None]), "task": ["Open a drawer"],
                       **{k: torch.from_numpy(images[k.removeprefix("observation.images.")].transpose(2, 0, 1)[None]
                                              .copy()) for k in CAMERAS}}
        noise = torch.randn(1, cfg.chunk_size, cfg.action_dim, generator=g)
        steps = torch.randn(1, cfg.num_inference_steps, cfg.chunk_size, cfg.action_dim, generator=g)
        actions, chain, _ = policy.sample_action_chain(observation, noise, steps, noise_level=NOISE)
        executed = cfg.n_action_steps if c < chunks - 1 else 1
        density = sampled_log_density(steps, None, cfg.num_inference_steps, NOISE)[0].numpy()
        records.append(ChunkRecord(state, images, "Open a drawer", chain[0].numpy(),
                                   np.ones(cfg.num_inference_steps, bool), density, actions[0].numpy(), executed,
                                   np.zeros(executed, np.float32), 0))
    return _Result(episode, Trajectory("drawer-open", episode, 0, episode, records, success, success))


@pytest.fixture(scope="module")
def setup():
    policy = tiny_policy()
    policy.eval()
    results = [_episode(policy, 0, 3, True, 1), _episode(policy, 1, 2, False, 2)]
    return policy, results


def _batch(policy, results, advantages):
    (batch,) = chunk_batches(results, np.asarray(advantages, np.float32), np.array([1.0, 0.0], np.float32),
                             image_keys=list(policy.config.image_keys), state_key=policy.config.state_key,
                             action_dim=policy.config.action_dim, max_chunks=16)
    return batch


def test_on_policy_the_loss_is_minus_the_mean_advantage_and_metrics_are_episode_means(setup) -> None:
    policy, results = setup
    loss, metrics = PolicyGradientLoss(RLOptions(), SAMPLER)(policy, _batch(policy, results, [1.0, -1.0]))
    # on-policy the ratio is 1 (up to float32 rounding of the recorded against the recomputed log-probabilities):
    # each episode's chunks average to its advantage, the episodes average to 0
    torch.testing.assert_close(loss, torch.tensor(0.0), atol=1e-6, rtol=0)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5) and metrics["clip_fraction"] == 0
    assert metrics["success"] == pytest.approx(0.5)  # 1 of 2 episodes, whatever their lengths (3 and 2 chunks)
    n_steps = policy.config.n_action_steps
    assert metrics["episode_steps"] == pytest.approx(((2 * n_steps + 1) + (n_steps + 1)) / 2)  # a mean over episodes
    assert metrics["episodes"] == pytest.approx(2.0) and metrics["chunks"] == 5
    n = policy.config.n_action_steps * 4
    loss_one, _ = PolicyGradientLoss(RLOptions(), SAMPLER)(policy, _batch(policy, results, [1.0, 0.0]))
    assert loss_one.item() == pytest.approx(-0.5 / n, rel=1e-5)  # (1 + 0) / 2 episodes, over n entries


def test_the_recorded_log_prob_is_the_one_the_trainer_recomputes(setup) -> None:
    """The sampler records each entry's density from its draws alone; recomputed through the policy's velocity
    from the recorded chain, the executed entries give the same chunk log-probabilities."""
    policy, results = setup
    batch = _batch(policy, results, [1.0, -1.0])
    with torch.no_grad():
        encoded = policy.encode(batch["observation"], cache=True)
        recomputed = policy.flow_matching.chain_log_prob(lambda x, t: policy.velocity(encoded, x, t),
                                                         batch["chain"], policy.config.num_inference_steps, NOISE,
                                                         batch["mask"], batch["stochastic"])
    torch.testing.assert_close(batch["old_log_prob"], recomputed, rtol=1e-4, atol=1e-3)


def test_the_gradient_raises_the_likelihood_of_a_positive_advantage(setup) -> None:
    """One small step along the loss's gradient makes the chunks of the episode with A > 0 likelier."""
    policy, results = setup
    objective = PolicyGradientLoss(RLOptions(), SAMPLER)
    batch = _batch(policy, results, [1.0, 0.0])
    policy.zero_grad()
    loss, _ = objective(policy, batch)
    loss.backward()

    def log_prob() -> torch.Tensor:
        with torch.no_grad():
            encoded = policy.encode(batch["observation"], cache=True)
            return policy.flow_matching.chain_log_prob(lambda x, t: policy.velocity(encoded, x, t), batch["chain"],
                                                       policy.config.num_inference_steps, NOISE, batch["mask"],
                                                      batch["stochastic"])

    before = log_prob()
    saved = [p.detach().clone() for p in policy.parameters()]
    with torch.no_grad():
        for p in policy.parameters():
            if p.grad is not None:
                p -= 1e-3 * p.grad
    after = log_prob()
    with torch.no_grad():
        for p, old in zip(policy.parameters(), saved, strict=True):
            p.copy_(old)
    assert (after[:3] - before[:3]).sum() > 0  # the successful episode's 3 chunks


def test_a_ratio_outside_the_clip_range_stops_pulling(setup) -> None:
    policy, results = setup
    batch = _batch(policy, results, [1.0, 1.0])
    objective = PolicyGradientLoss(RLOptions(clip=0.2), SAMPLER)
    _, metrics = objective(policy, batch)
    with torch.no_grad():
        encoded = policy.encode(batch["observation"], cache=True)
        current = policy.flow_matching.chain_log_prob(lambda x, t: policy.velocity(encoded, x, t), batch["chain"],
                                                      policy.config.num_inference_steps, NOISE, batch["mask"],
                                                      batch["stochastic"])
    batch["old_log_prob"] = current - 1.0  # ratio e > 1 + clip for every chunk, all advantages positive
    policy.zero_grad()
    loss, metrics = objective(policy, batch)
    loss.backward()
    assert metrics["clip_fraction"] == pytest.approx(1.0)
    assert all(p.grad is None or not p.grad.any() for p in policy.parameters())
