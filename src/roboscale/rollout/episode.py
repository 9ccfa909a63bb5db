"""What one episode is asked to be (``EpisodeJob``) and what came of it (``EpisodeResult``).

Episode ``i`` of task ``t`` starts from ``reset(episode_seed(seed, t, i))`` and draws its flow-matching noise from
``chunk_noise(job.seed, chunk)``, so its outcome depends on neither the worker that runs it nor the batch its
observations were predicted in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class EpisodeJob:
    task: str
    """The env's task name (MetaWorld: ``drawer-open-v3``)."""
    episode: int
    """Index of the episode within its task (0..episodes-1)."""
    seed: int
    """The seed ``reset`` places the scene with and the episode's noise is drawn from."""
    instruction: str = ""
    """What the policy is told (empty: the task's own instruction)."""
    record_video: bool = False
    """Keep this episode's frames of the video camera and write them to ``video_dir``."""

    @property
    def key(self) -> tuple[str, int]:
        return self.task, self.episode


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeResult:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
