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

What a killed save leaves (a hidden ``.<step>.<random>.tmp/``, ``.last.tmp``) is removed by the next run
(``remove_stale_files``): only our own names, and only temporaries no live process holds. Retention
(``prune_checkpoints``) keeps the newest ``keep_last`` step directories and whatever ``last`` and ``best`` point
to; a step directory is renamed away before it is deleted, so a kill mid-delete never leaves half a checkpoint
under a step name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from roboscale.config import to_dict
from roboscale.errors import CheckpointError
from roboscale.utils.io import atomic_directory, fsync_dir, remove_stale_temporaries

PRETRAINED = "pretrained_model"
TRAINING_STATE = "training_state"
TRAIN_CONFIG = "train_config.json"
POINTERS = ("last", "best")  # symlinks to step directories; retention never deletes what they point to
_STEP_NAME = re.compile(r"^\d{6,}$")


def step_name(step: int) -> str:
    return f"{step:06d}"


def _optimizer_tensors(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state_dict into flat tensors (safetensors) and JSON-able structure."""
    tensors: dict[str, torch.Tensor] = {}
    for param_id, slots in state["state"].items():
        for name, value in slots.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{param_id}.{name}"] = value.detach().contiguous().cpu()
    return tensors, {"param_groups": state["param_groups"]}


def _optimizer_state(tensors: dict[str, torch.Tensor], groups: dict) -> dict:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    return {"state": state, "param_groups": groups["param_groups"]}


def save_checkpoint(output_dir: Path, step: int, policy, training_state: dict[str, Any], train_config: Any) -> Path:
    """Write ``checkpoints/<step>`` (weights and the trainer's state: ``optimizer``, ``scheduler``, ``loader``,
    ``rng`` state dicts) atomically, then point ``last`` at it."""
    checkpoints = Path(output_dir) / "checkpoints"
    target = checkpoints / step_name(step)
    try:
        _write_step(target, policy, training_state, train_config)
    except (OSError, SafetensorError) as exc:  # a full disk, a quota, a vanished mount: nothing half-written stays
        previous = last_checkpoint(output_dir)
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(target, f"cannot write the checkpoint ({_os_reason(exc)}); {kept}") from None
    _point_last(checkpoints, target.name)
    return target


def _os_reason(exc: Exception) -> str:
    """'No space left on device', also from safetensors, which reports I/O errors as '... (os error 28)'."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    code = re.search(r"\(os error (\d+)\)", str(exc))
    return os.strerror(int(code.group(1))) if code else str(exc)


def _write_step(target: Path, policy, training_state: dict[str, Any], train_config: Any) -> None:
    with atomic_directory(target, overwrite=True) as tmp:
        pretrained = tmp / PRETRAINED
        policy.save_pretrained(pretrained)
        (pretrained / TRAIN_CONFIG).write_text(json.dumps(to_dict(train_config), indent=4))
        state_dir = tmp / TRAINING_STATE
        state_dir.mkdir()
        tensors, groups = _optimizer_tensors(training_state["optimizer"])
        save_file(tensors, str(state_dir / "optimizer_state.safetensors"))
        (state_dir / "optimizer_param_groups.json").write_text(json.dumps(groups, indent=4))
        (state_dir / "scheduler_state.json").write_text(json.dumps(training_state["scheduler"], indent=4))
        save_file({"torch": training_state["rng"]}, str(state_dir / "rng_state.safetensors"))
        (state_dir / "loader_state.json").write_text(json.dumps(training_state["loader"], indent=4))
        (state_dir / "training_step.json").write_text(json.dumps({"step": int(target.name)}, indent=4))


def _point_last(checkpoints: Path, name: str) -> None:
    tmp = checkpoints / ".last.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, checkpoints / "last")
    fsync_dir(checkpoints)


def step_directories(checkpoints: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if _STEP_NAME.match(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: int(p.name))


def remove_stale_files(output_dir: Path) -> list[Path]:
    """What killed saves left under ``<output_dir>/checkpoints`` (see the module docstring); returns it."""
    checkpoints = Path(output_dir) / "checkpoints"
    if not checkpoints.is_dir():
        return []
    names = {p.name.split(".")[1] for p in checkpoints.glob(".*.*") if p.name.count(".") >= 2}
    removed = remove_stale_temporaries(checkpoints, sorted(n for n in names if _STEP_NAME.match(n)))
    for leftover in (checkpoints / ".last.tmp", checkpoints / ".best.tmp"):
        if leftover.is_symlink():
            leftover.unlink()
            removed.append(leftover)
    for doomed in checkpoints.glob(".*.deleting"):  # a retention delete that was cut short
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(doomed)
    return removed


def prune_checkpoints(output_dir: Path, keep_last: int) -> list[Path]:
    """Delete step directories beyond the newest ``keep_last`` (0 keeps all), never one that ``last`` or ``best``
    points to; returns what was deleted."""
    checkpoints = Path(output_dir) / "checkpoints"
    steps = step_directories(checkpoints)
    if keep_last <= 0 or len(steps) <= keep_last:
        return []
    pinned = {(checkpoints / name).resolve() for name in POINTERS if (checkpoints / name).is_symlink()}
    deleted = []
    for step_dir in steps[:-keep_last]:
        if step_dir.resolve() in pinned:
            continue
        doomed = checkpoints / f".{step_dir.name}.deleting"
        os.replace(step_dir, doomed)
        shutil.rmtree(doomed)
        deleted.append(step_dir)
    if deleted:
        fsync_dir(checkpoints)
    return deleted


def saved_train_config(checkpoint: Path) -> dict[str, Any]:
    """The training config a checkpoint was saved with (``pretrained_model/train_config.json``)."""
    path = Path(checkpoint) / PRETRAINED / TRAIN_CONFIG
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, "expected a JSON object of training options")
    return data


def last_checkpoint(output_dir: Path) -> Path | None:
    last = Path(output_dir) / "checkpoints" / "last"
    return last.resolve() if last.exists() else None


def load_training_state(checkpoint: Path) -> dict[str, Any]:
    """What ``save_checkpoint`` wrote of the trainer's state: ``step``, ``optimizer``, ``scheduler``, ``loader``,
    ``rng``. A missing or damaged file is a CheckpointError naming it."""
    state_dir = checkpoint / TRAINING_STATE
    return {
        "optimizer": _optimizer_state(_read(state_dir / "optimizer_state.safetensors", lambda p: load_file(str(p))),
                                      _read(state_dir / "optimizer_param_groups.json", _json)),
        "scheduler": _read(state_dir / "scheduler_state.json", _json),
        "rng": _read(state_dir / "rng_state.safetensors", lambda p: load_file(str(p))["torch"]),
        "step": _read(state_dir / "training_step.json", lambda p: int(_json(p)["step"])),
        "loader": _read(state_dir / "loader_state.json", _json),
    }


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _read(path: Path, load: Any) -> Any:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - safetensors, JSON, a missing key: all mean a damaged file
        raise CheckpointError(path, f"damaged ({type(exc).__name__}: {exc})") from None
