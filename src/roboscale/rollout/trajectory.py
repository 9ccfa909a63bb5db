"""What an episode did, chunk by chunk, for RL post-training: the observation the policy saw, what it sampled (the
denoising chain of the stochastic sampler, whose likelihood training recomputes), how much of the chunk the
environment executed and the rewards that followed.

An env worker records a ``Trajectory`` for a job with ``record_trajectory``: one ``ChunkRecord`` per chunk it asked
for (``TrajectoryRecorder``). It travels with the episode's result to the engine (``EpisodeResult.trajectory``) and
is never written to ``episodes.jsonl``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ChunkRecord:
    state: np.ndarray
    """The observation the policy saw: its state vector."""
    images: dict[str, np.ndarray]
    """Camera name -> H x W x 3 uint8 (as in ``PredictItem``)."""
    instruction: str
    chain: np.ndarray | None
    """[K + 1, T, A] float32, normalized: the stochastic sampler's denoising chain (None for ``ode``)."""
    stochastic: np.ndarray | None
    """[K] bool: the steps of the chain that drew noise (the hybrid sampler's; None for ``ode``)."""
    log_density: np.ndarray | None
    """[T, A] float32: each entry's log-density under the acting weights (None for ``ode``); the chunk's
    log-probability is its sum over the executed entries."""
    chunk: np.ndarray
    """[T, A_data]: the predicted actions in the dataset's units."""
    executed: int
    """Action steps of this chunk the env executed (<= n_action_steps; fewer when the episode ended)."""
    rewards: np.ndarray
    """[executed] float32: the env's reward after each executed step."""
    version: int
    """The weights version that predicted it."""
    value: float | None = None
    """The acting weights' value estimate of the observation (PPO; None without a critic)."""


@dataclass
class Trajectory:
    task: str
    episode: int
    seed: int
    noise_seed: int
    chunks: list[ChunkRecord]
    success: bool
    """Success at any step."""
    terminated: bool
    """Ended by success or the env's done, not cut at max_steps."""


@dataclass
class TrajectoryRecorder:
    """One episode's records as its worker steps it: ``chunk`` when a predicted chunk arrives, ``step`` after each
    of its actions the env executed, ``finish`` at the end."""

    chunks: list[ChunkRecord] = field(default_factory=list)
    _rewards: list[float] = field(default_factory=list)

    def chunk(self, state: np.ndarray, images: dict[str, np.ndarray], instruction: str, prediction: Any) -> None:
        """``prediction``: the ``rollout.inference.Prediction`` of this observation."""
        self._close_chunk()
        self.chunks.append(ChunkRecord(state, images, instruction, prediction.chain, prediction.stochastic,
                                       prediction.log_density, prediction.chunk, 0, np.zeros(0, np.float32),
                                       prediction.version, prediction.value))

    def step(self, reward: float) -> None:
        self._rewards.append(reward)

    def finish(self, task: str, episode: int, seed: int, noise_seed: int, success: bool,
               terminated: bool) -> Trajectory:
        self._close_chunk()
        return Trajectory(task, episode, seed, noise_seed, self.chunks, success, terminated)

    def _close_chunk(self) -> None:
        if self.chunks and self._rewards:
            last = self.chunks[-1]
            last.rewards = np.asarray(self._rewards, np.float32)
            last.executed = len(self._rewards)
        self._rewards = []
