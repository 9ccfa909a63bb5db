"""Checkpoints in LeRobot's layout, sharded over ranks, written atomically, and exact resume.

    <output_dir>/checkpoints/<step:06d>/pretrained_model/   config.json, model.safetensors, tokenizer.json,
                                                            train_config.json  (consolidated: eval, export)
    <output_dir>/checkpoints/<step:06d>/training_state/     model_optimizer/ (torch.distributed.checkpoint:
                                                            every rank writes its shards), <name>_state.json
                                                            per Stateful entry (trainer_state.json,
                                                            loader_state.json, a job's own), rng_rank<r>.safetensors
    <output_dir>/checkpoints/last -> <step:06d>

The sharded part holds the live weights and the optimizer state as each rank has them (FSDP shards); DCP's
metadata lets a run with another number of ranks load them resharded. ``pretrained_model`` is gathered on rank 0
once per save, so evaluation and export never need the ranks that wrote it. The Stateful entries (the trainer's
step and schedule, the loader's position, what a job adds: ``train/components.py``) are global (the same on every
rank: rank 0 writes them) and restored by name; the RNG state is per rank.

Rank 0 assembles a step directory under a temporary name, every rank writes its part into it, and only when all
of them succeeded is it renamed into place and ``last`` switched with an atomic symlink replace; a run killed at
any moment leaves the previous checkpoint intact and ``last`` pointing at a complete one. With
``--checkpoint.async_save`` the sharded part is written by a background thread while training goes on, and the
same commit happens a few steps later, when every rank's write has finished (``CheckpointWriter``). Weights, optimizer and
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
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from roboscale.config import to_dict
from roboscale.errors import CheckpointError, TrainingError
from roboscale.utils.io import atomic_directory, fsync_dir, load_json, remove_stale_temporaries
from roboscale.utils.lifetime import interrupted

PRETRAINED = "pretrained_model"
TRAINING_STATE = "training_state"
TRAIN_CONFIG = "train_config.json"
SHARDED = "model_optimizer"
STATE_SUFFIX = "_state.json"  # training_state/<name>_state.json: trainer_state.json, loader_state.json, a job's
TENSORS_SUFFIX = "_tensors.safetensors"  # training_state/<name>_tensors.safetensors: a TensorStateful entry's
OWN_STATE = ("trainer", "loader")  # the trainer's entries; a job's extra ones take other names
POINTERS = ("last", "best")  # symlinks to step directories; retention never deletes what they point to
_STEP_NAME = re.compile(r"^\d{6,}$")


def step_name(step: int) -> str:
    return f"{step:06d}"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


def state_file(name: str) -> str:
    """The file of the Stateful entry ``name`` under ``training_state``."""
    return name + STATE_SUFFIX


def tensor_file(name: str) -> str:
    """The tensors of the entry ``name`` (a ``TensorStateful``) under ``training_state``."""
    return name + TENSORS_SUFFIX


def check_state_names(extra: dict[str, Any]) -> None:
    """A job's extra checkpointed entries: names that are file names of their own, each a Stateful."""
    from roboscale.train.components import Stateful

    for name, entry in extra.items():
        if name in OWN_STATE or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
            raise TrainingError(f"training state entry {name!r}: the names {list(OWN_STATE)} are the trainer's, and "
                                "a name is letters, digits, '_', '.' or '-' (it becomes the file "
                                f"{TRAINING_STATE}/{state_file('<name>')})")
        if not isinstance(entry, Stateful):
            raise TrainingError(f"training state entry {name!r}: {type(entry).__name__} is not Stateful (it needs "
                                "state_dict() and load_state_dict(state))")


def state_texts(training_state: dict[str, Any]) -> dict[str, str]:
    """Each entry's state as JSON; an entry that is not JSON-able is an error naming it (on every rank alike,
    before any rank writes)."""
    texts = {}
    for name, state in training_state.items():
        try:
            texts[name] = json.dumps(state, indent=4)
        except (TypeError, ValueError) as exc:
            raise TrainingError(f"training state entry {name!r}: its state_dict() is not JSON-able ({exc})") from None
    return texts


class CheckpointWriter:
    """Writes ``checkpoints/<step>`` (a collective: every rank calls every method, in the same order).

    ``save`` assembles the step directory under a temporary name; the checkpoint is committed (renamed into place,
    ``last`` switched) once every rank's part is on disk. Synchronous saves commit before ``save`` returns. With
    ``asynchronous`` (``--checkpoint.async_save``) ``save`` returns as soon as the sharded state is copied
    (DCP's staging: the copy costs host memory the size of this rank's model and optimizer state) and a thread
    writes it while training goes on; ``poll`` commits it at the first step at which every rank's write has
    finished, ``wait`` blocks for it. One save is in flight at most: the next ``save`` waits for the last. The
    consolidated ``pretrained_model`` is gathered inside ``save`` (a collective) and rank 0 writes a copy of it
    from a thread of its own. A run killed before the commit leaves the previous checkpoint as ``last``."""

    def __init__(self, output_dir: Path, env, *, asynchronous: bool = False, timeout_s: float = 1800.0):
        self.checkpoints = Path(output_dir) / "checkpoints"
        self.env = env
        self.asynchronous = asynchronous
        self._pending: _PendingSave | None = None
        self._group = None
        self._consolidated = None  # rank 0's writer thread for pretrained_model
        if asynchronous and env.is_main:
            from concurrent.futures import ThreadPoolExecutor

            self._consolidated = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pretrained-writer")
        if asynchronous and env.distributed:
            import datetime

            import torch.distributed as dist

            # the writer thread's collectives get a group of their own: on the training's group they would
            # interleave with the gradient reductions in a different order on each rank
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def save(self, step: int, *, policy, sharded_state: dict[str, Any],
             full_model_state: dict[str, torch.Tensor] | None, training_state: dict[str, dict[str, Any]],
             rng: torch.Tensor, train_config: Any,
             tensor_state: dict[str, dict[str, torch.Tensor]] | None = None) -> Path | None:
        """Start writing ``checkpoints/<step>``; returns the step directory committed during the call (this one
        when synchronous, the previous background save when it had to be waited for), or None.

        ``sharded_state``: this rank's ``{"model": ..., "optimizer": ...}`` (DCP). ``full_model_state``: the
        gathered weights for ``pretrained_model`` (rank 0; None elsewhere). ``training_state``: each Stateful
        entry's state by name (JSON, rank 0's written as ``<name>_state.json``). ``rng``: this rank's torch RNG
        state. ``tensor_state``: the tensors of the TensorStateful entries by name (rank 0's written as
        ``<name>_tensors.safetensors``)."""
        texts = state_texts(training_state)
        committed = self.wait()
        env = self.env
        target = self.checkpoints / step_name(step)
        commit = contextlib.ExitStack()
        state_dir, failed = None, None
        tmp = None
        if env.is_main:
            try:
                tmp = commit.enter_context(atomic_directory(target, overwrite=True))
            except OSError as exc:
                failed = exc
        tmp = _share(tmp, env)  # None everywhere when rank 0 could not create it
        writes = []
        try:
            if tmp is not None:
                state_dir = tmp / TRAINING_STATE
                writes.append(self._write_shards(state_dir, sharded_state))
                save_file({"torch": rng}, str(state_dir / rng_file(env.rank)))
            if env.is_main and failed is None:
                for name, text in texts.items():
                    (state_dir / state_file(name)).write_text(text)
                for name, tensors in (tensor_state or {}).items():
                    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                              str(state_dir / tensor_file(name)))
                config = json.dumps(to_dict(train_config), indent=4)
                if self._consolidated is None:
                    _write_pretrained(tmp / PRETRAINED, policy, full_model_state, config)
                else:  # a copy: training goes on changing the tensors the gathered state may share
                    full = {k: v.detach().clone() for k, v in full_model_state.items()}
                    writes.append(self._consolidated.submit(_write_pretrained, tmp / PRETRAINED, policy, full, config))
        except (OSError, SafetensorError, RuntimeError) as exc:  # a full disk, a quota, a vanished mount
            failed = exc
        except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: not a write error; nothing half-written stays
            self._pending = _PendingSave(target, state_dir, commit, [])
            raise self._interrupted(exc) from None
        except CheckpointException as exc:  # DCP's, from a synchronous save (it wraps a Ctrl-C too)
            interrupt = _wrapped(exc, KeyboardInterrupt)
            if interrupt is not None:
                self._pending = _PendingSave(target, state_dir, commit, [])
                raise self._interrupted(interrupt) from None
            failed = _dcp_os_error(exc, state_dir)
        self._pending = _PendingSave(target, state_dir, commit, [w for w in writes if w is not None])
        self._check(failed)
        if not self.asynchronous:
            return self.wait() or committed
        return committed

    def poll(self) -> Path | None:
        """Commit the background save if every rank's write has finished; returns the committed directory."""
        if self._pending is None:
            return None
        done = all(write.done() for write in self._pending.writes)
        if self.env.distributed:  # every rank commits, or raises, at the same step
            import torch.distributed as dist

            flag = torch.tensor([1.0 if done else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            done = flag.item() > 0
        return self.wait() if done else None

    def wait(self) -> Path | None:
        """Block until the save in flight is written, then commit it; returns the committed directory."""
        pending = self._pending
        if pending is None:
            return None
        if pending.writes:  # a synchronous save has nothing in flight: save checked its outcome already
            failed = None
            try:
                for write in pending.writes:
                    write.result()
            except (OSError, SafetensorError, RuntimeError) as exc:
                failed = exc
            except KeyboardInterrupt as exc:  # while waiting: the background write is abandoned, not committed
                raise self._interrupted(exc) from None
            except CheckpointException as exc:
                failed = _dcp_os_error(exc, pending.state_dir)
            self._check(failed)
        self._pending = None
        if self.env.is_main:
            pending.commit.close()  # renames the step directory into place
            _point_last(self.checkpoints, pending.target.name)
        self.env.barrier()  # nobody prunes or resumes before the new checkpoint is committed
        return pending.target

    def _write_shards(self, state_dir: Path, sharded_state: dict[str, Any]):
        """This rank's DCP shards into ``state_dir``: now, or (asynchronous) staged now and written by a thread,
        whose future is returned."""
        import torch.distributed.checkpoint as dcp

        state_dir.mkdir(exist_ok=True)
        where = str(state_dir / SHARDED)
        no_dist = not self.env.distributed
        with _quiet_dcp():
            if self.asynchronous:
                return dcp.async_save(sharded_state, checkpoint_id=where, process_group=self._group,
                                      no_dist=no_dist)
            dcp.save(sharded_state, checkpoint_id=where, no_dist=no_dist)
        return None

    def _interrupted(self, interrupt: KeyboardInterrupt) -> KeyboardInterrupt:
        """Ctrl-C (or SIGTERM) during a save: this rank drops the save in flight without waiting for the others
        (they are being interrupted too) and says which checkpoint is intact. Rank 0 removes the temporary."""
        pending, self._pending = self._pending, None
        if pending is not None and self.env.is_main:
            pending.commit.__exit__(type(interrupt), interrupt, None)
        previous = last_checkpoint(self.checkpoints.parent)
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        name = pending.target.name if pending is not None else "?"
        return interrupted(interrupt, f"while checkpoint {name} was being written (not saved); {kept}")

    def _check(self, failed: BaseException | None) -> None:
        """Raise on every rank if any rank failed to write its part (the main rank's error names why)."""
        peer_failed = self.env.another_rank_failed(failed is not None)
        if failed is None and not peer_failed:
            return
        pending, self._pending = self._pending, None
        reason = _os_reason(failed) if failed is not None else "another rank could not write its shards"
        if pending is not None and self.env.is_main:  # the temporary goes; the previous checkpoint stays
            abort = failed or OSError(reason)
            pending.commit.__exit__(type(abort), abort, None)
        self.env.barrier()
        previous = last_checkpoint(self.checkpoints.parent)
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        target = pending.target if pending is not None else self.checkpoints
        raise CheckpointError(target, f"cannot write the checkpoint ({reason}); {kept}")


def _write_pretrained(directory: Path, policy, state: dict[str, torch.Tensor], train_config: str) -> None:
    policy.save_pretrained(directory, state_dict=state)
    (directory / TRAIN_CONFIG).write_text(train_config)


@dataclasses.dataclass
class _PendingSave:
    target: Path
    state_dir: Path | None
    """Its ``training_state`` under the temporary name."""
    commit: contextlib.ExitStack
    """Holds the temporary step directory (rank 0); closing it renames the directory into place."""
    writes: list[Any]
    """The background writes' futures (DCP's, and rank 0's consolidated weights); empty when synchronous."""


def _share(tmp: Path | None, env) -> Path | None:
    """Rank 0's temporary directory, told to every rank."""
    if not env.distributed:
        return tmp
    import torch.distributed as dist

    box = [str(tmp) if tmp is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


def _dcp_os_error(exc: BaseException, directory: Path | None) -> OSError:
    """DCP's CheckpointException (a BaseException carrying each rank's error as text) as the OSError inside it."""
    reason = _dcp_reason(exc)
    code = re.search(r"\[Errno (\d+)\]", reason)
    if code:
        return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
    return (_write_probe(directory) if directory is not None else None) or OSError(reason)


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
        data = load_json(path.read_text())
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


def load_training_state(checkpoint: Path, sharded_state: dict[str, Any], env, names: Iterable[str]
                        ) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Load the sharded model/optimizer state into ``sharded_state`` in place (resharded to this run's ranks) and
    return the rest: the state of each Stateful entry in ``names``, and this rank's RNG state (None when the
    checkpoint had fewer ranks). A missing or damaged file is a CheckpointError naming it."""
    import torch.distributed.checkpoint as dcp

    state_dir = checkpoint / TRAINING_STATE
    sharded = state_dir / SHARDED
    if not (sharded / ".metadata").is_file():
        raise CheckpointError(sharded / ".metadata", "missing")
    planner = _PlainDataPlanner()
    index = _MetadataPickle()  # replaced by the one in use
    try:
        with _quiet_dcp(), _metadata_unpickled_safely() as index:
            dcp.load(sharded_state, storage_reader=FileSystemReader(str(sharded)), planner=planner,
                     no_dist=not env.distributed)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a truncated shard, a missing one, a key
        # that changed. (DCP's CheckpointException is a BaseException carrying each rank's traceback as text.)
        refused = index.refused or planner.refused  # (DCP may have tried another file after the refusal)
        if refused is not None:
            raise CheckpointError(sharded, f"refused: {refused}") from None
        raise CheckpointError(sharded, f"damaged or not this model's ({_dcp_reason(exc)})") from None
    rng_path = state_dir / rng_file(env.rank)
    states = {name: _read(state_dir / state_file(name), _json) for name in names}
    rng = _read(rng_path, lambda p: load_file(str(p))["torch"]) if rng_path.exists() else None
    return states, rng


# How a state that does not fit its entry is reported: the trainer's and the loader's as they always were
_UNFIT = {"trainer": "damaged ({error})", "loader": "does not fit this data loader ({kind}: {error})"}


def restore_entries(checkpoint: Path, entries: dict[str, Any], states: dict[str, Any]) -> None:
    """Hand each Stateful entry its saved state (``load_training_state``); a state it refuses (KeyError,
    TypeError, ValueError) is a CheckpointError naming the entry's file."""
    from roboscale.train.components import TensorStateful

    for name, entry in entries.items():
        path = checkpoint / TRAINING_STATE / state_file(name)
        if not isinstance(states[name], dict):
            raise CheckpointError(path, f"damaged (a JSON {type(states[name]).__name__}, not an object)")
        tensors_path = checkpoint / TRAINING_STATE / tensor_file(name)
        tensors = (_read(tensors_path, lambda p: load_file(str(p))) if tensors_path.is_file() else {}) \
            if isinstance(entry, TensorStateful) else {}
        try:
            entry.load_state_dict(states[name])
            if isinstance(entry, TensorStateful):
                entry.load_tensor_state(tensors)
        except CheckpointError:  # the entry named the problem itself
            raise
        except (KeyError, TypeError, ValueError) as exc:
            message = _UNFIT.get(name, "does not fit this run's {name!r} state ({kind}: {error})")
            raise CheckpointError(path, message.format(name=name, kind=type(exc).__name__, error=exc)) from None


# A checkpoint is something a user can be handed. DCP reads its index (.metadata) with pickle and the non-tensor
# entries of the state (optimizer hyperparameters) with torch.load(weights_only=False): either would run whatever
# code a crafted file names. The index may only build the classes DCP's metadata is made of, and the entries only
# what torch's weights-only unpickler accepts (plain data and tensors).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _Refused(pickle.UnpicklingError):
    """A checkpoint file names code (not a damaged one, which is any other error)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise _Refused(f"the checkpoint's index names {module}.{name}, which is not part of a "
                                         "checkpoint (a crafted file?); nothing was loaded")
        return super().find_class(module, name)


class _MetadataPickle:
    """``pickle`` as DCP's filesystem reader sees it while we load: ``load`` goes through the allow-list, and a
    refusal is kept here (DCP catches it and tries other files)."""

    def __init__(self) -> None:
        self.refused: _Refused | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    def load(self, file: Any) -> Any:
        try:
            return _MetadataUnpickler(file).load()
        except _Refused as exc:
            self.refused = exc
            raise


@contextlib.contextmanager
def _metadata_unpickled_safely():
    import torch.distributed.checkpoint.filesystem as filesystem

    real, filesystem.pickle = filesystem.pickle, _MetadataPickle()
    try:
        yield filesystem.pickle
    finally:
        filesystem.pickle = real


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner, with the state's non-tensor entries checked by torch's weights-only unpickler first."""

    refused: _Refused | None = None

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as exc:
            self.refused = _Refused("an entry of the checkpoint's state is not plain data (a crafted file?): "
                                    f"{str(exc).splitlines()[0]}")
            raise self.refused from None
        super().load_bytes(read_item, io.BytesIO(data))


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


def _wrapped(exc: BaseException, kind: type[BaseException]) -> Any:
    """The ``kind`` of exception DCP caught on some rank and wrapped in its CheckpointException (or ``exc``
    itself), if any: a Ctrl-C, SIGTERM's ``Terminated``, a refused unpickling."""
    if isinstance(exc, kind):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, kind):
            return inner
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
    return load_json(path.read_text())


def _read(path: Path, load: Any) -> Any:
    if not path.is_file():
        raise CheckpointError(path, "missing")
    try:
        return load(path)
    except Exception as exc:  # noqa: BLE001 - safetensors, JSON, a missing key: all mean a damaged file
        raise CheckpointError(path, f"damaged ({type(exc).__name__}: {exc})") from None
