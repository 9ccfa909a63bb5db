"""``RawSource``: a ``FrameSource`` over a raw LeRobot v3.0 dataset directory (parquet + mp4 + meta/).

Built in the main process from metadata only (info.json, tasks, the episodes table: O(episodes) arrays), then
pickled or forked into loader workers, which open files lazily:

- columns: an episode's rows come from its own row group(s) (LeRobot writes one row group per episode; chosen by
  the ``episode_index`` statistics) straight into numpy; the last ``column_cache_episodes`` episodes are kept, so
  the many windows a worker cuts from one episode cost one parquet read. No per-row Python objects.
- videos: a ``DecoderPool`` per worker (bounded LRU of open containers, decoders kept positioned between calls so
  reading an episode front to back never seeks backwards); cameras decode in parallel threads (PyAV releases the
  GIL while decoding). Frames stay uint8 HWC.

Bounded memory: open parquet files, decoders and cached episodes are each capped, whatever the number of files.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot import language
from roboscale.data.lerobot.depth import is_depth_map
from roboscale.data.lerobot.video import decode_png
from roboscale.data.loading.decode import DecoderPool
from roboscale.errors import DatasetError

DEPTH_REFUSED = ("is a depth map (12-bit gray12le, LeRobot 0.6's is_depth_map); the loader hands cameras to policies "
                 "as uint8 RGB and cannot take it: leave it out of the keys (policy.image_keys)")


class RawSource:
    """Episode-indexed reads from a local LeRobot v3.0 dataset (see ``roboscale.data.loading.source.FrameSource``)."""

    def __init__(
        self,
        root: str | Path,
        episodes: Sequence[int] | None = None,
        *,
        tolerance_s: float = fmt.DEFAULT_TOLERANCE_S,
        max_open_videos: int = 8,
        max_open_parquet: int = 4,
        column_cache_episodes: int = 8,
        decode_threads: int = 0,
    ):
        self.root = Path(root)
        self.tolerance_s = tolerance_s
        info = fmt.read_info(self.root)
        self.info = info
        self.fps = float(info.fps)
        self.features: dict[str, dict[str, Any]] = info.features
        self.camera_keys = [k for k, f in self.features.items() if fmt.is_camera(f)]
        self.video_keys = [k for k, f in self.features.items() if f["dtype"] == "video"]
        self.depth_keys = [k for k in self.video_keys if is_depth_map(self.features[k])]
        self.tasks = fmt.read_tasks(self.root)
        self.stats = fmt.read_stats(self.root)
        self._parquet_keys = fmt.parquet_features(self.features)
        table = fmt.read_episodes_table(self.root)
        all_ids = table["episode_index"].to_numpy().astype(np.int64)
        if episodes is None:
            rows = np.arange(len(all_ids))
        else:
            wanted = np.array(sorted({int(e) for e in episodes}), dtype=np.int64)
            rows = np.searchsorted(all_ids, wanted)
            bad = (rows >= len(all_ids)) | (all_ids[np.minimum(rows, len(all_ids) - 1)] != wanted)
            if bad.any():
                raise DatasetError(self.root / fmt.EPISODES_DIR, "no such episode", episode=int(wanted[bad][0]))
        self._ids = all_ids[rows]
        self._lengths = table["length"].to_numpy().astype(np.int64)[rows]

        def column(name: str) -> np.ndarray:
            if name not in table.column_names:
                raise DatasetError(self.root / fmt.EPISODES_DIR, "column missing from episodes metadata", field=name)
            return table[name].to_numpy()[rows]

        # File locations as small integer tables: O(episodes) numbers, no per-episode Python objects.
        chunk, file = column("data/chunk_index"), column("data/file_index")
        self._data_paths, self._data_file = _path_table(
            [fmt.relative_path(self.root, info.data_path, "data_path", chunk_index=int(c), file_index=int(f))
             for c, f in zip(chunk, file, strict=True)])
        self._video_paths: dict[str, list[str]] = {}
        self._video_file: dict[str, np.ndarray] = {}
        self._video_from: dict[str, np.ndarray] = {}
        for key in self.video_keys:
            assert info.video_path is not None
            chunk, file = column(f"videos/{key}/chunk_index"), column(f"videos/{key}/file_index")
            names = [fmt.relative_path(self.root, info.video_path, "video_path", video_key=key, chunk_index=int(c),
                                       file_index=int(f)) for c, f in zip(chunk, file, strict=True)]
            self._video_paths[key], self._video_file[key] = _path_table(names)
            self._video_from[key] = column(f"videos/{key}/from_timestamp").astype(np.float64)
        self.max_open_parquet = max_open_parquet
        self.column_cache_episodes = column_cache_episodes
        self.decode_threads = decode_threads
        self._decoders = DecoderPool(max_open=max_open_videos)
        self._reset_handles()

    # ------------------------------------------------------------------ FrameSource

    @property
    def episode_ids(self) -> np.ndarray:
        return self._ids

    @property
    def episode_lengths(self) -> np.ndarray:
        return self._lengths

    def __repr__(self) -> str:
        return f"RawSource({str(self.root)!r}, episodes={len(self._ids)}, frames={int(self._lengths.sum())})"

    def unreadable_episodes(self) -> dict[int, str]:
        from roboscale.data.lerobot.validate import bad_episodes

        selected = set(self._ids.tolist())
        return {ep: why for ep, why in bad_episodes(self.root, tolerance_s=self.tolerance_s).items() if ep in selected}

    def data_path(self, episode: int) -> Path:
        return self.root / self._data_paths[self._data_file[episode]]

    def video_location(self, episode: int, key: str) -> tuple[Path, float]:
        """(mp4 path, start time of the episode in it) of camera ``key``."""
        return self.root / self._video_paths[key][self._video_file[key][episode]], float(self._video_from[key][episode])

    def read(self, episode: int, frames: np.ndarray, keys: Sequence[str]) -> dict[str, np.ndarray]:
        self._check_fork()
        frames = np.asarray(frames, dtype=np.int64)
        n = int(self._lengths[episode])
        if frames.size and (frames[0] < 0 or frames[-1] >= n or np.any(np.diff(frames) < 0)):
            raise ValueError(f"{self.root}: episode {int(self._ids[episode])}: frames must be sorted within [0, {n})")
        unknown = [k for k in keys if k not in self.features]
        if unknown:
            raise KeyError(f"{unknown[0]!r} is not a feature of {self.root}; features: {list(self.features)}")
        depth = [k for k in keys if k in self.depth_keys]
        if depth:
            raise DatasetError(self.root / fmt.INFO_PATH, DEPTH_REFUSED, field=depth[0])
        columns = self._episode_columns(episode)
        out: dict[str, np.ndarray] = {}
        videos = [k for k in keys if k in self._video_file]
        for key in keys:
            if key in self._video_file:
                continue
            if self.features[key]["dtype"] == "image":
                out[key] = self._decode_images(episode, key, columns[key], frames)
            elif language.is_language(self.features[key]):
                out[key] = self._language_rows(episode, key, columns)[frames]
            else:
                out[key] = columns[key][frames]
        if videos:
            times = columns["timestamp"][frames].astype(np.float64)
            jobs = [(key, *self.video_location(episode, key)) for key in videos]
            if len(jobs) > 1 and self.decode_threads != 1:
                results = list(self._pool(len(jobs)).map(lambda job: self._decode(episode, job, times), jobs))
            else:
                results = [self._decode(episode, job, times) for job in jobs]
            out.update(zip(videos, results, strict=True))
        return out

    def close(self) -> None:
        self._decoders.close()
        if self._threads is not None:
            self._threads.shutdown(wait=True)
        self._reset_handles()

    # ------------------------------------------------------------------ internals

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_parquet", "_columns", "_threads", "_lock"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_handles()

    def _reset_handles(self) -> None:
        self._parquet: OrderedDict[int, tuple[pq.ParquetFile, np.ndarray, np.ndarray]] = OrderedDict()
        self._columns: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._threads: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked worker: own handles, the parent's thread pool does not exist here
            self._reset_handles()

    def _pool(self, n: int) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.decode_threads or n, thread_name_prefix="decode")
        return self._threads

    def _decode(self, episode: int, job: tuple[str, Path, float], times: np.ndarray) -> np.ndarray:
        key, path, start = job
        return self._decoders.read(path, start + times, self.tolerance_s, field=key, episode=int(self._ids[episode]))

    def _decode_images(self, episode: int, key: str, column: pa.StructArray, frames: np.ndarray) -> np.ndarray:
        path = self.data_path(episode)
        channels = fmt.image_hwc(self.features[key])[2]
        images = []
        for f in frames:
            data = column.field("bytes")[int(f)].as_py()
            if data is None:  # HF Image columns may reference a file instead of embedding it
                ref = column.field("path")[int(f)].as_py()
                if ref is None:
                    raise DatasetError(path, f"frame {int(f)} has neither image bytes nor path", field=key,
                                       episode=int(self._ids[episode]))
                data = fmt.referenced_file(self.root, ref, path, field=key).read_bytes()
            images.append(decode_png(data, channels, source=path))
        h, w, c = fmt.image_hwc(self.features[key])
        return np.stack(images) if images else np.zeros((0, h, w, c), np.uint8)

    def _parquet_file(self, index: int) -> tuple[pq.ParquetFile, np.ndarray, np.ndarray]:
        """Open data file ``index`` with its row groups' episode_index (min, max), read once per open."""
        entry = self._parquet.get(index)
        if entry is not None:
            self._parquet.move_to_end(index)
            return entry
        path = self.root / self._data_paths[index]
        handle = fmt.open_parquet(path)
        missing = [k for k in self._parquet_keys if k not in handle.schema_arrow.names]
        if missing:
            raise DatasetError(path, "column missing from the data file (declared in meta/info.json)",
                               field=missing[0])
        entry = (handle, *_episode_ranges(handle))
        self._parquet[index] = entry
        while len(self._parquet) > self.max_open_parquet:
            self._parquet.popitem(last=False)
        return entry

    def _language_rows(self, episode: int, key: str, columns: dict[str, Any]) -> np.ndarray:
        """An episode's language column as row lists (parsed on first use, then kept with its columns)."""
        value = columns[key]
        if isinstance(value, np.ndarray):
            return value
        try:
            rows = language.column_to_rows(value)
        except ValueError as e:  # tool_calls that are not JSON
            raise DatasetError(self.data_path(episode), f"annotations that cannot be read ({e})", field=key,
                               episode=int(self._ids[episode])) from None
        columns[key] = rows
        return rows

    def _episode_columns(self, episode: int) -> dict[str, Any]:
        """Every parquet column of one episode, numpy [n, *shape] (images: the Arrow struct of PNG bytes; language
        annotations: Arrow, parsed by ``_language_rows`` when read)."""
        with self._lock:  # camera threads never call this; the lock guards callers that use threads themselves
            cached = self._columns.get(episode)
            if cached is not None:
                self._columns.move_to_end(episode)
                return cached
            ep_id = int(self._ids[episode])
            path = self.data_path(episode)
            parquet, lo, hi = self._parquet_file(int(self._data_file[episode]))
            groups = np.flatnonzero((lo <= ep_id) & (ep_id <= hi)).tolist()
            try:
                table = parquet.read_row_groups(groups, columns=self._parquet_keys)
            except (pa.ArrowException, OSError) as e:
                raise DatasetError(path, f"cannot read parquet: {e}", episode=ep_id) from None
            table = table.filter(pc.equal(table["episode_index"], ep_id))
            if table.num_rows != self._lengths[episode]:
                raise DatasetError(path, f"has {table.num_rows} rows for this episode, meta/episodes says length "
                                         f"{int(self._lengths[episode])}", episode=ep_id)
            # language annotations stay Arrow until a caller asks for them (_language_rows): parsing every row's
            # tool_calls costs Python time per file, and a column nobody reads cannot fail a training
            columns = {k: (table[k].combine_chunks() if language.is_language(self.features[k])
                           else fmt.column_to_numpy(table[k], self.features[k], path, k)) for k in self._parquet_keys}
            order = np.argsort(columns["frame_index"], kind="stable")
            if not np.array_equal(order, np.arange(len(order))):
                columns = {k: (v.take(pa.array(order)) if isinstance(v, pa.Array) else v[order])
                           for k, v in columns.items()}
            self._columns[episode] = columns
            while len(self._columns) > self.column_cache_episodes:
                self._columns.popitem(last=False)
            return columns


def _path_table(names: list[str]) -> tuple[list[str], np.ndarray]:
    unique: dict[str, int] = {}
    index = np.array([unique.setdefault(n, len(unique)) for n in names], dtype=np.int32)
    return list(unique), index


def _episode_ranges(parquet: pq.ParquetFile) -> tuple[np.ndarray, np.ndarray]:
    """Per row group, the (min, max) ``episode_index`` from its statistics; (-inf, inf) where there are none."""
    meta = parquet.metadata
    col = parquet.schema_arrow.get_field_index("episode_index")
    lo = np.full(meta.num_row_groups, np.iinfo(np.int64).min, dtype=np.int64)
    hi = np.full(meta.num_row_groups, np.iinfo(np.int64).max, dtype=np.int64)
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(col).statistics
        if stats is not None and stats.has_min_max:
            lo[i], hi[i] = stats.min, stats.max
    return lo, hi


