"""The config of ``roboscale lake build`` (``roboscale.data.lake.build.build_lake``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roboscale.errors import ConfigError
from roboscale.utils.images import RESIZE_MODES


@dataclass
class LakeConfig:
    """Compile LeRobot v3.0 datasets into training-ready shards with Ray Data (resumable)."""

    sources: list[str] = field(default_factory=list)
    """LeRobot v3.0 dataset roots: local paths or pyarrow filesystem URIs (s3://bucket/ds, file:///data/ds)."""
    output: str = ""
    """Lake directory (local or a shared filesystem mounted on every Ray node): new, empty, or a lake (or partial
    build) of roboscale's, and neither inside nor around a source; a build deletes only shards it wrote there."""
    image_size: int = 224
    """Square side of every camera in the shards; 0 keeps each camera's native resolution."""
    resize: str = "pad"
    """pad: keep the aspect ratio and pad with black (pi0's resize_with_pad); stretch: fill the square."""
    shard_frames: int = 2048
    """Target frames per shard (whole episodes, never split; a camera takes frames x S x S x 3 bytes of it)."""
    ray_address: str | None = None
    """Connect to this Ray cluster (ray.init(address=...)); default: a local Ray on this machine."""
    num_cpus: int | None = None
    """CPUs of the local Ray instance (default: all)."""
    cpus_per_task: float = 0.5
    """Ray CPUs per shard task; fractional so that Ray Data's scheduler and the driver are not starved."""
    stats_bins: int = 4096
    """Histogram bins per dimension for the quantiles: error <= (max - min) / stats_bins."""
    tokenizer: str | None = None
    """tokenizer.json whose token ids for every task are precomputed into tasks.parquet."""
    validate: bool = True
    """Run roboscale.data.lerobot.validate's quick check on each local source before building."""
    repair: bool = False
    """Hash the files of already-built shards and rebuild those that differ from their shard.json (bit rot, a
    partial copy); without it a finished shard is trusted by its fingerprint."""

    def check(self) -> None:
        if not self.sources:
            raise ConfigError("lake build needs at least one source dataset: roboscale lake build SRC... --output DIR")
        if not self.output:
            raise ConfigError("lake build needs --output DIR")
        if self.image_size < 0:
            raise ConfigError(f"--image-size must be >= 0, got {self.image_size}")
        if self.resize not in RESIZE_MODES:
            raise ConfigError(f"--resize must be one of {list(RESIZE_MODES)}, got {self.resize!r}")
        if self.shard_frames < 1:
            raise ConfigError(f"--shard-frames must be >= 1, got {self.shard_frames}")
        if not 0 < self.cpus_per_task:
            raise ConfigError(f"--cpus-per-task must be > 0, got {self.cpus_per_task}")
        if self.stats_bins < 1:
            raise ConfigError(f"--stats-bins must be >= 1, got {self.stats_bins}")
