"""The RL objectives, as the Trainer's objective: a clipped policy-gradient loss over action chunks.

A batch holds chunks the rollouts recorded: the observation the policy saw, the denoising chain the stochastic
sampler took (``FlowMatching.sample_chain``) and which of its steps drew noise (``stochastic``), which of the
chunk's entries reached the environment (``mask``: the executed action steps, the dataset's action dimensions),
its log-probability under the weights that sampled it (``old_log_prob``, recorded by the sampler), the chunk's
advantage and its weight. The chunk's
log-probability under the current weights is the chain's (``FlowMatching.chain_log_prob``), computed as the
acting policy computed the actions: without augmentation or dropout (eval mode), or the ratio would measure them.

Per chunk c with ratio r = exp(log p(c) - log p_old(c)) and advantage A (PPO's clipped surrogate; GRPO uses the
same with group-relative advantages):

    loss_c = -min(r A, clip(r, 1 - eps, 1 + eps) A) / n,     n = n_action_steps x the dataset's action dims

(n keeps a chunk's gradient the size of one action's, whatever the chunk size). Chunks are weighted by
1 / (the chunks of their episode), so each episode weighs the same and the metrics that are episode properties
(success, return, length), averaged with these weights, are means over episodes. In a synchronous step the
chunks were sampled by the weights being trained (p_old = p up to float rounding, r = 1: the policy gradient
A grad log p); the clipping matters from a rollout's second epoch on, and once rollouts run ahead of the trainer
(``--rl.mode=async``: the chunks' ``staleness``, logged as its mean and ``staleness_max``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from roboscale.configs.rl import RLOptions
from roboscale.configs.rollout import SDESampler

SUMMED = frozenset({"episodes", "chunks"})
MAXED = frozenset({"staleness_max"})


def _detached(mean: Any, values: torch.Tensor) -> torch.Tensor:
    return mean(values).detach()


@contextlib.contextmanager
def acting_mode(policy: torch.nn.Module) -> Iterator[None]:
    """The policy as it acted (eval mode: no image shifts, no dropout), gradients still on."""
    was = policy.training
    policy.train(False)
    try:
        yield
    finally:
        policy.train(was)


@dataclass
class PolicyGradientLoss:
    """The Trainer's objective, every algorithm's clipped surrogate (and its critic's loss, where it has one):
    ``(policy, batch) -> (loss, metrics)``."""

    options: RLOptions
    sampler: SDESampler
    """The sampler the chunks were drawn with (``--rollout.sampler``): their likelihood is its."""
    summed: frozenset[str] = SUMMED
    maxed: frozenset[str] = MAXED

    def __call__(self, policy: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        device = next(policy.parameters()).device
        chain, mask = batch["chain"].to(device), batch["mask"].to(device)
        advantage, weight = batch["advantage"].to(device), batch["weight"].to(device)
        with acting_mode(policy):
            encoded = policy.encode(batch["observation"], cache=True)
            log_prob = policy.flow_matching.chain_log_prob(lambda x, t: policy.velocity(encoded, x, t), chain,
                                                           policy.config.num_inference_steps,
                                                           self.sampler.noise_level, mask,
                                                           batch["stochastic"].to(device))
            value = policy.value(encoded) if self.options.algorithm.critic else None
        ratio = torch.exp(log_prob - batch["old_log_prob"].to(device))
        clip = self.options.clip
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
        entries = float(policy.config.n_action_steps * batch["action_dims"])
        total = weight.sum()

        def mean(values: torch.Tensor) -> torch.Tensor:
            return (values.float() * weight).sum() / total.clamp_min(1e-12)

        policy_loss = -mean(surrogate) / entries
        extra: dict[str, torch.Tensor] = {}
        if value is not None:  # the critic (PPO's) regresses its targets
            target = batch["value_target"].to(device)
            loss = policy_loss + mean(self.options.algorithm.critic_loss(value, target))
            extra = {"value_loss": mean((value - target) ** 2).detach(), "value": mean(value).detach()}
        else:
            loss = policy_loss
        clipped = ((ratio - 1).abs() > clip).float()
        # how far the weights moved from those that acted (0 on-policy): PPO's approximate KL, (r - 1) - log r
        approx_kl = (ratio.detach() - 1) - (log_prob.detach() - batch["old_log_prob"].to(device))
        return loss, {**extra, "loss": loss.detach(), "policy_loss": policy_loss.detach(),
                      "loss_weight": total.detach(), "ratio": _detached(mean, ratio),
                      "clip_fraction": _detached(mean, clipped), "approx_kl": _detached(mean, approx_kl),
                      "log_prob": _detached(mean, log_prob / mask.flatten(1).sum(1).clamp_min(1)),
                      "advantage_abs": _detached(mean, advantage.abs()),
                      "success": _detached(mean, batch["success"].to(device)),
                      "return": _detached(mean, batch["return"].to(device)),
                      "episode_steps": _detached(mean, batch["steps"].to(device)),
                      "episodes": total.detach(), "chunks": torch.tensor(float(len(weight)), device=device),
                      # rollouts of updates the acting weights lagged behind (async; 0 in sync)
                      "staleness": _detached(mean, batch["staleness"].to(device)),
                      "staleness_max": batch["staleness"].max().to(device)}
