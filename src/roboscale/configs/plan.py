"""`roboscale plan`: the scaling model's inputs (policy and size, batch, GPU counts, network, loader)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roboscale.errors import ConfigError
from roboscale.models.registry import DEFAULT_POLICY, PolicyConfig, preset_config

STRATEGIES = ("fsdp", "hsdp", "ddp")
PRECISIONS = ("bf16", "fp8")
SOURCES = ("lake", "raw")


@dataclass
class NetworkConfig:
    """Links between GPUs: NVLink inside a node, RDMA across nodes."""

    nvlink_GBps: float = 0.0
    """NVLink bandwidth per GPU in GB/s, both directions together (0: the GPU's datasheet figure, 900 for
    H100/H200); a ring sends and receives at half of it each way."""
    node_gbps: float = 3200.0
    """RDMA bandwidth per node in Gb/s, one direction (8 x 400 Gb/s NICs)."""
    efficiency: float = 0.8
    """Fraction of a link's rate large collectives reach (NCCL bus bandwidth / link rate)."""
    latency_us: float = 20.0
    """Fixed cost of one collective call, in microseconds."""

    def __post_init__(self) -> None:
        for name in ("nvlink_GBps", "node_gbps", "latency_us"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--network.{name} must be >= 0, got {getattr(self, name)}")
        if self.node_gbps == 0:
            raise ConfigError("--network.node_gbps must be positive")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"--network.efficiency must be in (0, 1], got {self.efficiency}")


@dataclass
class DataConfig:
    """The loader feeding the GPUs."""

    source: str = "lake"
    """lake (memory-mapped uint8 shards) | raw (LeRobot v3 video): sets the CPU cost per camera frame from
    benchmarks/loader.py's recorded figures (docs/benchmarks.md)."""
    ms_per_frame: float = 0.0
    """CPU milliseconds per camera frame at the policy's image size (0: the benchmark figure for source)."""
    cores_per_node: int = 96
    """CPU cores of a node given to loader workers (a DGX H100 has 112; the rest run the 8 trainers)."""
    storage_GBps: float = 0.0
    """Read bandwidth per node in GB/s (0: not a limit)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ConfigError(f"--data.source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.cores_per_node <= 0:
            raise ConfigError(f"--data.cores_per_node must be positive, got {self.cores_per_node}")
        if self.ms_per_frame < 0 or self.storage_GBps < 0:
            raise ConfigError("--data.ms_per_frame and --data.storage_GBps must be >= 0")


def _default_policy() -> PolicyConfig:
    return preset_config(DEFAULT_POLICY, "full")


@dataclass
class PlanConfig:
    """`roboscale plan`: predicted step time, communication, data rate and scaling efficiency of data-parallel
    training of a policy at several GPU counts (an analytical model: docs/benchmarks.md states its rules).
    Choose the policy with --policy.type and its size with --policy.preset (full, demo, tiny; default full)."""

    policy: PolicyConfig = field(default_factory=_default_policy)
    """Policy type and architecture (on top of the preset)."""
    preset: str = "full"
    """Named size of --policy.type the policy options start from (also spelled --policy.preset)."""
    batch_size: int = 1024
    """Global batch: samples per optimizer step over all GPUs."""
    gpus: list[int] = field(default_factory=lambda: [1, 8, 64, 256, 1024])
    """GPU counts to predict (each a whole number of nodes, or a part of one node)."""
    gpu: str = "h100"
    """GPU type, for its datasheet peak and NVLink (h100, h200, b200, a100, ...)."""
    gpus_per_node: int = 8
    """GPUs per node."""
    precision: str = "bf16"
    """bf16 | fp8 (the large Linear layers in FP8: compute / fp8_speedup, their weights gathered in 1 byte)."""
    fp8_speedup: float = 1.25
    """Step-level speed-up of FP8 over bf16 compute (torchtitan measured 1.25-1.28x on Llama-3-8B, H100)."""
    mfu: float = 0.4
    """Model FLOPs utilisation assumed for compute (bf16 FLOPs / datasheet peak)."""
    samples_per_s: float = 0.0
    """Measured training samples/s of one GPU (replaces the peak x mfu estimate when > 0)."""
    strategy: str = "hsdp"
    """hsdp (shard in a node, replicate across nodes) | fsdp (shard over all GPUs) | ddp."""
    overlap: float = 0.8
    """Communication hidden behind compute, as a fraction of the compute time."""
    shard_frozen: bool = True
    """Frozen weights are sharded and gathered like the others (false: replicated, never communicated)."""
    dataset_frames: int = 10_000_000
    """Frames of the dataset, for the time per epoch."""
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """Links."""
    data: DataConfig = field(default_factory=DataConfig)
    """Loader."""
    paper_round: bool = False
    """Also print the GR00T-N1.5 round of the seed paper (15 h -> 22 min on ~1,000 GPUs) as the model sees it."""

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ConfigError(f"--batch_size must be positive, got {self.batch_size}")
        if not self.gpus or any(n <= 0 for n in self.gpus):
            raise ConfigError(f"--gpus must be positive GPU counts, got {self.gpus}")
        if self.gpus_per_node <= 0:
            raise ConfigError(f"--gpus_per_node must be positive, got {self.gpus_per_node}")
        for n in self.gpus:
            if n > self.gpus_per_node and n % self.gpus_per_node:
                raise ConfigError(f"--gpus: {n} is not a whole number of {self.gpus_per_node}-GPU nodes")
            if n > self.batch_size:
                raise ConfigError(f"--gpus: {n} GPUs exceed --batch_size={self.batch_size} (a GPU without a sample)")
        choices = {"precision": PRECISIONS, "strategy": STRATEGIES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"--mfu must be in (0, 1], got {self.mfu}")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"--overlap must be in [0, 1], got {self.overlap}")
        if self.samples_per_s < 0 or self.dataset_frames < 0:
            raise ConfigError("--samples_per_s and --dataset_frames must be >= 0")
        if self.fp8_speedup <= 0:
            raise ConfigError(f"--fp8_speedup must be positive, got {self.fp8_speedup}")


def parse_plan_args(argv: list[str]) -> PlanConfig:
    """``roboscale plan`` options: ``--policy.preset=NAME`` (default full) picks the size of ``--policy.type``;
    other ``--policy.*`` options change it."""
    from roboscale.config import parse

    rest, preset, kind = [], "full", DEFAULT_POLICY
    args = iter(argv)
    for arg in args:
        key, eq, value = arg.partition("=")
        if key in ("--policy.preset", "--preset", "--policy.type"):
            if not eq:
                value = next(args, "")
                if not value or value.startswith("--"):
                    raise ConfigError(f"{key} needs a value")
            if key == "--policy.type":
                kind, arg = value, f"--policy.type={value}"
            else:
                preset, arg = value, f"--preset={value}"
        rest.append(arg)
    defaults = PlanConfig(policy=preset_config(kind, preset), preset=preset)
    return parse(PlanConfig, rest, defaults=defaults, prog="roboscale plan")
