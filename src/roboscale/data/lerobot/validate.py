"""Check a LeRobot v3.0 dataset file by file and report every problem at once; summarise it for ``data info``.

``validate(root)`` never stops at the first problem: each file and each episode is checked on its own and every
problem becomes a ``Problem`` naming the file, the episode(s) and the field. Only an unreadable ``meta/info.json``
ends the check early (without it nothing else can be interpreted); without any readable ``meta/episodes`` file the
data and video files cannot be attributed to episodes and are not checked.

Two depths:
- ``full=True`` (``roboscale data validate``): every parquet is read completely (all columns, every PNG image
  decoded), every episode's video span is decoded, its frames counted against ``length`` and their times
  checked against ``from_timestamp + k / fps``.
- ``full=False`` (``bad_episodes``, for ``--skip-bad-episodes`` at loader start): metadata, parquet footers and
  schemas, the five small index columns (``episode_index``, ``frame_index``, ``index``, ``timestamp``,
  ``task_index``) and the float feature columns (state, actions, rewards: NaN and Inf) of every data file, and one
  decoded frame per episode and camera (the episode's last one: a seek plus at most a GOP of decoding, which
  catches truncated and missing mp4s). Cost: O(frames) of column reads plus O(episodes × cameras) single-frame
  decodes; no image column is read. Measured on 2 shared cores: 100 episodes × 30 frames × 2 cameras (64², AV1)
  take 0.2 s quick and 0.36 s full, i.e. about 1 ms per episode and camera; larger frames cost more per decode
  (one GOP, g=2). The float columns add 2-3 µs per frame at 56 float32 values a frame (200 episodes × 120
  frames: +40-80 ms of CPU on 0.6-0.8 s).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import av
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot import language
from roboscale.data.lerobot.depth import DepthQuantization, is_depth_map
from roboscale.data.lerobot.format import timestamp_problem
from roboscale.data.lerobot.video import decode_frames, decode_png, frame_times
from roboscale.errors import DatasetError
from roboscale.utils.text import printable

log = logging.getLogger(__name__)

_INDEX_COLUMNS = ("episode_index", "frame_index", "index", "timestamp", "task_index")
_EPISODE_COLUMNS = ("episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index",
                    "dataset_to_index")
_VIDEO_SUFFIXES = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
_REQUIRED_STATS = ("min", "max", "mean", "std", "count")


def stats_value_problems(stats: Mapping[str, np.ndarray], feature: Mapping[str, Any]) -> list[str]:
    """What is wrong with one feature's normalization stats: sizes that do not match the feature (cameras: one
    value per channel), non-finite values, a negative std or count, and min <= q01 <= ... <= q99 <= max and
    min <= mean <= max broken beyond float32 rounding. A model normalized with such stats trains on garbage."""
    size = fmt.image_hwc(feature)[2] if fmt.is_camera(feature) else int(np.prod(fmt.feature_shape(feature)))
    names = [n for n in ("min", "max", "mean", "std", *fmt.QUANTILES) if n in stats]
    values = {n: np.asarray(stats[n], dtype=np.float64).reshape(-1) for n in names}
    problems = [f"'{n}' has {v.size} values, the feature has {size}" for n, v in values.items() if v.size != size]
    if problems:
        return problems
    problems += [f"'{n}' is not finite" for n, v in values.items() if not np.isfinite(v).all()]
    count = np.asarray(stats["count"], dtype=np.float64).reshape(-1)
    if count.size != 1 or not np.isfinite(count).all() or count[0] <= 0:
        problems.append(f"'count' must be one positive number, got {count.tolist()}")
    if problems:
        return problems
    lo, hi = values["min"], values["max"]
    slack = 1e-5 * np.maximum(1.0, np.abs(lo) + np.abs(hi))  # float32 rounding of what was written
    if (values["std"] < 0).any():
        problems.append("'std' is negative")
    order = ["min", *[q for q in fmt.QUANTILES if q in values], "max"]
    for a, b in zip(order, order[1:]):
        above = np.flatnonzero(values[a] > values[b] + slack)
        if above.size:
            problems.append(f"'{a}' exceeds '{b}' (at dims {above[:5].tolist()})")
    if ((values["mean"] < lo - slack) | (values["mean"] > hi + slack)).any():
        problems.append("'mean' lies outside [min, max]")
    return problems


def float_features(features: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The data columns that can hold NaN or Inf (state, actions, rewards, timestamps)."""
    return [k for k in fmt.parquet_features(features) if str(features[k]["dtype"]).startswith("float")]


def nonfinite_problem(values: np.ndarray, frame_index: np.ndarray) -> str | None:
    """What is not finite in one episode's float ``values`` [N, ...] (None when all are): NaN and Inf in the data
    make the loss NaN, and the trainer would skip those steps instead of learning."""
    bad = ~np.isfinite(values.reshape(len(values), -1))
    if not bad.any():
        return None
    frames, dims = np.flatnonzero(bad.any(axis=1)), np.flatnonzero(bad.any(axis=0))
    kinds = "/".join(name for name, hit in (("NaN", np.isnan(values).any()), ("Inf", np.isinf(values).any())) if hit)
    shown = ", ".join(map(str, dims[:8].tolist())) + (", …" if dims.size > 8 else "")
    count = int(bad.sum())
    return (f"{count} non-finite value{'s' if count > 1 else ''} ({kinds}) in {frames.size} of {len(values)} frames "
            f"(first at frame {int(frame_index[frames[0]])}), dims [{shown}]")


# --------------------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a dataset. ``episode`` is the episode at fault; ``episodes`` lists the episodes a
    file-level problem (a missing or unreadable file) makes unreadable. Neither set, or ``fatal`` (the reader
    refuses the whole dataset, e.g. a gap in the episode indices): skipping episodes cannot work around it."""

    path: Path
    message: str
    field: str | None = None
    episode: int | None = None
    episodes: tuple[int, ...] = ()
    fatal: bool = False

    @property
    def affected(self) -> tuple[int, ...]:
        """The episodes a loader can skip to avoid this problem (none for dataset-level problems)."""
        if self.fatal:
            return ()
        return (self.episode,) if self.episode is not None else self.episodes

    def __str__(self) -> str:
        where = [str(self.path)]
        if self.episode is not None:
            where.append(f"episode {self.episode}")
        elif self.episodes:
            where.append(f"episode {self.episodes[0]}" if len(self.episodes) == 1 else
                         f"episodes {_ranges(self.episodes)}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        return printable(": ".join(where) + f": {self.message}")  # file names and messages quote the dataset


@dataclass
class Report:
    root: Path
    full: bool
    problems: list[Problem] = field(default_factory=list)
    episodes: int = 0
    frames: int = 0
    files_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    episode_ids: frozenset[int] = frozenset()

    def dataset_problems(self) -> list[Problem]:
        """Problems skipping episodes cannot avoid (info.json, tasks, stats, episode indices, totals)."""
        return [p for p in self.problems if not p.affected]

    def bad_episodes(self) -> dict[int, str]:
        """episode -> the first problem found with it."""
        out: dict[int, str] = {}
        for problem in self.problems:
            for ep in problem.affected:
                if ep in self.episode_ids:  # rows of unlisted episodes are never read: nothing to skip
                    out.setdefault(ep, str(problem))
        return dict(sorted(out.items()))


def _ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (long lists shortened)."""
    values = sorted(set(values))
    if not values:
        return "none"
    parts: list[str] = []
    start = prev = values[0]
    for v in [*values[1:], None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(parts[:8]) + (f", … ({len(values)} in all)" if len(parts) > 8 else "")


# --------------------------------------------------------------------------------------------------- checker


class _Checker:
    def __init__(self, root: Path, tolerance_s: float, full: bool):
        self.root, self.tol, self.full = root, tolerance_s, full
        self.report = Report(root, full)

    def add(self, path: Path, message: str, field: str | None = None, episode: int | None = None,
            episodes: Iterable[int] = (), fatal: bool = False) -> None:
        self.report.problems.append(Problem(path, message, field, episode, tuple(sorted(set(episodes))), fatal))

    def add_error(self, err: DatasetError, episodes: Iterable[int] = ()) -> None:
        self.add(err.path, fmt.error_message(err), err.field, err.episode, () if err.episode is not None else episodes)

    # ------------------------------------------------------------------ metadata

    def run(self) -> Report:
        try:
            info = fmt.read_info(self.root)
        except DatasetError as e:
            self.add_error(e)
            return self.report
        tasks = self._tasks(info)
        episodes = self._episodes(info, tasks)
        self._stats_json(info)
        if episodes is not None:
            self.report.episodes = len(episodes["episode_index"])
            self.report.episode_ids = frozenset(int(e) for e in episodes["episode_index"])
            self.report.frames = int(np.sum(episodes["length"]))
            self._data_files(info, episodes, len(tasks) if tasks is not None else None)
            self._videos(info, episodes)
        return self.report

    def _tasks(self, info: fmt.DatasetInfo) -> list[str] | None:
        try:
            tasks = fmt.read_tasks(self.root)
        except DatasetError as e:
            self.add_error(e)
            return None
        if info.total_tasks != len(tasks):
            self.add(self.root / fmt.INFO_PATH, f"says {info.total_tasks} tasks, meta/tasks.parquet has {len(tasks)}",
                     field="total_tasks")
        return tasks

    def _episodes(self, info: fmt.DatasetInfo, tasks: list[str] | None) -> dict[str, Any] | None:
        """The episodes metadata as numpy/list columns sorted by episode_index (None when none is readable)."""
        files = fmt.episodes_files(self.root)
        if not files:
            self.add(self.root / fmt.EPISODES_DIR, "no episodes parquet files found")
            return None
        wanted = [*_EPISODE_COLUMNS, "tasks",
                  *(f"videos/{k}/{s}" for k in info.video_keys for s in _VIDEO_SUFFIXES)]
        tables = []
        for path in files:
            self.report.files_checked += 1
            try:
                names = fmt.read_parquet_schema(path).names
                missing = [c for c in wanted if c not in names]
                for column in missing:
                    self.add(path, "column missing from episodes metadata", field=column)
                if any(c in missing for c in _EPISODE_COLUMNS):
                    continue
                self._stats_columns(path, names, info)
                table = fmt.read_parquet(path, [c for c in wanted if c in names])
            except DatasetError as e:
                self.add_error(e)
                continue
            tables.append(table)
        if not tables:
            return None
        try:
            table = pa.concat_tables(tables, promote_options="default").sort_by("episode_index")
        except pa.ArrowException as e:
            self.add(self.root / fmt.EPISODES_DIR, f"episodes files have incompatible schemas: {e}")
            return None
        columns = {name: (table[name].to_numpy() if name != "tasks" else table[name].to_pylist())
                   for name in table.column_names}
        self._episode_rows(info, columns, tasks)
        return columns

    def _stats_columns(self, path: Path, names: list[str], info: fmt.DatasetInfo) -> None:
        for key in fmt.stats_features(info.features):
            absent = [s for s in _REQUIRED_STATS if f"stats/{key}/{s}" not in names]
            if absent:
                self.add(path, f"per-episode stats missing: {absent}", field=f"stats/{key}")

    def _episode_rows(self, info: fmt.DatasetInfo, eps: Mapping[str, Any], tasks: list[str] | None) -> None:
        where = self.root / fmt.EPISODES_DIR
        info_path = self.root / fmt.INFO_PATH
        ids = eps["episode_index"]
        unique, counts = np.unique(ids, return_counts=True)
        for ep in unique[counts > 1]:
            self.add(where, "listed more than once", field="episode_index", episode=int(ep), fatal=True)
        if len(unique):
            missing = sorted(set(range(int(unique.max()) + 1)) - set(unique.tolist()))
            if missing or unique.min() != 0:
                self.add(where, f"episode indices must be 0..{len(unique) - 1} without gaps; missing "
                                f"{_ranges(missing) if missing else 'none'} (LeRobot indexes episodes by position)",
                         field="episode_index", episode=missing[0] if missing else int(unique.min()), fatal=True)
        if info.total_episodes != len(ids):
            self.add(info_path, f"says {info.total_episodes} episodes, meta/episodes has {len(ids)}",
                     field="total_episodes", fatal=True)
        if info.total_frames != int(np.sum(eps["length"])):
            self.add(info_path, f"says {info.total_frames} frames, the episodes' lengths sum to "
                                f"{int(np.sum(eps['length']))}", field="total_frames")
        previous_to = 0
        for row, ep in enumerate(ids.tolist()):
            length, start, stop = (int(eps[c][row]) for c in ("length", "dataset_from_index", "dataset_to_index"))
            if length <= 0:
                self.add(where, f"length must be positive, got {length}", field="length", episode=ep)
            if stop - start != length:
                self.add(where, f"dataset_to_index - dataset_from_index = {stop - start}, length is {length}",
                         field="length", episode=ep)
            if start != previous_to:
                self.add(where, f"global index starts at {start}, the previous episode ended at {previous_to}",
                         field="dataset_from_index", episode=ep, fatal=True)
            previous_to = stop
            if tasks is not None and "tasks" in eps:
                unknown = [t for t in (eps["tasks"][row] or []) if t not in tasks]
                if unknown:
                    self.add(where, f"tasks {unknown} are not in meta/tasks.parquet", field="tasks", episode=ep)
            for key in info.video_keys:
                self._video_span_row(eps, row, ep, key, length, info.fps)

    def _video_span_row(self, eps: Mapping[str, Any], row: int, ep: int, key: str, length: int, fps: int) -> None:
        start_col, stop_col = f"videos/{key}/from_timestamp", f"videos/{key}/to_timestamp"
        if start_col not in eps or stop_col not in eps:
            return  # reported as a missing column
        span = float(eps[stop_col][row]) - float(eps[start_col][row])
        # LeRobot records the episode mp4's duration: length/fps for constant frame rate; a real mismatch is a frame.
        if abs(span - length / fps) > 0.5 / fps:
            self.add(self.root / fmt.EPISODES_DIR, f"video span {span:.6f}s holds {span * fps:.2f} frames at {fps} "
                                                   f"fps, the episode has {length}", field=stop_col, episode=ep)

    def _stats_json(self, info: fmt.DatasetInfo) -> None:
        path = self.root / fmt.STATS_PATH
        try:
            stats = fmt.read_stats(self.root)
        except DatasetError as e:
            self.add_error(e)
            return
        if stats is None:
            self.add(path, "file not found (training needs normalization stats)")
            return
        for key in fmt.stats_features(info.features):
            if key not in stats:
                self.add(path, "no stats for this feature", field=key)
                continue
            absent = [s for s in _REQUIRED_STATS if s not in stats[key]]
            if absent:
                self.add(path, f"stats missing: {absent}", field=key)
                continue
            for problem in stats_value_problems(stats[key], info.features[key]):
                self.add(path, problem, field=key)

    # ------------------------------------------------------------------ data files

    def _file_of(self, eps: Mapping[str, Any], row: int, template: str, key: str, **values: Any) -> Path | None:
        """The file info.json's ``key`` template names for this episode row; None, and a problem with the
        episode, when it would lie outside the dataset."""
        try:
            return fmt.dataset_path(self.root, template, key, **values)
        except DatasetError as e:
            self.add_error(e, [int(eps["episode_index"][row])])
            return None

    def _data_files(self, info: fmt.DatasetInfo, eps: Mapping[str, Any], num_tasks: int | None) -> None:
        by_file: dict[Path, list[int]] = {}
        for row in range(len(eps["episode_index"])):
            path = self._file_of(eps, row, info.data_path, "data_path", chunk_index=int(eps["data/chunk_index"][row]),
                                 file_index=int(eps["data/file_index"][row]))
            if path is not None:
                by_file.setdefault(path, []).append(row)
        # Files no episode points at are checked too: their rows belong to episodes the metadata lost.
        for path in (self.root / "data").glob("**/*.parquet"):
            by_file.setdefault(path, [])
        for path, rows in sorted(by_file.items()):
            self.report.files_checked += 1
            episodes = [int(eps["episode_index"][r]) for r in rows]
            try:
                self._data_file(path, rows, eps, info, num_tasks)
            except DatasetError as e:
                self.add_error(e, episodes)
            except Exception as e:  # a validator reports, it does not crash on the unexpected
                log.debug("unexpected error checking %s", path, exc_info=True)
                self.add(path, f"cannot check: {type(e).__name__}: {e}", episodes=episodes)

    def _data_file(self, path: Path, rows: list[int], eps: Mapping[str, Any], info: fmt.DatasetInfo,
                   num_tasks: int | None) -> None:
        episodes = [int(eps["episode_index"][r]) for r in rows]
        if not path.is_file():
            raise DatasetError(path, "data file not found")
        schema = fmt.read_parquet_schema(path)
        expected = fmt.data_schema(info.features)
        present = []
        for fld in expected:
            if fld.name not in schema.names:
                self.add(path, "column missing (declared in meta/info.json)", field=fld.name, episodes=episodes)
            elif language.is_language(info.features[fld.name]):
                problem = language.arrow_type_problem(schema.field(fld.name).type, fld.name)
                if problem:
                    self.add(path, problem, field=fld.name, episodes=episodes)
                else:
                    present.append(fld.name)
            elif not _type_compatible(schema.field(fld.name).type, fld.type):
                self.add(path, f"column type {schema.field(fld.name).type} does not match meta/info.json "
                               f"({fld.type})", field=fld.name, episodes=episodes)
            else:
                present.append(fld.name)
        if any(c not in present for c in ("episode_index", "frame_index", "index")):
            return  # rows cannot be attributed to episodes
        index = [c for c in _INDEX_COLUMNS if c in present]
        # quick: the float columns too, for NaN/Inf (one vectorized pass per file, cheap next to the video decodes)
        floats = [c for c in float_features(info.features) if c in present and c not in index]
        table = fmt.read_parquet(path, present if self.full else [*index, *floats])
        ids = table["episode_index"].to_numpy()
        claimed = set(episodes)
        for ep in sorted(set(np.unique(ids).tolist()) - claimed):
            self.add(path, "file holds rows of an episode that meta/episodes places elsewhere (or does not list)",
                     field="episode_index", episode=int(ep))
        self._finite_values(path, table, claimed, info)
        if not self.full:  # the per-episode checks below read the index columns only: filter just those
            table = table.select(index)
        for row, ep in zip(rows, episodes, strict=True):
            self._data_episode(path, table.filter(pc.equal(table["episode_index"], ep)), ep, eps, row, info,
                               num_tasks)

    def _finite_values(self, path: Path, table: pa.Table, claimed: set[int], info: fmt.DatasetInfo) -> None:
        """Every float value of the file is finite: one vectorized pass per column; only a column that holds NaN or
        Inf is split by episode."""
        episode_index, frame_index = (table[c].to_numpy() for c in ("episode_index", "frame_index"))
        for key in float_features(info.features):
            if key not in table.column_names:
                continue
            try:
                values = fmt.column_to_numpy(table[key], info.features[key], path, key)
            except DatasetError:
                continue  # a column of the wrong size: the full check reports it per episode (_data_values)
            bad_rows = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            for ep in np.unique(episode_index[bad_rows]).tolist():
                mine = episode_index == ep
                message = nonfinite_problem(values[mine], frame_index[mine])
                if message and ep in claimed:  # other rows are reported above and never read
                    self.add(path, message, field=key, episode=int(ep))

    def _data_episode(self, path: Path, table: pa.Table, ep: int, eps: Mapping[str, Any], row: int,
                      info: fmt.DatasetInfo, num_tasks: int | None) -> None:
        length, start = int(eps["length"][row]), int(eps["dataset_from_index"][row])
        if table.num_rows != length:
            self.add(path, f"has {table.num_rows} rows for this episode, meta/episodes says length {length}",
                     field="length", episode=ep)
            if table.num_rows == 0:
                return
        frame_index = table["frame_index"].to_numpy()
        if not np.array_equal(frame_index, np.arange(len(frame_index))):
            self.add(path, f"must be 0..{len(frame_index) - 1} in order", field="frame_index", episode=ep)
        index = table["index"].to_numpy()
        if not np.array_equal(index, np.arange(start, start + len(index))):
            self.add(path, f"must be {start}..{start + len(index) - 1} (dataset_from_index onwards)", field="index",
                     episode=ep)
        if "timestamp" in table.column_names:
            message = timestamp_problem(table["timestamp"].to_numpy(), frame_index, info.fps, self.tol)
            if message:
                self.add(path, message, field="timestamp", episode=ep)
        if "task_index" in table.column_names and num_tasks is not None:
            task_index = table["task_index"].to_numpy()
            if task_index.size and (task_index.min() < 0 or task_index.max() >= num_tasks):
                self.add(path, f"values outside 0..{num_tasks - 1} (meta/tasks.parquet)", field="task_index",
                         episode=ep)
        if self.full:
            self._data_values(path, table, ep, info)

    def _data_values(self, path: Path, table: pa.Table, ep: int, info: fmt.DatasetInfo) -> None:
        """Full mode: every value column has its declared shape; every image decodes."""
        for key in fmt.parquet_features(info.features):
            if key not in table.column_names or key in _INDEX_COLUMNS:
                continue
            ft = info.features[key]
            try:
                if ft["dtype"] == "image":
                    self._images(path, table[key].combine_chunks(), fmt.image_hwc(ft), key, ep)
                elif language.is_language(ft):
                    self._language(path, fmt.column_to_numpy(table[key], ft, path, key), key, ep, info)
                else:
                    fmt.column_to_numpy(table[key], ft, path, key)
            except DatasetError as e:
                self.add(path, fmt.error_message(e), field=key, episode=ep)

    def _language(self, path: Path, cells: np.ndarray, key: str, ep: int, info: fmt.DatasetInfo) -> None:
        """Every annotation row has LeRobot's fields and types, sits in its style's column, and names a camera of
        the dataset exactly when its style is view-dependent; one problem per episode (the first, and a count)."""
        cameras = {k for k, f in info.features.items() if fmt.is_camera(f)}
        found = [(i, p) for i, cell in enumerate(cells) for p in language.cell_problems(cell, key, cameras)]
        if found:
            (frame, first), more = found[0], len(found) - 1
            self.add(path, f"frame {frame}, {first}" + (f" (and {more} more)" if more else ""), field=key, episode=ep)

    def _images(self, path: Path, column: pa.StructArray, hwc: tuple[int, int, int], key: str, ep: int) -> None:
        for i, data in enumerate(column.field("bytes").to_pylist()):
            if data is None:
                continue  # a path reference: the reader resolves it lazily
            image = decode_png(data, hwc[2], source=path)
            if image.shape != hwc:
                self.add(path, f"image of frame {i} is {list(image.shape)}, meta/info.json declares {list(hwc)}",
                         field=key, episode=ep)
                return

    # ------------------------------------------------------------------ videos

    def _videos(self, info: fmt.DatasetInfo, eps: Mapping[str, Any]) -> None:
        for key in info.video_keys:
            if is_depth_map(info.features[key]):
                self._depth_info(key, info.features[key])
            columns = [f"videos/{key}/{s}" for s in _VIDEO_SUFFIXES]
            if any(c not in eps for c in columns):
                continue  # reported with the episodes metadata
            by_file: dict[Path, list[int]] = {}
            for row in range(len(eps["episode_index"])):
                assert info.video_path is not None
                path = self._file_of(eps, row, info.video_path, "video_path", video_key=key,
                                     chunk_index=int(eps[columns[0]][row]), file_index=int(eps[columns[1]][row]))
                if path is not None:
                    by_file.setdefault(path, []).append(row)
            for path, rows in sorted(by_file.items()):
                self.report.files_checked += 1
                episodes = [int(eps["episode_index"][r]) for r in rows]
                try:
                    self._video_file(path, key, rows, eps, info)
                except DatasetError as e:
                    self.add(e.path, fmt.error_message(e), field=key, episode=e.episode,
                             episodes=() if e.episode is not None else episodes)
                except Exception as e:
                    log.debug("unexpected error checking %s", path, exc_info=True)
                    self.add(path, f"cannot check: {type(e).__name__}: {e}", field=key, episodes=episodes)

    def _video_file(self, path: Path, key: str, rows: list[int], eps: Mapping[str, Any], info: fmt.DatasetInfo
                    ) -> None:
        if not path.is_file():
            raise DatasetError(path, "video file not found")
        self._stream_matches_info(path, key, info.features[key])
        start_col, stop_col = f"videos/{key}/from_timestamp", f"videos/{key}/to_timestamp"
        spans = sorted((float(eps[start_col][r]), float(eps[stop_col][r]), r) for r in rows)
        for (_, prev_stop, prev_row), (start, _, row) in zip(spans, spans[1:], strict=False):
            if start < prev_stop - self.tol:
                self.add(self.root / fmt.EPISODES_DIR, f"video span starts at {start:.6f}s, before episode "
                         f"{int(eps['episode_index'][prev_row])} ends ({prev_stop:.6f}s) in the same file",
                         field=start_col, episode=int(eps["episode_index"][row]))
        for start, stop, row in spans:
            ep, length = int(eps["episode_index"][row]), int(eps["length"][row])
            try:
                if self.full:
                    self._video_span(path, key, ep, length, start, stop, info.fps)
                else:  # the last frame: a truncated file fails here
                    decode_frames(path, [start + (length - 1) / info.fps], self.tol,
                                  depth=is_depth_map(info.features[key]))
            except DatasetError as e:
                self.add(path, fmt.error_message(e), field=key, episode=ep)

    def _video_span(self, path: Path, key: str, ep: int, length: int, start: float, stop: float, fps: int) -> None:
        """Every frame of the span decodes, there are ``length`` of them, and frame k is where the reader will look
        for it: at ``from_timestamp + k / fps`` within the tolerance."""
        times = frame_times(path, start, stop)
        if len(times) != length:
            self.add(path, f"decoded {len(times)} frames between {start:.6f}s and {stop:.6f}s, the episode has "
                           f"{length}", field=key, episode=ep)
            return
        off = np.abs(times - (start + np.arange(length) / fps))
        if off.max() > self.tol:
            k = int(off.argmax())
            self.add(path, f"frame {k} is at {times[k]:.6f}s, the reader looks for it at "
                           f"{start + k / fps:.6f}s (tolerance_s={self.tol})", field=key, episode=ep)

    def _depth_info(self, key: str, feature: Mapping[str, Any]) -> None:
        try:
            DepthQuantization.of(feature)
        except ValueError as e:
            self.add(self.root / fmt.INFO_PATH, str(e), field=key)

    def _stream_matches_info(self, path: Path, key: str, feature: Mapping[str, Any]) -> None:
        try:
            with av.open(str(path), "r") as container:
                if not container.streams.video:
                    raise DatasetError(path, "file has no video stream")
                cc = container.streams.video[0].codec_context
                codec, width, height = cc.codec.canonical_name, cc.width, cc.height
                pixels = cc.format.name if cc.format is not None else ""
        except (av.FFmpegError, OSError) as e:
            raise DatasetError(path, f"cannot open video (corrupt or truncated?): {e}") from None
        h, w, _ = fmt.image_hwc(feature)
        if (height, width) != (h, w):
            self.add(path, f"video is {width}x{height}, meta/info.json declares {w}x{h}", field=key)
        if is_depth_map(feature) and not pixels.startswith("gray"):
            # an RGB stream marked as a depth map would be read as distances, and left out of every policy's cameras
            self.add(path, f"meta/info.json marks this camera a depth map (is_depth_map: true), but its stream is "
                           f"{pixels or 'of unknown pixel format'}, not a gray depth stream: set is_depth_map to "
                           "false if it is an RGB camera", field=key)
        declared = (feature.get("info") or {}).get("video.codec")
        if isinstance(declared, str) and declared != codec:
            self.add(path, f"video codec is {codec}, meta/info.json declares {declared}", field=key)


def _type_compatible(actual: pa.DataType, expected: pa.DataType) -> bool:
    """Same nesting and leaf type; a variable-length list may stand for a fixed-size one (old HF ``datasets``)."""
    def is_list(t: pa.DataType) -> bool:
        return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)

    while is_list(actual) and is_list(expected):
        if pa.types.is_fixed_size_list(actual) and actual.list_size != expected.list_size:
            return False
        actual, expected = actual.value_type, expected.value_type
    if is_list(actual) or is_list(expected):
        return False
    if pa.types.is_struct(expected):  # image: {bytes, path}
        return pa.types.is_struct(actual) and actual.get_field_index("bytes") >= 0
    if pa.types.is_string(expected):
        return pa.types.is_string(actual) or pa.types.is_large_string(actual)
    return actual == expected


# --------------------------------------------------------------------------------------------------- public


def validate(root: str | Path, *, full: bool = True, tolerance_s: float = fmt.DEFAULT_TOLERANCE_S) -> Report:
    """Check every file of the dataset at ``root``; the report lists every problem found (see the module doc)."""
    return _Checker(Path(root), tolerance_s, full).run()


def bad_episodes(root: str | Path, *, tolerance_s: float = fmt.DEFAULT_TOLERANCE_S) -> dict[int, str]:
    """episode -> reason, for every episode a loader should skip (``--skip-bad-episodes``); {} when all are fine.

    Runs the quick check (``full=False``; cost in the module doc). Problems with the dataset as a whole (info.json,
    tasks, episodes metadata, stats.json, gaps in the episode indices) cannot be skipped around: they raise one
    DatasetError that names the first of them and counts the rest."""
    report = validate(root, full=False, tolerance_s=tolerance_s)
    general = report.dataset_problems()
    if general:
        more = f" (and {len(general) - 1} more dataset-level problems)" if len(general) > 1 else ""
        first = general[0]
        raise DatasetError(first.path, f"{first.message}{more}; run `roboscale data validate {root}` for all",
                           field=first.field, episode=first.episode)
    return report.bad_episodes()


def readable_or_raise(root: str | Path, bad: Mapping[int, str], total: int, *, skip_bad_episodes: bool) -> None:
    """The gate in front of training data: refuse a dataset with unreadable episodes unless they are skipped, and
    refuse one where skipping would leave nothing. ``bad`` is ``bad_episodes(root)`` restricted to the ``total``
    episodes the caller reads."""
    if not bad:
        return
    first = next(iter(bad.values()))
    if not skip_bad_episodes:
        raise DatasetError(root, f"{len(bad)} of {total} episodes cannot be read (first: {first}); fix them, or skip "
                                 "them with --skip-bad-episodes (skip_bad_episodes=True); `roboscale data validate` "
                                 "lists every problem")
    if len(bad) >= total:
        raise DatasetError(root, f"all {total} episodes were skipped because they cannot be read (first: {first}); "
                                 "`roboscale data validate` lists every problem")


__all__ = ["Problem", "Report", "bad_episodes", "printable", "timestamp_problem", "validate"]
