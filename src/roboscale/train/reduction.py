"""One step's objective metrics, reduced by name over its micro-batches and the data-parallel ranks.

Counts (``loss_weight``, ``tokens``, ``computed_tokens`` and the names an objective lists in ``objective.summed``)
are summed, the names in ``objective.maxed`` take their largest value (bounds: RL's staleness); every other metric is a ``loss_weight``-weighted mean, so a step's ``loss`` is the global batch's
mean loss whatever the number of ranks or micro-batches. The values travel as one float64 vector in the sorted
order of their names: one all-reduce per step, without a host sync per micro-batch. The names are the same for
every micro-batch, step and rank (checked: across ranks once, at the first step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from roboscale.errors import TrainingError

WEIGHT = "loss_weight"
SUMMED = frozenset({WEIGHT, "tokens", "computed_tokens"})
RESERVED = frozenset({"grad_norm", "lr", "skipped_steps"})
"""What the trainer adds to a step's metrics itself: an objective's metric may not take these names."""


def summed_names(objective: Callable[..., Any]) -> frozenset[str]:
    return SUMMED | frozenset(getattr(objective, "summed", ()))


def maxed_names(objective: Callable[..., Any]) -> frozenset[str]:
    return frozenset(getattr(objective, "maxed", ()))


def loss_weight(metrics: Mapping[str, Any]) -> torch.Tensor:
    """The objective's ``loss_weight`` (required: the micro-batch's share of the global batch's loss)."""
    if WEIGHT not in metrics:
        raise TrainingError(f"the objective returned the metrics {sorted(metrics)} without {WEIGHT!r}, the loss's "
                            "denominator, which combines micro-batch losses into the global batch's mean")
    return torch.as_tensor(metrics[WEIGHT])


class StepMetrics:
    """Accumulates micro-batches' metrics (``add``), then reduces them over ranks (``reduce``). ``agreed``: the
    names of the run's earlier steps, which every step keeps (None at the first step, whose names are checked
    against every rank's: a rank with other names would add unrelated values position by position, or hang)."""

    def __init__(self, summed: frozenset[str], device: torch.device, agreed: tuple[str, ...] | None = None,
                 maxed: frozenset[str] = frozenset()):
        self.summed = summed
        self.maxed = maxed
        self.largest: dict[str, torch.Tensor] = {}
        self.device = device
        self.agreed = agreed
        self.names: tuple[str, ...] | None = None
        self.totals: torch.Tensor | None = None

    def add(self, metrics: Mapping[str, Any], weight: torch.Tensor) -> None:
        """One micro-batch's metrics; ``weight`` is its loss weight as the gradient was scaled by it."""
        names = tuple(sorted(metrics))
        if self.names is None:
            if self.agreed is not None and names != self.agreed:
                raise TrainingError(f"the objective returned the metrics {list(names)}, and {list(self.agreed)} at "
                                    "the run's earlier steps; it must return the same names at every step")
            clash = RESERVED.intersection(names)
            if clash:
                raise TrainingError(f"the objective's metrics {sorted(clash)} take names the trainer logs itself "
                                    f"({', '.join(sorted(RESERVED))}); rename them")
            self.names = names
            self.totals = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        elif names != self.names:
            raise TrainingError(f"the objective returned the metrics {list(names)} for a micro-batch and "
                                f"{list(self.names)} for an earlier one of the same step; it must return the same "
                                "names for every batch")
        for name in self.maxed.intersection(names):
            value = _scalar(name, metrics[name], self.device)
            self.largest[name] = torch.maximum(self.largest[name], value) if name in self.largest else value
        weight = weight.double()
        values = [weight if name == WEIGHT else
                  _scalar(name, metrics[name], self.device) * (1.0 if name in self.summed else weight)
                  for name in names]
        self.totals += torch.stack(values)

    def reduce(self, distributed: bool) -> dict[str, torch.Tensor]:
        """Sums over ranks; weighted means divided by the summed weight."""
        if self.totals is None:
            raise TrainingError("a step without micro-batches: the data source returned an empty batch")
        if distributed:
            import torch.distributed as dist

            if self.agreed is None:  # the first step, on every rank alike
                _check_same_names_on_every_rank(self.names)
            dist.all_reduce(self.totals, op=dist.ReduceOp.SUM)
        weight = self.totals[self.names.index(WEIGHT)]
        reduced = {name: value if name in self.summed else value / weight.clamp_min(1e-12)
                   for name, value in zip(self.names, self.totals, strict=True)}
        if self.largest:  # the same names on every rank (checked above), in the same order
            names = sorted(self.largest)
            largest = torch.stack([self.largest[name] for name in names])
            if distributed:
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            reduced.update(zip(names, largest, strict=True))
        return reduced


def _scalar(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A metric as a float64 scalar on ``device``, without a host sync: a number (or a CPU tensor, read on the
    host) becomes a fill on the device, not a copy from pageable host memory, which would wait for the queue."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TrainingError(f"the objective's metric {name!r} has shape {list(value.shape)}; metrics are scalars")
        if not (value.device.type == "cpu" and device.type != "cpu"):
            return value.detach().reshape(()).to(device=device, dtype=torch.float64)
        value = value.item()
    return torch.full((), float(value), dtype=torch.float64, device=device)


def _check_same_names_on_every_rank(names: tuple[str, ...]) -> None:
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, list(names))
    differing = {rank: found for rank, found in enumerate(every) if found != every[0]}
    if differing:
        raise TrainingError(f"the objective's metrics differ between ranks: rank 0 has {every[0]}, "
                            + "; ".join(f"rank {rank} has {found}" for rank, found in differing.items()))
