"""The configs of the data commands: ``roboscale data generate``, ``data validate`` and ``data convert``.

Defaults that are LeRobot's (the timestamp tolerance, the file sizes at which data and video files rotate) are
the values of ``roboscale.data.lerobot.format``, written out: configs import no data code (a test keeps them
equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateConfig:
    """`roboscale data generate`: run the scripted experts and write a LeRobot v3.0 dataset."""

    tasks: list[str] = field(default_factory=lambda: ["demo"])
    """MetaWorld task names (e.g. drawer-open, with or without -v3) or suites: demo, mt10, mt50."""
    episodes_per_task: int = 25
    """Successful episodes to keep per task (failed expert episodes are discarded and retried)."""
    out: str = "outputs/data/metaworld"
    """Dataset directory to create (must not exist yet)."""
    image_size: int = 64
    """Height and width of every camera image, in pixels."""
    cameras: dict[str, str] = field(default_factory=lambda: {"corner2": "corner2", "wrist": "gripperPOV"})
    """Feature name -> MuJoCo camera. Stored as observation.images.<name>."""
    action_noise: float = 0.3
    """Std of the noise added to the expert's actions when executing them (fraction of the [-1, 1] range)."""
    noise_correlation: float = 0.9
    """Step-to-step correlation of that noise (an AR(1) process). Correlated noise pushes the arm centimetres off
    the expert's path, so the demonstrations show how to recover from the states a learned policy drifts into
    (DART, Laskey et al. 2017); white noise at 80 Hz averages out within a few steps."""
    record_expert_action: bool = True
    """Label each frame with the expert's intended action (DART) rather than the noisy action executed. The
    executed action is kept as `action.executed`."""
    max_episode_steps: int = 300
    """Give up on an expert episode after this many steps (experts need 35-180)."""
    steps_after_success: int = 10
    """Keep recording this many steps after success so policies learn to hold the final state."""
    max_attempts: int = 0
    """Expert attempts per task before generation gives up on it (0: 4 x episodes_per_task + 10). The noise
    makes experts fail: with the default noise the push expert succeeds in about one attempt in four."""
    seed: int = 0
    """Base seed: episode placements and noise derive from (seed, task, attempt)."""
    workers: int = 2
    """Parallel worker processes (one MetaWorld env each)."""
    video_codec: str = "libsvtav1"
    """Video codec for the mp4 files (libsvtav1 as LeRobot; libx264 also works)."""


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
