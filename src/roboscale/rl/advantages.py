"""Advantages of RL post-training and the rewards they start from: GRPO's group-relative ones (no critic), PPO's
GAE (a value head); an episode's return and its chunks' rewards (``--rl.reward``).

An action chunk is one decision: the environment executes its first ``executed`` actions, and its reward is the
sum of theirs. GRPO gives every chunk of an episode that episode's advantage: its return against the mean (and
spread) of the returns of the episodes that started from the same initial state. PPO's GAE works on the chunk
sequence with the critic's values; an episode cut at max_steps is treated as ended there (its last value is not
bootstrapped: the observation after the last chunk is not recorded), a small bias a longer max_steps removes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def episode_return(trajectory: Any, reward: str) -> float:
    """Sparse: 1 if the episode succeeded; shaped: the sum of the simulator's rewards."""
    if reward == "success":
        return float(trajectory.success)
    return float(sum(float(np.sum(c.rewards)) for c in trajectory.chunks))


def chunk_rewards(trajectory: Any, reward: str) -> np.ndarray:
    """Each chunk's reward: sparse, 1 for the chunk in which the episode succeeded; shaped, the sum of the
    simulator's rewards after its executed actions."""
    if reward == "success":
        out = np.zeros(len(trajectory.chunks), np.float32)
        out[-1] = float(trajectory.success)  # success ends the episode: its last chunk reached it
        return out
    return np.array([float(np.sum(c.rewards)) for c in trajectory.chunks], np.float32)
