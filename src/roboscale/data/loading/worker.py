"""The loader's worker side: decode this rank's share of a block in one pass, gather all the block's batches from
it, and report failures as records; and, in the main process, the thread that waits on the workers and the means
to stop them.

A worker receives tasks (one block: this rank's share of its sample ids, and for each of the block's global batches
still to serve, the rows of the share that make this rank's slice and their per-sample seeds) from the main
process. It decodes the share (each episode's frames in one read, cameras in one sequential pass), gathers every
batch of the block (array gathers; without user transforms camera frames are written straight into a
shared-memory slot, ``roboscale.data.loading.transport``) and returns them together, so the loader can yield them in
the plan's order while the other workers decode the next blocks. The decoded share is dropped afterwards.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from roboscale.data.loading.index import SampleIndex
from roboscale.data.loading.transport import Arena, InArena, Slot
from roboscale.errors import DatasetError, RoboscaleError, from_record, to_record

# numpy kind -> dtype LeRobot's items have (hf_transform_to_torch: floats -> float32, ints -> int64)
_ITEM_DTYPE = {"f": np.float32, "i": np.int64, "u": np.int64, "b": np.bool_}


class LoaderError(RoboscaleError, RuntimeError):
    """A loader worker failed; the message names the dataset, episode and frame it was working on."""


@dataclass
class Task:
    """This rank's share of block ``block`` of ``epoch``, and the global batches of it to return."""

    epoch: int
    block: int
    samples: np.ndarray  # the sample ids this rank reads of the block (decoded in one pass)
    batches: np.ndarray  # [n] global batch index (within the epoch) of each batch to return, in yield order
    rows: np.ndarray  # [n, slice]: indices into ``samples`` of each batch's slice, in position order
    seeds: np.ndarray  # [n, slice] int64: each position's sample seed (``plan.sample_seeds``)


@dataclass
class _Block:
    """One decoded block: per key, the values of every frame any of its samples needs, and lookup tables."""

    gids: np.ndarray
    ep: np.ndarray
    frame: np.ndarray
    good: np.ndarray  # bool per sample: its episode could be read
    slot: np.ndarray  # per sample: index of its episode among the block's episodes
    lengths: np.ndarray  # per block episode
    values: dict[str, np.ndarray] = field(default_factory=dict)
    lut: dict[str, np.ndarray] = field(default_factory=dict)  # key -> concatenated frame -> row tables
    lut_start: dict[str, np.ndarray] = field(default_factory=dict)  # key -> per block episode offset into lut
    # cameras stay one array per episode (concatenating a block of frames would copy ~40 MB per camera)
    frames: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    frame_lut: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    skipped: list[tuple[str, int, str]] = field(default_factory=list)
    decode_s: float = 0.0


class BatchDataset(torch.utils.data.Dataset):
    """Runs in the workers: ``dataset[task]`` -> (batch, info)."""

    def __init__(self, sample_index: SampleIndex, keys: list[str], deltas: dict[str, np.ndarray], camera_keys: set[str],
                 transform: Callable | None, collate: Callable | None, skip_bad_episodes: bool):
        self.sample_index = sample_index
        self.keys = keys
        self.deltas = deltas
        self.camera_keys = camera_keys
        self.transform = transform
        self.collate = collate
        self.skip_bad = skip_bad_episodes
        self.arena: Arena | None = None  # set by the loader before workers start
        self.block_bytes = 1 << 20  # a one-off hand-over buffer's size (the loader sets one block's estimate)
        self.keep_decoded = False  # set by the loader: an epoch is one block (see _read)
        self.build_as_taken = True  # in the training process (see __getitem__; off: benchmarks/epoch_start.py)
        self._sent = 0
        self._decoded: dict[tuple[int, int, tuple[str, ...]], tuple[np.ndarray, dict[str, np.ndarray]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decoded": {}}  # what this process decoded is not shipped to new workers

    def __getitem__(self, task: Task) -> tuple[list[Any] | InArena | LazyBatches, dict[str, Any]]:
        """(the block's batches in yield order, info). Errors travel back as values: a ``WorkerFailure`` in place of
        the batch that failed (the batches before it are still served; torch would re-raise an exception with the
        worker's traceback pasted into the message, and cannot rebuild a DatasetError).

        In the training process itself (0 loader workers) the batches are built one at a time, as the trainer
        takes them (``LazyBatches``): built all at once, the block's transforms and collates (a whole epoch's,
        when the dataset fits in one block) stalled training at every block's first batch."""
        info: dict[str, Any] = {"skipped": [], "decode_s": 0.0, "decoded": len(task.samples), "short": [],
                                "episodes": []}
        batches: list[Any] = []
        worker = torch.utils.data.get_worker_info()
        slot = None
        try:
            block = self._prepare(task.samples)
            info["skipped"], info["decode_s"] = block.skipped, block.decode_s
            if worker is None and self.build_as_taken:
                return LazyBatches(self, block, task), info
            if worker is not None:  # hand the block over in shared memory: an arena slot, else a one-off buffer
                slot = self.arena.reserve(worker.id, self._sent) if self.arena is not None else None
                self._sent += 1
                slot = slot or Slot.one_off(self.block_bytes)
            # without user transforms, camera frames are written straight into the slot (no copy to hand them over)
            direct = slot if self.transform is None and self.collate is None else None
            for i in range(len(task.batches)):
                batch, short, episodes = self._one(block, task, i, direct)
                # moved into the slot now: a collate's tensors (shared memory, a file descriptor each) are freed
                batches.append(slot.put(batch) if slot is not None else batch)
                del batch
                info["short"].append(short)
                info["episodes"].append(episodes)
        except Exception as e:  # noqa: BLE001 - reported as the failure of the batch it happened in
            batches.append(self.failure(e, task, len(batches)))
        return (slot.handover(batches) if slot is not None else batches), info

    def failure(self, e: Exception, task: Task, i: int) -> WorkerFailure:
        """An exception met while preparing batch ``i`` of ``task``, as the value that replaces that batch."""
        if isinstance(e, RoboscaleError):
            return WorkerFailure(to_record(e))
        traceback.print_exc()  # the worker's stderr: the full traceback for debugging
        rows = task.rows[min(i, len(task.rows) - 1)]
        first = self.sample_index.describe(int(task.samples[rows[0]]))
        return WorkerFailure(to_record(LoaderError(
            f"loader worker failed on batch {int(task.batches[min(i, len(task.batches) - 1)])} of epoch "
            f"{task.epoch} (block {task.block}, first sample: {first}): {type(e).__name__}: {e}")))

    def _one(self, block: _Block, task: Task, i: int, slot: Slot | None) -> tuple[Any, int, int]:
        """Batch ``i`` of the task, the number of its samples refilled, and its number of distinct episodes."""
        sel = task.rows[i]
        seeds = task.seeds[i]
        ok = block.good[sel]
        short = int(len(sel) - ok.sum())
        if short:
            pool = np.flatnonzero(block.good)
            if len(pool) == 0:  # nothing readable to refill from: the batch is skipped
                return None, 0, 0
            # keep the batch size: refill from this share's readable samples (deterministic); a refilled position
            # keeps its seed
            fill = pool[(int(task.batches[i]) * len(sel) + np.arange(short)) % len(pool)]
            sel = sel.copy()
            sel[~ok] = fill
        episodes = len(np.unique(block.ep[sel]))
        return self._batch(block, sel, seeds, slot), short, episodes

    # ------------------------------------------------------------------ decode a block

    def _prepare(self, gids: np.ndarray) -> _Block:
        t0 = time.perf_counter()
        sample_index = self.sample_index
        ep, frame = sample_index.locate(gids)
        eps, slot = np.unique(ep, return_inverse=True)
        lengths = sample_index.lengths[eps]
        block = _Block(gids, ep, frame, np.ones(len(gids), bool), slot, lengths)
        # keys read together: same kind (camera or not) and the same window offsets
        groups: dict[tuple, list[str]] = {}
        for key in [*self.keys, "task_index"]:
            offsets = self.deltas.get(key)
            window = None if offsets is None else tuple(offsets.tolist())
            groups.setdefault((key in self.camera_keys, window), []).append(key)
        parts: dict[str, list[np.ndarray]] = {k: [] for group in groups.values() for k in group}
        luts: dict[str, list[np.ndarray]] = {k: [] for k in parts}
        for i, g in enumerate(eps):
            src, local, n = int(sample_index.source_of[g]), int(sample_index.local[g]), int(lengths[i])
            mine = frame[slot == i]
            try:
                read = {}
                for (_, window), keys in groups.items():
                    wanted = mine if window is None else (mine[:, None] + np.asarray(window)[None]).ravel()
                    needed = np.unique(np.clip(wanted, 0, n - 1))
                    values, needed = self._read(src, local, needed, keys)
                    lut = np.full(n, -1, np.int64)
                    lut[needed] = np.arange(len(needed))
                    read.update({k: (values[k], lut) for k in keys})
            except DatasetError as e:
                if not self.skip_bad:
                    raise
                block.good[slot == i] = False
                block.skipped.append((sample_index.names[src], int(sample_index.episode_ids[g]), str(e)))
                read = None
            for k in parts:
                if k in self.camera_keys:
                    block.frames.setdefault(k, []).append(None if read is None else read[k][0])
                    block.frame_lut.setdefault(k, []).append(None if read is None else read[k][1])
                    continue
                if read is None:  # a placeholder row keeps offsets aligned; never selected (good=False)
                    luts[k].append(np.zeros(n, np.int64))
                    continue
                values, lut = read[k]
                base = sum(len(p) for p in parts[k])
                parts[k].append(values)
                luts[k].append(lut + base)
        for k in parts:
            if not parts[k]:
                continue
            block.values[k] = np.concatenate(parts[k])
            block.lut[k] = np.concatenate(luts[k])
            block.lut_start[k] = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        block.decode_s = time.perf_counter() - t0
        return block

    def _read(self, src: int, local: int, needed: np.ndarray, keys: list[str]
              ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The values of ``keys`` at (at least) the frames ``needed`` of one episode, and the frames they hold.

        When an epoch is one block (the dataset fits in ``block_memory_mb``), every epoch reads the same frames
        again: decoding them once and keeping them costs no memory the budget did not already grant, and removes
        the decode from every later epoch's first batch (with 0 loader workers that was a stall of the whole
        training at each epoch start, ~12 s in `make demo`). The frames an epoch's cut to whole batches left out
        are added to an episode's frames when an epoch asks for them."""
        read = self.sample_index.sources[src].read
        if not self.keep_decoded:
            return read(local, needed, keys), needed
        key = (src, local, tuple(keys))
        kept = self._decoded.get(key)
        if kept is not None:
            have, values = kept
            if np.isin(needed, have, assume_unique=True).all():
                return values, have
            needed = np.union1d(have, needed)
        values = read(local, needed, keys)
        self._decoded[key] = (needed, values)
        return values, needed

    # ------------------------------------------------------------------ gather a batch

    @staticmethod
    def _frames(block: _Block, key: str, slot: np.ndarray, frames: np.ndarray, arena: Slot | None) -> torch.Tensor:
        """uint8 [B, (T,) C, H, W]: one copy per frame, transposing HWC -> CHW on the way (into the hand-over slot
        when there is one)."""
        parts, luts = block.frames[key], block.frame_lut[key]
        h, w, c = next(p for p in parts if p is not None).shape[1:]
        shape = (*frames.shape, c, h, w)
        batch = arena.empty(shape, torch.uint8) if arena is not None else torch.empty(shape, dtype=torch.uint8)
        out = batch.numpy().reshape(-1, c, h, w)
        flat_slot = np.broadcast_to(slot.reshape(-1, *([1] * (frames.ndim - 1))), frames.shape).ravel()
        for i, (s, fr) in enumerate(zip(flat_slot.tolist(), frames.ravel().tolist(), strict=True)):
            np.copyto(out[i], parts[s][luts[s][fr]].transpose(2, 0, 1))
        return batch

    def _batch(self, block: _Block, sel: np.ndarray, seeds: np.ndarray, arena: Slot | None = None
               ) -> dict[str, Any]:
        slot, frame = block.slot[sel], block.frame[sel]
        episode_length = block.lengths[slot]
        out: dict[str, Any] = {}
        for key in self.keys:
            offsets = self.deltas.get(key)
            wanted = frame if offsets is None else frame[:, None] + offsets[None]  # [B] or a window [B, T]
            length = episode_length if offsets is None else episode_length[:, None]
            clamped = np.clip(wanted, 0, length - 1)  # LeRobot's windows repeat the edge frame
            if key in self.camera_keys:
                out[key] = self._frames(block, key, slot, clamped, arena)
            else:
                rows = block.lut[key][block.lut_start[key][slot].reshape(-1, *([1] * (wanted.ndim - 1))) + clamped]
                values = block.values[key][rows]
                if values.dtype == object:  # language annotations: per sample a list of row dicts, as LeRobot
                    out[key] = values.tolist()
                    if offsets is not None:
                        out[f"{key}_is_pad"] = torch.from_numpy((wanted < 0) | (wanted >= length))
                    continue
                if values.dtype.kind in _ITEM_DTYPE:
                    values = values.astype(_ITEM_DTYPE[values.dtype.kind], copy=False)
                out[key] = torch.from_numpy(values)
            if offsets is not None:
                out[f"{key}_is_pad"] = torch.from_numpy((wanted < 0) | (wanted >= length))
        sample_index = self.sample_index
        episode = block.ep[sel]
        task_index = block.values["task_index"][block.lut["task_index"][block.lut_start["task_index"][slot] + frame]]
        out["task"] = [sample_index.sources[s].tasks[t] for s, t in zip(sample_index.source_of[episode].tolist(),
                                                                   task_index.tolist(), strict=True)]
        out["episode_index"] = torch.from_numpy(sample_index.episode_ids[episode])
        out["frame_index"] = torch.from_numpy(frame.astype(np.int64))
        if len(sample_index.sources) > 1:
            out["dataset_index"] = torch.from_numpy(sample_index.source_of[episode])
        seeds = np.asarray(seeds, dtype=np.int64)
        if self.transform is None and self.collate is None:
            out["sample_seed"] = torch.from_numpy(seeds.copy())
            return out
        samples = [{k: (v[i] if not isinstance(v, list) else v[i]) for k, v in out.items()} for i in range(len(sel))]
        for sample, seed in zip(samples, seeds.tolist(), strict=True):
            sample["sample_seed"] = seed  # a Python int: default_collate stacks it into int64 [B]
        if self.transform is not None:
            for i, sample in enumerate(samples):
                try:
                    samples[i] = self.transform(sample)
                except Exception as e:
                    raise LoaderError(f"transform failed on sample ({sample_index.describe(int(block.gids[sel[i]]))}): "
                                      f"{type(e).__name__}: {e}") from e
        collate = self.collate or torch.utils.data.default_collate
        return collate(samples)


class LazyBatches:
    """A decoded block whose batches are built when taken (in the training process, see
    ``BatchDataset.__getitem__``): ``take(i)`` -> (batch, samples refilled, distinct episodes)."""

    def __init__(self, dataset: BatchDataset, block: _Block, task: Task):
        self.dataset, self.block, self.task = dataset, block, task

    def __len__(self) -> int:
        return len(self.task.batches)

    def take(self, i: int) -> tuple[Any, int, int]:
        try:
            return self.dataset._one(self.block, self.task, i, None)
        except Exception as e:  # noqa: BLE001 - as a worker would report it
            return self.dataset.failure(e, self.task, i), 0, 0


@dataclass
class WorkerFailure:
    """An exception from a worker, as data (see ``BatchDataset.__getitem__``): ``roboscale.errors.to_record``."""

    record: dict[str, Any]

    def error(self) -> Exception:
        return from_record(self.record)


class Fetcher:
    """Runs ``next(iterator)`` on a daemon thread, so the trainer can stop waiting for it.

    A worker that returns nothing for ``worker_timeout_s`` is stopped (``stop_processes``). torch then notices the
    dead worker, but to mark it torch takes a lock that all workers share (its done event); a worker killed while
    holding that lock (a SIGSTOP or SIGKILL lands anywhere) leaves it held forever, and whoever touches it next
    blocks for good. So the wait happens here: on time-out the loader stops the workers, gives torch a moment to
    report them, and otherwise abandons this thread (daemon: it never holds up the interpreter's exit) and the
    iterator with it. (torch's own ``timeout`` would also postpone its check for crashed workers to the end of that
    wait: workers of a forkserver are not our children, so no SIGCHLD.)"""

    def __init__(self, iterator: Any):
        self.iterator = iterator
        self.busy = False
        self._requests: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="loader-fetch", daemon=True).start()

    def _run(self) -> None:
        while self._requests.get():
            try:
                self._results.put((True, next(self.iterator)))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread as it was
                self._results.put((False, e))

    def next(self, timeout_s: float, on_timeout: Callable[[], None]) -> Any:
        """The next item; after ``timeout_s`` without one, ``on_timeout()`` and ``TimeoutError`` (with the error
        torch raised meanwhile as its cause, if it raised one)."""
        self._requests.put(True)
        self.busy = True  # until the answer is taken: an interrupted wait leaves the thread inside torch
        try:
            ok, value = self._results.get(timeout=timeout_s)
        except queue.Empty:
            on_timeout()
            try:
                ok, value = self._results.get(timeout=_REPORT_GRACE_S)
            except queue.Empty:
                raise TimeoutError from None
            self.busy = False
            raise TimeoutError from (value if not ok else None)
        self.busy = False
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._requests.put(False)


_REPORT_GRACE_S = 10.0  # after stopping timed-out workers: how long torch may take to notice before we give up


def stop_processes(processes: Sequence[Any], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after ``grace_s``: a stopped process (SIGSTOP, a debugger, a
    frozen NFS read) never acts on SIGTERM, and a worker that looks alive makes torch wait on it forever."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(1.0)
