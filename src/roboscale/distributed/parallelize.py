"""Parallelism applied to a plain policy from outside: activation checkpointing, compile, then DDP or FSDP2.

The policy only declares its blocks (``Policy.parallel_units()``: for pi0.5 one (prefix layer, action-expert
layer) pair per unit, so the joint attention's two towers are gathered together, plus the vision blocks; for
GR00T the ViT blocks, language-model layers, VL self-attention and DiT blocks). Each wrapper works on those
blocks, in torchtitan's order (after any FP8 conversion of their Linear layers): activation checkpointing,
compile, and last ``fully_shard`` per block and once more at the root for the parameters outside every block.

The trainer drives a ``TrainingModule``: its ``forward(batch)`` is the objective on the policy (encode, draw,
velocity, loss), so DDP's and FSDP's forward/backward hooks see one forward per micro-batch even though a
policy's own forward is never called in training. The plain policy stays reachable as ``.policy`` for
checkpoints and evaluation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from roboscale.distributed.mesh import ParallelPlan

log = logging.getLogger(__name__)


class TrainingModule(nn.Module):
    """The policy under its objective: one forward per micro-batch returns ``(loss, metrics)``."""

    def __init__(self, policy: nn.Module, objective: Callable[[nn.Module, Any], Any]):
        super().__init__()
        self.policy = policy
        self.objective = objective

    def forward(self, batch: Any):
        return self.objective(self.policy, batch)


def apply_activation_checkpointing(units: list[nn.Module], mode: str) -> int:
    """Recompute blocks in backward instead of keeping their activations: every block (``full``) or every other
    one (``selective``, about half the activation memory saved for a third of the recompute). Returns how many."""
    if mode == "none":
        return 0
    from torch.utils.checkpoint import checkpoint

    chosen = units if mode == "full" else units[::2]
    for unit in chosen:
        # an instance attribute shadows the class's forward; FSDP's hooks wrap __call__ and still run around it
        unit.forward = functools.partial(checkpoint, unit.forward, use_reentrant=False)
    return len(chosen)


def apply_compile(units: list[nn.Module]) -> None:
    """Compile each block on its own: blocks repeat, so one compiled graph serves all of them, and a change of
    sequence length recompiles one block's graph, not the model's."""
    for unit in units:
        unit.compile(dynamic=None)


def apply_fsdp(module: TrainingModule, units: list[nn.Module], mesh, precision: str) -> None:
    """FSDP2 per block, then the root: parameters, gradients and optimizer state are sharded over the mesh's
    ``dp_shard`` ranks (and replicated over ``dp_replicate`` for HSDP). bf16: compute in bf16, keep fp32 master
    weights and reduce gradients in fp32. The last block is not resharded after forward, since backward starts
    with it and would gather it again at once."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None, reduce_dtype=torch.float32)
    for i, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(units) - 1)
    fully_shard(module, mesh=mesh, mp_policy=mp)


def parallelize(policy: nn.Module, objective: Callable[[nn.Module, Any], Any], plan: ParallelPlan, mesh, *,
                device: torch.device, precision: str, activation_checkpointing: str, compile: bool) -> nn.Module:
    """The module the training loop calls (see the module docstring); ``policy`` is modified in place."""
    policy.to(device)
    units = list(policy.parallel_units())
    checkpointed = apply_activation_checkpointing(units, activation_checkpointing)
    if checkpointed:
        log.info("activation checkpointing: %d of %d blocks", checkpointed, len(units))
    if compile:
        apply_compile(units)
    module = TrainingModule(policy, objective)
    if plan.sharded:
        apply_fsdp(module, units, mesh, precision)
    elif plan.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    return module


def set_gradient_sync(module: nn.Module, enabled: bool):
    """A context in which backward does (not) reduce gradients over ranks: accumulating micro-batches reduces once,
    with the last one."""
    import contextlib

    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if hasattr(module, "no_sync") and not enabled:  # DDP
        return module.no_sync()
    return contextlib.nullcontext()
