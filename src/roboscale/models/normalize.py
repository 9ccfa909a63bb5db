"""Normalization of state and actions, with the statistics stored as buffers so they travel with the weights."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn


class NormMode(str, Enum):
    IDENTITY = "identity"
    MEAN_STD = "mean_std"
    MIN_MAX = "min_max"  # [min, max] -> [-1, 1]
    QUANTILES = "quantiles"  # [q01, q99] -> [-1, 1], pi0.5's default


# Stats each mode needs, as (low/centre, high/scale) keys of LeRobot's stats.json.
_STAT_KEYS = {
    NormMode.MEAN_STD: ("mean", "std"),
    NormMode.MIN_MAX: ("min", "max"),
    NormMode.QUANTILES: ("q01", "q99"),
}


class Normalizer(nn.Module):
    """Maps one feature to a normalized space and back. Buffers: ``low`` and ``high`` (or mean and std)."""

    def __init__(self, dim: int, mode: NormMode | str, eps: float = 1e-6):
        super().__init__()
        self.mode = NormMode(mode)
        self.eps = eps
        self.register_buffer("a", torch.zeros(dim))  # mean or low
        self.register_buffer("b", torch.ones(dim))  # std or high

    def set_stats(self, stats: dict, feature: str = "") -> None:
        """Fill from a LeRobot stats dict ({"mean": [...], "std": [...], "q01": ...})."""
        if self.mode is NormMode.IDENTITY:
            return
        keys = _STAT_KEYS[self.mode]
        missing = [k for k in keys if k not in stats]
        if missing:
            raise ValueError(
                f"normalization mode {self.mode.value!r} of {feature!r} needs stats {missing}; "
                f"the dataset's stats.json has {sorted(stats)}"
            )
        self.a.copy_(torch.as_tensor(stats[keys[0]], dtype=torch.float32).reshape(-1))
        self.b.copy_(torch.as_tensor(stats[keys[1]], dtype=torch.float32).reshape(-1))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(self.mode, self.a, self.b, self.eps, x)

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return _unnormalize(self.mode, self.a, self.b, self.eps, x)

    def snapshot(self) -> NormStats:
        """A plain, picklable CPU copy of the statistics (for data-loader workers)."""
        return NormStats(self.mode, self.a.detach().cpu().clone(), self.b.detach().cpu().clone(), self.eps)


@dataclass
class NormStats:
    """The statistics of a ``Normalizer`` without the module: what data-loader workers normalize with."""

    mode: NormMode
    a: torch.Tensor
    b: torch.Tensor
    eps: float = 1e-6

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(self.mode, self.a, self.b, self.eps, x)

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return _unnormalize(self.mode, self.a, self.b, self.eps, x)


def _normalize(mode: NormMode, a: torch.Tensor, b: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    if mode is NormMode.IDENTITY:
        return x
    if mode is NormMode.MEAN_STD:
        return (x - a) / (b + eps)
    return 2.0 * (x - a) / (b - a).clamp_min(eps) - 1.0


def _unnormalize(mode: NormMode, a: torch.Tensor, b: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    if mode is NormMode.IDENTITY:
        return x
    if mode is NormMode.MEAN_STD:
        return x * (b + eps) + a
    return (x + 1.0) * 0.5 * (b - a).clamp_min(eps) + a
