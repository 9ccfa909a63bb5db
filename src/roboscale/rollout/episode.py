"""What one episode is asked to be (``EpisodeJob``) and what came of it (``EpisodeResult``).

Episode ``i`` of task ``t`` starts from ``reset(episode_seed(seed, t, i), scene=i)`` and draws its flow-matching
noise from ``chunk_noise(job.seed, chunk)`` (``job.noise_seed`` instead, where given), so its outcome depends on
neither the worker that runs it nor the batch its observations were predicted in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from roboscale.rollout.trajectory import Trajectory  # at run time: the eval's record schema reads the type hints


@dataclass(frozen=True)
class EpisodeJob:
    task: str
    """The env's task name (MetaWorld: ``drawer-open-v3``)."""
    episode: int
    """Index of the episode within its task (0..episodes-1)."""
    seed: int
    """The seed ``reset`` places the scene with (and the episode's noise is drawn from, unless ``noise_seed``)."""
    instruction: str = ""
    """What the policy is told (empty: the task's own instruction)."""
    record_video: bool = False
    """Keep this episode's frames of the video camera and write them to ``video_dir``."""
    noise_seed: int | None = None
    """The seed the episode's sampling noise is drawn from (None: ``seed``). GRPO runs a group of episodes from one
    initial state (one ``seed``) with different ``noise_seed``s."""
    record_trajectory: bool = False
    """Record what the policy saw and sampled, chunk by chunk, with the rewards (``EpisodeResult.trajectory``)."""
    scene: int | None = None
    """Which of the task's fixed initial states ``reset`` starts from (LIBERO: init state ``scene mod 50``; None:
    ``episode``). GRPO's group shares one, as it shares ``seed``."""

    @property
    def key(self) -> tuple[str, int]:
        return self.task, self.episode

    @property
    def start_scene(self) -> int:
        return self.episode if self.scene is None else self.scene

    @property
    def draws_from(self) -> int:
        """The seed of the episode's sampling noise."""
        return self.seed if self.noise_seed is None else self.noise_seed


@dataclass
class EpisodeResult:
    task: str
    episode: int
    seed: int
    success: bool
    steps: int
    """Steps until success, or until the episode was cut off at max_steps."""
    sum_reward: float
    max_reward: float
    video: str | None = None
    """The rollout video, relative to the report directory (None: not recorded or not kept)."""
    attempts: int = 1
    """Times the episode was started (more than 1: a simulator crashed or hung and it was retried)."""
    error: str | None = None
    """Why the last attempt failed, when every attempt did (the episode then counts as a failure)."""
    wall_s: float = 0.0
    """Wall time of the successful attempt."""
    trajectory: Trajectory | None = field(default=None, repr=False, compare=False)
    """The episode chunk by chunk (jobs with ``record_trajectory``); not part of the record (``to_dict``)."""

    def to_dict(self) -> dict[str, Any]:
        """The record episodes.jsonl and reports keep (every field but the trajectory)."""
        return {name: getattr(self, name) for name in _RECORDED}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeResult:
        return cls(**{k: v for k, v in data.items() if k in _RECORDED})


_RECORDED = tuple(f.name for f in fields(EpisodeResult) if f.name != "trajectory")
