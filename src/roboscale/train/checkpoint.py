"""Checkpoints in LeRobot's layout, written atomically, and exact resume.

    <output_dir>/checkpoints/<step:06d>/pretrained_model/   config.json, model.safetensors, tokenizer.json,
                                                            train_config.json
    <output_dir>/checkpoints/<step:06d>/training_state/     training_step.json, optimizer_state.safetensors,
                                                            optimizer_param_groups.json, scheduler_state.json,
                                                            rng_state.safetensors, loader_state.json
    <output_dir>/checkpoints/last -> <step:06d>

A step directory is assembled under a temporary name and renamed into place, then ``last`` is switched with an
atomic symlink replace; a run killed at any moment leaves the previous checkpoint intact and ``last`` pointing
at a complete one. Everything is safetensors or JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from roboscale.config import to_dict
from roboscale.errors import CheckpointError
from roboscale.utils.io import atomic_directory, fsync_dir

PRETRAINED = "pretrained_model"
TRAINING_STATE = "training_state"


def step_name(step: int) -> str:
    return f"{step:06d}"


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into flat tensors (safetensors) and JSON-able structure."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for param_id, slots in state["state"].items():
        for name, value in slots.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{param_id}.{name}"] = value.detach().contiguous().cpu()
    return tensors, {"param_groups": state["param_groups"]}


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups["param_groups"]})


def save_checkpoint(
    output_dir: Path,
    step: int,
    policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader_state: dict,
    train_config: Any,
) -> Path:
    checkpoints = Path(output_dir) / "checkpoints"
    target = checkpoints / step_name(step)
    with atomic_directory(target, overwrite=True) as tmp:
        pretrained = tmp / PRETRAINED
        policy.save_pretrained(pretrained)
        (pretrained / "train_config.json").write_text(json.dumps(to_dict(train_config), indent=4))
        state_dir = tmp / TRAINING_STATE
        state_dir.mkdir()
        tensors, groups = _optimizer_tensors(optimizer)
        save_file(tensors, str(state_dir / "optimizer_state.safetensors"))
        (state_dir / "optimizer_param_groups.json").write_text(json.dumps(groups, indent=4))
        (state_dir / "scheduler_state.json").write_text(json.dumps(scheduler.state_dict(), indent=4))
        save_file({"torch": torch.get_rng_state()}, str(state_dir / "rng_state.safetensors"))
        (state_dir / "loader_state.json").write_text(json.dumps(loader_state, indent=4))
        (state_dir / "training_step.json").write_text(json.dumps({"step": step}, indent=4))
    _point_last(checkpoints, target.name)
    return target


def _point_last(checkpoints: Path, name: str) -> None:
    tmp = checkpoints / ".last.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, checkpoints / "last")
    fsync_dir(checkpoints)


def last_checkpoint(output_dir: Path) -> Path | None:
    last = Path(output_dir) / "checkpoints" / "last"
    return last.resolve() if last.exists() else None


def load_training_state(
    checkpoint: Path, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler
) -> tuple[int, dict]:
    """Restore optimizer, scheduler and RNG; return (step, loader state). Weights are loaded by the caller."""
    state_dir = checkpoint / TRAINING_STATE
    needed = [
        "training_step.json",
        "optimizer_state.safetensors",
        "optimizer_param_groups.json",
        "scheduler_state.json",
        "rng_state.safetensors",
        "loader_state.json",
    ]
    for name in needed:
        if not (state_dir / name).is_file():
            raise CheckpointError(state_dir / name, "missing; cannot resume from this checkpoint")
    try:
        _load_optimizer(
            optimizer,
            load_file(str(state_dir / "optimizer_state.safetensors")),
            json.loads((state_dir / "optimizer_param_groups.json").read_text()),
        )
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(state_dir, f"optimizer state does not fit this model ({exc})") from None
    scheduler.load_state_dict(json.loads((state_dir / "scheduler_state.json").read_text()))
    torch.set_rng_state(load_file(str(state_dir / "rng_state.safetensors"))["torch"])
    step = int(json.loads((state_dir / "training_step.json").read_text())["step"])
    return step, json.loads((state_dir / "loader_state.json").read_text())
