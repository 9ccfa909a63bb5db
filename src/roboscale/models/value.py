"""PPO's critic: a value head on a policy's own features (``Policy.features``: the mean of the observation's
tokens as the policy embedded them), part of the policy when its config asks for one (``value_head_dim``), so it
is sharded, checkpointed and exported like any other part. It reads features the policy trains too (a shared
trunk, as in πRL's critic on pi0.5's features).
"""

from __future__ import annotations

import torch
from torch import nn


CRITIC = "value_head."
"""The prefix of the critic's tensors in a policy's state: what acting never reads (rollout servers take the
policy's weights without them)."""


def acting_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A policy's state without its critic."""
    return {name: tensor for name, tensor in state.items() if not name.startswith(CRITIC)}


class ValueHead(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.hidden = nn.Linear(in_dim, hidden)
        self.out = nn.Linear(hidden, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.out.weight)  # a fresh critic predicts 0: the first advantages are the returns
        nn.init.zeros_(self.out.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, in_dim] -> [B]"""
        return self.out(torch.nn.functional.gelu(self.hidden(self.norm(features.float())))).squeeze(-1)


def segment_means(stream: torch.Tensor, cu_seqlens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[S', W]: the mean of each segment of a flat token stream [T, W] bounded by ``cu_seqlens`` [S + 1], for the
    segments ``keep`` [S] (bool; None: all) selects, in order."""
    lengths = cu_seqlens.diff().to(stream.device)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=stream.device), lengths)
    sums = stream.new_zeros(len(lengths), stream.shape[-1]).index_add_(0, segment, stream)
    means = sums / lengths.clamp_min(1)[:, None].to(stream.dtype)
    return means if keep is None else means[keep.to(stream.device)]
