"""The stochastic flow sampler (Flow-SDE): its chains, and log-probabilities that equal a direct Gaussian
computation."""

from __future__ import annotations

import math

import pytest
import torch

from roboscale.models.flow_matching import FlowMatching

STEPS, B, T, A = 5, 3, 4, 2


def _velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A smooth field that depends on x and t, like a policy's."""
    return torch.tanh(x) * (1 + t[:, None, None]) - 0.3 * x.flip(-1)


@pytest.mark.parametrize("data_at", [0, 1])
def test_without_noise_the_chain_is_the_euler_sampler(data_at: int) -> None:
    flow = FlowMatching(data_at)
    noise = torch.randn(B, T, A, generator=torch.Generator().manual_seed(0))
    chain = flow.sample_chain(_velocity, noise, torch.zeros(B, STEPS, T, A), STEPS, noise_level=0.0)
    assert chain.shape == (B, STEPS + 1, T, A) and torch.equal(chain[:, 0], noise)
    torch.testing.assert_close(chain[:, -1], flow.sample(_velocity, noise, STEPS), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("data_at", [0, 1])
def test_the_chain_log_prob_equals_the_sum_of_its_gaussian_steps(data_at: int) -> None:
    """Recomputed step by step here, with the SDE's mean written out: pi0 (noise at t = 1, v = noise - actions)
    and GR00T (noise at t = 0, v = actions - noise)."""
    flow, g = FlowMatching(data_at), 0.7
    gen = torch.Generator().manual_seed(1)
    noise, draws = torch.randn(B, T, A, generator=gen), torch.randn(B, STEPS, T, A, generator=gen)
    chain = flow.sample_chain(_velocity, noise, draws, STEPS, g)
    mask = (torch.rand(B, T, A, generator=gen) > 0.3).float()
    dt, std = 1.0 / STEPS, g * math.sqrt(1.0 / STEPS)
    expected = torch.zeros(B)
    for k in range(STEPS):
        x = chain[:, k]
        t = (1.0 - k * dt) if data_at == 0 else k * dt
        v = _velocity(x, torch.full((B,), t))
        if data_at == 0:  # score -(x + (1 - t) v) / t, stepping down in t
            mean = x - dt * v - dt * (g ** 2 / 2) * (x + (1 - t) * v) / t
        else:  # score -(x - t v) / (1 - t), stepping up in t
            mean = x + dt * v - dt * (g ** 2 / 2) * (x - t * v) / (1 - t)
        torch.testing.assert_close(chain[:, k + 1], mean + std * draws[:, k], rtol=1e-5, atol=1e-5)
        density = torch.distributions.Normal(mean, std).log_prob(chain[:, k + 1])
        expected += (density * mask).flatten(1).sum(1)
    got = flow.chain_log_prob(_velocity, chain, STEPS, g, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_the_log_prob_is_differentiable_in_the_velocity_field() -> None:
    flow = FlowMatching(0)
    scale = torch.tensor(1.0, requires_grad=True)
    noise, draws = torch.randn(B, T, A), torch.randn(B, STEPS, T, A)
    chain = flow.sample_chain(_velocity, noise, draws, STEPS, 0.5)
    log_prob = flow.chain_log_prob(lambda x, t: scale * _velocity(x, t), chain, STEPS, 0.5)
    log_prob.sum().backward()
    assert scale.grad is not None and torch.isfinite(scale.grad) and scale.grad.abs() > 0


def test_the_sde_marginal_matches_the_flow_in_one_dimension() -> None:
    """With the exact velocity of a 1-d Gaussian target, the SDE's samples have the target's mean and spread
    (the drift correction keeps the flow's marginals; plain Euler plus noise would widen them)."""
    target_mean, target_std, steps, n = 2.0, 0.5, 200, 20000
    flow = FlowMatching(1)  # x_t = (1 - t) noise + t a, a ~ N(m, s^2)

    def exact(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t[:, None, None]
        var = (1 - t) ** 2 + (t * target_std) ** 2
        mean_a = target_mean + t * target_std ** 2 * (x - t * target_mean) / var
        mean_e = (1 - t) * (x - t * target_mean) / var
        return mean_a - mean_e

    gen = torch.Generator().manual_seed(3)
    noise, draws = torch.randn(n, 1, 1, generator=gen), torch.randn(n, steps, 1, 1, generator=gen)
    samples = flow.sample_chain(exact, noise, draws, steps, noise_level=0.8)[:, -1].flatten()
    assert abs(samples.mean().item() - target_mean) < 0.03
    assert abs(samples.std().item() - target_std) < 0.03


@pytest.mark.parametrize("data_at", [0, 1])
def test_the_hybrid_sampler_draws_noise_only_at_its_stochastic_steps(data_at: int) -> None:
    """πRL's hybrid ODE-SDE sampling: the deterministic steps are the ODE's Euler steps, the stochastic ones the
    SDE's, and the log-probability is the Gaussian density of the stochastic steps alone, each given the recorded
    state it started from."""
    flow, g = FlowMatching(data_at), 0.6
    gen = torch.Generator().manual_seed(4)
    noise, draws = torch.randn(B, T, A, generator=gen), torch.randn(B, STEPS, T, A, generator=gen)
    stochastic = torch.zeros(B, STEPS, dtype=torch.bool)
    stochastic[torch.arange(B), torch.tensor([0, 2, 4])] = True  # one step each, a different one per sample
    chain = flow.sample_chain(_velocity, noise, draws, STEPS, g, stochastic)
    dt, std = 1.0 / STEPS, g * math.sqrt(1.0 / STEPS)
    expected = torch.zeros(B)
    for k in range(STEPS):
        x = chain[:, k]
        t = (1.0 - k * dt) if data_at == 0 else k * dt
        mean_sde, _ = flow.sde_step(x, _velocity(x, torch.full((B,), t)), t, STEPS, g)
        euler = x - dt * _velocity(x, torch.full((B,), t)) if data_at == 0 else x + dt * _velocity(x, torch.full(
            (B,), t))
        for b in range(B):
            if stochastic[b, k]:
                torch.testing.assert_close(chain[b, k + 1], mean_sde[b] + std * draws[b, k], rtol=1e-5, atol=1e-5)
                expected[b] += torch.distributions.Normal(mean_sde[b], std).log_prob(chain[b, k + 1]).sum()
            else:
                torch.testing.assert_close(chain[b, k + 1], euler[b], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(flow.chain_log_prob(_velocity, chain, STEPS, g, None, stochastic), expected,
                               rtol=1e-5, atol=1e-4)


def test_the_hybrid_log_prob_runs_the_velocity_once_per_stochastic_step() -> None:
    flow, calls = FlowMatching(0), []

    def counted(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls.append(t.clone())
        return _velocity(x, t)

    stochastic = torch.zeros(B, STEPS, dtype=torch.bool)
    stochastic[:, 1] = stochastic[:, 3] = True
    chain = flow.sample_chain(_velocity, torch.randn(B, T, A), torch.randn(B, STEPS, T, A), STEPS, 0.5, stochastic)
    flow.chain_log_prob(counted, chain, STEPS, 0.5, None, stochastic)
    assert len(calls) == 2
    torch.testing.assert_close(torch.stack(calls), torch.tensor([[1 - 1 / STEPS] * B, [1 - 3 / STEPS] * B]))
    uneven = stochastic.clone()
    uneven[0, 0] = True
    with pytest.raises(ValueError, match="same number of stochastic steps"):
        flow.chain_log_prob(_velocity, chain, STEPS, 0.5, None, uneven)


def test_which_steps_are_stochastic_depends_on_the_episode_and_chunk_alone() -> None:
    from roboscale.rollout.noise import stochastic_steps

    picks = [stochastic_steps(12, c, 10, 1) for c in range(200)]
    assert all(p.sum() == 1 for p in picks)
    assert all((p == stochastic_steps(12, c, 10, 1)).all() for c, p in enumerate(picks))
    assert {int(p.argmax()) for p in picks} == set(range(10))  # every step gets its turn
    assert stochastic_steps(12, 0, 10, 0).all() and stochastic_steps(12, 0, 10, 10).all()
    assert stochastic_steps(12, 0, 10, 3).sum() == 3
