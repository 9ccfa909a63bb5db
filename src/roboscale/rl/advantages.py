"""Advantages of RL post-training: GRPO's group-relative ones (no critic) and PPO's GAE (a value head).

An action chunk is one decision: the environment executes its first ``executed`` actions, and its reward is the
sum of theirs. GRPO gives every chunk of an episode that episode's advantage: its return against the mean (and
spread) of the returns of the episodes that started from the same initial state. PPO's GAE works on the chunk
sequence with the critic's values; an episode cut at max_steps is treated as ended there (its last value is not
bootstrapped: the observation after the last chunk is not recorded), a small bias a longer max_steps removes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS = 1e-6


def group_advantages(returns: Sequence[float], groups: Sequence[int]) -> np.ndarray:
    """(R_i - mean of its group) / (std of its group + eps), float32 [N]: GRPO (DeepSeekMath), the group being
    the episodes of one initial state. A group whose returns are all equal (all succeeded, or all failed) has zero
    advantages: it says nothing about which actions were better."""
    returns = np.asarray(returns, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros_like(returns)
    for g in np.unique(groups):
        members = groups == g
        r = returns[members]
        out[members] = (r - r.mean()) / (r.std() + EPS)
    return out.astype(np.float32)


def gae(rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over one episode's chunks (Schulman et al. 2016): advantages and
    value targets (advantage + value), float32 [T]. The episode ends after its last chunk (value 0 beyond)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        delta = rewards[t] + gamma * following - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages.astype(np.float32), (advantages + values).astype(np.float32)
