"""Checkpoints in LeRobot's layout, sharded over ranks, written atomically, and exact resume.

    <output_dir>/checkpoints/<step:06d>/pretrained_model/   config.json, model.safetensors, tokenizer.json,
                                                            train_config.json  (consolidated: eval, export)
    <output_dir>/checkpoints/<step:06d>/training_state/     model_optimizer/ (torch.distributed.checkpoint:
                                                            every rank writes its shards), trainer_state.json,
                                                            loader_state.json, rng_rank<r>.safetensors
    <output_dir>/checkpoints/last -> <step:06d>

The sharded part holds the live weights and the optimizer state as each rank has them (FSDP shards); DCP's
metadata lets a run with another number of ranks load them resharded. ``pretrained_model`` is gathered on rank 0
once per save, so evaluation and export never need the ranks that wrote it. The loader's position is global
(the same on every rank), the RNG state is per rank.

Rank 0 assembles a step directory under a temporary name, every rank writes its part into it, and only when all
of them succeeded is it renamed into place and ``last`` switched with an atomic symlink replace; a run killed at
any moment leaves the previous checkpoint intact and ``last`` pointing at a complete one. Weights, optimizer and
state are safetensors, JSON or DCP: DCP keeps its own metadata as a pickle, which only a resume of this run's own
output directory reads (``eval`` and ``export`` read the safetensors).

What a killed save leaves (a hidden ``.<step>.<random>.tmp/``, ``.last.tmp``) is removed by the next run
(``remove_stale_files``): only our own names, and only temporaries no live process holds. Retention
(``prune_checkpoints``) keeps the newest ``keep_last`` step directories, whatever ``last`` and ``best`` point
to, and the checkpoints an evaluation is waiting for or reading (``train/evaluation.py``); a step directory is
renamed away before it is deleted, so a kill mid-delete never leaves half a checkpoint under a step name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
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
SHARDED = "model_optimizer"
TRAINER_STATE = "trainer_state.json"
LOADER_STATE = "loader_state.json"
POINTERS = ("last", "best")  # symlinks to step directories; retention never deletes what they point to
_STEP_NAME = re.compile(r"^\d{6,}$")


def step_name(step: int) -> str:
    return f"{step:06d}"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def save_checkpoint(output_dir: Path, step: int, *, policy, sharded_state: dict[str, Any],
                    full_model_state: dict[str, torch.Tensor] | None, training_state: dict[str, Any],
                    train_config: Any, env) -> Path:
    """Write ``checkpoints/<step>`` on every rank (a collective), then point ``last`` at it.

    ``sharded_state``: this rank's ``{"model": ..., "optimizer": ...}`` (DCP). ``full_model_state``: the gathered
    weights for ``pretrained_model`` (rank 0; None elsewhere). ``training_state``: ``trainer`` (JSON), ``loader``
    (JSON, rank 0's), ``rng`` (this rank's torch RNG state)."""
    checkpoints = Path(output_dir) / "checkpoints"
    target = checkpoints / step_name(step)
    try:
        if env.is_main:
            with atomic_directory(target, overwrite=True) as tmp:
                _write_shards(_share(tmp, env), sharded_state, training_state, env)
                pretrained = tmp / PRETRAINED
                policy.save_pretrained(pretrained, state_dict=full_model_state)
                (pretrained / TRAIN_CONFIG).write_text(json.dumps(to_dict(train_config), indent=4))
                state_dir = tmp / TRAINING_STATE
                (state_dir / TRAINER_STATE).write_text(json.dumps(training_state["trainer"], indent=4))
                (state_dir / LOADER_STATE).write_text(json.dumps(training_state["loader"], indent=4))
            _point_last(checkpoints, target.name)
        else:
            _write_shards(_share(None, env), sharded_state, training_state, env)
    except (OSError, SafetensorError, _PeerFailed) as exc:  # a full disk, a quota, a vanished mount
        previous = last_checkpoint(output_dir)
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(target, f"cannot write the checkpoint ({_os_reason(exc)}); {kept}") from None
    finally:
        env.barrier()  # nobody prunes or resumes before the new checkpoint is committed
    return target


class _PeerFailed(Exception):
    """Another rank could not write its part (its own error names why)."""


def _share(tmp: Path | None, env) -> Path:
    """Rank 0's temporary directory, told to every rank."""
    if not env.distributed:
        return tmp
    import torch.distributed as dist

    box = [str(tmp) if tmp is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _write_shards(tmp: Path, sharded_state: dict[str, Any], training_state: dict[str, Any],
                  env) -> None:
    """Every rank: its DCP shards and RNG state into ``tmp``; fails on every rank if any rank failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    state_dir = tmp / TRAINING_STATE
    failed = None
    try:
        state_dir.mkdir(exist_ok=True)
        with _quiet_dcp():
            dcp.save(sharded_state, checkpoint_id=str(state_dir / SHARDED), no_dist=not env.distributed)
        save_file({"torch": training_state["rng"]}, str(state_dir / rng_file(env.rank)))
    except (OSError, SafetensorError, RuntimeError) as exc:
        failed = exc
    except CheckpointException as exc:  # DCP's (a BaseException): the rank's own error is inside, as text
        reason = _dcp_reason(exc)
        code = re.search(r"\[Errno (\d+)\]", reason)
        failed = OSError(int(code.group(1)), os.strerror(int(code.group(1)))) if code else \
            _write_probe(state_dir) or OSError(reason)
    if env.another_rank_failed(failed is not None):
        raise _PeerFailed("another rank could not write its shards")
    if failed is not None:
        raise failed


def _os_reason(exc: Exception) -> str:
    """'No space left on device', also from safetensors, which reports I/O errors as '... (os error 28)'."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    code = re.search(r"\(os error (\d+)\)", str(exc))
    return os.strerror(int(code.group(1))) if code else str(exc)


def _point_last(checkpoints: Path, name: str) -> None:
    _point(checkpoints, "last", name)


def point_best(checkpoints: Path, name: str) -> None:
    """Switch ``best`` to the step directory ``name`` (the highest evaluated success so far)."""
    _point(checkpoints, "best", name)


def _point(checkpoints: Path, pointer: str, name: str) -> None:
    """A relative symlink, swapped in with one rename: a reader sees the old target or the new one, never none."""
    tmp = checkpoints / f".{pointer}.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(name, tmp)
    os.replace(tmp, checkpoints / pointer)
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


def prune_checkpoints(output_dir: Path, keep_last: int, keep: Iterable[str] = ()) -> list[Path]:
    """Delete step directories beyond the newest ``keep_last`` (0 keeps all), never one that ``last`` or ``best``
    points to nor one named in ``keep`` (an evaluation is waiting to read it or reading it); returns what was
    deleted."""
    checkpoints = Path(output_dir) / "checkpoints"
    steps = step_directories(checkpoints)
    if keep_last <= 0 or len(steps) <= keep_last:
        return []
    pinned = {(checkpoints / name).resolve() for name in (*POINTERS, *keep) if (checkpoints / name).exists()}
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


def load_training_state(checkpoint: Path, sharded_state: dict[str, Any], env) -> dict[str, Any]:
    """Load the sharded model/optimizer state into ``sharded_state`` in place (resharded to this run's ranks) and
    return the rest: ``trainer``, ``loader``, ``rng`` (this rank's, None when the checkpoint had fewer ranks). A
    missing or damaged file is a CheckpointError naming it."""
    import torch.distributed.checkpoint as dcp

    state_dir = checkpoint / TRAINING_STATE
    sharded = state_dir / SHARDED
    if not (sharded / ".metadata").is_file():
        raise CheckpointError(sharded / ".metadata", "missing")
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_dcp():
            dcp.load(sharded_state, checkpoint_id=str(sharded), no_dist=not env.distributed)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a truncated shard, a missing one, a key
        # that changed. (DCP's CheckpointException is a BaseException carrying each rank's traceback as text.)
        raise CheckpointError(sharded, f"damaged or not this model's ({_dcp_reason(exc)})") from None
    rng_path = state_dir / rng_file(env.rank)
    return {
        "trainer": _read(state_dir / TRAINER_STATE, _json),
        "loader": _read(state_dir / LOADER_STATE, _json),
        "rng": _read(rng_path, lambda p: load_file(str(p))["torch"]) if rng_path.exists() else None,
    }


def _write_probe(directory: Path) -> OSError | None:
    """What the OS says about writing into ``directory`` now (torch's zip writer reports a full disk as
    ``[enforce fail at inline_container.cc]``, without the reason)."""
    try:
        with tempfile.TemporaryFile(dir=directory) as f:
            f.write(b"\0" * 2**20)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        return exc
    return None


def _dcp_reason(exc: BaseException) -> str:
    """The last line of DCP's error (it carries each rank's traceback as text), up to its first sentence."""
    lines = str(exc).strip().splitlines()
    return lines[-1].split(". ")[0] if lines else type(exc).__name__


@contextlib.contextmanager
def _quiet_dcp():
    """DCP logs a damaged shard's whole traceback before raising; the error we raise names the file instead."""
    from torch.distributed.checkpoint.logger import _dcp_logger

    saved = _dcp_logger.level
    _dcp_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        _dcp_logger.setLevel(saved)


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _read(path: Path, load: Any) -> Any:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - safetensors, JSON, a missing key: all mean a damaged file
        raise CheckpointError(path, f"damaged ({type(exc).__name__}: {exc})") from None
