"""RLOO, REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024): an episode's advantage
is its return minus the mean of the other episodes of its group,

    A_i = R_i - (sum_j R_j - R_i) / (n - 1)  =  n / (n - 1) * (R_i - mean R),

an unbiased baseline (it does not depend on the episode it judges) that needs no critic and, unlike GRPO, no
division by the group's spread (a group with one success among many failures is not inflated). Every chunk of the
episode takes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from roboscale.configs.rl import Algorithm


def leave_one_out(returns: Any) -> np.ndarray:
    """float32 [n]: each return against the mean of the others."""
    returns = np.asarray(returns, dtype=np.float64)
    n = len(returns)
    return (returns - (returns.sum() - returns) / (n - 1)).astype(np.float32)


@dataclass(frozen=True)
class RLOO(Algorithm):
    type: ClassVar[str] = "rloo"
    min_group_size: ClassVar[int] = 2

    def advantages(self, returns: Any, trajectories: list[Any], reward: str) -> tuple[list[Any], None]:
        return list(leave_one_out(returns)), None
