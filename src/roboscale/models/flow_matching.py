"""Flow matching for action chunks: the one implementation both policies use.

A policy states its time convention: ``data_at=0`` is pi0's (t = 1 is noise, t = 0 the actions:
x_t = t * noise + (1 - t) * actions, velocity noise - actions), ``data_at=1`` GR00T's (t = 0 noise, t = 1 the
actions: x_t = (1 - t) * noise + t * actions, velocity actions - noise). Each convention keeps its own time
distribution and Euler schedule exactly as its reference implementation computes them, so a checkpoint trained
under one samples the same under the other's code path.

The objective is apart from the model (``roboscale.models.objective.flow_matching_loss``): the policy encodes an
observation and predicts a velocity; the noise and time draws, the interpolation and the sampler live here.
Another objective (RL's) drives the same model through the same two calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from roboscale.models.rtc import Guide, guided_velocity


@dataclass(frozen=True)
class FlowMatching:
    data_at: int
    """The time at which x_t is the actions: 0 (pi0, pi0.5) or 1 (GR00T)."""
    time_alpha: float = 1.5
    """Training time from Beta(alpha, beta): alpha > 1 puts more samples near pure noise, where the velocity can
    only come from the observation (pi0.5 and GR00T: 1.5)."""
    time_beta: float = 1.0
    noise_s: float = 0.999
    """GR00T's s in t = (s - u) / s (its time never reaches the noise end exactly)."""

    def __post_init__(self) -> None:
        if self.data_at not in (0, 1):
            raise ValueError(f"data_at must be 0 or 1, got {self.data_at}")

    def sample_time(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """Training times [B], drawn on the CPU from torch's global RNG (whose state checkpoints keep, so a resumed
        run draws the same times)."""
        u = torch.distributions.Beta(torch.tensor(self.time_alpha), torch.tensor(self.time_beta)).sample((batch_size,))
        return self.time_from_beta(u).to(device)

    def time_from_beta(self, u: torch.Tensor) -> torch.Tensor:
        """A Beta(alpha, beta) draw -> this convention's training time."""
        if self.data_at == 0:
            return u * 0.999 + 0.001  # pi0: t in [0.001, 1], near 1 (noise) likelier
        return (self.noise_s - u) / self.noise_s  # GR00T: near 0 (noise) likelier

    def draws_per_sample(self, seeds: torch.Tensor, shape: tuple[int, ...], device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(noise [B, *shape], t [B]) drawn from each sample's own seed (long [B], the loader's ``sample_seed``):
        what a sample draws depends on the sample and its place in the run, not on which rank computes it or
        what else is in its micro-batch, so 1 and N data-parallel ranks draw the same (numpy's PCG64: the same
        numbers on every platform)."""
        noise, u = [], []
        for seed in seeds.tolist():
            rng = np.random.default_rng(seed)
            u.append(rng.beta(self.time_alpha, self.time_beta))
            noise.append(rng.standard_normal(shape, dtype=np.float32))
        t = self.time_from_beta(torch.tensor(u, dtype=torch.float32))
        return torch.from_numpy(np.stack(noise)).to(device), t.to(device)

    def interpolate(self, actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_t, target velocity dx/dt) for actions/noise [B, T, A] and t [B]."""
        t = t[:, None, None]
        if self.data_at == 0:
            return t * noise + (1.0 - t) * actions, noise - actions
        return (1 - t) * noise + t * actions, actions - noise

    @torch.no_grad()
    def sample(self, velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
               steps: int, guide: Guide | None = None) -> torch.Tensor:
        """Actions from noise [B, T, A] by ``steps`` Euler steps of ``velocity(x_t, t[B])``. ``guide``: real-time
        chunking (``roboscale.models.rtc``), each step's velocity corrected towards the committed actions (one
        backward pass through ``velocity`` per step); None: the plain sampler, untouched."""
        if guide is not None:
            velocity = partial(guided_velocity, velocity, guide=guide, data_at=self.data_at)
        x = noise
        b = x.shape[0]
        if self.data_at == 0:  # from t = 1 down to 0
            dt = -1.0 / steps
            for i in range(steps):
                t = torch.full((b,), 1.0 + i * dt, device=x.device, dtype=x.dtype)
                x = x + dt * velocity(x, t)
            return x
        for i in range(steps):  # from t = 0 up to 1
            t = torch.full((b,), i / steps, device=x.device)
            x = x + velocity(x, t) / steps
        return x

    # --- Flow-SDE: the same flow as a stochastic process, so that a sampled chunk has a likelihood (RL) --------
    def times(self, steps: int) -> list[float]:
        """The Euler schedule's times t_0 .. t_K (noise end first), as ``sample`` steps through them."""
        if self.data_at == 0:
            return [1.0 - i / steps for i in range(steps + 1)]
        return [i / steps for i in range(steps + 1)]

    def sde_step(self, x: torch.Tensor, v: torch.Tensor, t: float | torch.Tensor, steps: int,
                 noise_level: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation of x at the next time of the schedule, from x at time ``t`` and the
        predicted velocity ``v`` there, under the SDE whose marginals are the flow's (Flow-SDE; see
        docs/architecture.md): with n(t) the noise fraction of x_t (t for pi0's convention, 1 - t for GR00T's),
        the score is -(x + (1 - n) v') / n where v' is the velocity towards the noise end, and

            mean = x + dt * v  -  |dt| * (g^2 / 2) * (x + (1 - n) v') / n,     std = g * sqrt(|dt|)

        for a step dt towards the data end and noise level g. ``t`` and ``g`` are numbers or per-sample tensors
        [B] (a deterministic step of the hybrid sampler has g = 0: exactly ``sample``'s Euler step)."""
        dt = 1.0 / steps
        t, g = _per_sample(t, x), _per_sample(noise_level, x)
        if self.data_at == 0:  # t goes down; v = noise - actions points at the noise end
            n, towards_noise, euler = t, v, x - dt * v
        else:  # t goes up; v = actions - noise points at the data end
            n, towards_noise, euler = 1.0 - t, -v, x + dt * v
        correction = (g ** 2 / 2) * (x + (1.0 - n) * towards_noise) / n.clamp_min(1e-6)
        return euler - dt * correction, g * dt ** 0.5

    def sample_chain(self, velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                     step_noise: torch.Tensor, steps: int, noise_level: float,
                     stochastic: torch.Tensor | None = None) -> torch.Tensor:
        """Flow-SDE sampling: the chain x_0 (= ``noise``) .. x_K (the sampled actions), float [B, K + 1, T, A].
        ``step_noise`` [B, K, T, A]: the standard normal draws of the K steps (drawn per episode and chunk by the
        caller, as ``noise`` is, so a sample does not depend on its batch). ``stochastic`` [B, K] bool: the steps
        that draw noise, the others are the ODE's (πRL's hybrid ODE-SDE sampling); None: all of them."""
        x, chain = noise, [noise]
        times = self.times(steps)
        for k in range(steps):
            t = torch.full((x.shape[0],), times[k], device=x.device, dtype=x.dtype)
            g = noise_level if stochastic is None else noise_level * stochastic[:, k].to(x.device, x.dtype)
            mean, std = self.sde_step(x, velocity(x, t), t, steps, g)
            x = mean + std * step_noise[:, k].to(mean.dtype)
            chain.append(x)
        return torch.stack(chain, 1)

    def chain_log_prob(self, velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], chain: torch.Tensor,
                       steps: int, noise_level: float, mask: torch.Tensor | None = None,
                       stochastic: torch.Tensor | None = None) -> torch.Tensor:
        """log p [B] of recorded chains [B, K + 1, T, A] under ``velocity`` (differentiable): the sum of the
        Gaussian densities of the stochastic steps (``stochastic`` [B, K] bool, the same number per sample; None:
        all K), each given the recorded x_k it started from (the denoising steps are steps of the decision process,
        so a deterministic step adds nothing and costs no velocity), over the entries ``mask`` [B, T, A] keeps (the
        action steps an environment executed, the dataset's action dimensions: the rest never reached the world).
        """
        if noise_level <= 0:
            raise ValueError("a likelihood needs a stochastic sampler: noise_level > 0")
        b = chain.shape[0]
        if stochastic is None:
            chosen = torch.arange(steps, device=chain.device).expand(b, steps)
        else:
            counts = stochastic.sum(1)
            if b and not bool((counts == counts[0]).all()):
                raise ValueError("every chain of a batch must have the same number of stochastic steps")
            chosen = stochastic.to(chain.device).nonzero()[:, 1].view(b, -1)  # row-major: each sample's, in order
        times = torch.tensor(self.times(steps), device=chain.device, dtype=chain.dtype)
        rows = torch.arange(b, device=chain.device)
        total = chain.new_zeros(b)
        for k in chosen.unbind(1):
            x, t = chain[rows, k], times[k]
            mean, std = self.sde_step(x, velocity(x, t), t, steps, noise_level)
            density = gaussian_log_density(chain[rows, k + 1], mean, std)
            total = total + (density if mask is None else density * mask).flatten(1).sum(1)
        return total


def sampled_log_density(step_noise: torch.Tensor, stochastic: torch.Tensor | None, steps: int,
                        noise_level: float) -> torch.Tensor:
    """[B, T, A]: the log-density of each entry of chains ``sample_chain`` drew, summed over their stochastic steps,
    under the weights that drew them. A stochastic step's x_{k+1} is mean + std * eps, so its density is that of
    the standard draw eps alone (no velocity is needed): what the acting policy's log-probability was, recorded
    with each chunk for the importance ratio of later updates."""
    std = noise_level * (1.0 / steps) ** 0.5
    density = -0.5 * step_noise.float() ** 2 - math.log(std) - 0.5 * math.log(2 * math.pi)  # [B, K, T, A]
    if stochastic is not None:
        density = density * stochastic.to(density.device, density.dtype)[:, :, None, None]
    return density.sum(1)


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A number or a per-sample tensor [B] as a tensor that broadcasts over ``like`` [B, ...]."""
    value = torch.as_tensor(value, device=like.device, dtype=like.dtype)
    return value.view(-1, *([1] * (like.dim() - 1))) if value.dim() else value


def gaussian_log_density(x: torch.Tensor, mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2)."""
    std = torch.as_tensor(std, device=x.device, dtype=x.dtype)
    return -0.5 * ((x - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)


def sample_seeds(batch: Any) -> torch.Tensor | None:
    """The loader's per-sample seeds (long [B]) of a dict batch or a PackedBatch, if it has them."""
    seeds = batch.get("sample_seed") if isinstance(batch, dict) else getattr(batch, "sample_seed", None)
    return seeds if isinstance(seeds, torch.Tensor) and seeds.numel() else None
