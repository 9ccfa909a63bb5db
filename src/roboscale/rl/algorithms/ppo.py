"""PPO (Schulman et al. 2017) with GAE: the advantages of an episode's chunks from a critic, a value head on the
policy's features whose values the acting weights recorded with each chunk (as RLinf's rollouts do), regressed on
the GAE targets beside the clipped surrogate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from roboscale.configs.rl import Algorithm, RLOptions
from roboscale.errors import ConfigError
from roboscale.rl.advantages import chunk_rewards, gae


@dataclass(frozen=True)
class PPO(Algorithm):
    type: ClassVar[str] = "ppo"
    critic: ClassVar[bool] = True

    gamma: float = 0.99
    """Discount per action chunk."""
    gae_lambda: float = 0.95
    """GAE's lambda."""
    value_coef: float = 0.5
    """Weight of the value head's loss."""
    value_head_dim: int = 64
    """Hidden width of the value head added to a checkpoint without one."""

    def check(self, options: RLOptions) -> None:
        super().check(options)
        if not (0 < self.gamma <= 1 and 0 <= self.gae_lambda <= 1) or self.value_coef < 0:
            raise ConfigError("--rl.algorithm.gamma must be in (0, 1], --rl.algorithm.gae_lambda in [0, 1], "
                              "--rl.algorithm.value_coef >= 0")
        if self.value_head_dim <= 0:
            raise ConfigError(f"--rl.algorithm.value_head_dim must be a positive integer for ppo (its critic's "
                              f"width), got {self.value_head_dim}")

    def advantages(self, returns: Any, trajectories: list[Any], reward: str) -> tuple[list[Any], list[Any]]:
        advantages, targets = [], []
        for trajectory in trajectories:
            values = [c.value for c in trajectory.chunks]
            if any(v is None for v in values):
                raise RuntimeError("ppo: the rollout's chunks carry no critic values (the acting weights had no "
                                   "value head)")
            adv, target = gae(chunk_rewards(trajectory, reward), np.asarray(values, np.float32), self.gamma,
                              self.gae_lambda)
            advantages.append(adv)
            targets.append(target)
        return advantages, targets

    def critic_loss(self, value: Any, target: Any) -> Any:
        return self.value_coef * (value - target) ** 2
