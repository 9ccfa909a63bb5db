"""RL post-training as a job of the Trainer (``train.components.TrainingJob``): the policy from a supervised
checkpoint, rollouts as the data source, the policy-gradient loss as the objective, weight publishing as a step
hook, and the RL state in the checkpoint. Everything else (ranks, FSDP2/DDP, optimizer, DCP checkpoints, resume,
telemetry, evaluation during training) is the Trainer's, as for supervised training.

The job owns the one ``WeightChannel`` between the trainer and the generators (``rollout.weights``): the engine
takes its weights from it, and the trainer's reach it through the rollout driver's ``WeightSchedule``
(``rl.driver``), which decides when each version goes in.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roboscale.config import from_dict, to_dict
from roboscale.configs.rl import RLConfig
from roboscale.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from roboscale.configs.rollout import RolloutConfig
    from roboscale.distributed.env import DistributedEnv
    from roboscale.models.config import PolicyConfig
    from roboscale.models.policy import Policy
    from roboscale.rl.driver import WeightSchedule
    from roboscale.rollout.engine import EnvSetup
    from roboscale.train.components import TrainerView, TrainingComponents

log = logging.getLogger(__name__)

ROLLOUT_LOG = "rollouts.jsonl"
"""One line per rollout trained on (rank 0's share): its weights version and staleness, episodes, successes, env
steps, when it ran, and how long the driver held it back and the trainer waited for it."""

STATE = "rl"
"""The job's entry of a checkpoint's training state (training_state/rl_state.json): its config and step."""


class WeightPublisher:
    """Step hook: after an optimizer step that a rollout follows, the new weights with their version (the number
    of the step that made them) go to ``schedule`` (``rl.driver.WeightSchedule``: on to the engine's channel, for
    the rollouts that start from then on). ``publish`` alone: the weights a run starts (or resumes) with."""

    def __init__(self, schedule: WeightSchedule, due: Callable[[], bool]):
        self.schedule = schedule
        self.due = due  # whether a rollout comes next (not another epoch on the last one)

    def __call__(self, trainer: TrainerView) -> None:
        if self.due():
            self.publish(trainer)  # hooks run once the trainer has counted the step it applied

    def publish(self, trainer: TrainerView) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank gathers the full weights (a collective) for its own engine; copies, since training goes on
        # while the engine hands them to the servers (the critic too, if any: PPO's values come from the acting
        # weights)
        full = get_model_state_dict(trainer.policy, options=StateDictOptions(full_state_dict=True))
        self.schedule.publish({k: v.detach().to("cpu", copy=True) for k, v in full.items()}, trainer.step)


@dataclass
class RLState:
    """The job's checkpointed entry: its config (what a resume continues with). Trajectories in flight are not
    kept: a resume rolls their rollouts out again (``RolloutSource`` counts them)."""

    config: RLConfig
    extra: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"config": to_dict(self.config), **self.extra}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.extra = {k: v for k, v in state.items() if k != "config"}


class RLJob:
    """``TrainingJob`` for ``roboscale rl`` (see the module docstring)."""

    def __init__(self, cfg: RLConfig, checkpoint: Path, tasks: list[str]):
        self.cfg, self.checkpoint, self.tasks = cfg, checkpoint, tasks
        self.batch_size = len(tasks) * cfg.rl.states_per_task * cfg.rl.group_size
        """The global batch (``TrainingJob.batch_size``): the episodes of one rollout, which each step trains on."""

    def build_policy(self, trainer: TrainerView, resumed: Policy | None) -> Policy:
        from roboscale.models.policy import Policy

        if resumed is not None:
            return resumed
        # the checkpoint's policy, with a critic where the algorithm needs one and it has none (a fresh value head)
        config = policy_config(self.cfg, self.checkpoint)
        return Policy.from_pretrained(self.checkpoint, value_head_dim=config.value_head_dim)

    def build(self, trainer: TrainerView) -> TrainingComponents:
        from roboscale.rl.driver import WeightSchedule
        from roboscale.rl.objective import PolicyGradientLoss
        from roboscale.rl.rollouts import RolloutSource
        from roboscale.rollout.engine import RolloutEngine
        from roboscale.rollout.weights import WeightChannel
        from roboscale.train.components import TrainingComponents

        cfg = self.cfg
        groups = len(self.tasks) * cfg.rl.states_per_task
        if groups % trainer.plan.dp_size:
            raise ConfigError(f"--rl.states_per_task={cfg.rl.states_per_task} x {len(self.tasks)} tasks = {groups} "
                              f"episode groups per step, not divisible by the {trainer.plan.dp_size} data-parallel "
                              "ranks (each rank rolls out whole groups)")
        rollout, cores = placed(cfg, trainer.env)
        weights = WeightChannel()  # the trainer's weights to the generators, the one way
        engine = RolloutEngine(rollout, rl_env_setup(cfg, self.checkpoint, self.tasks, trainer.policy.config),
                               weights=weights)
        with pinned(cores.rollout if cores else None):  # spawned processes inherit the thread's cores
            engine.start()  # one pool for the whole run: its servers take each rollout's weights
        if cores:
            os.sched_setaffinity(0, cores.trainer)
            import torch

            torch.set_num_threads(len(cores.trainer))
        schedule = WeightSchedule(cfg.rl, cfg.steps // cfg.rl.epochs, weights)
        source = RolloutSource(cfg.rl, self.tasks, engine, schedule, trainer.policy.config,
                               rank=trainer.env.rank, world_size=trainer.plan.dp_size,
                               before_first=lambda: publisher.publish(trainer),
                               driver_cores=cores.rollout if cores else None,
                               log_path=trainer.output_dir / ROLLOUT_LOG if trainer.env.is_main else None)
        publisher = WeightPublisher(schedule, due=lambda: source.rolls_out_next)
        return TrainingComponents(data=source, objective=PolicyGradientLoss(cfg.rl, cfg.rollout.sampler),
                                  hooks=[publisher], state={STATE: RLState(cfg)}, counts_flops=False)


@dataclass(frozen=True)
class Cores:
    trainer: set[int]
    rollout: set[int]


def placed(cfg: RLConfig, env: DistributedEnv) -> tuple[RolloutConfig, Cores | None]:
    """The rollout processes' options for --rl.placement on this rank's devices (see RLOptions.placement), and on
    the CPU, disaggregated, the cores of the trainer and of the rollout processes."""
    import dataclasses

    rollout = cfg.rollout
    if env.device.type == "cuda":
        if rollout.runner.device != "auto":  # the user placed them
            return rollout, None
        import torch

        index = env.device.index or 0
        if cfg.rl.placement == "disaggregated":
            per_node = env.local_world_size
            index += per_node
            if index >= torch.cuda.device_count():
                raise ConfigError(f"--rl.placement=disaggregated: the generators of {per_node} ranks need "
                                  f"{2 * per_node} GPUs per node, this one has {torch.cuda.device_count()}")
        return dataclasses.replace(rollout, runner=dataclasses.replace(rollout.runner, device=f"cuda:{index}")), None
    if cfg.rl.placement == "disaggregated":
        return rollout, split_cores()
    return rollout, None


@contextlib.contextmanager
def pinned(cores: set[int] | None) -> Iterator[None]:
    """This thread on ``cores`` inside the block (None: as it is)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def split_cores() -> Cores:
    """This process's cores, halved: the trainer's and the rollout processes'. (The trainer's torch threads that
    exist already keep their cores; their number is cut to its half.)"""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ConfigError("--rl.placement=disaggregated needs at least 2 cores (this process may use "
                          f"{len(cores)})")
    half = len(cores) // 2
    return Cores(set(cores[:half]), set(cores[half:]))


def policy_config(cfg: RLConfig, checkpoint: Path) -> PolicyConfig:
    """The trained policy's config: the checkpoint's, with the algorithm's critic (PPO's value head) where it has
    none. The one place that decides the critic."""
    from roboscale.models.config import PolicyConfig
    from roboscale.models.policy import CONFIG_NAME, read_policy_config

    saved = read_policy_config(checkpoint)
    if cfg.rl.algorithm.critic and not saved.get("value_head_dim"):
        saved["value_head_dim"] = cfg.rl.algorithm.value_head_dim
    try:
        return from_dict(PolicyConfig, saved, where=str(checkpoint / CONFIG_NAME))
    except ConfigError as exc:
        raise CheckpointError(checkpoint / CONFIG_NAME, str(exc)) from None


def rl_env_setup(cfg: RLConfig, checkpoint: Path, tasks: list[str], policy_config: PolicyConfig) -> EnvSetup:
    """The environments the rollouts run in, as evaluation builds them for this policy (its cameras, image size
    and state feature), with RL's episode limit."""
    from roboscale.rollout.setup import policy_env_setup

    return policy_env_setup(cfg.env, tasks, policy_config, checkpoint, cfg.rl.max_steps, cfg.env_options)
