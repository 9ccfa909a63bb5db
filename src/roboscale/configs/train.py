"""`roboscale train`: the training job's options (dataset, policy, optimizer, checkpoints, schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roboscale.errors import ConfigError
from roboscale.models.registry import PolicyConfig, default_policy_config


@dataclass
class DatasetConfig:
    """Which data a training reads, and how the loader reads it."""

    root: str = "outputs/data/metaworld"
    """LeRobot v3.0 dataset directory, or a roboscale lake directory."""
    mixture: dict[str, float] = field(default_factory=dict)
    """Train on several datasets instead of root: directory -> weight (its share of every epoch)."""
    episodes: list[int] | None = None
    """Episode indices to train on (default: all; raw LeRobot datasets only)."""
    num_workers: int = -1
    """Loader worker processes (video decoding, windows, the policy's per-sample transforms); 0: in the training
    process; -1: 0 without a GPU (CPU training needs every core for itself), else half the cores, at most 8."""
    prefetch_factor: int = 2
    """Batches each loader worker prepares ahead."""
    block_samples: int = 0
    """Samples a loader worker decodes together and shuffles among; consecutive batches come from one block.
    0: as many as fit in block_memory_mb (the whole dataset when it fits, which makes batches independent)."""
    block_memory_mb: int = 512
    """Camera-frame memory of one block when block_samples is 0 (per loader worker)."""
    chunk_frames: int = 4
    """Consecutive frames of an episode decoded in one pass (more: fewer seeks, less diverse batches; training
    wants diverse batches, see docs/benchmarks.md). With LeRobot's GOP of 2, 4-frame chunks cost little extra
    decoding."""
    skip_bad_episodes: bool = False
    """Skip and count unreadable episodes instead of stopping."""


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 5e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (pi0.5's)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at the last step."""


@dataclass
class CheckpointConfig:
    """Checkpoint retention."""

    keep_last: int = 3
    """Keep this many most recent checkpoints (0: all); `last` (and the best evaluated one) are always kept."""

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last must be >= 0, got {self.keep_last}")


@dataclass
class TrainConfig:
    """`roboscale train`: train a policy on a LeRobot v3.0 dataset."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Which dataset to train on."""
    policy: PolicyConfig = field(default_factory=default_policy_config)
    """Policy type and architecture."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    steps: int = 1700
    """Optimizer steps."""
    batch_size: int = 64
    """Samples per step."""
    seed: int = 0
    """Seed for initialization, shuffling and noise."""
    output_dir: str = "outputs/train/pi05"
    """Where checkpoints/ and tensorboard/ go."""
    save_freq: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint retention."""
    log_freq: int = 50
    """Log metrics every this many steps."""
    resume: bool = False
    """Continue from <output_dir>/checkpoints/last exactly where it stopped. Options not given are the
    checkpoint's; steps, save_freq, log_freq, checkpoint.*, num_threads and the loader's worker settings may
    change, anything else that differs is refused."""
    num_threads: int = 0
    """torch CPU threads (0: all cores)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "save_freq", "log_freq"):
            value = getattr(self, name)
            if isinstance(value, int) and value <= 0:
                raise ConfigError(f"--{name} must be a positive integer, got {value}")
        if self.num_threads < 0:
            raise ConfigError(f"--num_threads must be >= 0, got {self.num_threads}")
