"""Flow matching for action chunks (pi0 convention: t=1 is noise, t=0 is data).

x_t = t * noise + (1 - t) * actions, the model predicts the velocity u = noise - actions, and sampling integrates
dx/dt = u from t=1 to t=0 with Euler steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def sample_time(batch_size: int, device: torch.device, alpha: float = 1.5, beta: float = 1.0) -> torch.Tensor:
    """t ~ Beta(alpha, beta) * 0.999 + 0.001; pi0/pi0.5 use Beta(1.5, 1): more weight near the noisy end.

    Draws from torch's global RNG, whose state the trainer checkpoints, so resumed runs continue exactly.
    """
    dist = torch.distributions.Beta(torch.tensor(alpha, device=device), torch.tensor(beta, device=device))
    return dist.sample((batch_size,)) * 0.999 + 0.001


def noisy_actions(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, target velocity) for actions/noise [B, T, A] and t [B]."""
    t = t[:, None, None]
    return t * noise + (1.0 - t) * actions, noise - actions


@torch.no_grad()
def euler_sample(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor, steps: int):
    """Integrate from t=1 (noise) to t=0 (actions) with ``steps`` Euler steps; velocity(x_t, t[B]) -> [B, T, A]."""
    x = noise
    dt = -1.0 / steps
    for i in range(steps):
        t = torch.full((x.shape[0],), 1.0 + i * dt, device=x.device, dtype=x.dtype)
        x = x + dt * velocity(x, t)
    return x
