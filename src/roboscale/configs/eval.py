"""`roboscale eval`: the evaluation job's options."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

from roboscale.configs.rollout import RolloutConfig
from roboscale.errors import ConfigError


@dataclass
class EvalProtocol:
    """What an evaluation measures: the same options for `roboscale eval` and for evaluations during training
    (``--eval.*``), which pass them on to `roboscale eval`."""

    option_prefix: ClassVar[str] = "--"

    env: str = "metaworld"
    """The simulator adapter (registered name, or package.module:SPEC for one of your own)."""
    tasks: list[str] = field(default_factory=lambda: ["demo"])
    """Tasks or suites: demo, mt10, mt50, pairs (tasks told apart by the instruction alone)."""
    episodes: int = 10
    """Episodes per task."""
    seed: int = 1000
    """Evaluation seed; episode i of task t is placed by (seed, t, i). Demos use seed 0, so 1000 is unseen."""
    max_steps: int = 250
    """Steps before an episode counts as a failure (experts need 35-180 on these tasks)."""
    videos_per_task: int = 2
    """Rollout videos to keep per task, failures and successes both where there are both."""

    def __post_init__(self) -> None:
        for name in ("episodes", "max_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.option_prefix}{name} must be a positive integer, got {getattr(self, name)}")
        if self.videos_per_task < 0:
            raise ConfigError(f"{self.option_prefix}videos_per_task must be >= 0, got {self.videos_per_task}")

    def protocol_options(self) -> list[str]:
        """These options as `roboscale eval` arguments."""
        values = {f.name: getattr(self, f.name) for f in fields(EvalProtocol)}
        return [f"--{name}={','.join(value) if isinstance(value, list) else value}" for name, value in values.items()]


@dataclass
class EvalConfig(EvalProtocol):
    """`roboscale eval`: closed-loop evaluation of a checkpoint in simulation (MetaWorld by default)."""

    checkpoint: str = ""
    """A pretrained_model directory, a checkpoints/<step> directory, or a training output_dir (uses its last)."""
    video_camera: str = "corner2"
    """Camera shown in the videos."""
    instructions: dict[str, str] = field(default_factory=dict)
    """Task -> instruction to give the policy instead of the task's own (paraphrases, or a swapped instruction
    as a language-following control), e.g. {faucet-open: "Rotate the faucet clockwise"}."""
    output_dir: str = ""
    """Report directory (default: <checkpoint>/../eval)."""
    resume: bool = True
    """Skip the episodes an interrupted run with the same protocol already wrote to <output_dir>/episodes.jsonl;
    false: start over (the old episodes are discarded)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Env workers, inference servers, dynamic batching, retries."""
