"""Ways a LeRobot v3.0 dataset gets damaged, as data: each ``Damage`` edits a copy of the small test dataset
(``tests.data.conftest.write_small_dataset``: 5 episodes of 7/11/6/9/12 frames, two cameras whose mp4 files
rotate: episodes 0-2 in file-000, 3-4 in file-001, one data parquet per episode).

``bad`` is the set of episodes the damage makes unreadable (what ``--skip-bad-episodes`` must skip, and nothing
else), or None when the dataset as a whole is refused. ``found`` says when a reader can know: ``"upfront"`` (the
cheap checks every reader runs before it starts: metadata, indices, timestamps, one frame per episode and camera)
or ``"read"`` (only by decoding the damaged frames).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from roboscale.data.loading.raw_source import RawSource

FRONT = "observation.images.front"
WRIST = "observation.images.wrist"


@dataclass(frozen=True)
class Damage:
    name: str
    what: str
    """One line for docs/reliability.md."""
    apply: Callable[[Path], None]
    bad: frozenset[int] | Callable[[Path], frozenset[int]] | None
    """The episodes the damage makes unreadable, or how to find them in the pristine dataset (which episodes share
    a video file depends on the encoder's output sizes, so the file layout is looked up, not assumed)."""
    found: str = "upfront"
    expect: dict[str, str] = field(default_factory=dict)
    """Outcomes that differ from the defaults of the entry points (see test_dataset_faults.py)."""

    def bad_episodes(self, pristine: Path) -> frozenset[int]:
        assert self.bad is not None
        return self.bad(pristine) if callable(self.bad) else self.bad


# --------------------------------------------------------------------------------------------------- helpers


def _data_file(root: Path, episode: int) -> Path:
    return RawSource(root).data_path(episode)


def _video_file(root: Path, episode: int, key: str) -> Path:
    return RawSource(root).video_location(episode, key)[0]


def _sharing_video_file(episode: int, key: str) -> Callable[[Path], frozenset[int]]:
    """The episodes stored in the same video file as ``episode``'s ``key`` camera."""
    def find(root: Path) -> frozenset[int]:
        source = RawSource(root)
        path = _video_file(root, episode, key)
        return frozenset(ep for ep in range(len(source.episode_lengths)) if _video_file(root, ep, key) == path)

    return find


def _edit_table(path: Path, edit: Callable[[pa.Table], pa.Table]) -> None:
    table = pq.read_table(path)
    pq.write_table(edit(table), path)


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=4))


def _overwrite(path: Path, start: int, stop: int, seed: int = 0) -> None:
    """Random bytes over [start, stop) of a file (its size unchanged)."""
    data = bytearray(path.read_bytes())
    data[start:stop] = np.random.default_rng(seed).integers(0, 256, stop - start, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def _corrupt_video_packets(path: Path, from_s: float, to_s: float) -> None:
    """Random bytes over the payload of every packet presented in [from_s, to_s): the container stays valid, the
    frames there do not decode."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        spans = [(p.pos, p.pos + p.size) for p in container.demux(stream)
                 if p.size and p.pts is not None and from_s - 1e-6 <= float(p.pts * stream.time_base) < to_s - 1e-6]
    assert spans, f"no packets in [{from_s}, {to_s}) of {path}"
    for i, (start, stop) in enumerate(spans):
        _overwrite(path, start, stop, seed=i)


def _episode_span(root: Path, episode: int, key: str) -> tuple[float, float]:
    source = RawSource(root)
    _, start = source.video_location(episode, key)
    return start, start + int(source.episode_lengths[episode]) / source.fps


# --------------------------------------------------------------------------------------------------- damages


def shift_timestamps(root: Path) -> None:
    def edit(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index("timestamp")
        return table.set_column(i, "timestamp", pc.add(table["timestamp"], pa.scalar(0.5, pa.float32())))

    _edit_table(_data_file(root, 1), edit)


def corrupt_episode_end_in_video(root: Path) -> None:
    start, stop = _episode_span(root, 1, FRONT)
    _corrupt_video_packets(_video_file(root, 1, FRONT), stop - 0.3, stop)  # its last frames, and their keyframe


def corrupt_episode_middle_in_video(root: Path) -> None:
    start, _ = _episode_span(root, 1, FRONT)
    _corrupt_video_packets(_video_file(root, 1, FRONT), start + 0.3, start + 0.5)


def truncate_video(root: Path) -> None:
    path = _video_file(root, 3, FRONT)
    path.write_bytes(path.read_bytes()[:200])


def delete_video(root: Path) -> None:
    _video_file(root, 0, WRIST).unlink()


def delete_data_file(root: Path) -> None:
    _data_file(root, 2).unlink()


def truncate_data_file(root: Path) -> None:
    path = _data_file(root, 3)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble_data_pages(root: Path) -> None:
    """Random bytes in the column pages (the footer intact): only reading the values finds it."""
    path = _data_file(root, 4)
    group = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(group.column(i) for i in range(group.num_columns)
                 if group.column(i).path_in_schema.split(".")[0] == "action")
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    _overwrite(path, start, start + chunk.total_compressed_size)


def set_values(root: Path, episode: int, key: str, frames: slice, value: float) -> None:
    """``value`` into the last dimension of ``key`` at ``frames`` of the episode's data parquet (meta/stats.json
    untouched: what a damaged copy or a tool that wrote the data after the stats leaves)."""
    def edit(table: pa.Table) -> pa.Table:
        column = table[key].combine_chunks()
        values = column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), -1).copy()
        values[frames, -1] = value
        edited = pa.FixedSizeListArray.from_arrays(pa.array(values.ravel(), column.type.value_type),
                                                   column.type.list_size)
        i = table.schema.get_field_index(key)
        return table.set_column(i, table.schema.field(i), edited)

    _edit_table(_data_file(root, episode), edit)


def nan_in_actions(root: Path) -> None:
    set_values(root, 1, "action", slice(2, 5), float("nan"))


def inf_in_state(root: Path) -> None:
    set_values(root, 3, "observation.state", slice(4, 5), float("inf"))


def lengthen_episode_in_metadata(root: Path) -> None:
    def edit(table: pa.Table) -> pa.Table:
        i = table.schema.get_field_index("length")
        bumped = pc.if_else(pc.equal(table["episode_index"], 2), pc.add(table["length"], 1), table["length"])
        return table.set_column(i, "length", bumped)

    for path in sorted((root / "meta" / "episodes").glob("**/*.parquet")):
        _edit_table(path, edit)


def drop_episode_from_metadata(root: Path) -> None:
    """A gap in the episode indices (0, 1, 3, 4): LeRobot looks episodes up by position."""
    for path in sorted((root / "meta" / "episodes").glob("**/*.parquet")):
        _edit_table(path, lambda t: t.filter(pc.not_equal(t["episode_index"], 2)))
    _edit_json(root / "meta" / "info.json", lambda info: info.update(total_episodes=info["total_episodes"] - 1))


def double_fps(root: Path) -> None:
    def edit(info: dict) -> None:
        info["fps"] *= 2
        for feature in info["features"].values():
            if "video.fps" in (feature.get("info") or {}):
                feature["info"]["video.fps"] *= 2

    _edit_json(root / "meta" / "info.json", edit)


def grow_state_shape(root: Path) -> None:
    _edit_json(root / "meta" / "info.json", lambda info: info["features"]["observation.state"].update(shape=[5]))


def garble_info(root: Path) -> None:
    _overwrite(root / "meta" / "info.json", 10, 200)


def delete_info(root: Path) -> None:
    (root / "meta" / "info.json").unlink()


def delete_tasks(root: Path) -> None:
    (root / "meta" / "tasks.parquet").unlink()


def truncate_episodes_metadata(root: Path) -> None:
    for path in sorted((root / "meta" / "episodes").glob("**/*.parquet")):
        path.write_bytes(path.read_bytes()[:100])


def nest_info_deeply(root: Path) -> None:
    """A 100,000-deep JSON array: valid JSON that Python's parser cannot read without a RecursionError."""
    (root / "meta" / "info.json").write_text("[" * 100_000 + "]" * 100_000)


def delete_stats(root: Path) -> None:
    (root / "meta" / "stats.json").unlink()


_INFO_FAILS = {"data info": "error"}  # the metadata `data info` reads is itself damaged

DAMAGES: list[Damage] = [
    Damage("timestamps-shifted", "episode 1's timestamps moved by 0.5 s in its data parquet", shift_timestamps,
           frozenset({1})),
    Damage("video-episode-end-corrupted", "random bytes over the packets of episode 1's last frames in the front "
           "camera's mp4 (the mp4 stays valid)", corrupt_episode_end_in_video, frozenset({1})),
    Damage("video-episode-middle-corrupted", "random bytes over the packets of frames 3-4 of episode 1 in the front "
           "camera's mp4", corrupt_episode_middle_in_video, frozenset({1}), found="read"),
    Damage("video-truncated",
           "the front camera's mp4 holding episode 3 (and the episodes it shares the file with) cut to 200 bytes",
           truncate_video, _sharing_video_file(3, FRONT)),
    Damage("video-deleted", "the wrist camera's first mp4 (episode 0 and the episodes it shares the file with) deleted",
           delete_video,
           _sharing_video_file(0, WRIST)),
    Damage("data-file-deleted", "episode 2's data parquet deleted", delete_data_file, frozenset({2})),
    Damage("data-file-truncated", "episode 3's data parquet cut in half (no footer)", truncate_data_file,
           frozenset({3})),
    # the quick check reads the float columns (for NaN/Inf), so it finds garbled pages of the action column
    Damage("data-pages-garbled", "random bytes over the action column's pages of episode 4's data parquet (footer "
           "intact)", garble_data_pages, frozenset({4})),
    Damage("episode-length-edited", "episode 2's length in meta/episodes one frame longer than its data",
           lengthen_episode_in_metadata, None),
    Damage("episode-index-gap", "episode 2 removed from meta/episodes (indices 0, 1, 3, 4)",
           drop_episode_from_metadata, None),
    Damage("fps-doubled", "fps doubled in meta/info.json (every timestamp is now off)", double_fps, None),
    Damage("state-shape-edited", "observation.state declared [5] in meta/info.json, stored as [4]",
           grow_state_shape, None),
    Damage("info-garbled", "random bytes inside meta/info.json", garble_info, None, expect=_INFO_FAILS),
    Damage("info-deleted", "meta/info.json deleted", delete_info, None, expect=_INFO_FAILS),
    Damage("info-nested-deeply", "meta/info.json a 100,000-deep JSON array (a RecursionError in every reader)",
           nest_info_deeply, None, expect=_INFO_FAILS),
    Damage("tasks-deleted", "meta/tasks.parquet deleted", delete_tasks, None, expect=_INFO_FAILS),
    Damage("episodes-metadata-truncated", "meta/episodes parquet cut to 100 bytes", truncate_episodes_metadata,
           None, expect=_INFO_FAILS),
    # LeRobot reads NaN and Inf as any other value; training on them makes the loss NaN
    Damage("nan-action", "NaN in the last action dimension of frames 2-4 of episode 1's data parquet (stats.json "
           "untouched)", nan_in_actions, frozenset({1}), expect={"LeRobotDataset": "ok"}),
    Damage("inf-state", "+Inf in one observation.state value of episode 3's data parquet (stats.json untouched)",
           inf_in_state, frozenset({3}), expect={"LeRobotDataset": "ok"}),
    # LeRobot reads a dataset without stats; training cannot normalize without them
    Damage("stats-deleted", "meta/stats.json deleted (training needs normalization statistics)", delete_stats,
           None, expect={"LeRobotDataset": "ok"}),
]
