"""Real-time chunking (RTC): a new action chunk denoised to agree with the actions the robot has already committed.

A chunking policy that keeps acting while its next chunk is being computed has to switch chunks mid-motion, and
two chunks sampled independently from a multimodal policy can disagree there (a jerk, or a switch between two
strategies). Real-time chunking ("Real-Time Execution of Action Chunking Flow Policies", Black, Galliker and
Levine, 2025) treats the switch as inpainting: at inference time, without retraining, each Euler step of the new
chunk is guided towards the previous chunk's actions that the robot will still execute (the first ``delay`` of
them, which run while the chunk is computed, fully; the rest of the previous chunk with decaying weights, so
the new chunk blends in; nothing after it).

The guidance is the paper's (ΠGDM-style) correction, in its time convention (tau: 0 noise -> 1 data,
A^tau = tau A + (1 - tau) eps, velocity v = A - eps): the predicted clean chunk is A_hat = A^tau + (1 - tau) v,
and the step's velocity becomes

    v + min(beta, c(tau)) * (Y - A_hat)^T diag(W) dA_hat/dA^tau,    c(tau) = (1 - tau) / tau / r^2,
    r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2)

for targets Y (the committed actions, normalized) and weights W (``prefix_weights``). The product with the
Jacobian is one vector-Jacobian product (``torch.autograd.grad`` of A_hat with respect to the noisy chunk, with
``W * (Y - A_hat)`` as the output gradient): the cost of one backward pass through the action model per step,
never the Jacobian itself. Only the action model is differentiated: the observation's encoding (pi0.5's prefix
keys/values) is computed once, without a graph, and shared by every step as in the unguided sampler.

Our samplers (``FlowMatching``) keep their policy's own time: GR00T's (``data_at=1``) is the paper's, tau = t
and v its velocity; pi0's (``data_at=0``: t = 1 noise, velocity noise - actions) has tau = 1 - t and the velocity
pointing the other way, so its A_hat is x - t v and the correction enters with a minus sign. Either way an Euler
step moves A_hat towards Y.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

SCHEDULES = ("exp", "linear", "ones", "zeros")
"""How the weights of the committed actions after the delay fall: ``exp`` (the paper's), ``linear``, ``ones`` (all
committed actions fully), ``zeros`` (only the delay's)."""


@dataclass(frozen=True)
class ChunkGuide:
    """What a robot has committed to, per sample, in the dataset's units: ``Policy.predict_action_chunk``'s input."""

    actions: torch.Tensor
    """float [B, chunk_size, A_data]: the previous chunk's actions not yet executed when the observation was taken,
    aligned with the new chunk (its step 0 is the observation's); entries from ``count`` on are ignored."""
    count: torch.Tensor
    """long [B]: how many of ``actions`` each sample has (n; 0: that sample is not guided)."""
    delay: torch.Tensor
    """long [B]: of those, how many the robot executes before the new chunk arrives (d <= n): frozen, weight 1."""
    schedule: str = "exp"
    max_guidance: float = 5.0
    """beta: the largest guidance weight (the paper's 5)."""


@dataclass(frozen=True)
class Guide:
    """What ``FlowMatching.sample`` is guided by, in the model's normalized action space."""

    target: torch.Tensor
    """float [B, T, A]: Y, the normalized committed actions (anything where the weight is 0)."""
    weights: torch.Tensor
    """float [B, T], or [B, T, A] to leave some action dimensions free (a fine-tuned policy's padded ones)."""
    beta: float


def prefix_weights(delay: int, committed: int, total: int, schedule: str = "exp") -> torch.Tensor:
    """float [total]: the guidance weight of each step of the new chunk. 1 for the ``delay`` steps that run before
    it arrives (they are executed from the previous chunk whatever the new one says), then falling from 1 to 0
    over the rest of the ``committed`` steps (the new chunk takes over gradually), 0 after them (nothing to agree
    with)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if not 0 <= delay <= committed <= total:
        raise ValueError(f"need 0 <= delay <= committed <= total, got delay={delay}, committed={committed}, "
                         f"total={total}")
    weights = torch.zeros(total)
    if schedule == "zeros":
        weights[:delay] = 1.0
        return weights
    if schedule == "ones":
        weights[:committed] = 1.0
        return weights
    weights[:delay] = 1.0
    decay = torch.linspace(1.0, 0.0, committed - delay + 2)[1:-1]  # strictly between the frozen 1 and the free 0
    if schedule == "exp":
        decay = decay * torch.expm1(decay) / (math.e - 1)  # the paper's: lets go of the committed actions sooner
    weights[delay:committed] = decay
    return weights


def guidance_weight(tau: torch.Tensor, beta: float) -> torch.Tensor:
    """min(beta, c(tau)) [B]. c = (1 - tau) / tau / r^2 is (tau^2 + (1 - tau)^2) / (tau (1 - tau)), which grows
    without bound at both ends of the flow (at pure noise the first step, and near the data); the clamped
    denominator keeps it finite there, and beta caps it."""
    c = (tau ** 2 + (1 - tau) ** 2) / (tau * (1 - tau)).clamp_min(1e-12)
    return c.clamp(max=beta)


def guided_velocity(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                    t: torch.Tensor, guide: Guide, data_at: int) -> torch.Tensor:
    """``velocity(x, t)`` [B, T, A] corrected towards ``guide.target`` (the module docstring derives it), in the
    sampler's own convention ``data_at``. Gradients flow to ``x`` alone, and only here: the caller may run under
    ``torch.no_grad``, parameters' ``.grad`` is never written, and the result carries no graph."""
    # the paper's time, and the sign that turns the model's velocity into the paper's (towards the data)
    tau, to_data = (t, 1.0) if data_at == 1 else (1.0 - t, -1.0)
    weights = guide.weights if guide.weights.dim() == 3 else guide.weights[..., None]
    with torch.enable_grad():
        x = x.detach().requires_grad_(True)
        v = velocity(x, t)
        clean = x + (1.0 - tau).view(-1, 1, 1) * to_data * v  # A_hat: where this step's velocity leads
        error = (weights * (guide.target - clean)).detach()  # constant: the paper's VJP, not a gradient of |error|
        (pull,) = torch.autograd.grad(clean, x, grad_outputs=error.to(clean.dtype))
    # a weight of 0 leaves the velocity exactly as it was: pull is then exactly 0
    correction = to_data * guidance_weight(tau.float(), guide.beta).view(-1, 1, 1) * pull
    return v.detach() + correction.to(v.dtype)
