"""Training batches from LeRobot v3.0 datasets or lake shards: streaming, elastic across ranks, resumable.

``build_loader(source, batch_size=..., num_workers=..., delta_timestamps=..., rank=r, world_size=W)`` returns a
``StreamingLoader``: an endless iterator of batches (epoch after epoch) with ``state_dict()`` /
``load_state_dict()``. ``batch_size`` is the *global* batch: each ``next()`` returns rank r's slice (``batch_size /
W`` samples) of the next global batch, and the sequence of global batches does not depend on W, the rank or the
worker count, so a run resumes on another world size or worker count where it stood (``roboscale.data.loading.plan``).

A sample is the current frame of each camera (uint8 CHW), the other requested features at the current frame,
``delta_timestamps`` windows (LeRobot's semantics: offsets clamped to the episode, ``<key>_is_pad``), the
``task`` string, ``episode_index``, ``frame_index`` (+ ``dataset_index`` for mixtures) and ``sample_seed`` (an int
in [0, 2**63) fixed by the seed, epoch and the sample's place in the global batch sequence: draw per-sample noise
from it and every world size draws the same). The default collate
stacks them into LeRobot's dict batch; a ``transform`` runs per sample and a ``collate`` per batch, both in the
workers.

The parts: sources (``source``: raw datasets and lakes behind one ``FrameSource`` contract), the sample ids over
them (``index``), the global batches of an epoch and each rank's slice (``plan``: why it reads runs of consecutive
frames), the worker side (``worker``: block decode, batch gather) and the hand-over through shared memory
(``transport``).

Workers start from a *forkserver* (a clean process that imported this module once), not by forking the trainer:
by the time a loader starts, the trainer runs threads (pyarrow's pool, decoder threads, OpenMP, a Ray or gRPC
client), and a fork copies whatever lock one of them holds, so a worker can deadlock on its first read (most
likely what hung a loader test in our CI, after an in-process Ray session). Python 3.14 made the same choice.
The cost: ``transform``, ``collate`` and the sources travel pickled, so they must be picklable (module-level
functions or objects); pass ``multiprocessing_context="fork"`` for closures. As under spawn, the workers import
the main module, so a script that builds loaders at module level needs an ``if __name__ == "__main__":`` guard.
A worker that returns nothing for ``worker_timeout_s`` is reported like a crashed one, never waited on forever
(a worker returns a whole block at a time: the limit is per block).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.depth import is_depth_map
from roboscale.data.lerobot.language import LANGUAGE_DTYPE
from roboscale.data.lerobot.validate import readable_or_raise
from roboscale.data.loading.index import SampleIndex
from roboscale.data.loading.plan import EpochOrder, EpochPlan, sample_seeds
from roboscale.data.loading.raw_source import DEPTH_REFUSED
from roboscale.data.loading.source import FrameSource, open_source
from roboscale.data.loading.transport import Arena, InArena, has_refs, take
from roboscale.data.loading.worker import (
    BatchDataset,
    Fetcher,
    LazyBatches,
    LoaderError,
    Task,
    WorkerFailure,
    stop_processes,
)
from roboscale.errors import ConfigError, DatasetError
from roboscale.utils.lifetime import exit_with

log = logging.getLogger(__name__)

# what a forkserver imports once, so that each worker it forks starts with torch and the readers loaded
# ("__main__": a script's module-level transforms unpickle in the workers as they do under spawn)
_WORKER_PRELOAD = ["__main__", "roboscale.data.loading.loader"]


# --------------------------------------------------------------------------------------------------- sources


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


def _delta_offsets(delta_timestamps: Mapping[str, Sequence[float]] | None, fps: float, tolerance_s: float,
                   features: Mapping[str, Any], where: str) -> dict[str, np.ndarray]:
    """``delta_timestamps`` as frame offsets per key, each a whole number of frames within ``tolerance_s``."""
    out = {}
    for key, deltas in (delta_timestamps or {}).items():
        if key not in features:
            raise ValueError(f"delta_timestamps key {key!r} is not a feature of {where}")
        seconds = np.asarray(list(deltas), dtype=np.float64)
        error = np.abs(seconds * fps - np.round(seconds * fps)) / fps
        if (error > tolerance_s).any():
            raise ValueError(f"delta_timestamps[{key!r}] = {seconds[error > tolerance_s].tolist()} are not multiples "
                             f"of 1/fps = {1 / fps} within tolerance_s={tolerance_s} ({where})")
        out[key] = np.round(seconds * fps).astype(np.int64)
    return out


# --------------------------------------------------------------------------------------------------- workers


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
                         "(see roboscale.data.loading.loader on why fork is not the default)") from None


def _identity(x: Any) -> Any:
    return x


def _exit_with_owner(owner_pid: int, worker_id: int) -> None:
    exit_with(owner_pid)


class _TaskSampler:
    """Main process: the endless sequence of tasks (blocks) from the loader's current (epoch, position)."""

    def __init__(self, loader: StreamingLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[Task]:
        loader = self.loader
        epoch, start = loader.epoch, loader.position
        while True:
            order = loader._order(epoch)
            if start < order.batches:
                for block in range(order.block_of(start), len(order.block_start) - 1):
                    yield loader._task(order, block, start)
            epoch, start = epoch + 1, 0


STATE_FORMAT = 2  # state_dict's layout: global batch positions (1: per-rank positions, before elastic loading)


class StreamingLoader:
    """Endless iterator of batches; ``roboscale.data.loading.plan`` has the order, sharding and resume semantics."""

    def __init__(self, sample_index: SampleIndex, dataset: BatchDataset, plan: EpochPlan, *, rank: int,
                 world_size: int, num_workers: int, prefetch_factor: int, pin_memory: bool,
                 multiprocessing_context: str, excluded: list[tuple[str, int, str]], arena_bytes: int = 0,
                 worker_timeout_s: float = 0.0):
        self.sample_index = sample_index
        self.arena_bytes = arena_bytes
        self._arena: Arena | None = None
        self._dataset = dataset
        self._plan = plan
        self.batch_size = plan.batch_size  # global
        self.rank, self.world_size = rank, world_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context
        self.worker_timeout_s = worker_timeout_s
        self._fetcher: Fetcher | None = None
        self.epoch = 0
        self.position = 0  # global batches of ``epoch`` returned (or skipped)
        self._iter: Iterator | None = None
        self._orders: dict[int, EpochOrder] = {}
        self._block: tuple[Any, dict[str, Any]] | None = None  # the block being yielded: (batches, info)
        self._next_in_block = 0
        self.data_wait_s = 0.0
        self.last_wait_s = 0.0
        self.batches = 0
        self.decode_s = 0.0
        self.decoded_samples = 0  # samples of the blocks received from the workers (``decode_s`` is theirs)
        self.skipped_episodes: dict[tuple[str, int], str] = {(name, ep): why for name, ep, why in excluded}
        self.refilled_samples = 0
        self.skipped_batches = 0
        self._empty_in_a_row = 0
        self.arena_batches = 0  # handed over through the shared-memory arena
        self._episodes_sum = 0

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (the same on every rank)."""
        return self._plan.batches_per_epoch

    @property
    def local_batch_size(self) -> int:
        """Samples per ``next()``: this rank's slice of a global batch."""
        return self.batch_size // self.world_size

    @property
    def sources(self) -> list[FrameSource]:
        return self.sample_index.sources

    def _order(self, epoch: int) -> EpochOrder:
        if epoch not in self._orders:
            while len(self._orders) >= 2:  # the epoch being yielded and the one the workers prefetch into
                del self._orders[min(self._orders)]
            self._orders[epoch] = self._plan.epoch(epoch)
        return self._orders[epoch]

    def _task(self, order: EpochOrder, block: int, start: int) -> Task:
        """This rank's share of ``block``, for its global batches from ``start`` on."""
        first, end = int(order.block_start[block]), int(order.block_start[block + 1])
        batches = np.arange(max(first, start), end)
        share = order.share(block, self.rank, self.world_size)
        per_rank = self.local_batch_size
        rows = order.slot[batches][:, None] + (end - first) * np.arange(per_rank)[None]
        if len(batches) < end - first:  # resuming inside the block: decode only what is left
            used = np.unique(rows)
            share, rows = share[used], np.searchsorted(used, rows)
        positions = self.rank * per_rank + np.arange(per_rank)
        seeds = sample_seeds(self._plan.seed, order.epoch, self.batch_size, batches[:, None], positions[None])
        return Task(order.epoch, block, share, batches, rows, seeds)

    # ------------------------------------------------------------------ iteration

    def _start(self) -> Iterator:
        from torch.utils.data import DataLoader

        workers = self.num_workers
        blocks_ahead = self._blocks_ahead()
        if workers and self.arena_bytes and self._arena is None:
            self._arena = self._make_arena(workers, blocks_ahead + 1)
        if self._arena is not None:
            self._arena.busy.zero_()  # the previous workers are gone; so are their unread slots
        self._dataset.arena = self._arena
        self._block, self._next_in_block = None, 0
        loader = DataLoader(
            self._dataset,
            sampler=_TaskSampler(self),
            batch_size=None,
            collate_fn=_identity,
            num_workers=workers,
            prefetch_factor=blocks_ahead if workers else None,
            pin_memory=self.pin_memory,
            multiprocessing_context=_worker_context(self.multiprocessing_context) if workers else None,
            # a worker ends with the process that reads its batches, however that one ends (utils/lifetime.py)
            worker_init_fn=partial(_exit_with_owner, os.getpid()) if workers else None,
            # our own generator: creating the iterator must not consume the global RNG (bit-exact resume)
            generator=torch.Generator().manual_seed(self._plan.seed),
        )
        iterator = iter(loader)
        if workers and self.worker_timeout_s > 0:
            self._fetcher = Fetcher(iterator)
        return iterator

    def _blocks_ahead(self) -> int:
        """Blocks each worker prepares ahead: ``prefetch_factor`` batches, rounded up to whole blocks."""
        return max(1, -(-self.prefetch_factor // self._plan.block_batches))

    def _make_arena(self, workers: int, slots: int) -> Arena | None:
        total = workers * slots * self.arena_bytes
        try:
            shm = os.statvfs("/dev/shm")
            free = shm.f_bavail * shm.f_frsize
        except OSError:
            free = None
        # slots are allocated lazily (written pages only): refuse up front what /dev/shm could not hold, rather
        # than a SIGBUS in a worker later
        why = f"{total / 2**20:.0f} MiB wanted, {free / 2**20:.0f} MiB free in /dev/shm" \
            if free is not None and total > free // 2 else None
        if why is None:
            try:
                return Arena(workers, slots, self.arena_bytes)
            except RuntimeError as e:  # e.g. no /dev/shm: torch's own path still works
                why = str(e)
        log.warning("loader: no shared-memory arena (%s); batches take torch's slower path", why)
        self.arena_bytes = 0
        return None

    def __iter__(self) -> StreamingLoader:
        self.close()
        self._iter = self._start()
        return self

    def _fetch_block(self) -> None:
        """The next block's batches from the workers (or in process)."""
        fetcher = self._fetcher
        try:
            if fetcher is None:
                batches, info = next(self._iter)
            else:
                workers = list(getattr(fetcher.iterator, "_workers", []))
                batches, info = fetcher.next(self.worker_timeout_s, lambda: stop_processes(workers))
        except (LoaderError, DatasetError):
            raise
        except Exception as e:  # a worker crash or a time-out: name what it was working on
            where = ""
            try:
                ids = self._order(self.epoch).batch(self.position, self.rank, self.world_size)
                where = f" on batch {self.position} of epoch {self.epoch} (first sample: " \
                        f"{self.sample_index.describe(int(ids[0]))})"
            except IndexError:
                pass
            why = f"{type(e).__name__}: {e}"
            if isinstance(e, TimeoutError):
                why = f"no batch for {self.worker_timeout_s:g} s (worker_timeout_s): the workers timed out and " \
                      f"were stopped" + (f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else "")
            elif "exited unexpectedly" in why and self.multiprocessing_context != "fork":
                why += " (its error, if any, is on stderr above; workers import your main module, so a script " \
                       "that builds loaders at module level needs `if __name__ == \"__main__\":`)"
            self.close()
            raise LoaderError(f"data loader failed{where}: {why}") from e
        self.decode_s += info["decode_s"]
        self.decoded_samples += info["decoded"]
        for name, ep, why in info["skipped"]:
            if (name, ep) not in self.skipped_episodes:
                log.warning("skipping unreadable episode %d of %s: %s", ep, name, why)
            self.skipped_episodes[(name, ep)] = why
        self._block, self._next_in_block = (batches, info), 0

    def _take(self) -> tuple[Any, int, int]:
        """The next batch of the current block (copied out of the arena), its refilled samples and episodes."""
        batches, info = self._block
        i = self._next_in_block
        self._next_in_block += 1
        if isinstance(batches, LazyBatches):  # in this process: built now
            if self._next_in_block >= len(batches):
                self._block = None
            return batches.take(i)
        arena = isinstance(batches, InArena)
        items = batches.tree if arena else batches
        last = self._next_in_block >= len(items)
        batch = items[i]
        if arena:
            if batch is not None and not isinstance(batch, WorkerFailure) and has_refs(batch):
                if batches.buffer is None:
                    batch = self._arena.take(batches, self.pin_memory, part=i, release=False)
                    self.arena_batches += 1
                else:
                    batch = take(batches, self.pin_memory, part=i)
            if last and batches.buffer is None:
                self._arena.release(batches)
        if last:
            self._block = None
        if isinstance(batch, WorkerFailure):
            return batch, 0, 0
        return batch, info["short"][i], info["episodes"][i]

    def __next__(self) -> Any:
        if self._iter is None:
            self._iter = self._start()
        while True:
            t0 = time.perf_counter()
            if self._block is None:
                self._fetch_block()
            batch, short, episodes = self._take()
            if isinstance(batch, WorkerFailure):
                self.close()
                error = batch.error()
                if isinstance(error, DatasetError) and not self._dataset.skip_bad:
                    raise DatasetError(error.path, f"{fmt.error_message(error)} (to train on the other episodes, "
                                       "skip unreadable ones: --skip-bad-episodes, skip_bad_episodes=True)",
                                       field=error.field, episode=error.episode)
                raise error
            self.last_wait_s = time.perf_counter() - t0
            self.data_wait_s += self.last_wait_s
            self.refilled_samples += short
            self.position += 1
            if self.position >= self.batches_per_epoch:
                self.epoch, self.position = self.epoch + 1, 0
            if batch is None:
                self.skipped_batches += 1
                self._empty_in_a_row += 1
                if self._empty_in_a_row >= self.batches_per_epoch:  # else an all-unreadable dataset spins forever
                    self.close()
                    raise DatasetError(", ".join(self.sample_index.names), f"every episode read in the last "
                                       f"{self._empty_in_a_row} batches was unreadable (skipped: "
                                       f"{len(self.skipped_episodes)} episodes; first: "
                                       f"{next(iter(self.skipped_episodes.values()), '?')})")
                continue
            self._empty_in_a_row = 0
            self.batches += 1
            self._episodes_sum += episodes
            return batch

    def take(self, n: int) -> list[Any]:
        return [next(self) for _ in range(n)]

    def close(self) -> None:
        """Stop the workers (the next ``next()`` starts them again where the loader stands)."""
        it, self._iter = self._iter, None
        fetcher, self._fetcher = self._fetcher, None
        self._block = None  # batches received but not returned are served again by the next workers
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
        """Where the consumer stands in the global batch sequence: ``position`` global batches of ``epoch`` already
        *returned* (not those prefetched by workers). The same on every rank, and loadable on another world size or
        worker count."""
        plan = self._plan
        return {"format": STATE_FORMAT, "epoch": self.epoch, "position": self.position, "seed": plan.seed,
                "batch_size": self.batch_size, "block_batches": plan.block_batches,
                "chunk_frames": plan.chunk_frames, "shuffle": plan.shuffle,
                # informational: where it was saved (any world size / worker count may load it)
                "world_size": self.world_size, "num_workers": self.num_workers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state.get("format", 1)) != STATE_FORMAT:
            raise ValueError(f"loader state of format {state.get('format', 1)} (keys {sorted(state)}), from before "
                             f"global batch positions (format {STATE_FORMAT}): its per-rank position cannot be "
                             "continued; start the data order afresh (drop the checkpoint's loader state)")
        plan = self._plan
        settings = [("seed", plan.seed), ("batch_size", self.batch_size)]
        if int(state["position"]):  # mid-epoch, the epoch's order must be the one it was saved with
            settings += [("block_batches", plan.block_batches), ("chunk_frames", plan.chunk_frames),
                         ("shuffle", plan.shuffle)]
        for name, mine in settings:
            if name in state and type(mine)(state[name]) != mine:
                what = f"{name} (block_samples // batch_size)" if name == "block_batches" else name
                raise ValueError(f"loader state was saved with {what}={state[name]}, this loader has {mine}: "
                                 "resuming would not continue the same sample sequence")
        self.close()
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self.position >= self.batches_per_epoch:
            raise ValueError(f"loader state is at batch {self.position} of an epoch of {self.batches_per_epoch} "
                             "batches: the data changed since it was saved")

    def stats(self) -> dict[str, float]:
        """Counters since the loader was built. ``distinct_episodes``: mean number of distinct episodes per returned
        batch (this rank's slice; on one rank, the global batch)."""
        return {"data_wait_s": self.data_wait_s, "batches": self.batches, "decode_s": self.decode_s,
                "decoded_samples": self.decoded_samples,
                "skipped_episodes": len(self.skipped_episodes), "refilled_samples": self.refilled_samples,
                "arena_batches": self.arena_batches,
                "distinct_episodes": self._episodes_sum / self.batches if self.batches else 0.0}


def check_sources(sources: Sequence[FrameSource], names: Sequence[str], *, skip_bad_episodes: bool
                  ) -> list[tuple[str, int, str]]:
    """Each source's cheap up-front checks (``FrameSource.unreadable_episodes``): raise for problems no skip avoids,
    for unreadable episodes unless ``skip_bad_episodes``, and when skipping would leave a source empty; returns
    the (source name, episode, why) to exclude."""
    excluded = []
    for source, name in zip(sources, names, strict=True):
        bad = source.unreadable_episodes()
        readable_or_raise(name, bad, len(source.episode_ids), skip_bad_episodes=skip_bad_episodes)
        if bad:
            log.warning("%s: skipping %d unreadable episodes (%s)", name, len(bad), sorted(bad)[:10])
        excluded += [(name, int(ep), why) for ep, why in bad.items()]
    return excluded


@dataclass(frozen=True)
class LoaderConfig:
    """How a ``StreamingLoader`` reads (``build_loader``): the global batch, its order and the workers."""

    batch_size: int
    """The *global* batch, divisible by the world size: each rank's ``next()`` is its ``batch_size / world_size``
    samples of it."""
    seed: int = 0
    shuffle: bool = True
    block_samples: int = 256
    """Samples decoded together and shuffled among (global: each rank decodes ``block_samples / world_size``);
    ``>= batch_size * chunk_frames`` gives batches of distinct chunks (``roboscale.data.loading.plan``)."""
    chunk_frames: int = 16
    """Consecutive frames of an episode decoded in one pass."""
    num_workers: int = 2
    prefetch_factor: int = 2
    """Batches each worker prepares ahead, rounded up to whole blocks (a worker prepares a block at a time)."""
    pin_memory: bool | None = None
    """None: pin where CUDA is available."""
    shared_arena: bool = True
    """Workers hand batches over through recycled shared memory (``roboscale.data.loading.transport``)."""
    multiprocessing_context: str = "forkserver"
    """How workers start: forkserver, spawn or fork (see the module docstring)."""
    worker_timeout_s: float = 600.0
    """A worker silent this long fails the loader with the batch it was on (0: wait forever)."""
    check: bool = True
    """Run each source's cheap up-front checks (what LeRobot's reader and ``data validate --quick`` refuse)."""
    skip_bad_episodes: bool = False
    """Exclude unreadable episodes (counted) instead of refusing them; at read time too."""
    tolerance_s: float = fmt.DEFAULT_TOLERANCE_S
    """How far a ``delta_timestamps`` offset may be from a frame."""


def build_loader(
    source: Any,
    config: LoaderConfig | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    keys: Sequence[str] | None = None,
    delta_timestamps: Mapping[str, Sequence[float]] | None = None,
    transform: Callable[[dict[str, Any]], Any] | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
    source_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> StreamingLoader:
    """A ``StreamingLoader`` over ``source``: a dataset directory (raw LeRobot v3.0 or lake), a ``FrameSource``,
    or a list of those, each optionally ``(item, weight)`` (mixture weights: a source's share of every epoch;
    without weights, shares follow the sources' frame counts).

    ``config``: how it reads (``LoaderConfig``), or its fields as keyword ``options`` (``build_loader(root,
    batch_size=8)``), not both. Each ``next()`` returns rank ``rank``'s ``batch_size / world_size`` samples
    (positions ``[rank, rank + 1) * batch_size / world_size``) of the next global batch; the global batch sequence
    depends on the seed, the data, the batch size, ``block_samples``, ``chunk_frames`` and ``shuffle`` only
    (``roboscale.data.loading.plan``): the same values on every world size resume across them.

    ``keys``: features to load (default: every feature; cameras cost decoding, so pass what the policy reads).
    ``delta_timestamps``: ``{key: [seconds, ...]}`` windows, as LeRobot. ``transform`` runs per sample and
    ``collate`` per batch in the workers (default: stack into a dict batch). A hand-over slot of the shared arena
    holds one block's batches (``num_workers x (blocks ahead + 1)`` slots, sized from the features with 25%
    headroom for what transforms add; pages are allocated as written). Unreadable episodes found by the checks
    are refused, or excluded with ``skip_bad_episodes``; episodes that fail later, at read time, are skipped and
    counted the same way. ``source_options``: passed to each source's opener.
    """
    if config is None:
        config = LoaderConfig(**options)
    elif options:
        raise TypeError(f"build_loader: give a LoaderConfig or its options, not both ({sorted(options)})")
    c = config
    batch_size, block_samples, shuffle = c.batch_size, c.block_samples, c.shuffle
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if batch_size % world_size:
        raise ConfigError(f"batch_size {batch_size} (the global batch) is not divisible by the world size "
                          f"{world_size}: every rank takes batch_size / world_size samples of each batch")
    options = dict(source_options or {})
    opened = [(_open(item, options), weight) for item, weight in _parse_source(source)]
    sources = [s for (s, _), _ in opened]
    names = [n for (_, n), _ in opened]
    first = sources[0]
    fps = float(first.fps)
    for s, n in zip(sources, names, strict=True):
        if float(s.fps) != fps:
            raise ConfigError(f"mixture sources must share one fps: {names[0]} has {fps}, {n} has {s.fps}")
    if keys is None:  # what a policy can batch: no strings, language annotations or depth maps unless asked for
        keys = [k for k, f in first.features.items()
                if f.get("dtype") not in ("string", LANGUAGE_DTYPE) and not is_depth_map(f)]
    keys = list(dict.fromkeys(keys))
    depth = [k for k in keys if k in first.features and is_depth_map(first.features[k])]
    if depth:
        raise ConfigError(f"{names[0]}: feature {depth[0]!r} {DEPTH_REFUSED}")
    for s, n in zip(sources, names, strict=True):
        missing = [k for k in keys if k not in s.features]
        if missing:
            raise DatasetError(n, f"no such feature (it has {sorted(s.features)})", field=missing[0])
    cameras = {k for k in keys if first.features[k].get("dtype") in ("video", "image")}
    deltas = _delta_offsets(delta_timestamps, fps, c.tolerance_s, first.features, names[0])
    unread = set(deltas) - set(keys)
    if unread:
        keys += sorted(unread)
    sample_index = SampleIndex.build(sources, names)

    lengths = sample_index.lengths.copy()
    excluded = check_sources(sources, names, skip_bad_episodes=c.skip_bad_episodes) if c.check else []
    for name, ep, _ in excluded:
        i = names.index(name)
        mine = np.flatnonzero(sample_index.source_of == i)
        lengths[mine[int(np.flatnonzero(np.asarray(sources[i].episode_ids) == ep)[0])]] = 0
    frames = np.array([lengths[sample_index.source_of == i].sum() for i in range(len(sources))], dtype=np.int64)
    weights = [weight for _, weight in opened]
    if all(weight is None for weight in weights):
        quotas = frames
    else:
        if any(weight is None for weight in weights):
            raise ConfigError("give every mixture source a weight, or none")
        weight_sum = sum(weights)
        if weight_sum <= 0:
            raise ConfigError("mixture weights sum to 0")
        total = int(frames.sum())
        quotas = np.array([int(round(total * weight / weight_sum)) if frames[i] else 0
                           for i, weight in enumerate(weights)],
                          dtype=np.int64)
    # unshuffled: one batch per block, so batches come in dataset order
    block_batches = max(1, block_samples // batch_size) if shuffle else 1
    plan = EpochPlan(lengths, sample_index.starts[:-1], sample_index.source_of, quotas, batch_size, block_batches,
                     max(1, c.chunk_frames), shuffle, c.seed)
    if plan.batches_per_epoch == 0:
        raise ConfigError(f"{', '.join(names)}: {int(quotas.sum())} samples per epoch are too few for batch_size "
                          f"{batch_size}")
    if c.num_workers:
        for what, obj in (("transform", transform), ("collate", collate)):
            _check_picklable(what, obj, c.multiprocessing_context)
        for s, n in zip(sources, names, strict=True):
            _check_picklable(f"source {n}", s, c.multiprocessing_context)
    dataset = BatchDataset(sample_index, keys, deltas, cameras, transform, collate, c.skip_bad_episodes)
    pin_memory = torch.cuda.is_available() if c.pin_memory is None else c.pin_memory
    per_sample = 0
    for key in keys:
        ft = first.features[key]
        t = len(deltas[key]) if key in deltas else 1
        size = int(np.prod(fmt.image_hwc(ft))) if key in cameras else 8 * int(np.prod(fmt.feature_shape(ft)))
        per_sample += t * size
    # a hand-over slot holds one block's batches (this rank's slices)
    dataset.block_bytes = int(1.25 * block_batches * (batch_size // world_size) * per_sample) + (1 << 20)
    dataset.keep_decoded = plan.block_batches >= plan.batches_per_epoch  # the whole dataset fits in one block
    arena_bytes = dataset.block_bytes if c.shared_arena and c.num_workers else 0
    return StreamingLoader(sample_index, dataset, plan, rank=rank, world_size=world_size, num_workers=c.num_workers,
                           prefetch_factor=c.prefetch_factor, pin_memory=pin_memory,
                           multiprocessing_context=c.multiprocessing_context, excluded=excluded,
                           arena_bytes=arena_bytes, worker_timeout_s=c.worker_timeout_s)
