"""Training batches from LeRobot v3.0 datasets or lake shards: streaming, rank-sharded, resumable.

``build_loader(source, batch_size=..., num_workers=..., delta_timestamps=...)`` returns a ``StreamingLoader``:
an endless iterator of batches (epoch after epoch) with ``state_dict()`` / ``load_state_dict()``.

A sample is the current frame of each camera (uint8 CHW), the other requested features at the current frame,
``delta_timestamps`` windows (LeRobot's semantics: offsets clamped to the episode, ``<key>_is_pad``), the
``task`` string, ``episode_index`` and ``frame_index`` (+ ``dataset_index`` for mixtures). The default collate
stacks them into LeRobot's dict batch; a ``transform`` runs per sample and a ``collate`` per batch, both in the
workers.

The parts: sources (``source``: raw datasets and lakes behind one ``FrameSource`` contract), the sample ids over
them (``index``), the order of an epoch over ranks and workers (``plan``: why it reads runs of consecutive frames),
the worker side (``worker``: block decode, batch gather) and the hand-over through shared memory (``transport``).

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

import logging
import multiprocessing
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.validate import readable_or_raise
from roboscale.data.loading.index import SampleIndex
from roboscale.data.loading.plan import EpochPlan, batch_order
from roboscale.data.loading.source import FrameSource, open_source
from roboscale.data.loading.transport import Arena, InArena
from roboscale.data.loading.worker import BatchDataset, Fetcher, LoaderError, Task, WorkerFailure, stop_processes
from roboscale.errors import ConfigError, DatasetError

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


class _TaskSampler:
    """Main process: the endless sequence of tasks from the loader's current (epoch, position)."""

    def __init__(self, loader: StreamingLoader):
        self.loader = loader

    def __iter__(self) -> Iterator[Task]:
        loader = self.loader
        epoch, start, skip = loader.epoch, loader.position, loader._resume_skip
        while True:
            blocks = loader._blocks(epoch)
            order = loader._epoch_order(epoch, blocks)
            if skip:
                order = [t for t in order if t not in skip]
                skip = set()
            for blk, b in order[start:]:
                yield Task(epoch, blk, b, blocks[blk], loader.batch_size)
            epoch, start = epoch + 1, 0


class StreamingLoader:
    """Endless iterator of batches; ``roboscale.data.loading.plan`` has the order, sharding and resume semantics."""

    def __init__(self, sample_index: SampleIndex, dataset: BatchDataset, plan: EpochPlan, *, num_workers: int,
                 prefetch_factor: int, pin_memory: bool, multiprocessing_context: str,
                 excluded: list[tuple[str, int, str]], arena_bytes: int = 0, worker_timeout_s: float = 0.0):
        self.sample_index = sample_index
        self.arena_bytes = arena_bytes
        self._arena: Arena | None = None
        self._dataset = dataset
        self._plan = plan
        self.batch_size = plan.batch_size
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.multiprocessing_context = multiprocessing_context
        self.worker_timeout_s = worker_timeout_s
        self._fetcher: Fetcher | None = None
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
        return self.sample_index.sources

    def _blocks(self, epoch: int) -> list[np.ndarray]:
        if self._cached_blocks is None or self._cached_blocks[0] != epoch:
            self._cached_blocks = (epoch, self._plan.epoch(epoch))
        return self._cached_blocks[1]

    def _epoch_order(self, epoch: int, blocks: list[np.ndarray], num_workers: int | None = None):
        sizes = [len(b) // self.batch_size + (len(b) % self.batch_size > 0) for b in blocks]
        return batch_order(sizes, self.num_workers if num_workers is None else num_workers)

    # ------------------------------------------------------------------ iteration

    def _start(self) -> Iterator:
        from torch.utils.data import DataLoader

        workers = self.num_workers
        if workers and self.arena_bytes and self._arena is None:
            try:
                self._arena = Arena(workers, self.prefetch_factor + 2, self.arena_bytes)
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
            self._fetcher = Fetcher(iterator)
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
                            f"{self.sample_index.describe(int(ids[0]))})"
                why = f"{type(e).__name__}: {e}"
                if isinstance(e, TimeoutError):
                    why = f"no batch for {self.worker_timeout_s:g} s (worker_timeout_s): the workers timed out and " \
                          f"were stopped" + (f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else "")
                elif "exited unexpectedly" in why and self.multiprocessing_context != "fork":
                    why += " (its error, if any, is on stderr above; workers import your main module, so a script " \
                           "that builds loaders at module level needs `if __name__ == \"__main__\":`)"
                self.close()
                raise LoaderError(f"data loader failed{where}: {why}") from e
            if isinstance(batch, WorkerFailure):
                self.close()
                error = batch.error()
                if isinstance(error, DatasetError) and not self._dataset.skip_bad:
                    raise DatasetError(error.path, f"{fmt.error_message(error)} (to train on the other episodes, "
                                       "skip unreadable ones: --skip-bad-episodes, skip_bad_episodes=True)",
                                       field=error.field, episode=error.episode)
                raise error
            if isinstance(batch, InArena):
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
                    raise DatasetError(", ".join(self.sample_index.names), f"every episode read in the last "
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
    tolerance_s: float = fmt.DEFAULT_TOLERANCE_S,
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
    availability. ``block_samples`` / ``chunk_frames``: see ``roboscale.data.loading.plan``. ``shared_arena``:
    workers hand batches over through recycled shared memory (``roboscale.data.loading.transport``; costs
    ``num_workers x (prefetch_factor + 2)`` batch-sized buffers, sized from the features with 25% headroom for what
    transforms add).
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
    opened = [(_open(item, options), weight) for item, weight in _parse_source(source)]
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
    sample_index = SampleIndex.build(sources, names)

    lengths = sample_index.lengths.copy()
    excluded = check_sources(sources, names, skip_bad_episodes=skip_bad_episodes) if check else []
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
    # unshuffled: one batch per block, so the batches dealt round-robin to workers come back in dataset order
    block_batches = max(1, block_samples // batch_size) if shuffle else 1
    plan = EpochPlan(lengths, sample_index.starts[:-1], sample_index.source_of, quotas, batch_size, block_batches,
                 max(1, chunk_frames), shuffle, seed, rank, world_size)
    if plan.batches_per_epoch == 0:
        raise ConfigError(f"{', '.join(names)}: {int(quotas.sum())} samples per epoch are too few for batch_size "
                          f"{batch_size} x world_size {world_size}")
    if num_workers:
        for what, obj in (("transform", transform), ("collate", collate)):
            _check_picklable(what, obj, multiprocessing_context)
        for s, n in zip(sources, names, strict=True):
            _check_picklable(f"source {n}", s, multiprocessing_context)
    dataset = BatchDataset(sample_index, keys, deltas, cameras, transform, collate, skip_bad_episodes)
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
    return StreamingLoader(sample_index, dataset, plan, num_workers=num_workers, prefetch_factor=prefetch_factor,
                           pin_memory=pin_memory, multiprocessing_context=multiprocessing_context, excluded=excluded,
                           arena_bytes=arena_bytes, worker_timeout_s=worker_timeout_s)
