"""The configs of the data commands: ``roboscale data generate``, ``data validate`` and ``data convert``.

Defaults that are LeRobot's (the timestamp tolerance, the file sizes at which data and video files rotate) are
the values of ``roboscale.data.lerobot.format``, written out: configs import no data code (a test keeps them
equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roboscale.errors import ConfigError


@dataclass
class GenerateConfig:
    """`roboscale data generate`: run the scripted experts and write a LeRobot v3.0 dataset."""

    env: str = "metaworld"
    """The simulator whose scripted experts act: metaworld or libero (libero_object, libero_spatial, libero_goal,
    libero_10 and their LIBERO-Pro perturbations)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """The simulator's own options (``--env_options.NAME=VALUE``; LIBERO: settle_steps)."""
    tasks: list[str] = field(default_factory=list)
    """Task names or suites (empty: the simulator's default; MetaWorld: demo, e.g. drawer-open, mt10, mt50;
    LIBERO: libero_object, libero_spatial or task names)."""
    episodes_per_task: int = 25
    """Successful episodes to keep per task (failed expert episodes are discarded and retried)."""
    out: str = ""
    """Dataset directory to create (must not exist yet; default outputs/data/<env>)."""
    image_size: int = 64
    """Height and width of every camera image, in pixels."""
    cameras: dict[str, str] = field(default_factory=dict)
    """Feature name -> simulator camera, stored as observation.images.<name> (empty: the simulator's default;
    MetaWorld {corner2: corner2, wrist: gripperPOV}, LIBERO {image: agentview, image2: robot0_eye_in_hand})."""
    action_noise: float = 0.3
    """Std of the noise added to the expert's actions when executing them (fraction of the [-1, 1] range)."""
    noise_correlation: float = 0.9
    """Step-to-step correlation of that noise (an AR(1) process). Correlated noise pushes the arm centimetres off
    the expert's path, so the demonstrations show how to recover from the states a learned policy drifts into
    (DART, Laskey et al. 2017); white noise at 80 Hz averages out within a few steps."""
    record_expert_action: bool = True
    """Label each frame with the expert's intended action (DART) rather than the noisy action executed. The
    executed action is kept as `action.executed`."""
    max_episode_steps: int = 0
    """Give up on an expert episode after this many steps (0: the experts' own limit; MetaWorld's 300, where
    they need 35-180)."""
    steps_after_success: int = 10
    """Keep recording this many steps after success so policies learn to hold the final state."""
    max_attempts: int = 0
    """Expert attempts per task before generation gives up on it (0: 4 x episodes_per_task + 10). The noise
    makes experts fail: with the default noise the push expert succeeds in about one attempt in four."""
    partial_tasks: bool = False
    """A task whose expert runs out of attempts keeps the demos it made and generation goes on with the other
    tasks (the summary lists the short ones; no demo at all is still an error). Off: generation stops with an
    error and writes nothing, so a dataset always has episodes_per_task demos of every task."""
    seed: int = 0
    """Base seed: episode placements and noise derive from (seed, task, attempt)."""
    first_scene: int = 0
    """Attempt a starts from scene first_scene + a (LIBERO: init state (first_scene + a) mod 50; MetaWorld places
    from the seed alone). Evaluation's episode i uses scene i: demos from scene 25 on leave 0-24 unseen."""
    workers: int = 2
    """Parallel worker processes (one env each, a task at a time)."""
    video_codec: str = "libsvtav1"
    """Video codec for the mp4 files (libsvtav1 as LeRobot; libx264 also works)."""

    def __post_init__(self) -> None:
        if self.episodes_per_task < 1:  # (roboscale demo: --data.episodes_per_task)
            raise ConfigError(f"--episodes_per_task must be a positive integer, got {self.episodes_per_task}")


@dataclass
class TasksConfig:
    """`roboscale data tasks`: every task of a simulator with its instruction, and its suites."""

    env: str = "metaworld"
    """The simulator: metaworld or libero."""


@dataclass
class ValidateConfig:
    """Check every file of a LeRobot v3.0 dataset and list every problem (exit status 1 if there are any)."""

    root: str = ""
    """The dataset directory."""
    quick: bool = False
    """Index and numeric columns (NaN/Inf) and one frame per episode and camera instead of decoding everything."""
    tolerance_s: float = 1e-4
    """Allowed timestamp error in seconds (LeRobot's tolerance_s)."""


@dataclass
class ConvertConfig:
    """Convert a LeRobot v2.0/v2.1 dataset to v3.0 (the source is not modified)."""

    src: str = ""
    """The v2.0/v2.1 dataset directory."""
    dst: str = ""
    """The new v3.0 dataset directory (must not exist, or be empty)."""
    reencode: bool = False
    """Decode and re-encode videos instead of stream-copying them (slower, lossy)."""
    video_codec: str = "libsvtav1"
    """Encoder for --reencode (libsvtav1, libx264)."""
    data_files_size_in_mb: float = 100
    """Rotate to a new data parquet file past this size."""
    video_files_size_in_mb: float = 200
    """Rotate to a new mp4 per camera past this size."""
    tolerance_s: float = 1e-4
    """Allowed difference between a source timestamp and frame_index / fps."""
