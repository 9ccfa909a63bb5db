"""Read LeRobot v3.0 datasets with LeRobot's item semantics, without HF ``datasets``.

``LeRobotDataset(root=...)[i]`` returns what LeRobot 0.4.x's ``LeRobotDataset`` returns: torch tensors with the
dtypes ``hf_transform_to_torch`` produces (floats -> float32, ints -> int64, bools -> bool; shape-(1,) features as
0-d tensors), cameras as float32 CHW in [0, 1], the ``task`` string, and with ``delta_timestamps`` a leading time
dim plus ``<key>_is_pad`` (out-of-episode positions repeat the edge frame). LeRobot 0.6 additions come back as 0.6
returns them: language columns as lists of row dicts (``roboscale.data.lerobot.language``), depth-map videos as
float32 [1, H, W] in ``depth_unit`` (millimetres by default; ``roboscale.data.lerobot.depth``), untouched by
``image_transforms``, their stats converted to that unit.

The non-video parquet columns of the selected episodes are loaded once into numpy (images stay PNG bytes), so
``__getitem__`` is array indexing plus video decoding. ``read_episode`` / ``decode_episode_video`` are bulk paths
for the trainer: one episode's row group(s) straight from pyarrow, one sequential decode of its video span.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.depth import DEPTH_UNITS, MILLIMETRE, DepthQuantization, is_depth_map, rescale_depth_stats
from roboscale.data.lerobot.video import decode_frames, decode_png, decode_range
from roboscale.errors import DatasetError

# numpy kind -> dtype of the tensor LeRobot's torch.tensor(python value) gives.
_TORCH_SEMANTIC_DTYPE = {"f": np.float32, "i": np.int64, "u": np.int64, "b": np.bool_}


def default_root(repo_id: str) -> Path:
    """Where LeRobot keeps a dataset locally: ``$HF_LEROBOT_HOME/<repo_id>`` (default ~/.cache/huggingface/lerobot)."""
    home = os.environ.get("HF_LEROBOT_HOME")
    base = Path(home) if home else Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "lerobot"
    return base.expanduser() / repo_id


class LeRobotDatasetMetadata:
    """info.json, tasks, episodes (without per-episode stats) and stats.json of a local v3.0 dataset."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.info = fmt.read_info(self.root)
        self.task_list: list[str] = fmt.read_tasks(self.root)
        self.tasks: dict[str, int] = {task: i for i, task in enumerate(self.task_list)}
        self.episodes = fmt.read_episodes(self.root)
        self.stats = fmt.read_stats(self.root)
        ids = self.episodes["episode_index"]
        self._row_of = {int(e): i for i, e in enumerate(ids)}
        self._check_episode_indices(ids)
        if len(self.episodes) != self.info.total_episodes:
            raise DatasetError(self.root / fmt.INFO_PATH, f"says {self.info.total_episodes} episodes but "
                               f"meta/episodes has {len(self.episodes)}", field="total_episodes")
        for key in self.video_keys:
            for suffix in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
                if f"videos/{key}/{suffix}" not in self.episodes:
                    raise DatasetError(self.root / fmt.EPISODES_DIR, "column missing from episodes metadata",
                                       field=f"videos/{key}/{suffix}")

    def _check_episode_indices(self, ids: np.ndarray) -> None:
        """Episodes must be 0..n-1: LeRobot looks rows up by episode index, so a gap or a duplicate breaks it."""
        where = self.root / fmt.EPISODES_DIR
        if len(self._row_of) != len(ids):
            duplicate = int(next(e for e, c in zip(*np.unique(ids, return_counts=True), strict=True) if c > 1))
            raise DatasetError(where, "listed more than once", field="episode_index", episode=duplicate)
        if len(ids) and (int(ids[0]) != 0 or int(ids[-1]) != len(ids) - 1):  # sorted and unique: ends decide
            missing = next(e for e in range(len(ids) + 1) if e not in self._row_of)
            raise DatasetError(where, f"episode indices must be 0..{len(ids) - 1} without gaps; episode {missing} "
                                      "is missing (run `roboscale data validate` for every problem)",
                               field="episode_index", episode=missing)

    # ------------------------------------------------------------------ info shortcuts

    @property
    def fps(self) -> int:
        return self.info.fps

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.info.features

    @property
    def robot_type(self) -> str | None:
        return self.info.robot_type

    @property
    def total_episodes(self) -> int:
        return self.info.total_episodes

    @property
    def total_frames(self) -> int:
        return self.info.total_frames

    @property
    def total_tasks(self) -> int:
        return len(self.task_list)

    @property
    def video_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] == "video"]

    @property
    def image_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] == "image"]

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] in fmt.CAMERA_DTYPES]

    @property
    def depth_keys(self) -> list[str]:
        """Video features holding depth maps (LeRobot 0.6's ``is_depth_map``)."""
        return [k for k in self.video_keys if is_depth_map(self.features[k])]

    def depth_quantization(self, key: str) -> DepthQuantization:
        """How depth feature ``key``'s codes map to distance; a DatasetError naming info.json and the feature."""
        try:
            return DepthQuantization.of(self.features[key])
        except ValueError as e:
            raise DatasetError(self.root / fmt.INFO_PATH, str(e), field=key) from None

    # ------------------------------------------------------------------ per episode

    def episode(self, ep: int) -> dict[str, Any]:
        try:
            return self.episodes[self._row_of[int(ep)]]
        except KeyError:
            raise DatasetError(self.root / fmt.EPISODES_DIR, "no such episode", episode=int(ep)) from None

    def data_path(self, ep: int) -> Path:
        row = self.episode(ep)
        return fmt.dataset_path(self.root, self.info.data_path, "data_path", chunk_index=row["data/chunk_index"],
                                file_index=row["data/file_index"])

    def video_path(self, ep: int, key: str) -> Path:
        row = self.episode(ep)
        assert self.info.video_path is not None
        return fmt.dataset_path(self.root, self.info.video_path, "video_path", video_key=key,
                                chunk_index=row[f"videos/{key}/chunk_index"],
                                file_index=row[f"videos/{key}/file_index"])

    def video_span(self, ep: int, key: str) -> tuple[float, float]:
        row = self.episode(ep)
        return row[f"videos/{key}/from_timestamp"], row[f"videos/{key}/to_timestamp"]


# --------------------------------------------------------------------------------------------------- columns


def _decode_image(struct: pa.StructArray, row: int, channels: int, root: Path, path: Path) -> np.ndarray:
    data = struct.field("bytes")[row].as_py()
    if data is None:  # HF Image columns may reference a file instead of embedding it
        ref = struct.field("path")[row].as_py()
        if ref is None:
            raise DatasetError(path, f"image row {row} has neither bytes nor path")
        file = fmt.referenced_file(root, ref, path)
        try:
            data = file.read_bytes()
        except OSError as e:
            raise DatasetError(file, f"cannot read the image file row {row} of {path} refers to: {e}") from None
    return decode_png(data, channels, source=path)


def _row_groups_with(parquet: pq.ParquetFile, column: str, value: int) -> list[int]:
    """Row groups whose min/max statistics of ``column`` allow ``value`` (all of them when stats are absent)."""
    meta = parquet.metadata
    col = parquet.schema_arrow.get_field_index(column)
    chosen = []
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(col).statistics
        if stats is None or not stats.has_min_max or stats.min <= value <= stats.max:
            chosen.append(i)
    return chosen


# --------------------------------------------------------------------------------------------------- dataset


class LeRobotDataset(torch.utils.data.Dataset):
    """Drop-in for LeRobot's ``LeRobotDataset`` on a local v3.0 dataset (no Hub download)."""

    def __init__(
        self,
        repo_id: str | None = None,
        root: str | Path | None = None,
        episodes: Sequence[int] | None = None,
        image_transforms: Callable[[torch.Tensor], torch.Tensor] | None = None,
        delta_timestamps: Mapping[str, Sequence[float]] | None = None,
        tolerance_s: float = fmt.DEFAULT_TOLERANCE_S,
        revision: str | None = None,
        video_backend: str | None = None,
        return_uint8: bool = False,
        depth_unit: str = MILLIMETRE,
    ):
        if root is None:
            if repo_id is None:
                raise ValueError("LeRobotDataset needs root= (or repo_id= of a dataset under $HF_LEROBOT_HOME)")
            root = default_root(repo_id)
        self.repo_id = repo_id
        self.root = Path(root)
        self.revision = revision
        self.video_backend = video_backend or "pyav"
        self.image_transforms = image_transforms
        self.tolerance_s = tolerance_s
        self.return_uint8 = return_uint8
        if depth_unit not in DEPTH_UNITS:
            raise ValueError(f"depth_unit must be one of {list(DEPTH_UNITS)}, got {depth_unit!r}")
        self.depth_unit = depth_unit
        self.meta = LeRobotDatasetMetadata(self.root)
        self._depth = {key: self.meta.depth_quantization(key) for key in self.meta.depth_keys}
        for key, quantization in self._depth.items():  # stats are in the recorded unit; items in depth_unit
            if self.meta.stats is not None and key in self.meta.stats:
                self.meta.stats[key] = rescale_depth_stats(self.meta.stats[key], quantization.unit, depth_unit)
        self.episodes = sorted({int(e) for e in episodes}) if episodes is not None else None
        selected = self.episodes if self.episodes is not None else [int(e) for e in self.meta.episodes["episode_index"]]
        if not selected:
            raise ValueError("episodes=[] selects no episodes")
        for ep in selected:
            self.meta.episode(ep)  # unknown episode -> DatasetError
        self.delta_timestamps = dict(delta_timestamps) if delta_timestamps is not None else None
        self.delta_indices = self._delta_indices(self.delta_timestamps)
        self._selected = np.array(selected, dtype=np.int64)
        self._parquet_keys = fmt.parquet_features(self.features)
        self._load_columns(selected)
        # Per selected episode (by position): where its frames live, so __getitem__ builds no metadata rows.
        self._data_paths = [self.meta.data_path(ep) for ep in selected]
        self._video_locations = {
            key: [(self.meta.video_path(ep, key), self.meta.video_span(ep, key)[0]) for ep in selected]
            for key in self.meta.video_keys
        }
        self._check_videos(selected)
        self._parquet_files: dict[Path, pq.ParquetFile] = {}
        self._parquet_pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers (spawn) get a copy without open parquet handles; they reopen lazily.
        state = self.__dict__.copy()
        state["_parquet_files"] = {}
        return state

    # ------------------------------------------------------------------ setup

    def _delta_indices(self, delta_timestamps: Mapping[str, Sequence[float]] | None) -> dict[str, np.ndarray]:
        """``round(d * fps)`` per key, after checking every delta is a whole number of frames (within tolerance)."""
        if not delta_timestamps:
            return {}
        fps = self.fps
        out = {}
        for key, deltas in delta_timestamps.items():
            if key not in self.features:
                raise ValueError(f"delta_timestamps key {key!r} is not a feature of {self.root}")
            d = np.asarray(list(deltas), dtype=np.float64)
            off = np.abs(d * fps - np.round(d * fps)) / fps
            if (off > self.tolerance_s).any():
                bad = d[off > self.tolerance_s].tolist()
                raise ValueError(f"delta_timestamps[{key!r}] = {bad} are not multiples of 1/fps = {1 / fps} "
                                 f"within tolerance_s={self.tolerance_s}")
            out[key] = np.round(d * fps).astype(np.int64)
        return out

    def _read_data_file(self, path: Path, wanted: set[int]) -> pa.Table:
        names = fmt.read_parquet_schema(path).names
        for key in self._parquet_keys:
            if key not in names:
                raise DatasetError(path, "column missing from the data file (declared in meta/info.json)", field=key)
        table = fmt.read_parquet(path, self._parquet_keys)
        episode_ids = table["episode_index"]
        if not set(pc.unique(episode_ids).to_pylist()) <= wanted:
            table = table.filter(pc.is_in(episode_ids, value_set=pa.array(sorted(wanted), pa.int64())))
        return table

    def _load_columns(self, selected: Sequence[int]) -> None:
        by_file: dict[Path, set[int]] = {}
        for ep in selected:
            by_file.setdefault(self.meta.data_path(ep), set()).add(ep)
        parts: dict[str, list[Any]] = {k: [] for k in self._parquet_keys}
        for path, wanted in sorted(by_file.items()):
            try:
                table = self._read_data_file(path, wanted)
            except DatasetError as e:  # a missing or corrupt file: name the first episode it holds
                raise fmt.locate_error(e, episode=min(wanted)) from None
            self._check_timestamps(path, table)
            for key in self._parquet_keys:
                parts[key].append(fmt.column_to_numpy(table[key], self.features[key], path, key))
        columns = {k: (pa.concat_arrays(v) if isinstance(v[0], pa.Array) else np.concatenate(v))
                   for k, v in parts.items()}
        order = np.argsort(columns["index"], kind="stable")
        if not np.array_equal(order, np.arange(len(order))):
            columns = {k: (v.take(pa.array(order)) if isinstance(v, pa.Array) else v[order])
                       for k, v in columns.items()}
        self._columns = {k: self._to_item_dtype(v) for k, v in columns.items()}
        lengths = np.array([self.meta.episode(ep)["length"] for ep in selected], dtype=np.int64)
        counts = np.bincount(np.searchsorted(self._selected, columns["episode_index"]), minlength=len(selected))
        for ep, count, length in zip(selected, counts, lengths, strict=True):
            if count != length:
                raise DatasetError(self.meta.data_path(ep), f"has {count} rows for this episode, meta/episodes says "
                                                            f"length {length}", episode=ep)
        self._starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self._lengths = lengths

    def _check_timestamps(self, path: Path, table: pa.Table) -> None:
        """``timestamp`` must be ``frame_index / fps`` within ``tolerance_s``: video frames are looked up by it."""
        timestamps, frame_index = table["timestamp"].to_numpy(), table["frame_index"].to_numpy()
        if fmt.timestamp_problem(timestamps, frame_index, self.fps, self.tolerance_s) is None:
            return
        episode_ids = table["episode_index"].to_numpy()
        for ep in np.unique(episode_ids):  # name the first episode at fault
            rows = episode_ids == ep
            message = fmt.timestamp_problem(timestamps[rows], frame_index[rows], self.fps, self.tolerance_s)
            if message is not None:
                raise DatasetError(path, message, field="timestamp", episode=int(ep))

    @staticmethod
    def _to_item_dtype(values: Any) -> Any:
        if isinstance(values, np.ndarray) and values.dtype.kind in _TORCH_SEMANTIC_DTYPE:
            return values.astype(_TORCH_SEMANTIC_DTYPE[values.dtype.kind], copy=False)
        return values

    def _check_videos(self, selected: Sequence[int]) -> None:
        """Fail at load time, naming file, camera and episode, rather than in a DataLoader worker later."""
        for key, locations in self._video_locations.items():
            checked: set[Path] = set()
            for ep, (path, _) in zip(selected, locations, strict=True):
                if path not in checked and not path.is_file():
                    raise DatasetError(path, "video file not found", field=key, episode=ep)
                checked.add(path)

    # ------------------------------------------------------------------ properties

    @property
    def fps(self) -> int:
        return self.meta.fps

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.meta.features

    @property
    def num_frames(self) -> int:
        return int(self._lengths.sum())

    @property
    def num_episodes(self) -> int:
        return len(self._selected)

    @property
    def episode_indices(self) -> list[int]:
        """The episodes this dataset reads (all of them unless ``episodes=`` selected some), in order."""
        return self._selected.tolist()

    def __len__(self) -> int:
        return self.num_frames

    def __repr__(self) -> str:
        return (f"LeRobotDataset(root={str(self.root)!r}, episodes={self.num_episodes}, frames={self.num_frames}, "
                f"fps={self.fps}, cameras={self.meta.camera_keys})")

    # ------------------------------------------------------------------ items

    def _camera_tensor(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [..., H, W, C] -> CHW, float32 in [0, 1] (uint8 when ``return_uint8``)."""
        tensor = torch.from_numpy(np.ascontiguousarray(frames)).movedim(-1, -3)
        return tensor.contiguous() if self.return_uint8 else tensor.to(torch.float32).div_(255.0)

    def _values(self, key: str, rows: np.ndarray | int, path: Path) -> Any:
        column = self._columns[key]
        ft = self.features[key]
        if ft["dtype"] == "image":
            channels = fmt.image_hwc(ft)[2]
            if isinstance(rows, np.ndarray):
                frames = np.stack([_decode_image(column, int(r), channels, self.root, path) for r in rows])
            else:
                frames = _decode_image(column, rows, channels, self.root, path)
            return self._camera_tensor(frames)
        if ft["dtype"] in ("string", "language"):
            return column[rows].tolist() if isinstance(rows, np.ndarray) else column[rows]
        return torch.tensor(column[rows])

    def _query_rows(self, idx: int, start: int, length: int, deltas: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        rel = idx - start + deltas
        pad = (rel < 0) | (rel >= length)
        return start + np.clip(rel, 0, length - 1), torch.from_numpy(pad)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"index {idx} out of range for a dataset of {len(self)} frames")
        pos = int(np.searchsorted(self._starts, idx, side="right")) - 1
        start, length = int(self._starts[pos]), int(self._lengths[pos])
        queries = {key: self._query_rows(idx, start, length, d) for key, d in self.delta_indices.items()}

        data_path = self._data_paths[pos]  # for error messages only
        item: dict[str, Any] = {}
        for key, locations in self._video_locations.items():
            video_path, from_timestamp = locations[pos]
            rows = queries[key][0] if key in queries else np.array([idx])
            times = self._columns["timestamp"][rows].astype(np.float64) + from_timestamp
            try:
                decoded = decode_frames(video_path, times, self.tolerance_s, depth=key in self._depth)
            except DatasetError as e:
                raise fmt.locate_error(e, field=key, episode=int(self._selected[pos])) from None
            if key in self._depth:  # float32 [.., 1, H, W] in depth_unit, as LeRobot 0.6 returns depth
                frames = torch.from_numpy(self._depth[key].dequantize(decoded, self.depth_unit)).movedim(-1, -3)
            else:
                frames = self._camera_tensor(decoded)
            item[key] = frames if key in queries else frames[0]
        for key in self._parquet_keys:
            try:
                item[key] = self._values(key, queries[key][0] if key in queries else idx, data_path)
            except DatasetError as e:  # an undecodable image
                raise fmt.locate_error(e, field=key, episode=int(self._selected[pos])) from None
        for key, (_, pad) in queries.items():
            item[f"{key}_is_pad"] = pad
        if self.image_transforms is not None:
            for key in self.meta.camera_keys:
                if key not in self._depth:  # colour transforms mean nothing to distances (LeRobot skips them too)
                    item[key] = self.image_transforms(item[key])
        item["task"] = self.meta.task_list[int(self._columns["task_index"][idx])]
        return item

    # ------------------------------------------------------------------ bulk paths

    def _parquet_file(self, path: Path) -> pq.ParquetFile:
        if self._parquet_pid != os.getpid():  # a forked worker must not share the parent's open files
            self._parquet_files, self._parquet_pid = {}, os.getpid()
        handle = self._parquet_files.get(path)
        if handle is None:
            handle = fmt.open_parquet(path)
            self._parquet_files[path] = handle
        return handle

    def read_episode(self, ep: int) -> dict[str, np.ndarray]:
        """All data-parquet columns of episode ``ep`` as numpy in their stored dtypes ([N, *shape]; scalars [N];
        image columns decoded to uint8 [N, H, W, C]; language columns object arrays of row lists), read from the
        episode's row group(s) only."""
        row = self.meta.episode(ep)
        path = self.meta.data_path(ep)
        try:
            parquet = self._parquet_file(path)
        except DatasetError as e:
            raise fmt.locate_error(e, episode=ep) from None
        missing = [k for k in self._parquet_keys if k not in parquet.schema_arrow.names]
        if missing:
            raise DatasetError(path, "column missing from the data file", field=missing[0], episode=ep)
        try:
            table = parquet.read_row_groups(_row_groups_with(parquet, "episode_index", ep), columns=self._parquet_keys)
        except (pa.ArrowException, OSError) as e:
            raise DatasetError(path, f"cannot read parquet: {e}", episode=ep) from None
        table = table.filter(pc.equal(table["episode_index"], ep))
        if table.num_rows != row["length"]:
            raise DatasetError(path, f"has {table.num_rows} rows for this episode, meta/episodes says length "
                                     f"{row['length']}", episode=ep)
        out = {}
        for key in self._parquet_keys:
            try:
                values = fmt.column_to_numpy(table[key], self.features[key], path, key)
                if self.features[key]["dtype"] == "image":
                    channels = fmt.image_hwc(self.features[key])[2]
                    values = np.stack([_decode_image(values, i, channels, self.root, path)
                                       for i in range(len(values))])
            except DatasetError as e:
                raise fmt.locate_error(e, field=key, episode=ep) from None
            out[key] = values
        return out

    def decode_episode_video(self, ep: int, key: str) -> np.ndarray:
        """uint8 [N, H, W, 3]: every frame of episode ``ep`` for camera ``key``, in one sequential decode (a depth map:
        float32 [N, H, W, 1] in ``depth_unit``)."""
        if key not in self.meta.video_keys:
            raise KeyError(f"{key!r} is not a video feature; video keys: {self.meta.video_keys}")
        path = self.meta.video_path(ep, key)
        from_ts, to_ts = self.meta.video_span(ep, key)
        try:
            frames = decode_range(path, from_ts, to_ts, depth=key in self._depth)
        except DatasetError as e:
            raise fmt.locate_error(e, field=key, episode=ep) from None
        if key in self._depth:
            frames = self._depth[key].dequantize(frames, self.depth_unit)
        length = self.meta.episode(ep)["length"]
        if len(frames) != length:
            raise DatasetError(path, f"decoded {len(frames)} frames between {from_ts}s and {to_ts}s, the episode has "
                                     f"{length}", field=key, episode=ep)
        return frames
