"""`roboscale train`: the training job's options (dataset, policy, optimizer, checkpoints, schedule)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from roboscale.configs.eval import EvalProtocol
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
    instruction_variants: str = ""
    """JSON file: a task string of the data -> a list of other phrasings; each training sample reads its task as
    one of them or the recorded one, drawn from its seed (``data/instructions.py``). The tokenizer is trained on
    them too. For policies that must follow instructions worded in ways the data never recorded."""
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
    verify_lake_shards: bool = True
    """Lakes: check each shard file's sha256 the first time this machine reads that version of it (remembered in
    ~/.cache/roboscale/verified, or $ROBOSCALE_CACHE_DIR); false trusts the bytes (sizes are still checked)."""


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

    def __post_init__(self) -> None:
        # refused here, at parse time, not by torch's optimizer after the rollout processes have started
        if not self.lr > 0:
            raise ConfigError(f"--optimizer.lr must be a positive number, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"--optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not self.weight_decay >= 0:
            raise ConfigError(f"--optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.grad_clip_norm >= 0:
            raise ConfigError(f"--optimizer.grad_clip_norm must be >= 0 (0 disables clipping), got "
                              f"{self.grad_clip_norm}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"--optimizer.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class CheckpointConfig:
    """Checkpoint saving and retention."""

    keep_last: int = 3
    """Keep this many most recent checkpoints (0: all); `last`, `best` and checkpoints waiting for or under
    evaluation (--eval.every) are always kept."""
    async_save: bool = False
    """Write the sharded model and optimizer state in a background thread while training goes on (DCP's
    async_save): a save blocks only for a copy of this rank's state into host memory (which it costs, once more),
    and the checkpoint becomes `last` a few steps later, when every rank's write has finished."""

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last must be >= 0, got {self.keep_last}")


@dataclass
class EvalDuringTrainingConfig(EvalProtocol):
    """Closed-loop evaluation of checkpoints while training goes on (a separate `roboscale eval` process with
    these options; each checkpoint meets the same scenes)."""

    option_prefix: ClassVar[str] = "--eval."

    every: int = 0
    """Evaluate the checkpoint of every this many steps, and the final one (0: off). A checkpoint is saved at
    these steps whatever --save_freq says. Training does not wait: one evaluation runs at a time, and a newer
    checkpoint replaces one still waiting for its turn."""
    workers: int = 1
    """Env worker processes of each evaluation (`roboscale eval --rollout.workers`; they share the machine with
    training)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every < 0:
            raise ConfigError(f"--eval.every must be >= 0, got {self.every}")
        if self.workers <= 0:
            raise ConfigError(f"--eval.workers must be a positive integer, got {self.workers}")


STRATEGIES = ("auto", "none", "ddp", "fsdp", "hsdp")


@dataclass
class ParallelConfig:
    """How the policy is spread over the data-parallel ranks (a device mesh of dp_replicate x dp_shard)."""

    strategy: str = "auto"
    """auto (none for one rank, else fsdp) | none | ddp (replicated weights, all-reduced gradients) | fsdp (FSDP2:
    parameters, gradients and optimizer state sharded over all ranks, per block) | hsdp (sharded within
    dp_shard ranks, replicated across dp_replicate groups: shard within a node, replicate across nodes)."""
    dp_shard: int = -1
    """Ranks one copy of the weights is sharded over (-1: every rank for fsdp, the ranks of a node for hsdp)."""
    dp_replicate: int = -1
    """Copies of the sharded weights (hsdp; -1: world size / dp_shard)."""
    timeout_s: float = 600.0
    """Collective timeout: a dead or stuck rank fails the others after this long instead of hanging them."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--parallel.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--parallel.timeout_s must be positive, got {self.timeout_s}")


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


@dataclass
class RayLaunchConfig:
    """`--launcher=ray`: Ray Train's TorchTrainer runs the same training on Ray workers."""

    num_workers: int = 2
    """Training workers (ranks)."""
    address: str | None = None
    """An existing cluster (HOST:PORT); default: a local cluster on this machine, bound to 127.0.0.1."""
    cpus_per_worker: float = 0.5
    """CPUs Ray reserves per worker (0.5 leaves room for Ray Data on a 2-core machine; 1 each deadlocks it)."""
    use_gpu: bool = False
    """One GPU per worker."""
    max_failures: int = 2
    """Times Ray restarts failed workers; each restart resumes from the last checkpoint."""
    placement_strategy: str = "PACK"
    """Where the workers go, as Ray's placement groups say it: PACK (as few nodes as possible), SPREAD (one per
    node where it can), STRICT_SPREAD (one per node, or wait for nodes), STRICT_PACK (all on one node)."""

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ConfigError(f"--ray.num_workers must be positive, got {self.num_workers}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"--ray.placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got "
                              f"{self.placement_strategy!r}")


@dataclass
class TrainerConfig:
    """The Trainer's options: its loop, optimizer, checkpoints, parallelism, precision and evaluation during
    training. `roboscale train` and `roboscale rl` are both this plus what they train on (TrainConfig: a dataset
    and a policy; RLConfig: a simulator, a supervised policy and RL's options)."""

    steps: int = 1700
    """Optimizer steps."""
    seed: int = 0
    """Seed for initialization, shuffling and noise."""
    output_dir: str = "outputs/train/pi05"
    """Where checkpoints/ and tensorboard/ go."""
    save_freq: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    log_freq: int = 50
    """Log metrics every this many steps."""
    resume: bool = False
    """Continue from <output_dir>/checkpoints/last exactly where it stopped. Options not given are the
    checkpoint's; steps, save_freq, log_freq, checkpoint.*, eval.*, num_threads and how the run is spread (the
    loader's workers, ranks, parallel.*) may change, anything else that differs is refused."""
    num_threads: int = 0
    """torch CPU threads per rank (0: the cores of this machine divided among its ranks)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint retention and background writes."""
    eval: EvalDuringTrainingConfig = field(default_factory=EvalDuringTrainingConfig)
    """Evaluation during training: results in evals.jsonl, metrics.jsonl and TensorBoard; checkpoints/best."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data parallelism: DDP, FSDP2 or HSDP over the ranks."""
    precision: str = "fp32"
    """fp32 | bf16 (bf16 compute, fp32 master weights and gradient reduction)."""
    fp8: bool = False
    """FP8 training of the large Linear layers (torchao; the policy's FP8 filter picks them). CPU: emulated."""
    activation_checkpointing: str = "none"
    """none | full (recompute each block in backward) | selective (every other block)."""
    compile: bool = False
    """torch.compile each block."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: each rank's share of the global batch is split into this many."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay (0: off); checkpoints save it as the
    policy's weights."""
    freeze: list[str] = field(default_factory=list)
    """Components to keep fixed (names from `roboscale model info`, e.g. [vision]): no gradients, no optimizer
    state."""
    max_nonfinite_steps: int = 5
    """A NaN/Inf loss or gradient norm skips the step; this many in a row stop the run."""
    wandb: bool = False
    """Also log to Weights & Biases (when installed)."""

    def __post_init__(self) -> None:
        for name in ("steps", "save_freq", "log_freq", "grad_accum", "max_nonfinite_steps"):
            value = getattr(self, name)
            if isinstance(value, int) and value <= 0:
                raise ConfigError(f"--{name} must be a positive integer, got {value}")
        if self.num_threads < 0:
            raise ConfigError(f"--num_threads must be >= 0, got {self.num_threads}")
        choices = {"precision": ("fp32", "bf16"), "activation_checkpointing": ("none", "full", "selective")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"--ema_decay must be in [0, 1), got {self.ema_decay}")


@dataclass
class TrainConfig(TrainerConfig):
    """`roboscale train`: train a policy on a LeRobot v3.0 dataset."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Which dataset to train on."""
    policy: PolicyConfig = field(default_factory=default_policy_config)
    """Policy type and architecture."""
    batch_size: int = 64
    """Samples per optimizer step, over all data-parallel ranks (the global batch; each rank takes
    batch_size / ranks of it)."""
    launcher: str = "local"
    """local (this process, or the ranks torchrun started) | ray (Ray Train workers, see ray.*)."""
    ray: RayLaunchConfig = field(default_factory=RayLaunchConfig)
    """Ray Train launch (with --launcher=ray)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_size <= 0:
            raise ConfigError(f"--batch_size must be a positive integer, got {self.batch_size}")
        if self.launcher not in ("local", "ray"):
            raise ConfigError(f"--launcher must be one of local, ray, got {self.launcher!r}")
