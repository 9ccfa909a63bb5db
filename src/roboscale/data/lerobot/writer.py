"""Write LeRobot v3.0 datasets that LeRobot's own ``LeRobotDataset`` loads.

Layout and semantics follow LeRobot 0.4.x: one row group per episode in snappy parquet shards, per-camera mp4
shards, per-episode stats in ``meta/episodes``, shards rotated by (soft) size limits and chunked by ``chunks_size``.
Differences on purpose:
- videos are appended to an open encoder per camera instead of being concatenated per episode (no O(n²) rewrite);
- everything is written into a hidden sibling directory that is renamed to ``root`` only by ``finalize()``, after
  every file is fsynced, so an interrupted run never leaves a dataset that looks complete.

An episode's frames are buffered in memory until ``save_episode`` (LeRobot stages them as PNG files instead).

LeRobot 0.6's additions: the language columns (``language_persistent`` / ``language_events``, each frame a list of
row dicts; written with LeRobot's types, no stats) and info.json's ``tools``. Video info carries 0.6's encoder
keys and ``is_depth_map`` (plus 0.4.x's ``video.is_depth_map``). Depth-map videos are read, not written.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot import language
from roboscale.data.lerobot.depth import is_depth_map
from roboscale.data.lerobot.stats import Stats, aggregate_stats, compute_episode_stats
from roboscale.data.lerobot.video import VideoStreamWriter, available_codec, canonical_codec_name, encode_png
from roboscale.errors import DatasetError
from roboscale.utils.io import fsync_dir, make_temporary_directory, remove_stale_temporaries

log = logging.getLogger(__name__)

_MB = 1024 * 1024
_EPISODES_PER_META_FLUSH = 10  # LeRobot's metadata_buffer_size: one meta row group per 10 episodes
_RESERVED = {*fmt.DEFAULT_FEATURES, "task"}


def next_shard(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    """The shard after (chunk, file): files fill a chunk directory up to ``chunks_size``, then a new chunk starts."""
    return (chunk + 1, 0) if file >= chunks_size - 1 else (chunk, file + 1)


class _ParquetShards:
    """Parquet files from a path template, one open ParquetWriter at a time, rotated by estimated size."""

    def __init__(self, root: Path, template: str, schema: pa.Schema, limit_mb: float, chunks_size: int):
        self._root, self._template, self._schema = root, template, schema
        self._limit_bytes = float(limit_mb) * _MB
        self._chunks_size = chunks_size
        self.chunk, self.file = 0, 0
        self._writer: pq.ParquetWriter | None = None
        self._rows = 0

    @property
    def path(self) -> Path:
        return self._root / self._template.format(chunk_index=self.chunk, file_index=self.file)

    def reserve(self, num_rows: int) -> tuple[int, int]:
        """The shard the next ``num_rows`` rows go to: a new one when the current would reach the size limit
        (current size on disk + its average bytes per row × ``num_rows``, LeRobot's rule)."""
        if self._writer is not None and self._rows > 0:
            size = self.path.stat().st_size
            if size + size / self._rows * num_rows >= self._limit_bytes:
                self.close()
                self.chunk, self.file = next_shard(self.chunk, self.file, self._chunks_size)
        return self.chunk, self.file

    def write(self, table: pa.Table) -> None:
        """Write ``table`` as one row group into the reserved shard."""
        if self._writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, self._schema, compression="snappy", use_dictionary=True)
            self._rows = 0
        self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        self._rows += table.num_rows

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # writes the footer; without it the file is unreadable
            self._writer = None


@dataclass(frozen=True)
class VideoSettings:
    codec: str = "libsvtav1"
    pix_fmt: str = "yuv420p"
    g: int = 2
    crf: int = 30
    preset: int = 12
    fast_decode: int = 0


@dataclass(frozen=True)
class VideoSpan:
    chunk: int
    file: int
    from_timestamp: float
    to_timestamp: float


class _VideoShards:
    """One camera's mp4 shards; rotated independently of the data files and of the other cameras."""

    def __init__(self, root: Path, key: str, template: str, fps: int, hwc: tuple[int, int, int],
                 settings: VideoSettings, limit_mb: float, chunks_size: int):
        self._root, self._key, self._template, self._fps = root, key, template, fps
        self._height, self._width = hwc[0], hwc[1]
        self._settings = settings
        self._limit_bytes = float(limit_mb) * _MB
        self._chunks_size = chunks_size
        self.chunk, self.file = 0, 0
        self._writer: VideoStreamWriter | None = None

    def _path(self) -> Path:
        return self._root / self._template.format(video_key=self._key, chunk_index=self.chunk, file_index=self.file)

    def _rotate_if_full(self, num_frames: int) -> None:
        writer = self._writer
        if writer is None or writer.frames_written == 0:
            return
        per_frame = writer.estimated_bytes_per_frame()  # None while the encoder is still filling its lookahead
        if per_frame is not None and writer.bytes_muxed + per_frame * num_frames >= self._limit_bytes:
            self.close()
            self.chunk, self.file = next_shard(self.chunk, self.file, self._chunks_size)

    def append(self, frames: np.ndarray) -> VideoSpan:
        self._rotate_if_full(len(frames))
        if self._writer is None:
            s = self._settings
            self._writer = VideoStreamWriter(self._path(), self._fps, self._width, self._height, codec=s.codec,
                                             pix_fmt=s.pix_fmt, g=s.g, crf=s.crf, preset=s.preset,
                                             fast_decode=s.fast_decode)
        start = self._writer.frames_written
        self._writer.write_many(frames)
        # pts are frame counts, so times are exact multiples of 1/fps (no accumulated float sums).
        return VideoSpan(self.chunk, self.file, start / self._fps, (start + len(frames)) / self._fps)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# --------------------------------------------------------------------------------------------------- validation


def _check_user_features(root: Path, features: Mapping[str, Mapping[str, Any]]) -> None:
    if not isinstance(features, Mapping) or not features:
        raise DatasetError(root, "features must be a non-empty dict")
    for key, ft in features.items():
        if not isinstance(ft, Mapping):
            raise DatasetError(root, "feature must be a dict with dtype, shape and names", field=key)
        if key in _RESERVED:
            raise DatasetError(root, "is added by the writer; do not declare it", field=key)
        if "/" in key:
            raise DatasetError(root, "feature names must not contain '/'", field=key)
        dtype, shape = ft.get("dtype"), ft.get("shape")
        if not isinstance(shape, (list, tuple)) or not shape or not all(
            isinstance(s, (int, np.integer)) and s > 0 for s in shape
        ):
            raise DatasetError(root, f"shape must be a non-empty list of positive ints, got {shape!r}", field=key)
        if dtype == language.LANGUAGE_DTYPE:
            if key not in language.LANGUAGE_COLUMNS or list(shape) != [1]:
                raise DatasetError(root, f"dtype 'language' is for the columns {list(language.LANGUAGE_COLUMNS)} "
                                         "with shape [1]", field=key)
            continue
        if dtype in fmt.CAMERA_DTYPES:
            if is_depth_map(ft):
                raise DatasetError(root, "depth-map videos (LeRobot 0.6's is_depth_map) are read, not written, by "
                                         "roboscale", field=key)
            try:
                channels = fmt.image_hwc(ft)[2]
            except ValueError as e:
                raise DatasetError(root, str(e), field=key) from None
            allowed = (3,) if dtype == "video" else (1, 3, 4)
            if channels not in allowed:
                raise DatasetError(root, f"{dtype} features need {allowed} channels, got {channels}", field=key)
        elif dtype != "string":
            try:
                kind = np.dtype(dtype).kind
            except TypeError:
                kind = "?"
            if kind not in ("b", "i", "u", "f"):
                raise DatasetError(root, f"unsupported dtype {dtype!r}", field=key)


_Err = Callable[[str], DatasetError]  # builds the error for one feature of the current frame


def _fail(root: Path, episode: int, key: str, message: str) -> DatasetError:
    return DatasetError(root, message, field=key, episode=episode)


def _conform_camera(value: Any, hwc: tuple[int, int, int], batched: bool, err: _Err) -> np.ndarray:
    """uint8 [..., H, W, C] from HWC or CHW input, uint8 or float in [0, 1]."""
    array = np.asarray(value)
    lead = array.shape[:1] if batched else ()
    body = array.shape[len(lead):]
    chw = (hwc[2], hwc[0], hwc[1])
    if body == chw and body != hwc:
        array = np.moveaxis(array, -3, -1)
    elif body != hwc:
        raise err(f"expected image of shape {list(hwc)} (HWC) or {list(chw)} (CHW), got {list(body)}")
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if array.dtype.kind == "f":
        if array.size and (np.nanmin(array) < 0.0 or np.nanmax(array) > 1.0):
            raise err("float images must be in [0, 1]")
        return np.round(array * 255.0).astype(np.uint8)
    raise err(f"images must be uint8 or float in [0, 1], got {array.dtype}")


def _conform_numeric(value: Any, dtype: np.dtype, shape: tuple[int, ...], batched: bool, err: _Err) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in "biuf" or not np.can_cast(array.dtype, dtype, casting="same_kind"):
        raise err(f"expected dtype {dtype}, got {array.dtype}")
    lead = array.shape[:1] if batched else ()
    body = array.shape[len(lead):]
    scalar_ok = shape == (1,) and body == ()
    if body != shape and not scalar_ok:
        raise err(f"expected shape {list(shape)}, got {list(body)}")
    return array.astype(dtype, copy=False).reshape((*lead, *shape))


def _conform_language(value: Any, key: str, cameras: set[str], batched: bool, err: _Err) -> Any:
    """One frame's list of annotation rows (None: none), checked as ``data validate`` checks them; batched: an
    object array of such lists."""
    cells = list(value) if batched else [value]
    for i, cell in enumerate(cells):
        problems = language.cell_problems(cell, key, cameras)
        if problems:
            raise err((f"frame {i}: " if batched else "") + problems[0])
    out = np.empty(len(cells), dtype=object)
    for i, cell in enumerate(cells):
        out[i] = [dict(row) for row in (cell or [])]
    return out if batched else out[0]


def _conform_string(value: Any, batched: bool, err: _Err) -> Any:
    values = list(value) if batched else [value]
    if not all(isinstance(v, str) for v in values):
        raise err("expected str")
    return np.array(values, dtype=object) if batched else value


# --------------------------------------------------------------------------------------------------- arrow


def _numeric_column(values: np.ndarray, arrow_type: pa.DataType) -> pa.Array:
    """[N, *shape] numpy -> a scalar column, or nested fixed-size lists built from the flat values (no copies)."""
    levels = []
    inner = arrow_type
    while pa.types.is_fixed_size_list(inner):
        levels.append(inner)
        inner = inner.value_type
    array: pa.Array = pa.array(np.ascontiguousarray(values).reshape(-1), type=inner)
    for level in reversed(levels):
        array = pa.FixedSizeListArray.from_arrays(array, type=level)
    return array


def _image_column(frames: np.ndarray) -> pa.Array:
    pngs = pa.array([encode_png(f) for f in frames], pa.binary())
    paths = pa.nulls(len(frames), pa.string())
    return pa.StructArray.from_arrays([pngs, paths], names=["bytes", "path"])


def _stacked(values: list[Any], feature: Mapping[str, Any]) -> np.ndarray:
    """Buffered frames of one feature as [N, ...]; strings and annotation lists as object arrays [N]."""
    if feature["dtype"] not in ("string", language.LANGUAGE_DTYPE):
        return np.stack(values)
    out = np.empty(len(values), dtype=object)  # np.array would turn equal-length lists into a 2-D array
    for i, value in enumerate(values):
        out[i] = value
    return out


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


# --------------------------------------------------------------------------------------------------- writer


class DatasetWriter:
    """Build a LeRobot v3.0 dataset episode by episode; it appears at ``root`` only when ``finalize()`` succeeds.

    Use ``DatasetWriter.create(...)``. As a context manager it finalizes on success and aborts on an exception.
    """

    def __init__(self, root: Path, staging: Path, info: fmt.DatasetInfo, video: VideoSettings, lock: int):
        self.root = root
        self.staging = staging
        self._lock = lock  # held while this writer lives: its staging directory is not stale
        self.info = info
        self.features = info.features
        self._user_keys = [k for k in self.features if k not in fmt.DEFAULT_FEATURES]
        self._camera_keys = {k for k, f in self.features.items() if fmt.is_camera(f)}
        self._schema = fmt.data_schema(self.features)
        self._episodes_schema = fmt.episodes_schema(self.features)
        self._data = _ParquetShards(staging, info.data_path, self._schema, info.data_files_size_in_mb,
                                    info.chunks_size)
        self._meta = _ParquetShards(staging, fmt.EPISODES_PATH, self._episodes_schema, info.data_files_size_in_mb,
                                    info.chunks_size)
        self._videos = {
            key: _VideoShards(staging, key, fmt.DEFAULT_VIDEO_PATH, info.fps, fmt.image_hwc(self.features[key]),
                              video, info.video_files_size_in_mb, info.chunks_size)
            for key in info.video_keys
        }
        self._tasks: dict[str, int] = {}
        self._stats: dict[str, Stats] | None = None
        self._pending_rows: list[dict[str, Any]] = []
        self._buffer: dict[str, list[Any]] = {}
        self._buffer_tasks: list[str] = []
        self.num_episodes = 0
        self.num_frames = 0
        self._done = False

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls,
        root: str | Path,
        fps: int,
        features: Mapping[str, Mapping[str, Any]],
        robot_type: str | None = None,
        data_files_size_in_mb: float = fmt.DEFAULT_DATA_FILE_SIZE_MB,
        video_files_size_in_mb: float = fmt.DEFAULT_VIDEO_FILE_SIZE_MB,
        chunks_size: int = fmt.DEFAULT_CHUNKS_SIZE,
        video_codec: str = "libsvtav1",
        pix_fmt: str = "yuv420p",
        g: int = 2,
        crf: int = 30,
        preset: int = 12,
        fast_decode: int = 0,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> DatasetWriter:
        """``features`` is a LeRobot features dict without the five default features (the writer adds them);
        ``tools``: OpenAI-style tool schemas for info.json (LeRobot 0.6's ``tools``)."""
        root = Path(root).absolute()
        if root.exists() and (not root.is_dir() or any(root.iterdir())):
            raise DatasetError(root, "already exists and is not empty; choose a new dataset root")
        if isinstance(fps, bool) or not isinstance(fps, (int, np.integer)) or fps <= 0:
            raise DatasetError(root, f"fps must be a positive integer, got {fps!r}", field="fps")
        if not isinstance(chunks_size, int) or chunks_size <= 0:
            raise DatasetError(root, f"must be a positive integer, got {chunks_size!r}", field="chunks_size")
        _check_user_features(root, features)
        video = VideoSettings(available_codec(video_codec), pix_fmt, g, crf, preset, fast_decode)
        all_features = {k: cls._feature_entry(ft, int(fps), video) for k, ft in features.items()}
        all_features.update({k: dict(v) for k, v in fmt.DEFAULT_FEATURES.items()})
        has_video = any(ft["dtype"] == "video" for ft in all_features.values())
        info = fmt.DatasetInfo(
            fps=int(fps), features=all_features, robot_type=robot_type, chunks_size=chunks_size,
            data_files_size_in_mb=data_files_size_in_mb, video_files_size_in_mb=video_files_size_in_mb,
            video_path=fmt.DEFAULT_VIDEO_PATH if has_video else None,
            tools=[dict(t) for t in tools] if tools is not None else None,
        )
        for stale in remove_stale_temporaries(root.parent, [root.name]):  # of a writer that was killed
            log.info("removed %s, left by a writer that did not finish", stale)
        staging, lock = make_temporary_directory(root, suffix=".partial")
        return cls(root, staging, info, video, lock)

    @staticmethod
    def _feature_entry(ft: Mapping[str, Any], fps: int, video: VideoSettings) -> dict[str, Any]:
        entry: dict[str, Any] = {"dtype": ft["dtype"], "shape": [int(s) for s in ft["shape"]],
                                 "names": ft.get("names")}
        if ft["dtype"] == "video":
            height, width, channels = fmt.image_hwc(ft)
            entry["info"] = {
                "video.height": height,
                "video.width": width,
                "video.codec": canonical_codec_name(video.codec),
                "video.pix_fmt": video.pix_fmt,
                "video.is_depth_map": False,  # the key LeRobot 0.4.x writes
                "video.fps": fps,
                "video.channels": channels,
                "has_audio": False,
                "is_depth_map": False,  # the key newer LeRobot canonicalizes to
                "video.g": video.g,
                "video.crf": video.crf,
                "video.preset": video.preset,
                "video.fast_decode": video.fast_decode,
                "video.video_backend": "pyav",
                "video.extra_options": {},
            }
        return entry

    # ------------------------------------------------------------------ frames in

    def _conform(self, key: str, value: Any, batched: bool) -> Any:
        ft = self.features[key]

        def err(message: str) -> DatasetError:
            return _fail(self.root, self.num_episodes, key, message)

        if fmt.is_camera(ft):
            return _conform_camera(value, fmt.image_hwc(ft), batched, err)
        if ft["dtype"] == "string":
            return _conform_string(value, batched, err)
        if language.is_language(ft):
            return _conform_language(value, key, self._camera_keys, batched, err)
        return _conform_numeric(value, np.dtype(ft["dtype"]), fmt.feature_shape(ft), batched, err)

    def _check_keys(self, given: set[str], expect_task: bool) -> None:
        expected = set(self._user_keys) | ({"task"} if expect_task else set())
        missing, unknown = sorted(expected - given), sorted(given - expected)
        if missing:
            raise _fail(self.root, self.num_episodes, missing[0], "missing from the frame")
        if unknown:
            raise _fail(self.root, self.num_episodes, unknown[0], "not a declared feature")

    def add_frame(self, frame: Mapping[str, Any]) -> None:
        """Buffer one frame: every declared feature plus ``"task"`` (str). Validated now, written at save_episode."""
        self._check_open()
        self._check_keys(set(frame), expect_task=True)
        task = frame["task"]
        if not isinstance(task, str) or not task:
            raise _fail(self.root, self.num_episodes, "task", "must be a non-empty string")
        conformed = {key: self._conform(key, frame[key], batched=False) for key in self._user_keys}
        for key, value in conformed.items():
            self._buffer.setdefault(key, []).append(value)
        self._buffer_tasks.append(task)

    def clear_episode_buffer(self) -> None:
        self._buffer, self._buffer_tasks = {}, []

    def save_episode(self) -> int:
        """Write the buffered frames as the next episode; returns its episode_index."""
        self._check_open()
        if not self._buffer_tasks:
            raise DatasetError(self.root, "save_episode() with no buffered frames", episode=self.num_episodes)
        episode = {key: _stacked(values, self.features[key]) for key, values in self._buffer.items()}
        tasks = self._buffer_tasks
        self.clear_episode_buffer()
        return self._write_episode(episode, tasks)

    def add_episode(self, frames: Mapping[str, Any], task: str) -> int:
        """Write a whole episode at once: ``frames[key]`` stacked over time ([N, *shape]); one task for all."""
        self._check_open()
        if self._buffer_tasks:
            raise DatasetError(self.root, f"{len(self._buffer_tasks)} frames from add_frame are buffered; call "
                                          "save_episode() or clear_episode_buffer() first", episode=self.num_episodes)
        self._check_keys(set(frames), expect_task=False)
        if not isinstance(task, str) or not task:
            raise _fail(self.root, self.num_episodes, "task", "must be a non-empty string")
        episode = {key: self._conform(key, frames[key], batched=True) for key in self._user_keys}
        lengths = {key: len(v) for key, v in episode.items()}
        n = lengths[self._user_keys[0]]
        for key, length in lengths.items():
            if length != n:
                raise _fail(self.root, self.num_episodes, key, f"has {length} frames, {self._user_keys[0]!r} has {n}")
        if n == 0:
            raise DatasetError(self.root, "episode has no frames", episode=self.num_episodes)
        return self._write_episode(episode, [task] * n)

    # ------------------------------------------------------------------ episode out

    def _task_indices(self, tasks: Sequence[str]) -> tuple[np.ndarray, list[str]]:
        """Per-frame task_index (new tasks get the next index) and the episode's unique tasks in order."""
        unique = list(dict.fromkeys(tasks))
        for task in unique:
            self._tasks.setdefault(task, len(self._tasks))
        if len(unique) == 1:
            return np.full(len(tasks), self._tasks[unique[0]], dtype=np.int64), unique
        return np.array([self._tasks[t] for t in tasks], dtype=np.int64), unique

    def _data_table(self, episode: Mapping[str, Any]) -> pa.Table:
        columns = []
        for field in self._schema:
            ft = self.features[field.name]
            values = episode[field.name]
            if ft["dtype"] == "image":
                columns.append(_image_column(values))
            elif ft["dtype"] == "string":
                columns.append(pa.array(list(values), pa.string()))
            elif language.is_language(ft):
                columns.append(language.language_array(list(values), field.name))
            else:
                columns.append(_numeric_column(values, field.type))
        return pa.Table.from_arrays(columns, schema=self._schema)

    def _write_episode(self, episode: dict[str, Any], tasks: Sequence[str]) -> int:
        ep, n, start = self.num_episodes, len(tasks), self.num_frames
        frame_index = np.arange(n, dtype=np.int64)
        task_index, unique_tasks = self._task_indices(tasks)
        episode.update(
            timestamp=(frame_index / self.info.fps).astype(np.float32),
            frame_index=frame_index,
            episode_index=np.full(n, ep, dtype=np.int64),
            index=start + frame_index,
            task_index=task_index,
        )
        ep_stats = compute_episode_stats(episode, self.features)
        chunk, file = self._data.reserve(n)
        self._data.write(self._data_table(episode))
        row: dict[str, Any] = {
            "episode_index": ep, "tasks": unique_tasks, "length": n,
            "data/chunk_index": chunk, "data/file_index": file,
            "dataset_from_index": start, "dataset_to_index": start + n,
        }
        for key, shards in self._videos.items():
            span = shards.append(episode[key])
            row.update({
                f"videos/{key}/chunk_index": span.chunk, f"videos/{key}/file_index": span.file,
                f"videos/{key}/from_timestamp": span.from_timestamp, f"videos/{key}/to_timestamp": span.to_timestamp,
            })
        for key, st in ep_stats.items():
            row.update({f"stats/{key}/{name}": value.tolist() for name, value in st.items()})
        self._pending_rows.append(row)
        if len(self._pending_rows) >= _EPISODES_PER_META_FLUSH:
            self._flush_episode_rows()
        self._stats = ep_stats if self._stats is None else aggregate_stats([self._stats, ep_stats])
        self.num_episodes += 1
        self.num_frames += n
        return ep

    def _flush_episode_rows(self) -> None:
        if not self._pending_rows:
            return
        chunk, file = self._meta.reserve(len(self._pending_rows))
        for row in self._pending_rows:
            row["meta/episodes/chunk_index"], row["meta/episodes/file_index"] = chunk, file
        self._meta.write(fmt.episode_rows_to_table(self._pending_rows, self._episodes_schema))
        self._pending_rows = []

    # ------------------------------------------------------------------ finish

    def _check_open(self) -> None:
        if self._done:
            raise DatasetError(self.root, "writer is already finalized or aborted")

    def _close_files(self) -> None:
        self._data.close()
        self._meta.close()
        for shards in self._videos.values():
            shards.close()

    def finalize(self) -> Path:
        """Close every file, write tasks/stats/info, fsync, and rename the staging directory to ``root``."""
        self._check_open()
        if self._buffer_tasks:
            raise DatasetError(self.root, f"{len(self._buffer_tasks)} buffered frames were never saved; call "
                                          "save_episode() or clear_episode_buffer() first")
        if self.num_episodes == 0:
            raise DatasetError(self.root, "no episodes were saved")
        self._flush_episode_rows()
        self._close_files()
        self.info.total_episodes = self.num_episodes
        self.info.total_frames = self.num_frames
        self.info.total_tasks = len(self._tasks)
        self.info.splits = {"train": f"0:{self.num_episodes}"}
        fmt.write_tasks(self.staging, list(self._tasks))
        assert self._stats is not None
        fmt.write_stats(self.staging, self._stats)
        fmt.write_info(self.staging, self.info)
        _fsync_tree(self.staging)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise DatasetError(self.root, "appeared while writing and is not empty; nothing was moved there")
        os.replace(self.staging, self.root)  # rename(2) also replaces an empty directory
        fsync_dir(self.root.parent)
        self._done = True
        os.close(self._lock)
        return self.root

    def abort(self) -> None:
        """Drop everything written so far (nothing ever appeared at ``root``)."""
        if self._done:
            return
        self._done = True
        try:
            self._close_files()
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
            os.close(self._lock)

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finalize()
        except BaseException:
            self.abort()
            raise
