"""The supervised training objective of every flow-matching policy: ``flow_matching_loss(policy, batch)``, the
registry's default ``PolicySpec.objective``. Apart from the model (``models.flow_matching``) so that the flow
knows no policy: the policy encodes an observation and predicts a velocity, the loss draws the noise and time
(from each sample's seed), interpolates, and compares."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from roboscale.models.flow_matching import sample_seeds

if TYPE_CHECKING:
    from roboscale.models.policy import Policy


def flow_matching_loss(policy: Policy, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor | int]]:
    """The training objective: mean squared error of the predicted velocity over the action steps that exist and
    the action dimensions ``policy.config.loss_action_dims`` names.

    Returns the loss and metrics as tensors (no host sync per micro-batch): ``loss``, ``loss_weight`` (the loss's
    denominator, so micro-batch losses combine into the whole batch's mean) and the token counts."""
    encoded = policy.encode(batch)
    actions = encoded.actions
    if actions is None:
        raise ValueError("a training batch needs actions; this one was collated without them")
    flow = policy.flow_matching
    seeds = sample_seeds(batch)
    if seeds is not None:
        noise, t = flow.draws_per_sample(seeds, tuple(actions.shape[1:]), actions.device)
        noise = noise.to(actions.dtype)
    else:  # a batch built outside the loader: the global RNG
        noise = torch.randn_like(actions)
        t = flow.sample_time(actions.shape[0], actions.device)
    x_t, target = flow.interpolate(actions, noise, t)
    pred = policy.velocity(encoded, x_t, t)
    width = policy.config.loss_action_width()  # the dataset's dimensions only, where the config says so
    err = (pred - target)[..., :width].pow(2).mean(-1)  # [B, T]
    if encoded.action_mask is not None:
        keep = encoded.action_mask.float()
        weight = keep.sum().clamp_min(1.0)
        loss = (err * keep).sum() / weight
    else:
        weight = torch.tensor(float(err.numel()))
        loss = err.mean()
    return loss, {"loss": loss.detach(), "loss_weight": weight.detach(), "tokens": encoded.tokens,
                  "computed_tokens": encoded.computed_tokens}
