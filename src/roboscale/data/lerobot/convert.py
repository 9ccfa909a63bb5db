"""Convert a legacy LeRobot v2.0/v2.1 dataset (one parquet and one mp4 per episode) to v3.0.

The result is what ``DatasetWriter`` writes for the same frames: the same data parquet shards (built with the
writer's ``_ParquetShards``, so rotation and row groups match), the same ``meta/episodes`` rows, tasks, stats and
info.json. What is copied and what is recomputed:

- data columns are copied (cast to the v3 Arrow types; old HF ``datasets`` files may hold variable-length lists);
  ``index`` is rewritten as the contiguous global index and ``task_index`` is remapped only when ``tasks.jsonl``
  is not already 0..n-1;
- numeric stats are recomputed from the data (exact, and with the q01..q99 quantiles pi0.5 normalises with, which
  v2.1 never had); camera stats come from ``episodes_stats.jsonl`` and are computed from decoded frames only when
  that file lacks them (v2.0);
- videos are concatenated per camera by **stream copy** (remux, no re-encode, as LeRobot's converter does): every
  episode's packets are shifted to start at ``frames_before / fps`` in the shard, so ``from_timestamp`` and
  ``to_timestamp`` are exact multiples of 1/fps, the same values the writer records. Episodes whose stream
  parameters (codec, size, pixel format, time base, codec headers) differ from the open shard's start a new shard,
  because a single mp4 stream cannot switch them. ``reencode=True`` decodes and re-encodes with the writer's
  ``VideoStreamWriter`` instead: slower and lossy, but it works for sources that cannot be remuxed exactly (a time
  base that cannot express k/fps, or packets the mp4 muxer refuses after the shift). B-frame streams (HEVC,
  H.264) remux fine: presentation and decode times are shifted together.
- the source's ``timestamp`` column must be ``frame_index / fps`` within ``tolerance_s`` (LeRobot v2.1 enforced
  this when loading): the v3 video spans place frame k at exactly ``from_timestamp + k / fps``.

Everything is written into a hidden sibling directory that is renamed to ``dst`` only at the end.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.stats import Stats, aggregate_stats, image_stats, numeric_stats
from roboscale.data.lerobot.video import available_codec, decode_png
from roboscale.data.lerobot.writer import (
    _EPISODES_PER_META_FLUSH,
    DatasetWriter,
    VideoSettings,
    VideoSpan,
    _ParquetShards,
    _VideoShards,
    next_shard,
)
from roboscale.data.loading.decode import frame_array
from roboscale.errors import DatasetError
from roboscale.utils.io import atomic_directory, load_json

log = logging.getLogger(__name__)

_MB = 1024 * 1024
_V2_VERSION_RE = re.compile(r"^v2\.\d+$")
EPISODES_JSONL = "meta/episodes.jsonl"
EPISODES_STATS_JSONL = "meta/episodes_stats.jsonl"
TASKS_JSONL = "meta/tasks.jsonl"
_REQUIRED_STATS = ("min", "max", "mean", "std", "count")


# --------------------------------------------------------------------------------------------------- v2.x source


def _read_json(path: Path) -> Any:
    try:
        return load_json(path.read_text())
    except FileNotFoundError:
        raise DatasetError(path, "file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(path, f"cannot read JSON: {e}") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DatasetError(path, "file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(path, f"cannot read: {e}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = load_json(line)
        except json.JSONDecodeError as e:
            raise DatasetError(path, f"line {number}: invalid JSON: {e}") from None
        if not isinstance(row, dict):
            raise DatasetError(path, f"line {number}: must be a JSON object")
        rows.append(row)
    return rows


def _int_field(row: Mapping[str, Any], key: str, path: Path, where: str) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DatasetError(path, f"{where}: must be an integer, got {value!r}", field=key)
    return value


@dataclass
class V2Source:
    """A v2.0/v2.1 dataset on disk: info.json, episodes, tasks (by task_index) and per-episode stats."""

    root: Path
    info: dict[str, Any]
    fps: int
    features: dict[str, dict[str, Any]]
    lengths: list[int]  # lengths[e] is the length of episode e (indices are 0..n-1)
    tasks: list[str]  # tasks[i] is the v3 task with task_index i
    task_remap: dict[int, int] | None  # old task_index -> new, when tasks.jsonl is not already 0..n-1
    episode_stats: dict[int, dict[str, Stats]] = field(default_factory=dict)

    @property
    def video_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] == "video"]

    def _chunk(self, ep: int) -> int:
        return ep // int(self.info.get("chunks_size") or fmt.DEFAULT_CHUNKS_SIZE)

    def data_path(self, ep: int) -> Path:
        return fmt.dataset_path(self.root, self.info["data_path"], "data_path", episode_chunk=self._chunk(ep),
                                episode_index=ep)

    def video_path(self, ep: int, key: str) -> Path:
        return fmt.dataset_path(self.root, self.info["video_path"], "video_path", episode_chunk=self._chunk(ep),
                                episode_index=ep, video_key=key)


def _check_templates(info: Mapping[str, Any], path: Path, video_keys: list[str]) -> None:
    fmt.check_template(info.get("data_path"), fmt.V2_DATA_PATH_FIELDS, path, "data_path")
    fmt.dataset_path(path.parent.parent, info["data_path"], "data_path", episode_chunk=0, episode_index=0)
    if video_keys:
        fmt.check_template(info.get("video_path"), fmt.V2_VIDEO_PATH_FIELDS, path, "video_path")
    for key in video_keys:  # a camera's name is a directory of its videos, here and in the copy: it must stay one
        fmt.dataset_path(path.parent.parent, info["video_path"], "video_path", episode_chunk=0, episode_index=0,
                         video_key=key)
        fmt.dataset_path(path.parent.parent, fmt.DEFAULT_VIDEO_PATH, key, video_key=key, chunk_index=0, file_index=0)


def _read_v2_info(root: Path) -> tuple[dict[str, Any], int]:
    path = root / fmt.INFO_PATH
    if not path.is_file():
        raise DatasetError(path, "not found; is this a LeRobot dataset root?")
    info = _read_json(path)
    if not isinstance(info, dict):
        raise DatasetError(path, "must be a JSON object")
    version = info.get("codebase_version")
    if not isinstance(version, str) or not _V2_VERSION_RE.match(version):
        hint = "; it is already in the v3 format" if isinstance(version, str) and version.startswith("v3") else ""
        raise DatasetError(path, f"not a LeRobot v2.x dataset (codebase_version {version!r}){hint}",
                           field="codebase_version")
    fps = info.get("fps")
    if isinstance(fps, float) and fps.is_integer():
        fps = int(fps)
    if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
        raise DatasetError(path, f"must be a positive integer (v3.0 needs integer fps), got {fps!r}", field="fps")
    features = info.get("features")
    if not isinstance(features, dict) or not features:
        raise DatasetError(path, "must be a non-empty object", field="features")
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        if key not in features:
            raise DatasetError(path, "default feature missing", field=key)
    for key, ft in features.items():
        if not isinstance(ft, dict) or not isinstance(ft.get("dtype"), str) or not isinstance(ft.get("shape"), list):
            raise DatasetError(path, "feature needs 'dtype' and 'shape'", field=key)
    _check_templates(info, path, [k for k, f in features.items() if f["dtype"] == "video"])
    return info, fps


def _read_v2_episodes(root: Path) -> list[int]:
    path = root / EPISODES_JSONL
    lengths: dict[int, int] = {}
    for row in _read_jsonl(path):
        ep = _int_field(row, "episode_index", path, "episode")
        length = _int_field(row, "length", path, f"episode {ep}")
        if length <= 0:
            raise DatasetError(path, f"length must be positive, got {length}", episode=ep, field="length")
        if ep in lengths:
            raise DatasetError(path, "listed twice", episode=ep)
        lengths[ep] = length
    if not lengths:
        raise DatasetError(path, "lists no episodes")
    missing = sorted(set(range(max(lengths) + 1)) - set(lengths))
    if missing or min(lengths) != 0:
        raise DatasetError(path, f"episode indices must be 0..{len(lengths) - 1}; missing {missing[:10]}",
                           field="episode_index")
    return [lengths[e] for e in range(len(lengths))]


def _read_v2_tasks(root: Path) -> tuple[list[str], dict[int, int] | None]:
    path = root / TASKS_JSONL
    by_index: dict[int, str] = {}
    for row in _read_jsonl(path):
        index = _int_field(row, "task_index", path, "task")
        task = row.get("task")
        if not isinstance(task, str):
            raise DatasetError(path, f"task {index}: must be a string, got {task!r}", field="task")
        by_index[index] = task
    if not by_index:
        raise DatasetError(path, "lists no tasks")
    order = sorted(by_index)
    remap = None if order == list(range(len(order))) else {old: new for new, old in enumerate(order)}
    return [by_index[i] for i in order], remap


def _read_v2_episode_stats(root: Path, features: Mapping[str, Mapping[str, Any]]) -> dict[int, dict[str, Stats]]:
    """Camera stats per episode from episodes_stats.jsonl (v2.1); {} for v2.0, which has no such file."""
    path = root / EPISODES_STATS_JSONL
    if not path.is_file():
        return {}
    cameras = [k for k, f in features.items() if fmt.is_camera(f)]
    out: dict[int, dict[str, Stats]] = {}
    for row in _read_jsonl(path):
        ep = _int_field(row, "episode_index", path, "episode stats")
        stats = row.get("stats") or {}
        for key in cameras:
            st = stats.get(key)
            if not isinstance(st, dict) or not all(s in st for s in _REQUIRED_STATS):
                continue  # computed from decoded frames instead
            channels = fmt.image_hwc(features[key])[2]
            try:
                out.setdefault(ep, {})[key] = {
                    s: np.asarray(st[s], dtype=np.int64 if s == "count" else np.float64).reshape(
                        (1,) if s == "count" else (channels, 1, 1))
                    for s in _REQUIRED_STATS
                }
            except (ValueError, TypeError):
                raise DatasetError(path, f"stats do not have {channels} channels", episode=ep, field=key) from None
    return out


def read_v2_source(root: str | Path) -> V2Source:
    """Load and check a v2.x dataset's metadata; raises DatasetError naming the file at fault."""
    root = Path(root)
    info, fps = _read_v2_info(root)
    features = {k: dict(v) for k, v in info["features"].items()}
    lengths = _read_v2_episodes(root)
    tasks, remap = _read_v2_tasks(root)
    return V2Source(root, info, fps, features, lengths, tasks, remap, _read_v2_episode_stats(root, features))


# --------------------------------------------------------------------------------------------------- features


@dataclass(frozen=True)
class StreamParams:
    """The stream-derived facts LeRobot records in a video feature's ``info`` block."""

    codec: str  # canonical name: "av1", "h264"
    width: int
    height: int
    pix_fmt: str

    @classmethod
    def of(cls, stream: av.VideoStream) -> StreamParams:
        cc = stream.codec_context
        return cls(cc.codec.canonical_name, cc.width, cc.height, cc.pix_fmt)


def _v3_features(source: V2Source, first_streams: Mapping[str, StreamParams], video: VideoSettings | None
                 ) -> dict[str, dict[str, Any]]:
    """v3 feature entries: numeric ones as they were; video ones with an ``info`` block (v2.0 called it
    ``video_info``) whose stream-derived keys describe what the v3 files actually hold."""
    out: dict[str, dict[str, Any]] = {}
    for key, ft in source.features.items():
        entry = {k: v for k, v in ft.items() if k not in ("info", "video_info")}
        if ft["dtype"] == "video":
            if video is not None:  # re-encoded: the writer's own block
                entry = DatasetWriter._feature_entry(ft, source.fps, video)
            else:
                old = dict(ft.get("info") or ft.get("video_info") or {})
                stream = first_streams[key]
                depth = bool(old.get("is_depth_map", old.get("video.is_depth_map", False)))
                old.update({
                    "video.height": stream.height,
                    "video.width": stream.width,
                    "video.codec": stream.codec,
                    "video.pix_fmt": stream.pix_fmt,
                    "video.is_depth_map": depth,
                    "video.fps": source.fps,
                    "video.channels": fmt.image_hwc(ft)[2],
                    "has_audio": False,
                    "is_depth_map": depth,
                })
                entry["info"] = old
        out[key] = entry
    return out


# --------------------------------------------------------------------------------------------------- videos


def _stream_signature(stream: av.VideoStream) -> tuple[Any, ...]:
    """What must be equal for two episodes' packets to share one mp4 stream."""
    cc = stream.codec_context
    return (cc.codec.canonical_name, cc.width, cc.height, cc.pix_fmt, stream.time_base, bytes(cc.extradata or b""))


def _open_source_video(path: Path, key: str, ep: int) -> av.container.InputContainer:
    if not path.is_file():
        raise DatasetError(path, "episode video file not found", field=key, episode=ep)
    try:
        container = av.open(str(path), "r")
    except (av.FFmpegError, OSError) as e:
        raise DatasetError(path, f"cannot open video: {e}", field=key, episode=ep) from None
    if not container.streams.video:
        container.close()
        raise DatasetError(path, "file has no video stream", field=key, episode=ep)
    return container


def decode_episode_file(path: Path, length: int, key: str, ep: int) -> np.ndarray:
    """uint8 [length, H, W, 3]: the first ``length`` frames (in presentation order) of a v2.x episode mp4."""
    container = _open_source_video(path, key, ep)
    try:
        decoded = sorted(((f.pts or 0, frame_array(f, "rgb24")) for f in container.decode(video=0)),
                         key=lambda item: item[0])
    except (av.FFmpegError, ValueError) as e:
        raise DatasetError(path, f"cannot decode video: {e}", field=key, episode=ep) from None
    finally:
        container.close()
    if len(decoded) < length:
        raise DatasetError(path, f"has {len(decoded)} frames, episodes.jsonl says length {length}", field=key,
                           episode=ep)
    return np.stack([frame for _, frame in decoded[:length]])


class _RemuxShards:
    """One camera's v3 mp4 shards, filled by stream-copying whole episode mp4s (LeRobot's size rule: a new shard
    when current + episode bytes would reach the limit)."""

    def __init__(self, root: Path, key: str, fps: int, hwc: tuple[int, int, int], limit_mb: float,
                 chunks_size: int):
        self._root, self._key, self._fps = root, key, fps
        self._height, self._width = hwc[0], hwc[1]
        self._limit_bytes = float(limit_mb) * _MB
        self._chunks_size = chunks_size
        self.chunk, self.file = 0, 0
        self._out: av.container.OutputContainer | None = None
        self._stream: av.VideoStream | None = None
        self._signature: tuple[Any, ...] | None = None
        self._first_params: StreamParams | None = None
        self._bytes = 0
        self._frames = 0  # frames in the open shard: the next episode starts at _frames / fps

    def _path(self) -> Path:
        return fmt.dataset_path(self._root, fmt.DEFAULT_VIDEO_PATH, "video_path", video_key=self._key,
                                chunk_index=self.chunk, file_index=self.file)

    def _start_shard(self, template: av.VideoStream, signature: tuple[Any, ...]) -> None:
        if self._out is not None:
            self.close()
            self.chunk, self.file = next_shard(self.chunk, self.file, self._chunks_size)
        path = self._path()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._out = av.open(str(path), "w", format="mp4", options={"movflags": "faststart"})
        self._stream = self._out.add_stream_from_template(template, opaque=True)
        self._signature, self._bytes, self._frames = signature, 0, 0

    def append(self, src: Path, length: int, ep: int) -> VideoSpan:
        container = _open_source_video(src, self._key, ep)
        try:
            return self._append(container, src, length, ep)
        except (av.FFmpegError, ValueError) as e:
            raise DatasetError(src, f"cannot stream-copy this episode ({e}); convert with reencode=True",
                               field=self._key, episode=ep) from None
        finally:
            container.close()

    def _append(self, container: av.container.InputContainer, src: Path, length: int, ep: int) -> VideoSpan:
        stream = container.streams.video[0]
        params = StreamParams.of(stream)
        if (params.height, params.width) != (self._height, self._width):
            raise DatasetError(src, f"video is {params.width}x{params.height}, meta/info.json declares "
                                    f"{self._width}x{self._height}", field=self._key, episode=ep)
        if self._first_params is None:
            self._first_params = params
        elif params != self._first_params:  # info.json records one codec and pixel format per camera
            first = self._first_params
            raise DatasetError(src, f"video is {params.codec}/{params.pix_fmt}, earlier episodes are "
                                    f"{first.codec}/{first.pix_fmt}; a v3.0 camera has one codec: convert with "
                                    "--reencode", field=self._key, episode=ep)
        signature = _stream_signature(stream)
        size = src.stat().st_size
        if self._out is None or signature != self._signature or self._bytes + size >= self._limit_bytes:
            self._start_shard(stream, signature)
        assert self._out is not None and self._stream is not None
        time_base = stream.time_base
        frame_ticks = Fraction(1, self._fps) / time_base
        offset = Fraction(self._frames, self._fps) / time_base
        if frame_ticks.denominator != 1 or offset.denominator != 1:
            raise DatasetError(src, f"stream time base {time_base} cannot place frames at exact multiples of "
                                    f"1/{self._fps} s; convert with reencode=True", field=self._key, episode=ep)
        packets = [p for p in container.demux(stream) if p.pts is not None and p.dts is not None]
        if not packets:
            raise DatasetError(src, "has no video packets", field=self._key, episode=ep)
        first = min(p.pts for p in packets)
        end = first + length * int(frame_ticks)
        kept = [p for p in packets if p.pts < end]
        if len(kept) < length:
            raise DatasetError(src, f"has {len(kept)} frames, episodes.jsonl says length {length}",
                               field=self._key, episode=ep)
        if len(kept) < len(packets):
            log.warning("%s: dropping %d frames past the episode's %d", src, len(packets) - len(kept), length)
        for packet in kept:
            packet.pts = packet.pts - first + int(offset)
            packet.dts = packet.dts - first + int(offset)
            packet.stream = self._stream
            self._bytes += packet.size
            self._out.mux(packet)
        start = self._frames
        self._frames += length
        # Both ends are frame counts over fps: exactly what DatasetWriter records for the same episode.
        return VideoSpan(self.chunk, self.file, start / self._fps, self._frames / self._fps)

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out, self._stream = None, None


# --------------------------------------------------------------------------------------------------- data


def _episode_table(source: V2Source, ep: int, start: int, schema: pa.Schema, tolerance_s: float) -> pa.Table:
    """The episode's rows cast to the v3 data schema, with the global ``index`` and the remapped ``task_index``.

    Timestamps are kept but must be ``frame_index / fps`` within ``tolerance_s`` (LeRobot v2.1 checked this at
    load time too): the v3 video span places the episode's frames at exactly those times."""
    path = source.data_path(ep)
    if not path.is_file():
        raise DatasetError(path, "episode data file not found", episode=ep)
    table = fmt.read_parquet(path)
    length = source.lengths[ep]
    if table.num_rows != length:
        raise DatasetError(path, f"has {table.num_rows} rows, episodes.jsonl says length {length}", episode=ep)
    columns = []
    for fld in schema:
        if fld.name not in table.column_names:
            raise DatasetError(path, "column missing (declared in meta/info.json)", field=fld.name, episode=ep)
        try:
            columns.append(table[fld.name].cast(fld.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise DatasetError(path, f"cannot convert column to {fld.type}: {e}", field=fld.name,
                               episode=ep) from None
    out = pa.Table.from_arrays(columns, schema=schema)
    if not np.array_equal(out["episode_index"].to_numpy(), np.full(length, ep)):
        raise DatasetError(path, "rows of another episode in this episode's file", field="episode_index", episode=ep)
    if not np.array_equal(out["frame_index"].to_numpy(), np.arange(length)):
        raise DatasetError(path, f"must be 0..{length - 1} in order", field="frame_index", episode=ep)
    off = fmt.timestamp_problem(out["timestamp"].to_numpy(), np.arange(length), source.fps, tolerance_s)
    if off is not None:
        raise DatasetError(path, off, field="timestamp", episode=ep)
    task_index = out["task_index"].to_numpy()
    if source.task_remap is not None:
        try:
            task_index = np.array([source.task_remap[int(t)] for t in task_index], dtype=np.int64)
        except KeyError as e:
            raise DatasetError(path, f"task_index {e} is not in tasks.jsonl", field="task_index", episode=ep) from None
    elif task_index.size and (task_index.min() < 0 or task_index.max() >= len(source.tasks)):
        raise DatasetError(path, f"task_index outside 0..{len(source.tasks) - 1}", field="task_index", episode=ep)
    replace = {"index": np.arange(start, start + length, dtype=np.int64), "task_index": task_index.astype(np.int64)}
    for name, values in replace.items():
        out = out.set_column(schema.get_field_index(name), schema.field(name), pa.array(values, pa.int64()))
    return out


def _unique_tasks(table: pa.Table, tasks: list[str]) -> list[str]:
    """The episode's tasks in order of first appearance, as DatasetWriter lists them."""
    return [tasks[int(t)] for t in dict.fromkeys(table["task_index"].to_numpy().tolist())]


def _episode_stats(source: V2Source, ep: int, table: pa.Table, features: Mapping[str, Mapping[str, Any]],
                   decoded: Mapping[str, np.ndarray]) -> dict[str, Stats]:
    path = source.data_path(ep)
    out: dict[str, Stats] = {}
    for key in fmt.stats_features(features):
        ft = features[key]
        if not fmt.is_camera(ft):
            out[key] = numeric_stats(fmt.column_to_numpy(table[key], ft, path, key), fmt.feature_shape(ft))
            continue
        known = source.episode_stats.get(ep, {}).get(key)
        if known is not None:
            out[key] = known
        elif key in decoded:
            out[key] = image_stats(decoded[key])
        elif ft["dtype"] == "video":
            out[key] = image_stats(decode_episode_file(source.video_path(ep, key), source.lengths[ep], key, ep))
        else:  # image column: PNG bytes
            channels = fmt.image_hwc(ft)[2]
            pngs = table[key].combine_chunks().field("bytes").to_pylist()
            if any(b is None for b in pngs):
                raise DatasetError(path, "image rows reference external files; cannot compute stats", field=key,
                                   episode=ep)
            out[key] = image_stats(np.stack([decode_png(b, channels, source=path) for b in pngs]))
    return out


# --------------------------------------------------------------------------------------------------- convert


class _Converter:
    """The staging-directory side of one conversion; ``run`` writes every file, the caller renames."""

    def __init__(self, source: V2Source, staging: Path, data_mb: float, video_mb: float,
                 video: VideoSettings | None, tolerance_s: float = fmt.DEFAULT_TOLERANCE_S):
        self.source, self.staging, self.video = source, staging, video
        self.tolerance_s = tolerance_s
        self.data_mb, self.video_mb = data_mb, video_mb
        self.chunks_size = fmt.DEFAULT_CHUNKS_SIZE

    def _first_streams(self) -> dict[str, StreamParams]:
        streams = {}
        for key in self.source.video_keys:
            container = _open_source_video(self.source.video_path(0, key), key, 0)
            try:
                streams[key] = StreamParams.of(container.streams.video[0])
            finally:
                container.close()
        return streams

    def run(self, progress: bool) -> None:
        from tqdm import tqdm

        source = self.source
        features = _v3_features(source, self._first_streams() if self.video is None else {}, self.video)
        info = fmt.DatasetInfo(
            fps=source.fps, features=features, robot_type=source.info.get("robot_type"),
            chunks_size=self.chunks_size, data_files_size_in_mb=self.data_mb, video_files_size_in_mb=self.video_mb,
            video_path=fmt.DEFAULT_VIDEO_PATH if source.video_keys else None,
        )
        schema = fmt.data_schema(features)
        episodes_schema = fmt.episodes_schema(features)
        data = _ParquetShards(self.staging, info.data_path, schema, self.data_mb, self.chunks_size)
        meta = _ParquetShards(self.staging, fmt.EPISODES_PATH, episodes_schema, self.data_mb, self.chunks_size)
        videos: dict[str, _RemuxShards | _VideoShards] = {}
        for key in source.video_keys:
            if self.video is None:
                videos[key] = _RemuxShards(self.staging, key, source.fps, fmt.image_hwc(features[key]),
                                           self.video_mb, self.chunks_size)
            else:
                videos[key] = _VideoShards(self.staging, key, fmt.DEFAULT_VIDEO_PATH, source.fps,
                                           fmt.image_hwc(features[key]), self.video, self.video_mb, self.chunks_size)
        stats: dict[str, Stats] | None = None
        pending: list[dict[str, Any]] = []
        start = 0
        try:
            for ep in tqdm(range(len(source.lengths)), desc="convert v2→v3", unit="ep", disable=not progress):
                length = source.lengths[ep]
                table = _episode_table(source, ep, start, schema, self.tolerance_s)
                chunk, file = data.reserve(length)
                data.write(table)
                row: dict[str, Any] = {
                    "episode_index": ep, "tasks": _unique_tasks(table, source.tasks), "length": length,
                    "data/chunk_index": chunk, "data/file_index": file,
                    "dataset_from_index": start, "dataset_to_index": start + length,
                }
                decoded: dict[str, np.ndarray] = {}
                for key, shards in videos.items():
                    src = source.video_path(ep, key)
                    if isinstance(shards, _RemuxShards):
                        span = shards.append(src, length, ep)
                    else:
                        decoded[key] = decode_episode_file(src, length, key, ep)
                        span = shards.append(decoded[key])
                    row.update({
                        f"videos/{key}/chunk_index": span.chunk, f"videos/{key}/file_index": span.file,
                        f"videos/{key}/from_timestamp": span.from_timestamp,
                        f"videos/{key}/to_timestamp": span.to_timestamp,
                    })
                ep_stats = _episode_stats(source, ep, table, features, decoded)
                row.update({f"stats/{k}/{name}": v.tolist() for k, st in ep_stats.items() for name, v in st.items()})
                pending.append(row)
                if len(pending) >= _EPISODES_PER_META_FLUSH:
                    _flush_rows(meta, pending, episodes_schema)
                stats = ep_stats if stats is None else aggregate_stats([stats, ep_stats])
                start += length
            _flush_rows(meta, pending, episodes_schema)
        finally:
            data.close()
            meta.close()
            for shards in videos.values():
                shards.close()
        info.total_episodes = len(source.lengths)
        info.total_frames = start
        info.total_tasks = len(source.tasks)
        info.splits = {"train": f"0:{info.total_episodes}"}
        fmt.write_tasks(self.staging, source.tasks)
        assert stats is not None
        fmt.write_stats(self.staging, stats)
        fmt.write_info(self.staging, info)


def _flush_rows(meta: _ParquetShards, pending: list[dict[str, Any]], schema: pa.Schema) -> None:
    """Write buffered episode rows as one row group (DatasetWriter's metadata flush)."""
    if not pending:
        return
    chunk, file = meta.reserve(len(pending))
    for row in pending:
        row["meta/episodes/chunk_index"], row["meta/episodes/file_index"] = chunk, file
    meta.write(fmt.episode_rows_to_table(pending, schema))
    pending.clear()


def convert_v21_to_v30(
    src: str | Path,
    dst: str | Path,
    *,
    data_files_size_in_mb: float = fmt.DEFAULT_DATA_FILE_SIZE_MB,
    video_files_size_in_mb: float = fmt.DEFAULT_VIDEO_FILE_SIZE_MB,
    progress: bool = True,
    reencode: bool = False,
    video_codec: str = "libsvtav1",
    tolerance_s: float = fmt.DEFAULT_TOLERANCE_S,
) -> Path:
    """Convert the v2.0/v2.1 dataset at ``src`` into a new v3.0 dataset at ``dst`` (which must not exist or be
    empty); returns ``dst``. Videos are stream-copied unless ``reencode`` (then encoded with ``video_codec`` and the
    writer's defaults). Raises DatasetError naming the source file at fault; ``dst`` is untouched on failure."""
    src, dst = Path(src).absolute(), Path(dst).absolute()
    if dst == src or src in dst.parents:
        raise DatasetError(dst, f"must be outside the source dataset {src}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise DatasetError(dst, "already exists and is not empty; choose a new dataset root")
    source = read_v2_source(src)
    video = None
    if reencode:
        video = VideoSettings(codec=available_codec(video_codec))
    if dst.exists():
        os.rmdir(dst)  # empty: atomic_directory renames into place and needs the name free
    try:
        with atomic_directory(dst) as staging:
            _Converter(source, staging, data_files_size_in_mb, video_files_size_in_mb, video,
                       tolerance_s).run(progress)
    except (av.FFmpegError, pa.ArrowException, OSError) as e:  # writing side (disk full, muxer refusing packets)
        raise DatasetError(dst, f"conversion failed while writing: {e}") from None
    log.info("converted %s (%s) to %s (v3.0): %d episodes", src, source.info["codebase_version"], dst,
             len(source.lengths))
    return dst


__all__ = ["V2Source", "convert_v21_to_v30", "decode_episode_file", "read_v2_source"]
