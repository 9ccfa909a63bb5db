"""`roboscale eval`: the evaluation job's options."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from roboscale.configs.rollout import RolloutConfig
from roboscale.errors import ConfigError


@dataclass
class EvalProtocol:
    """What an evaluation measures: the same options for `roboscale eval` and for evaluations during training
    (``--eval.*``), which pass them on to `roboscale eval`."""

    option_prefix: ClassVar[str] = "--"

    env: str = "metaworld"
    """The simulator adapter: metaworld, libero, or package.module:SPEC for one of your own."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """The simulator's own options (``--env_options.NAME=VALUE``; LIBERO: settle_steps)."""
    tasks: list[str] = field(default_factory=list)
    """Tasks or suites (empty: the simulator's default). MetaWorld: demo, mt10, mt50, pairs (tasks told apart by
    the instruction alone), or task names; LIBERO: libero_spatial, libero_object, libero_goal, libero_10,
    libero_90, LIBERO-Pro's perturbed suites (libero_object_lan, ...), or task ids (`roboscale data tasks`)."""
    episodes: int = 10
    """Episodes per task."""
    seed: int = 1000
    """Evaluation seed; episode i of task t is placed by (seed, t, i). Demos use seed 0, so 1000 is unseen."""
    max_steps: int = 0
    """Steps before an episode counts as a failure (0: the simulator's limit; MetaWorld 250, where experts need
    35-180; LIBERO per suite as LeRobot's: spatial/object 280, goal 300, libero_10 520, libero_90 400)."""
    videos_per_task: int = 2
    """Rollout videos to keep per task, failures and successes both where there are both."""

    def __post_init__(self) -> None:
        if self.episodes <= 0:
            raise ConfigError(f"{self.option_prefix}episodes must be a positive integer, got {self.episodes}")
        if self.max_steps < 0:
            raise ConfigError(f"{self.option_prefix}max_steps must be >= 0 (0: the simulator's limit), "
                              f"got {self.max_steps}")
        if self.videos_per_task < 0:
            raise ConfigError(f"{self.option_prefix}videos_per_task must be >= 0, got {self.videos_per_task}")

    def protocol_options(self) -> list[str]:
        """These options as `roboscale eval` arguments."""
        values = {f.name: getattr(self, f.name) for f in fields(EvalProtocol)}
        return [f"--{name}={_as_option(value)}" for name, value in values.items()]


def _as_option(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, dict):
        return json.dumps(value)  # a YAML flow mapping
    return str(value)


POLICY_BACKENDS = ("torch", "onnx")


@dataclass
class EvalPolicy:
    """What runs the checkpoint's policy."""

    backend: str = "torch"
    """torch (the checkpoint in PyTorch), or onnx (--checkpoint is a directory `roboscale export --format=onnx`
    wrote, run by onnxruntime)."""

    def __post_init__(self) -> None:
        if self.backend not in POLICY_BACKENDS:
            raise ConfigError(f"--policy.backend must be one of {list(POLICY_BACKENDS)}, got {self.backend!r}")


@dataclass
class EvalConfig(EvalProtocol):
    """`roboscale eval`: closed-loop evaluation of a checkpoint in simulation (MetaWorld by default)."""

    checkpoint: str = ""
    """A pretrained_model directory, a checkpoints/<step> directory, or a training output_dir (uses its last); with
    --policy.backend=onnx, an exported directory."""
    policy: EvalPolicy = field(default_factory=EvalPolicy)
    """--policy.backend: torch or onnx."""
    video_camera: str = ""
    """Camera shown in the videos (empty: the simulator's; MetaWorld corner2, LIBERO image)."""
    robustness: bool = False
    """Also evaluate every perturbation of --tasks the simulator has (LIBERO: LIBERO-Pro's suites, `roboscale data
    tasks --env=libero`), with the same episodes per task; the report adds success per perturbation and its drop
    from the standard tasks."""
    perturbations: list[str] = field(default_factory=list)
    """With --robustness: the perturbations to evaluate (LIBERO: lan, object, swap, task, with_mug, ...); empty:
    all that the simulator has for --tasks."""
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
