"""RL post-training as a job of the Trainer (``train.components.TrainingJob``): the policy from a supervised
checkpoint, rollouts as the data source, the policy-gradient loss as the objective, weight publishing as a step
hook, and the RL state in the checkpoint. Everything else (ranks, FSDP2/DDP, optimizer, DCP checkpoints, resume,
telemetry, evaluation during training) is the Trainer's, as for supervised training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roboscale.config import to_dict
from roboscale.configs.rl import RLConfig
from roboscale.errors import ConfigError

log = logging.getLogger(__name__)

STATE = "rl"
"""The job's entry of a checkpoint's training state (training_state/rl_state.json): its config and step."""


class WeightPublisher:
    """Step hook: after an optimizer step that a rollout follows, the rollout engine's servers take the new
    weights with their version (the number of the step that made them). ``ensure_current`` publishes before a
    rollout when the servers hold older weights (a resumed run, a skipped step)."""

    def __init__(self, engine: Any, version: int = 0, due: Callable[[], bool] = lambda: True):
        self.engine = engine
        self.version = version
        """The version the servers hold: 0 is the supervised checkpoint they start from."""
        self.due = due  # whether a rollout comes next (not another epoch on the last one)

    def __call__(self, trainer: Any) -> None:
        if self.due():
            self.publish(trainer, trainer.step)  # hooks run once the trainer has counted the step it applied

    def ensure_current(self, trainer: Any) -> None:
        if self.version != trainer.step:
            self.publish(trainer, trainer.step)

    def publish(self, trainer: Any, version: int) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank gathers the full weights (a collective) for its own engine's servers
        from roboscale.models.value import acting_weights

        full = get_model_state_dict(trainer.policy, options=StateDictOptions(full_state_dict=True))
        self.engine.update_weights({k: v.detach().cpu() for k, v in acting_weights(full).items()}, version)
        self.version = version


@dataclass
class RLState:
    """The job's checkpointed entry: its config (what a resume continues with) and nothing in flight (a
    synchronous step leaves no trajectory behind)."""

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

    def build_policy(self, trainer: Any, resumed: Any | None) -> Any:
        from roboscale.models.policy import Policy

        if resumed is not None:
            return resumed
        if self.cfg.rl.algorithm == "ppo":  # the critic: a value head on the policy's features, fresh unless it has one
            saved = Policy.from_pretrained(self.checkpoint)
            if saved.config.value_head_dim:
                return saved
            return Policy.from_pretrained(self.checkpoint, value_head_dim=self.cfg.rl.value_head_dim)
        return Policy.from_pretrained(self.checkpoint)

    def build(self, trainer: Any) -> Any:
        from roboscale.rl.objective import PolicyGradientLoss
        from roboscale.rl.rollouts import RolloutSource
        from roboscale.rollout.engine import RolloutEngine
        from roboscale.train.components import TrainingComponents

        cfg = self.cfg
        groups = len(self.tasks) * cfg.rl.states_per_task
        if groups % trainer.plan.dp_size:
            raise ConfigError(f"--rl.states_per_task={cfg.rl.states_per_task} x {len(self.tasks)} tasks = {groups} "
                              f"episode groups per step, not divisible by the {trainer.plan.dp_size} data-parallel "
                              "ranks (each rank rolls out whole groups)")
        engine = RolloutEngine(cfg.rollout, rl_env_setup(cfg, self.checkpoint, self.tasks, trainer.policy.config))
        engine.start()  # one pool for the whole run: its servers take each step's weights
        source = RolloutSource(cfg.rl, self.tasks, engine, trainer.policy.config, rank=trainer.env.rank,
                               world_size=trainer.plan.dp_size,
                               before_rollout=lambda: publisher.ensure_current(trainer),
                               value_fn=lambda batches: critic_values(trainer, batches))
        publisher = WeightPublisher(engine, due=lambda: source.rolls_out_next)
        return TrainingComponents(data=source, objective=PolicyGradientLoss(cfg.rl), hooks=[publisher],
                                  state={STATE: RLState(cfg)}, counts_flops=False)


def rl_env_setup(cfg: RLConfig, checkpoint: Path, tasks: list[str], policy_config: Any) -> Any:
    """The environments the rollouts run in, as evaluation builds them for this policy (its cameras, image size
    and state feature), with RL's episode limit."""
    from roboscale.eval.closed_loop import policy_env_setup
    from roboscale.sim.env import env_spec

    return policy_env_setup(env_spec(cfg.env), tasks, policy_config, checkpoint, cfg.rl.max_steps)


def critic_values(trainer: Any, batches: list[dict[str, Any]]) -> list[Any]:
    """The critic's values of each batch's chunks, through the trainer's module (the sharded weights gather as in a
    training step). Every rank runs the same number of forward passes (FSDP gathers in each): one with fewer
    batches repeats its last."""
    import torch

    from roboscale.rl.objective import VALUES_OF

    count = len(batches)
    if trainer.env.distributed:
        import torch.distributed as dist

        counts = torch.tensor([count], dtype=torch.float64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        count = int(counts.item())
    values = []
    with torch.no_grad():
        for i in range(count):
            value, _ = trainer.module({VALUES_OF: batches[min(i, len(batches) - 1)]["observation"]})
            if i < len(batches):
                values.append(value.float().cpu())
    return values
