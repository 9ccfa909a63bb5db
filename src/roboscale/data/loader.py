"""Training batches from LeRobot v3.0 datasets or lake shards: streaming, rank-sharded, resumable.

``build_loader(source, batch_size=..., num_workers=..., delta_timestamps=...)`` returns a ``StreamingLoader``:
an endless iterator of batches (epoch after epoch) with ``state_dict()`` / ``load_state_dict()``.

A sample is the current frame of each camera (uint8 CHW), the other requested features at the current frame,
``delta_timestamps`` windows (LeRobot's semantics: offsets clamped to the episode, ``<key>_is_pad``), the
``task`` string, ``episode_index`` and ``frame_index`` (+ ``dataset_index`` for mixtures). The default collate
stacks them into LeRobot's dict batch; a ``transform`` runs per sample and a ``collate`` per batch, both in the
workers.

How an epoch is ordered (why: random access into video is what makes LeRobot's loader 20-40x slow; see
docs/architecture.md). Every rank computes the same plan from ``(seed, epoch)``:

1. Each episode is cut into *chunks* of ``chunk_frames`` consecutive frames, at a random phase per episode and
   epoch. Chunks are shuffled over the whole dataset (all mixture sources together; a source contributes
   ``weight / sum(weights)`` of the epoch's samples, repeating or truncating its own shuffled chunks).
2. The shuffled stream is cut into *blocks* of ``block_samples`` samples (rounded to whole batches); block ``j``
   goes to rank ``j % world_size``, so ranks never share a sample. Each rank keeps the same number of batches
   (the last partial batches are dropped), so data-parallel ranks never wait on each other.
3. Inside a block the samples are shuffled, and batches are cut from it. A block is decoded by one worker in one
   pass: each chunk is a run of consecutive frames, so decoders move forward through the file (one seek per
   chunk and camera, then ~0.5 ms per 224² AV1 frame instead of ~2 ms for a seek each). Batches hold samples
   from about ``block_samples / chunk_frames`` places in the dataset.

Blocks are dealt to workers round-robin, and torch's DataLoader hands task ``p`` to worker ``p % num_workers``,
so a worker receives the batches of its own blocks and keeps the current block decoded: worker memory is one
or two blocks of frames (``block_samples x cameras x H x W x 3`` bytes) plus bounded caches, whatever the dataset
size. The order depends on ``num_workers``; the *set* of samples does not, and ``load_state_dict`` continues with
exactly the samples not yet returned, even if ``num_workers`` changed. Without ``shuffle`` every block is one
batch, so batches come in dataset order. The main process holds the epoch plan (8 bytes per sample).

Workers hand batches over through a shared-memory arena of recycled buffers (``_Arena``) rather than torch's
fresh segment per tensor; on 2 cores that halved the CPU cost per sample when reading lake shards.

Workers start from a *forkserver* (a clean process that imported this module once), not by forking the trainer:
by the time a loader starts, the trainer runs threads (pyarrow's pool, decoder threads, OpenMP, a Ray or gRPC
client), and a fork copies whatever lock one of them holds, so a worker can deadlock on its first read (most
likely what hung a loader test in our CI, after an in-process Ray session). Python 3.14 made the same choice.
The cost: ``transform``, ``collate`` and the sources travel pickled, so they must be picklable (module-level
functions or objects); pass ``multiprocessing_context="fork"`` for closures. As under spawn, the workers import
the main module, so a script that builds loaders at module level needs an ``if __name__ == "__main__":`` guard.
A worker that returns nothing for ``worker_timeout_s`` is reported like a crashed one, never waited on forever.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import multiprocessing
import pickle
import queue
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roboscale.data import lerobot_format as fmt
from roboscale.data.source import FrameSource, open_source
from roboscale.errors import ConfigError, DatasetError, RoboscaleError, from_record, to_record

log = logging.getLogger(__name__)

# what a forkserver imports once, so that each worker it forks starts with torch and the readers loaded
# ("__main__": a script's module-level transforms unpickle in the workers as they do under spawn)
_WORKER_PRELOAD = ["__main__", "roboscale.data.loader"]

# numpy kind -> dtype LeRobot's items have (hf_transform_to_torch: floats -> float32, ints -> int64)
_ITEM_DTYPE = {"f": np.float32, "i": np.int64, "u": np.int64, "b": np.bool_}


class LoaderError(RoboscaleError, RuntimeError):
    """A loader worker failed; the message names the dataset, episode and frame it was working on."""


# --------------------------------------------------------------------------------------------------- sources


@dataclass
class _Sources:
    """The global sample id space over one or more sources: ids ``starts[g] .. starts[g+1]-1`` are the frames of
    global episode ``g`` (source ``source_of[g]``, position ``local[g]`` in it)."""

    sources: list[FrameSource]
    names: list[str]
    starts: np.ndarray
    source_of: np.ndarray
    local: np.ndarray
    episode_ids: np.ndarray

    @classmethod
    def build(cls, sources: list[FrameSource], names: list[str]) -> _Sources:
        lengths = [np.asarray(s.episode_lengths, dtype=np.int64) for s in sources]
        all_lengths = np.concatenate(lengths)
        return cls(
            sources=sources,
            names=names,
            starts=np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64),
            source_of=np.concatenate([np.full(len(x), i, np.int64) for i, x in enumerate(lengths)]),
            local=np.concatenate([np.arange(len(x), dtype=np.int64) for x in lengths]),
            episode_ids=np.concatenate([np.asarray(s.episode_ids, dtype=np.int64) for s in sources]),
        )

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def locate(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global episode, frame) of sample ids."""
        ep = np.searchsorted(self.starts, gids, side="right") - 1
        return ep, gids - self.starts[ep]

    def describe(self, gid: int) -> str:
        ep, fr = self.locate(np.array([gid]))
        g = int(ep[0])
        return f"{self.names[self.source_of[g]]}: episode {int(self.episode_ids[g])}, frame {int(fr[0])}"


def _open(item: Any, options: Mapping[str, Any]) -> tuple[FrameSource, str]:
    if isinstance(item, FrameSource) and not isinstance(item, (str, Path)):
        return item, str(getattr(item, "root", repr(item)))
    return open_source(item, **options), str(item)


def _parse_source(source: Any) -> list[tuple[Any, float | None]]:
    """A path / FrameSource, or a list of them, each optionally ``(item, weight)``."""
    if isinstance(source, (str, Path)) or isinstance(source, FrameSource):
        return [(source, None)]
    items = []
    for entry in source:
        if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], (int, float)):
            if entry[1] < 0:
                raise ConfigError(f"mixture weight of {entry[0]} is negative: {entry[1]}")
            items.append((entry[0], float(entry[1])))
        else:
            items.append((entry, None))
    if not items:
        raise ConfigError("build_loader: empty list of sources")
    return items


# --------------------------------------------------------------------------------------------------- plan


def _delta_offsets(delta_timestamps: Mapping[str, Sequence[float]] | None, fps: float, tolerance_s: float,
                   features: Mapping[str, Any], where: str) -> dict[str, np.ndarray]:
    out = {}
    for key, deltas in (delta_timestamps or {}).items():
        if key not in features:
            raise ValueError(f"delta_timestamps key {key!r} is not a feature of {where}")
        d = np.asarray(list(deltas), dtype=np.float64)
        off = np.abs(d * fps - np.round(d * fps)) / fps
        if (off > tolerance_s).any():
            raise ValueError(f"delta_timestamps[{key!r}] = {d[off > tolerance_s].tolist()} are not multiples of "
                             f"1/fps = {1 / fps} within tolerance_s={tolerance_s} ({where})")
        out[key] = np.round(d * fps).astype(np.int64)
    return out


@dataclass
class _Plan:
    """What every rank agrees on; ``epoch(e)`` gives this rank's blocks of sample ids."""

    lengths: np.ndarray  # frames per global episode (0 for excluded episodes)
    starts: np.ndarray  # first sample id of each global episode (of every episode: ids never shift when one is
    # excluded, since workers locate samples in the full id space)
    source_of: np.ndarray
    quotas: np.ndarray  # samples per source per epoch
    batch_size: int
    block_batches: int
    chunk_frames: int
    shuffle: bool
    seed: int
    rank: int
    world_size: int
    batches_per_epoch: int = 0

    def __post_init__(self) -> None:
        total = int(self.quotas.sum())
        block = self.block_batches * self.batch_size
        n_blocks = -(-total // block)
        per_rank = [sum(min(block, total - j * block) for j in range(r, n_blocks, self.world_size))
                    for r in range(self.world_size)]
        self.batches_per_epoch = min(per_rank) // self.batch_size if per_rank else 0

    def _stream(self, rng: np.random.Generator, source: int, quota: int) -> tuple[np.ndarray, np.ndarray]:
        """``quota`` sample ids of one source and their chunk keys, chunk-shuffled (repeating passes if needed)."""
        eps = np.flatnonzero((self.source_of == source) & (self.lengths > 0))
        starts = self.starts
        ids, keys, have, base = [], [], 0, 0
        while have < quota:
            lengths = self.lengths[eps]
            order = rng.permutation(len(eps)) if self.shuffle else np.arange(len(eps))
            e, n = eps[order], lengths[order]
            frame = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            gid = np.repeat(starts[e], n) + frame
            if self.shuffle:
                phase = np.repeat(rng.integers(0, self.chunk_frames, len(e)), n)
                local_chunk = (frame + phase) // self.chunk_frames
                per_ep = (n - 1 + phase[np.cumsum(n) - 1]) // self.chunk_frames + 1
                chunk = np.repeat(np.cumsum(per_ep) - per_ep, n) + local_chunk
                chunk_order = rng.permutation(int(per_ep.sum()))
                key = chunk_order[chunk]
                sort = np.argsort(key, kind="stable")
                gid, key = gid[sort], key[sort]
            else:
                key = np.zeros(len(gid), np.int64)
            take = min(quota - have, len(gid))
            ids.append(gid[:take])
            keys.append(key[:take] + base)  # chunk keys stay distinct across passes
            have, base = have + take, base + int(key.max(initial=0)) + 1
        return np.concatenate(ids), np.concatenate(keys)

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """This rank's blocks (sample id arrays) for ``epoch``, truncated to ``batches_per_epoch`` batches."""
        rng = np.random.default_rng([self.seed, epoch])
        parts = [self._stream(rng, s, int(q)) for s, q in enumerate(self.quotas) if q > 0]
        gid = np.concatenate([p[0] for p in parts])
        if self.shuffle and len(parts) > 1:  # interleave the sources' chunks
            offsets = np.cumsum([0] + [int(p[1].max(initial=0)) + 1 for p in parts])
            key = np.concatenate([p[1] + off for p, off in zip(parts, offsets, strict=False)])
            uniq, inverse = np.unique(key, return_inverse=True)
            rank_of = rng.permutation(len(uniq))
            gid = gid[np.argsort(rank_of[inverse], kind="stable")]
        block = self.block_batches * self.batch_size
        mine = [gid[j: j + block] for j in range(self.rank * block, len(gid), self.world_size * block)]
        if self.shuffle:
            brng = np.random.default_rng([self.seed, epoch, 1 + self.rank])
            mine = [brng.permutation(b) for b in mine]
        out, left = [], self.batches_per_epoch * self.batch_size
        for b in mine:
            if left <= 0:
                break
            out.append(b[:left])
            left -= len(out[-1])
        return out


def _order(n_blocks_batches: list[int], num_workers: int) -> list[tuple[int, int]]:
    """Yield order of (block, batch in block): blocks dealt to workers round-robin, workers served round-robin
    (torch gives task p to worker p % num_workers), leftovers appended in the same rhythm."""
    w = max(1, num_workers)
    queues = [[(blk, b) for blk in range(i, len(n_blocks_batches), w) for b in range(n_blocks_batches[blk])]
              for i in range(w)]
    out: list[tuple[int, int]] = []
    depth = max((len(q) for q in queues), default=0)
    for k in range(depth):
        out.extend(q[k] for q in queues if k < len(q))
    return out


# --------------------------------------------------------------------------------------------------- transport

# Sending a tensor from a worker makes torch copy it into a fresh shared-memory segment, whose pages fault in on
# first touch: measured ~9 ms per 32 x 224² x 3 camera batch, more than decoding costs per sample on a lake.
# Instead each worker writes its large tensors into a recycled slot of an arena allocated once (pages stay mapped),
# sends only offsets, and the main process copies them out (into pinned memory when pinning) and frees the slot.
_MIN_ARENA_BYTES = 1 << 16  # smaller tensors take torch's path


@dataclass(frozen=True)
class _Ref:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _InArena:
    worker: int
    slot: int
    tree: Any


class _Arena:
    """``workers x slots`` byte buffers in one shared-memory tensor, and a busy flag per buffer."""

    def __init__(self, workers: int, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.buffers = torch.empty((workers, slots, capacity), dtype=torch.uint8).share_memory_()
        self.busy = torch.zeros((workers, slots), dtype=torch.int32).share_memory_()

    def reserve(self, worker: int, counter: int) -> _Slot | None:
        """This worker's next buffer, or None while the main process still reads it (then torch's path is used)."""
        slot = counter % self.slots
        if int(self.busy[worker, slot]):
            return None
        self.busy[worker, slot] = 1
        return _Slot(self, worker, slot, self.buffers[worker, slot])

    def take(self, item: _InArena, pin: bool) -> Any:
        try:
            return _unpack(item.tree, self.buffers[item.worker, item.slot], pin)
        finally:
            self.busy[item.worker, item.slot] = 0


class _Slot:
    """One reserved buffer: tensors can be allocated in it directly, then the batch is packed around them."""

    def __init__(self, arena: _Arena, worker: int, slot: int, buffer: torch.Tensor):
        self.arena, self.worker, self.slot, self.buffer = arena, worker, slot, buffer
        self.offset = 0
        self._start = buffer.data_ptr()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor living in this slot (a fresh one when the slot is full)."""
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if self.offset + n > self.buffer.numel():
            return torch.empty(shape, dtype=dtype)
        out = self.buffer[self.offset:self.offset + n].view(dtype).view(shape)
        self.offset += -(-n // 64) * 64
        return out

    def _inside(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr()

    def pack(self, obj: Any) -> Any:
        """``obj`` as an ``_InArena`` (large tensors as offsets into this slot); if it does not fit, ``obj`` with
        its in-slot tensors copied out, and the slot released."""
        extra = [0]

        def need(t: torch.Tensor) -> torch.Tensor:
            if not self._inside(t):
                extra[0] += -(-t.nbytes // 64) * 64
            return t

        _walk(obj, need, _big)
        if self.offset + extra[0] > self.buffer.numel():
            obj = _walk(obj, lambda t: t.clone() if self._inside(t) else t, lambda x: isinstance(x, torch.Tensor))
            self.arena.busy[self.worker, self.slot] = 0
            return obj
        target = self.buffer.numpy()

        def put(t: torch.Tensor) -> _Ref:
            if self._inside(t) and t.is_contiguous():  # already here (allocated with ``empty``)
                return _Ref(t.data_ptr() - self._start, t.dtype, tuple(t.shape))
            start, n = self.offset, t.nbytes
            if n:
                np.copyto(target[start:start + n], t.detach().contiguous().view(-1).view(torch.uint8).numpy())
            self.offset = start + -(-n // 64) * 64
            return _Ref(start, t.dtype, tuple(t.shape))

        return _InArena(self.worker, self.slot, _walk(obj, put, lambda x: _big(x) or (
            isinstance(x, torch.Tensor) and self._inside(x))))


def _walk(obj: Any, fn: Callable[[torch.Tensor], Any], is_leaf: Callable[[Any], bool]) -> Any:
    if is_leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn, is_leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_walk(v, fn, is_leaf) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, _walk(getattr(obj, f.name), fn, is_leaf))
        return out
    return obj


def _big(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.nbytes >= _MIN_ARENA_BYTES


def _unpack(tree: Any, buffer: torch.Tensor, pin: bool) -> Any:
    source = buffer.numpy()

    def get(ref: _Ref) -> torch.Tensor:
        out = torch.empty(ref.shape, dtype=ref.dtype, pin_memory=pin)
        n = out.nbytes
        if n:  # numpy's memcpy: torch's copy_ would spread one memcpy over the trainer's OpenMP threads
            np.copyto(out.view(-1).view(torch.uint8).numpy(), source[ref.offset:ref.offset + n])
        return out

    return _walk(tree, get, lambda x: isinstance(x, _Ref))


# --------------------------------------------------------------------------------------------------- workers


@dataclass
class _Task:
    epoch: int
    block: int
    batch: int
    samples: np.ndarray  # the whole block's sample ids (the worker decodes it once)
    batch_size: int


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


class _BatchDataset(torch.utils.data.Dataset):
    """Runs in the workers: ``dataset[task]`` -> (batch, info)."""

    def __init__(self, space: _Sources, keys: list[str], deltas: dict[str, np.ndarray], camera_keys: set[str],
                 transform: Callable | None, collate: Callable | None, skip_bad_episodes: bool):
        self.space = space
        self.keys = keys
        self.deltas = deltas
        self.camera_keys = camera_keys
        self.transform = transform
        self.collate = collate
        self.skip_bad = skip_bad_episodes
        self.arena: _Arena | None = None  # set by the loader before workers start
        self._sent = 0
        self._blocks: OrderedDict[tuple[int, int], _Block] = OrderedDict()

    def __getitem__(self, task: _Task) -> tuple[Any, dict[str, Any]]:
        # Errors travel back as values: torch would re-raise them with the worker's traceback pasted into the
        # message (and cannot rebuild a DatasetError); the main process raises them as they were.
        try:
            return self._get(task)
        except RoboscaleError as e:
            failure = _Failure(to_record(e))
        except Exception as e:  # noqa: BLE001 - anything else is reported with where it happened
            traceback.print_exc()  # the worker's stderr: the full traceback for debugging
            first = self.space.describe(int(task.samples[min(task.batch * task.batch_size, len(task.samples) - 1)]))
            failure = _Failure(to_record(LoaderError(f"loader worker failed on batch {task.batch} of a block "
                                                     f"starting at ({first}): {type(e).__name__}: {e}")))
        return failure, {"skipped": [], "decode_s": 0.0, "short": 0}

    def _get(self, task: _Task) -> tuple[Any, dict[str, Any]]:
        key = (task.epoch, task.block)
        block = self._blocks.get(key)
        fresh = block is None
        if block is None:
            block = self._prepare(task.samples)
            self._blocks[key] = block
            while len(self._blocks) > 2:  # the current block, and one more for the epoch tail's interleaving
                self._blocks.popitem(last=False)
        sel = np.arange(task.batch * task.batch_size, min((task.batch + 1) * task.batch_size, len(block.gids)))
        info = {"skipped": block.skipped if fresh else [], "decode_s": block.decode_s if fresh else 0.0,
                "short": 0}
        ok = sel[block.good[sel]]
        if len(ok) < len(sel):
            pool = np.flatnonzero(block.good)
            if len(pool) == 0:
                return None, info
            # keep the batch size: refill from the block's readable samples (deterministic)
            fill = pool[(task.batch * task.batch_size + np.arange(len(sel) - len(ok))) % len(pool)]
            info["short"] = len(sel) - len(ok)
            sel = np.concatenate([ok, fill])
        worker = torch.utils.data.get_worker_info()
        slot = None
        if self.arena is not None and worker is not None:
            slot = self.arena.reserve(worker.id, self._sent)
            self._sent += 1
        # without user transforms, camera frames are written straight into the slot (no copy to hand them over)
        batch = self._batch(block, sel, slot if self.transform is None and self.collate is None else None)
        return (slot.pack(batch) if slot is not None else batch), info

    # ------------------------------------------------------------------ decode a block

    def _prepare(self, gids: np.ndarray) -> _Block:
        t0 = time.perf_counter()
        space = self.space
        ep, frame = space.locate(gids)
        eps, slot = np.unique(ep, return_inverse=True)
        lengths = space.lengths[eps]
        block = _Block(gids, ep, frame, np.ones(len(gids), bool), slot, lengths)
        groups: dict[tuple, list[str]] = {}
        for key in [*self.keys, "task_index"]:
            d = self.deltas.get(key)
            groups.setdefault((key in self.camera_keys, None if d is None else tuple(d.tolist())), []).append(key)
        parts: dict[str, list[np.ndarray]] = {k: [] for g in groups.values() for k in g}
        luts: dict[str, list[np.ndarray]] = {k: [] for k in parts}
        for i, g in enumerate(eps):
            src, local, n = int(space.source_of[g]), int(space.local[g]), int(lengths[i])
            mine = frame[slot == i]
            try:
                read = {}
                for (_, d), keys in groups.items():
                    q = mine if d is None else (mine[:, None] + np.asarray(d)[None]).ravel()
                    needed = np.unique(np.clip(q, 0, n - 1))
                    values = space.sources[src].read(local, needed, keys)
                    lut = np.full(n, -1, np.int64)
                    lut[needed] = np.arange(len(needed))
                    read.update({k: (values[k], lut) for k in keys})
            except DatasetError as e:
                if not self.skip_bad:
                    raise
                block.good[slot == i] = False
                block.skipped.append((space.names[src], int(space.episode_ids[g]), str(e)))
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

    # ------------------------------------------------------------------ gather a batch

    @staticmethod
    def _frames(block: _Block, key: str, slot: np.ndarray, frames: np.ndarray, arena: _Slot | None,
                shared: bool) -> torch.Tensor:
        """uint8 [B, (T,) C, H, W]: one copy per frame, transposing HWC -> CHW on the way (into shared memory when
        it will cross to the main process without the arena: saves torch's copy into a new segment)."""
        parts, luts = block.frames[key], block.frame_lut[key]
        h, w, c = next(p for p in parts if p is not None).shape[1:]
        shape = (*frames.shape, c, h, w)
        batch = arena.empty(shape, torch.uint8) if arena is not None else torch.empty(shape, dtype=torch.uint8)
        if shared and arena is None:
            batch.share_memory_()
        out = batch.numpy().reshape(-1, c, h, w)
        flat_slot = np.broadcast_to(slot.reshape(-1, *([1] * (frames.ndim - 1))), frames.shape).ravel()
        for i, (s, fr) in enumerate(zip(flat_slot.tolist(), frames.ravel().tolist(), strict=True)):
            np.copyto(out[i], parts[s][luts[s][fr]].transpose(2, 0, 1))
        return batch

    def _batch(self, block: _Block, sel: np.ndarray, arena: _Slot | None = None) -> dict[str, Any]:
        slot, f = block.slot[sel], block.frame[sel]
        n = block.lengths[slot]
        out: dict[str, Any] = {}
        in_worker = torch.utils.data.get_worker_info() is not None and self.arena is None
        for key in self.keys:
            d = self.deltas.get(key)
            q = f if d is None else f[:, None] + d[None]
            nn = n if d is None else n[:, None]
            qc = np.clip(q, 0, nn - 1)
            if key in self.camera_keys:
                out[key] = self._frames(block, key, slot, qc, arena, in_worker)
            else:
                rows = block.lut[key][block.lut_start[key][slot].reshape(-1, *([1] * (q.ndim - 1))) + qc]
                values = block.values[key][rows]
                if values.dtype.kind in _ITEM_DTYPE:
                    values = values.astype(_ITEM_DTYPE[values.dtype.kind], copy=False)
                out[key] = torch.from_numpy(values)
            if d is not None:
                out[f"{key}_is_pad"] = torch.from_numpy((q < 0) | (q >= nn))
        space = self.space
        g = block.ep[sel]
        task_index = block.values["task_index"][block.lut["task_index"][block.lut_start["task_index"][slot] + f]]
        out["task"] = [space.sources[s].tasks[t] for s, t in zip(space.source_of[g].tolist(), task_index.tolist(),
                                                                  strict=True)]
        out["episode_index"] = torch.from_numpy(space.episode_ids[g])
        out["frame_index"] = torch.from_numpy(f.astype(np.int64))
        if len(space.sources) > 1:
            out["dataset_index"] = torch.from_numpy(space.source_of[g])
        if self.transform is None and self.collate is None:
            return out
        samples = [{k: (v[i] if not isinstance(v, list) else v[i]) for k, v in out.items()} for i in range(len(sel))]
        if self.transform is not None:
            for i, sample in enumerate(samples):
                try:
                    samples[i] = self.transform(sample)
                except Exception as e:
                    raise LoaderError(f"transform failed on sample ({space.describe(int(block.gids[sel[i]]))}): "
                                      f"{type(e).__name__}: {e}") from e
        collate = self.collate or torch.utils.data.default_collate
        return collate(samples)


@dataclass
class _Failure:
    """An exception from a worker, as data (see ``_BatchDataset.__getitem__``): ``roboscale.errors.to_record``."""

    record: dict[str, Any]

    def error(self) -> Exception:
        return from_record(self.record)


class _Fetcher:
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


def _worker_context(name: str) -> multiprocessing.context.BaseContext:
    context = multiprocessing.get_context(name)
    if name == "forkserver":  # only takes effect before this process's forkserver starts
        context.set_forkserver_preload(_WORKER_PRELOAD)
    return context


def _check_picklable(what: str, obj: Any, context: str) -> None:
    """Name the culprit up front: torch would fail at worker start with a bare pickling error."""
    if obj is None or context == "fork":
        return
    try:
        pickle.dumps(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"{what} {obj!r} cannot be pickled for the loader workers ({e}): define it at module "
                         f"level (or make it a picklable object), or pass multiprocessing_context='fork' "
                         "(see roboscale.data.loader on why fork is not the default)") from None


def _identity(x: Any) -> Any:
    return x


class _TaskSampler:
    """Main process: the endless sequence of tasks from the loader's current (epoch, position)."""

    def __init__(self, loader: StreamingLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[_Task]:
        loader = self.loader
        epoch, start, skip = loader.epoch, loader.position, loader._resume_skip
        while True:
            blocks = loader._blocks(epoch)
            order = loader._epoch_order(epoch, blocks)
            if skip:
                order = [t for t in order if t not in skip]
                skip = set()
            for blk, b in order[start:]:
                yield _Task(epoch, blk, b, blocks[blk], loader.batch_size)
            epoch, start = epoch + 1, 0


# --------------------------------------------------------------------------------------------------- loader


class StreamingLoader:
    """Endless iterator of batches; see the module docstring for the order, sharding and resume semantics."""

    def __init__(self, space: _Sources, dataset: _BatchDataset, plan: _Plan, *, num_workers: int,
                 prefetch_factor: int, pin_memory: bool, multiprocessing_context: str,
                 excluded: list[tuple[str, int, str]], arena_bytes: int = 0, worker_timeout_s: float = 0.0):
        self.space = space
        self.arena_bytes = arena_bytes
        self._arena: _Arena | None = None
        self._dataset = dataset
        self._plan = plan
        self.batch_size = plan.batch_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context
        self.worker_timeout_s = worker_timeout_s
        self._fetcher: _Fetcher | None = None
        self.epoch = 0
        self.position = 0
        self._resume_skip: set[tuple[int, int]] = set()
        self._iter: Iterator | None = None
        self._cached_blocks: tuple[int, list[np.ndarray]] | None = None
        self.data_wait_s = 0.0
        self.last_wait_s = 0.0
        self.batches = 0
        self.decode_s = 0.0
        self.skipped_episodes: dict[tuple[str, int], str] = {(name, ep): why for name, ep, why in excluded}
        self.refilled_samples = 0
        self.skipped_batches = 0
        self._empty_in_a_row = 0
        self.arena_batches = 0  # handed over through the shared-memory arena

    @property
    def batches_per_epoch(self) -> int:
        return self._plan.batches_per_epoch

    @property
    def sources(self) -> list[FrameSource]:
        return self.space.sources

    def _blocks(self, epoch: int) -> list[np.ndarray]:
        if self._cached_blocks is None or self._cached_blocks[0] != epoch:
            self._cached_blocks = (epoch, self._plan.epoch(epoch))
        return self._cached_blocks[1]

    def _epoch_order(self, epoch: int, blocks: list[np.ndarray], num_workers: int | None = None):
        sizes = [len(b) // self.batch_size + (len(b) % self.batch_size > 0) for b in blocks]
        return _order(sizes, self.num_workers if num_workers is None else num_workers)

    # ------------------------------------------------------------------ iteration

    def _start(self) -> Iterator:
        from torch.utils.data import DataLoader

        workers = self.num_workers
        if workers and self.arena_bytes and self._arena is None:
            try:
                self._arena = _Arena(workers, self.prefetch_factor + 2, self.arena_bytes)
            except RuntimeError as e:  # e.g. a small /dev/shm: torch's own path still works
                log.warning("loader: no shared-memory arena (%s); batches take torch's slower path", e)
                self.arena_bytes = 0
        if self._arena is not None:
            self._arena.busy.zero_()  # the previous workers are gone; so are their unread slots
        self._dataset.arena = self._arena
        loader = DataLoader(
            self._dataset,
            sampler=_TaskSampler(self),
            batch_size=None,
            collate_fn=_identity,
            num_workers=workers,
            prefetch_factor=self.prefetch_factor if workers else None,
            pin_memory=self.pin_memory,
            multiprocessing_context=_worker_context(self.multiprocessing_context) if workers else None,
            # our own generator: creating the iterator must not consume the global RNG (bit-exact resume)
            generator=torch.Generator().manual_seed(self._plan.seed),
        )
        iterator = iter(loader)
        if workers and self.worker_timeout_s > 0:
            self._fetcher = _Fetcher(iterator)
        return iterator

    def __iter__(self) -> StreamingLoader:
        self.close()
        self._iter = self._start()
        return self

    def __next__(self) -> dict[str, Any]:
        if self._iter is None:
            self._iter = self._start()
        while True:
            t0 = time.perf_counter()
            fetcher = self._fetcher
            try:
                if fetcher is None:
                    batch, info = next(self._iter)
                else:
                    workers = list(getattr(fetcher.iterator, "_workers", []))
                    batch, info = fetcher.next(self.worker_timeout_s, lambda: stop_processes(workers))
            except LoaderError:
                raise
            except DatasetError:
                raise
            except Exception as e:  # a worker crash or a time-out: name what it was working on
                blocks = self._blocks(self.epoch)
                order = self._epoch_order(self.epoch, blocks)
                pending = [t for t in order if t not in self._resume_skip][self.position] \
                    if self.position < len(order) else None
                where = ""
                if pending is not None:
                    ids = blocks[pending[0]][pending[1] * self.batch_size:(pending[1] + 1) * self.batch_size]
                    where = f" on batch {self.position} of epoch {self.epoch} (first sample: " \
                            f"{self.space.describe(int(ids[0]))})"
                why = f"{type(e).__name__}: {e}"
                if isinstance(e, TimeoutError):
                    why = f"no batch for {self.worker_timeout_s:g} s (worker_timeout_s): the workers timed out and " \
                          f"were stopped" + (f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else "")
                elif "exited unexpectedly" in why and self.multiprocessing_context != "fork":
                    why += " (its error, if any, is on stderr above; workers import your main module, so a script " \
                           "that builds loaders at module level needs `if __name__ == \"__main__\":`)"
                self.close()
                raise LoaderError(f"data loader failed{where}: {why}") from e
            if isinstance(batch, _Failure):
                self.close()
                error = batch.error()
                if isinstance(error, DatasetError) and not self._dataset.skip_bad:
                    raise DatasetError(error.path, f"{fmt.error_message(error)} (to train on the other episodes, "
                                       "skip unreadable ones: --skip-bad-episodes, skip_bad_episodes=True)",
                                       field=error.field, episode=error.episode)
                raise error
            if isinstance(batch, _InArena):
                batch = self._arena.take(batch, self.pin_memory)
                self.arena_batches += 1
            self.last_wait_s = time.perf_counter() - t0
            self.data_wait_s += self.last_wait_s
            self.decode_s += info["decode_s"]
            for name, ep, why in info["skipped"]:
                if (name, ep) not in self.skipped_episodes:
                    log.warning("skipping unreadable episode %d of %s: %s", ep, name, why)
                self.skipped_episodes[(name, ep)] = why
            self.refilled_samples += info["short"]
            self.position += 1
            if self.position >= self.batches_per_epoch - len(self._resume_skip):
                self.epoch, self.position, self._resume_skip = self.epoch + 1, 0, set()
            if batch is None:
                self.skipped_batches += 1
                self._empty_in_a_row += 1
                if self._empty_in_a_row >= self.batches_per_epoch:  # else an all-unreadable dataset spins forever
                    self.close()
                    raise DatasetError(", ".join(self.space.names), f"every episode read in the last "
                                       f"{self._empty_in_a_row} batches was unreadable (skipped: "
                                       f"{len(self.skipped_episodes)} episodes; first: "
                                       f"{next(iter(self.skipped_episodes.values()), '?')})")
                continue
            self._empty_in_a_row = 0
            self.batches += 1
            return batch

    def take(self, n: int) -> list[dict[str, Any]]:
        return [next(self) for _ in range(n)]

    def close(self) -> None:
        """Stop the workers (the next ``next()`` starts them again where the loader stands)."""
        it, self._iter = self._iter, None
        fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:
            fetcher.close()
        if it is not None and hasattr(it, "_shutdown_workers"):
            workers = list(getattr(it, "_workers", []))
            if fetcher is not None and fetcher.busy:  # stuck in torch (or interrupted while it worked there):
                it._shutdown = True  # its shared locks may be held by a dead worker; never touch them again
            else:
                it._shutdown_workers()
            stop_processes(workers, grace_s=1.0)  # torch only sends SIGTERM to a worker that does not exit

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer stands (batches already *returned*, not those prefetched by workers)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self._plan.seed,
                "num_workers": self.num_workers, "batch_size": self.batch_size,
                "world_size": self._plan.world_size, "rank": self._plan.rank,
                "skip": sorted([list(t) for t in self._resume_skip])}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, mine in (("seed", self._plan.seed), ("batch_size", self.batch_size),
                           ("world_size", self._plan.world_size)):
            if name in state and int(state[name]) != mine:
                raise ValueError(f"loader state was saved with {name}={state[name]}, this loader has {mine}: "
                                 "resuming would not continue the same sample sequence")
        self.close()
        epoch, position = int(state["epoch"]), int(state["position"])
        old_workers = int(state.get("num_workers", self.num_workers))
        skip = {tuple(t) for t in state.get("skip", [])}
        if old_workers != self.num_workers and position:
            blocks = self._blocks(epoch)
            old = [t for t in self._epoch_order(epoch, blocks, old_workers) if t not in skip]
            skip |= set(old[:position])
            position = 0
        self.epoch, self.position, self._resume_skip = epoch, position, skip

    def stats(self) -> dict[str, float]:
        return {"data_wait_s": self.data_wait_s, "batches": self.batches, "decode_s": self.decode_s,
                "skipped_episodes": len(self.skipped_episodes), "refilled_samples": self.refilled_samples,
                "arena_batches": self.arena_batches}


# --------------------------------------------------------------------------------------------------- builder


def check_sources(sources: Sequence[FrameSource], names: Sequence[str], *, skip_bad_episodes: bool
                  ) -> list[tuple[str, int, str]]:
    """Each source's cheap up-front checks (``FrameSource.unreadable_episodes``): raise for problems no skip avoids,
    for unreadable episodes unless ``skip_bad_episodes``, and when skipping would leave a source empty; returns
    the (source name, episode, why) to exclude."""
    from roboscale.data.validate import readable_or_raise

    excluded = []
    for source, name in zip(sources, names, strict=True):
        bad = source.unreadable_episodes()
        readable_or_raise(name, bad, len(source.episode_ids), skip_bad_episodes=skip_bad_episodes)
        if bad:
            log.warning("%s: skipping %d unreadable episodes (%s)", name, len(bad), sorted(bad)[:10])
        excluded += [(name, int(ep), why) for ep, why in bad.items()]
    return excluded


def build_loader(
    source: Any,
    *,
    batch_size: int,
    num_workers: int = 2,
    delta_timestamps: Mapping[str, Sequence[float]] | None = None,
    keys: Sequence[str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    transform: Callable[[dict[str, Any]], Any] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    prefetch_factor: int = 2,
    pin_memory: bool | None = None,
    block_samples: int = 256,
    chunk_frames: int = 16,
    skip_bad_episodes: bool = False,
    check: bool = True,
    tolerance_s: float = 1e-4,
    multiprocessing_context: str = "forkserver",
    worker_timeout_s: float = 600.0,
    source_options: Mapping[str, Any] | None = None,
    shared_arena: bool = True,
) -> StreamingLoader:
    """A ``StreamingLoader`` over ``source``: a dataset directory (raw LeRobot v3.0 or lake), a ``FrameSource``,
    or a list of those, each optionally ``(item, weight)`` (mixture weights: a source's share of every epoch;
    without weights, shares follow the sources' frame counts).

    ``keys``: features to load (default: every feature; cameras cost decoding, so pass what the policy reads).
    ``delta_timestamps``: ``{key: [seconds, ...]}`` windows, as LeRobot. ``transform`` runs per sample and
    ``collate`` per batch in the workers (default: stack into a dict batch). ``pin_memory`` defaults to CUDA
    availability. ``block_samples`` / ``chunk_frames``: see the module docstring. ``shared_arena``: workers hand
    batches over through recycled shared memory (see ``_Arena``; costs ``num_workers x (prefetch_factor + 2)``
    batch-sized buffers, sized from the features with 25% headroom for what transforms add).
    ``multiprocessing_context``: how workers start ("forkserver", "spawn" or "fork"; see the module docstring).
    ``worker_timeout_s``: a worker silent this long fails the loader with the batch it was on (0: wait forever).
    ``check``: run each source's cheap up-front checks (``FrameSource.unreadable_episodes``: what LeRobot's reader
    and ``roboscale data validate --quick`` refuse) and refuse unreadable episodes, or exclude them with
    ``skip_bad_episodes``; episodes that fail later, at read time, are skipped and counted the same way.
    """
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    options = dict(source_options or {})
    opened = [(_open(item, options), w) for item, w in _parse_source(source)]
    sources = [s for (s, _), _ in opened]
    names = [n for (_, n), _ in opened]
    first = sources[0]
    fps = float(first.fps)
    for s, n in zip(sources, names, strict=True):
        if float(s.fps) != fps:
            raise ConfigError(f"mixture sources must share one fps: {names[0]} has {fps}, {n} has {s.fps}")
    if keys is None:
        keys = [k for k, f in first.features.items() if f.get("dtype") != "string"]
    keys = list(dict.fromkeys(keys))
    for s, n in zip(sources, names, strict=True):
        missing = [k for k in keys if k not in s.features]
        if missing:
            raise DatasetError(n, f"no such feature (it has {sorted(s.features)})", field=missing[0])
    cameras = {k for k in keys if first.features[k].get("dtype") in ("video", "image")}
    deltas = _delta_offsets(delta_timestamps, fps, tolerance_s, first.features, names[0])
    unread = set(deltas) - set(keys)
    if unread:
        keys += sorted(unread)
    space = _Sources.build(sources, names)

    lengths = space.lengths.copy()
    excluded = check_sources(sources, names, skip_bad_episodes=skip_bad_episodes) if check else []
    for name, ep, _ in excluded:
        i = names.index(name)
        mine = np.flatnonzero(space.source_of == i)
        lengths[mine[int(np.flatnonzero(np.asarray(sources[i].episode_ids) == ep)[0])]] = 0
    frames = np.array([lengths[space.source_of == i].sum() for i in range(len(sources))], dtype=np.int64)
    weights = [w for _, w in opened]
    if all(w is None for w in weights):
        quotas = frames
    else:
        if any(w is None for w in weights):
            raise ConfigError("give every mixture source a weight, or none")
        wsum = sum(weights)
        if wsum <= 0:
            raise ConfigError("mixture weights sum to 0")
        total = int(frames.sum())
        quotas = np.array([int(round(total * w / wsum)) if frames[i] else 0 for i, w in enumerate(weights)],
                          dtype=np.int64)
    # unshuffled: one batch per block, so the batches dealt round-robin to workers come back in dataset order
    block_batches = max(1, block_samples // batch_size) if shuffle else 1
    plan = _Plan(lengths, space.starts[:-1], space.source_of, quotas, batch_size, block_batches,
                 max(1, chunk_frames), shuffle, seed, rank, world_size)
    if plan.batches_per_epoch == 0:
        raise ConfigError(f"{', '.join(names)}: {int(quotas.sum())} samples per epoch are too few for batch_size "
                          f"{batch_size} x world_size {world_size}")
    if num_workers:
        for what, obj in (("transform", transform), ("collate", collate)):
            _check_picklable(what, obj, multiprocessing_context)
        for s, n in zip(sources, names, strict=True):
            _check_picklable(f"source {n}", s, multiprocessing_context)
    dataset = _BatchDataset(space, keys, deltas, cameras, transform, collate, skip_bad_episodes)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    arena_bytes = 0
    if shared_arena and num_workers:
        per_sample = 0
        for key in keys:
            ft = first.features[key]
            t = len(deltas[key]) if key in deltas else 1
            size = int(np.prod(fmt.image_hwc(ft))) if key in cameras else 8 * int(np.prod(fmt.feature_shape(ft)))
            per_sample += t * size
        arena_bytes = int(1.25 * batch_size * per_sample) + (1 << 20)
    return StreamingLoader(space, dataset, plan, num_workers=num_workers, prefetch_factor=prefetch_factor,
                           pin_memory=pin_memory, multiprocessing_context=multiprocessing_context, excluded=excluded,
                           arena_bytes=arena_bytes, worker_timeout_s=worker_timeout_s)


# --------------------------------------------------------------------------------------------------- metadata


@dataclass
class SourceMeta:
    """What ``roboscale.models.registry.build_policy`` reads from a dataset, for any source or mixture."""

    root: str
    features: dict[str, Any]
    fps: float
    camera_keys: list[str]
    task_list: list[str]
    stats: dict[str, Any] | None


def source_meta(sources: Sequence[FrameSource], names: Sequence[str]) -> SourceMeta:
    """Features, fps and cameras of the first source; tasks of all; stats merged over the sources."""
    first = sources[0]
    tasks = list(dict.fromkeys(t for s in sources for t in s.tasks))
    stats = first.stats
    if len(sources) > 1 and all(s.stats for s in sources):
        from roboscale.data.stats import aggregate_stats

        common = set.intersection(*(set(s.stats) for s in sources))
        stats = aggregate_stats([{k: s.stats[k] for k in common} for s in sources])
    return SourceMeta(root=", ".join(names), features=dict(first.features), fps=float(first.fps),
                      camera_keys=list(first.camera_keys), task_list=tasks, stats=stats)
