"""The flow-matching noise of an episode: drawn from (episode seed, chunk index) alone, so the actions of an
episode do not depend on which other observations share its batch, on the worker, or on the server."""

from __future__ import annotations

import numpy as np


def chunk_noise(episode_seed: int, chunk_index: int, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, 1) float32 noise for the ``chunk_index``-th action chunk an episode predicts."""
    return np.random.Generator(np.random.PCG64([int(episode_seed), int(chunk_index)])).standard_normal(
        shape, dtype=np.float32)


def step_noise(episode_seed: int, chunk_index: int, steps: int, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, 1) float32 [steps, *shape]: the draws of the stochastic sampler's denoising steps (Flow-SDE) for the
    ``chunk_index``-th chunk of an episode, apart from ``chunk_noise``'s starting point."""
    return np.random.Generator(np.random.PCG64([int(episode_seed), int(chunk_index), 1])).standard_normal(
        (steps, *shape), dtype=np.float32)


def stochastic_steps(episode_seed: int, chunk_index: int, steps: int, count: int) -> np.ndarray:
    """bool [steps]: which denoising steps of the ``chunk_index``-th chunk draw noise under the hybrid ODE-SDE
    sampler (``count`` of them, uniformly without replacement; 0 or ``count >= steps``: all)."""
    if count <= 0 or count >= steps:
        return np.ones(steps, dtype=bool)
    chosen = np.random.Generator(np.random.PCG64([int(episode_seed), int(chunk_index), 2])).choice(
        steps, size=count, replace=False)
    out = np.zeros(steps, dtype=bool)
    out[chosen] = True
    return out
