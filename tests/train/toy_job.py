"""A toy ``TrainingJob`` for the Trainer's seams (tests/train/test_components.py): synthetic batches from memory
for the tiny pi0.5 preset, an objective with extra metrics, a step hook, an extra checkpointed entry.

Batch ``i`` of the global sequence is a function of ``i`` alone (its samples' seeds are ``1000 * i + j``), so any
number of ranks and a resumed run see the same global batches; each rank takes its contiguous share, cut into
two micro-batches of different sizes (3 + 5 samples of 8 on one process, 1 + 3 of each 4 on two ranks).

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.train.toy_job DATASET OUT STEPS
    python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.train.toy_job names
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roboscale.configs.train import DatasetConfig, OptimizerConfig, ParallelConfig, TrainConfig
from roboscale.models.objective import flow_matching_loss
from roboscale.models.registry import preset_config
from roboscale.train.components import TrainingComponents

from tests.conftest import TASKS

BATCH = 8
CHUNK = 4
CAMERAS = ["observation.images.corner2", "observation.images.wrist"]


def ratio_of(seeds: torch.Tensor) -> torch.Tensor:
    """A per-sample value (1 .. 8: the sample's place in its global batch) averaged over a micro-batch: with
    every sample of equal loss weight, its weighted mean over micro-batches is the global batch's mean, 4.5."""
    return (seeds % 1000 + 1).double().mean()


class ToyData:
    """A DataSource of synthetic batches in memory: this rank's share of global batch ``position``."""

    def __init__(self, policy: Any, rank: int, ranks: int, seed: int):
        self.transform, self.collate = policy.data_transforms()
        self.rank, self.ranks, self.seed = rank, ranks, seed
        self.position = 0
        self.closed = False

    def sample(self, i: int, j: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, i, j])
        image = torch.from_numpy(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8))
        return {CAMERAS[0]: image, CAMERAS[1]: image.flip(-1), "task": TASKS[j % 2],
                "observation.state": torch.from_numpy(rng.standard_normal(4, dtype=np.float32)),
                "action": torch.from_numpy(rng.standard_normal((CHUNK, 4), dtype=np.float32)),
                "sample_seed": 1000 * i + j, "episode_index": j}

    def __next__(self) -> list[Any]:
        share = BATCH // self.ranks
        first = self.rank * share
        samples = [self.transform(self.sample(self.position, j)) for j in range(first, first + share)]
        self.position += 1
        cut = share * 3 // 8  # two micro-batches of different loss weights
        return [self.collate(samples[:cut]), self.collate(samples[cut:])]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def stats(self) -> dict[str, float]:
        return {"batches": float(self.position)}

    def close(self) -> None:
        self.closed = True


@dataclass
class Publisher:
    """What an RL job's weight publisher would keep: how many new weights it sent, at which step last."""

    published: int = 0
    last_step: int = 0
    called_at: list[int] = field(default_factory=list)  # this process's calls (not checkpointed)
    restored: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, trainer: Any) -> None:  # the step hook
        self.published += 1
        self.last_step = trainer.step
        self.called_at.append(trainer.step)

    def state_dict(self) -> dict[str, Any]:
        return {"published": self.published, "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.published, self.last_step = int(state["published"]), int(state["last_step"])
        self.restored.append(dict(state))


class ToyJob:
    """``nan_at``: optimizer steps (1-based) whose loss is made NaN (the step is skipped)."""

    def __init__(self, dataset: Path, nan_at: frozenset[int] = frozenset()):
        self.dataset = dataset
        self.batch_size = BATCH
        self.nan_at = nan_at
        self.publisher = Publisher()
        self.calls: list[dict[str, float]] = []  # each micro-batch's metrics, as the objective returned them
        self.data: ToyData | None = None

    def build_policy(self, trainer: Any, resumed: Any) -> Any:
        if resumed is not None:
            return resumed
        from roboscale.data.loading.meta import source_meta
        from roboscale.data.loading.source import open_source
        from roboscale.models.registry import build_policy

        # the dataset gives only the shapes, stats and tasks the policy is built for; batches are synthetic
        return build_policy(trainer.cfg.policy, source_meta([open_source(self.dataset)], [str(self.dataset)]))

    def build(self, trainer: Any) -> TrainingComponents:
        self.data = ToyData(trainer.policy, trainer.env.rank, trainer.plan.dp_size, trainer.cfg.seed)

        def objective(policy: Any, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            loss, metrics = flow_matching_loss(policy, batch)
            if trainer.step + 1 in self.nan_at:
                loss = loss * float("nan")
            metrics = {**metrics, "loss": loss.detach(), "ratio": ratio_of(batch.sample_seed),
                       "samples": len(batch.sample_seed)}
            self.calls.append({"step": trainer.step + 1, **{k: float(v) for k, v in metrics.items()}})
            return loss, metrics

        objective.summed = frozenset({"samples"})
        return TrainingComponents(data=self.data, objective=objective, hooks=[self.publisher],
                                  state={"publisher": self.publisher})


def toy_config(dataset: Path, out: Path, steps: int, **kw: Any) -> TrainConfig:
    policy = preset_config("pi05", "tiny", chunk_size=CHUNK, n_action_steps=2)
    return TrainConfig(dataset=DatasetConfig(root=str(dataset), num_workers=0), policy=policy, steps=steps,
                       batch_size=BATCH, seed=3, output_dir=str(out), log_freq=1,
                       save_freq=kw.pop("save_freq", steps), optimizer=OptimizerConfig(lr=1e-3, warmup_steps=2),
                       parallel=ParallelConfig(strategy="ddp"), **kw)


def disagreeing_names() -> None:
    """``... -m tests.train.toy_job names``: each rank's objective names another metric; every rank says so."""
    import torch.distributed as dist

    from roboscale.errors import TrainingError
    from roboscale.train.reduction import StepMetrics

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    metrics = StepMetrics(frozenset({"loss_weight"}), torch.device("cpu"))
    metrics.add({"loss": torch.tensor(1.0), "loss_weight": torch.tensor(2.0), f"rank{rank}_only": 1.0},
                torch.tensor(2.0))
    try:
        metrics.reduce(distributed=True)
    except TrainingError as exc:
        # one write per line: the ranks share stdout, and an unbuffered print writes text and newline apart
        os.write(sys.stdout.fileno(), f"rank {rank}: {exc}\n".encode())
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "names":
        disagreeing_names()
    else:
        from roboscale.train.supervised import train

        dataset, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
        train(toy_config(dataset, out, steps), progress=False, job=ToyJob(dataset))
