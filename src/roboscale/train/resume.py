"""Resuming a training run: which options may change, the checkpoint's own config, and errors that say how to go on.

A resumed run continues the same run: options not given are the checkpoint's (``parse_train_args``), and an
option that would change the model, the data order or the optimizer's trajectory is refused, each named with
the checkpoint's value (``resume_conflicts``). A damaged checkpoint is an error naming the file and the command
that resumes from the previous one instead (``resuming``). A checkpoint's config never names code to import: a
``package.module:attribute`` it holds is refused unless the command line gives it again (``refuse_saved_code``).
Every command that resumes (``train``, ``rl``) is a ``ResumableCommand`` parsed by ``parse_resumable``, which holds
that guard, so a new one cannot leave it out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roboscale.config import flat_options, to_dict
from roboscale.configs.train import TrainConfig
from roboscale.errors import CheckpointError, ConfigError
from roboscale.utils.imports import is_code_name

# Options a resumed run may change: they do not alter the model, the data order or the optimizer's trajectory
# (steps moves the end of the cosine schedule, which is what a user extending a run wants).
RESUMABLE_CHANGES = ("steps", "save_freq", "log_freq", "checkpoint.", "num_threads", "resume",
                     "eval.",  # evaluations during training read checkpoints; they do not change them
                     "dataset.num_workers", "dataset.prefetch_factor", "dataset.verify_lake_shards",
                     # how the same run is spread over ranks and devices: the loader's order and the update do not
                     # depend on them (a resume may change the number of ranks too)
                     "launcher", "ray.", "parallel.", "activation_checkpointing", "compile", "grad_accum",
                     "max_nonfinite_steps", "wandb")


def resume_conflicts(saved: TrainConfig, cfg: TrainConfig) -> list[str]:
    """``--option=value (checkpoint: value)`` for every option of ``cfg`` that a resume may not change. Policy
    fields left to be filled from the dataset (0 / empty) take the checkpoint's value; another policy type is one
    conflict, not one per option."""
    from roboscale.models.registry import FILLED_AT_BUILD

    old, new = flat_options(to_dict(saved)), flat_options(to_dict(cfg))
    for name in FILLED_AT_BUILD:
        key = f"policy.{name}"
        if not new.get(key) and key in old:
            new[key] = old[key]
    other_type = old["policy.type"] != new["policy.type"]
    conflicts = []
    for key in sorted(set(old) | set(new)):
        if key.startswith(RESUMABLE_CHANGES) or key == "output_dir":
            continue
        if key.startswith("policy.") and key != "policy.type" and other_type:
            continue
        if key in old and key in new and _same(old[key], new[key]):
            continue
        conflicts.append(f"--{key}={json.dumps(new.get(key))} (checkpoint: {json.dumps(old.get(key))})")
    return conflicts


def saved_config(checkpoint: Path) -> TrainConfig:
    """The TrainConfig a checkpoint was saved with; options it predates take their defaults."""
    from roboscale.config import from_dict
    from roboscale.train.checkpoint import PRETRAINED, TRAIN_CONFIG, saved_train_config

    path = checkpoint / PRETRAINED / TRAIN_CONFIG
    try:
        return from_dict(TrainConfig, saved_train_config(checkpoint), where=str(path))
    except ConfigError as e:
        raise CheckpointError(path, f"not a training config this roboscale reads ({e})") from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


@dataclass(frozen=True)
class ResumableCommand:
    """A command whose runs resume (``--resume=true`` in its ``--output_dir``): its config class, the checkpoint file
    its options are saved in, how to read them, and what it checks of the options a resume changes. Every such
    command parses its options with ``parse_resumable``, where the code-name guard is."""

    config: type
    prog: str
    saved_file: Callable[[Path], Path]
    """checkpoint step directory -> the file holding the run's options (named in errors)."""
    read_saved: Callable[[Path], Any]
    """checkpoint step directory -> the run's options (a ``config`` instance; a CheckpointError when damaged)."""
    check: Callable[[Any, Any, Path], None] | None = None
    """``check(saved, merged, checkpoint)``: refuse changes the command cannot resume with (None: checked later)."""


def parse_resumable(command: ResumableCommand, argv: list[str]) -> Any:
    """The options of ``command``: the command line's; with ``--resume``, the options not given are the
    checkpoint's own, and no ``package.module:attribute`` is taken from the checkpoint (``refuse_saved_code``)."""
    from roboscale.config import parse

    cfg = parse(command.config, argv, prog=command.prog)
    if not cfg.resume:
        return cfg
    checkpoint = resume_checkpoint(Path(cfg.output_dir))
    with resuming(checkpoint):
        saved = command.read_saved(checkpoint)
    merged = parse(command.config, argv, defaults=saved, prog=command.prog)
    refuse_saved_code(merged, cfg, command.saved_file(checkpoint))
    if command.check is not None:
        command.check(saved, merged, checkpoint)
    return merged


def _train_config_file(checkpoint: Path) -> Path:
    from roboscale.train.checkpoint import PRETRAINED, TRAIN_CONFIG

    return checkpoint / PRETRAINED / TRAIN_CONFIG


# `roboscale train`: what else a resume may change is checked once the policy is built (check_resume)
TRAIN = ResumableCommand(TrainConfig, "roboscale train", _train_config_file, lambda c: saved_config(c))


def parse_train_args(argv: list[str]) -> TrainConfig:
    """``roboscale train`` options; with ``--resume``, the options not given are the checkpoint's own."""
    return parse_resumable(TRAIN, argv)


def refuse_saved_code(merged: Any, given: Any, saved_file: Path) -> None:
    """A ConfigError for the first option of ``merged`` whose ``package.module:attribute`` value came from the
    checkpoint (``saved_file``) rather than from ``given`` (the command line and --config alone): importing it
    would run code a file names (under ``python -m``, even a module of the working directory)."""
    stated = flat_options(to_dict(given))
    for key, value in flat_options(to_dict(merged)).items():
        values = value if isinstance(value, list) else [value]
        if any(is_code_name(v) for v in values) and not _same(stated.get(key), value):
            shown = ",".join(map(str, values))
            raise ConfigError(f"{saved_file}: --{key}={shown} names code to import, which a resume does not take "
                              f"from a checkpoint; to allow it, give --{key}={shown} on the command line")


def resume_checkpoint(output_dir: Path) -> Path:
    from roboscale.train.checkpoint import last_checkpoint

    checkpoint = last_checkpoint(output_dir)
    if checkpoint is None:
        last = output_dir / "checkpoints" / "last"
        if last.is_symlink():
            raise CheckpointError(last, f"points to {os.readlink(last)}, which does not exist{_earlier_hint(last)}")
        raise ConfigError(f"--resume: no checkpoint under {output_dir / 'checkpoints'} to resume from")
    return checkpoint


@contextmanager
def resuming(checkpoint: Path) -> Iterator[None]:
    """A damaged checkpoint is an error that names the file and how to resume from an earlier one instead."""
    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(e.path, f"{_message(e)}; cannot resume from it{_earlier_hint(checkpoint)}") from None


def _message(err: CheckpointError) -> str:
    return str(err).removeprefix(f"{err.path}: ")


def _earlier_hint(checkpoint: Path) -> str:
    from roboscale.train.checkpoint import step_directories

    checkpoints = checkpoint.parent
    current = checkpoint.resolve().name if checkpoint.exists() else os.readlink(checkpoint)
    if not current.isdigit():
        return ""
    earlier = [p.name for p in step_directories(checkpoints) if int(p.name) < int(current)]
    if not earlier:
        return ""
    return f" (to resume from the previous checkpoint: ln -sfn {earlier[-1]} {checkpoints / 'last'})"


def check_resume(saved: TrainConfig, cfg: TrainConfig, checkpoint: Path) -> None:
    """Refuse a resume whose options contradict the checkpoint's, naming each."""
    conflicts = resume_conflicts(saved, cfg)
    if conflicts:
        raise ConfigError(f"--resume: {len(conflicts)} options differ from the checkpoint's "
                          f"({checkpoint / 'pretrained_model' / 'train_config.json'}): {'; '.join(conflicts)}. A "
                          "resumed run continues the same run; drop them, or train into a new --output_dir")

