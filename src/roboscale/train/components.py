"""What a training job gives the Trainer: its data, its objective, its step hooks and its extra checkpointed state.

The Trainer owns the loop, parallelism, the optimizer, checkpoints and telemetry; a ``TrainingJob`` owns what is
trained on and how (torchtitan's split between its ``Trainer`` and the components it is handed). Supervised
training (``train/supervised.py``: datasets, the streaming loader, the policy's registered flow-matching loss)
is one job; RL post-training is another, with trajectories from simulators as its data, a policy-gradient loss
and a hook that publishes new weights after each step, through the same loop.

A job is asked twice, in the order that keeps runs reproducible: ``build_policy`` right after the seed (the
initial weights follow it), then ``build`` once the policy exists (its data transforms, its config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

if TYPE_CHECKING:
    from pathlib import Path

    from roboscale.configs.train import TrainerConfig
    from roboscale.distributed.env import DistributedEnv
    from roboscale.distributed.mesh import ParallelPlan
    from roboscale.models.policy import Policy


class TrainerView(Protocol):
    """What a job and its step hooks see of the Trainer that runs them (``train.trainer.Trainer`` is one): this
    module names no Trainer, so a job depends on the loop's state, not on the loop."""

    cfg: TrainerConfig
    """The run's options (the job's own config: a TrainConfig, an RLConfig)."""
    env: DistributedEnv
    plan: ParallelPlan
    policy: Policy
    """The plain policy (its parallelized wrapper is the Trainer's business)."""
    output_dir: Path
    resume_from: Path | None
    """The checkpoint being resumed, or None."""
    step: int
    """Optimizer steps applied so far."""


@runtime_checkable
class Stateful(Protocol):
    """Something a checkpoint keeps: ``training_state/<name>_state.json`` holds its ``state_dict()`` (JSON-able,
    the same on every rank: rank 0's is written) and a resume hands it back to ``load_state_dict`` (a KeyError,
    TypeError or ValueError there is reported as a checkpoint that does not fit, naming the file)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class TensorStateful(Protocol):
    """A Stateful entry that keeps tensors too (RL's: the older weights its next rollouts act with), as
    ``training_state/<name>_tensors.safetensors`` (rank 0's; safetensors, never pickle). A resume hands the file's
    tensors to ``load_tensor_state`` (``{}`` for a checkpoint written without it)."""

    def tensor_state(self) -> dict[str, Tensor]: ...

    def load_tensor_state(self, tensors: dict[str, Tensor]) -> None: ...


@runtime_checkable
class DataSource(Stateful, Protocol):
    """This rank's batches, one ``next()`` per optimizer step: its share of the global batch (a list of
    micro-batches when it cuts them itself, or an iterator of micro-batches that arrive while the step computes
    the earlier ones: RL's trajectories as simulators finish them). ``stats()``: counters for telemetry (``distinct_episodes`` is
    logged when present). ``close()`` stops whatever it started (workers, simulators); called when training ends
    or fails. ``roboscale.data.loading.loader.StreamingLoader`` is one."""

    def __next__(self) -> Any: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


Objective = Callable[["Policy", Any], tuple[Tensor, dict[str, Tensor]]]
"""``(policy, micro_batch) -> (loss, metrics)``. ``metrics["loss_weight"]`` is required: the loss's denominator, by
which micro-batch losses combine into the global batch's mean. Metrics are scalars (tensors or numbers), the same
names for every micro-batch, step and rank; ``loss_weight``, ``tokens``, ``computed_tokens`` and the names in an
optional attribute ``objective.summed: frozenset[str]`` are summed over micro-batches and ranks, every other one is
a ``loss_weight``-weighted mean (``loss`` among them: the returned loss when the metrics do not name it)."""

StepHook = Callable[[TrainerView], None]
"""Called with the trainer after every optimizer step that was applied (never after a skipped NaN/Inf step), on
every rank, once ``trainer.step`` counts that step."""


@dataclass
class TrainingComponents:
    data: DataSource
    objective: Objective
    hooks: list[StepHook] = field(default_factory=list)
    """Run after the trainer's own (FP8 scales, then the EMA update), in this order."""
    state: dict[str, Stateful] = field(default_factory=dict)
    """Extra checkpointed entries by name, beside the trainer's (``trainer``) and the data's (``loader``)."""
    counts_flops: bool = True
    """Whether the policy's analytical FLOPs per sample (one supervised sample) measure this job's samples: MFU is
    logged only then (an RL sample is an episode, whose compute depends on its length)."""


class TrainingJob(Protocol):
    batch_size: int
    """Samples per optimizer step over all ranks (the global batch: what telemetry counts, what the ranks share):
    ``--batch_size`` for supervised training, one rollout's episodes for RL."""

    def build_policy(self, trainer: TrainerView, resumed: Policy | None) -> Policy:
        """The policy to train. ``resumed``: the checkpoint's policy (its weights are restored later, with the
        optimizer) when the run resumes, else None."""
        ...

    def build(self, trainer: TrainerView) -> TrainingComponents:
        """Data, objective, hooks and extra state, once ``trainer.policy`` exists."""
        ...
