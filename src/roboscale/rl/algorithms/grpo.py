"""GRPO (DeepSeekMath, Shao et al. 2024): an episode's advantage is its return against the mean and spread of its
group's (the episodes of one initial state); every chunk of the episode takes it. No critic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from roboscale.configs.rl import Algorithm
from roboscale.rl.advantages import group_advantages


@dataclass(frozen=True)
class GRPO(Algorithm):
    type: ClassVar[str] = "grpo"
    min_group_size: ClassVar[int] = 2

    def advantages(self, returns: Any, trajectories: list[Any], reward: str) -> tuple[list[Any], None]:
        return list(group_advantages(returns, [0] * len(returns))), None
