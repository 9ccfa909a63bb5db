"""Bad datasets and bad frames fail with a DatasetError that names the file (and the field/episode)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roboscale.data import DatasetWriter, LeRobotDataset
from roboscale.data.lerobot import format as fmt
from roboscale.errors import DatasetError

from ..conftest import SMALL_FEATURES, SMALL_LENGTHS, small_episode

FRONT = "observation.images.front"


def _edit_info(root: Path, **changes: object) -> None:
    path = root / fmt.INFO_PATH
    info = json.loads(path.read_text())
    info.update(changes)
    path.write_text(json.dumps(info, indent=4))


def _first_frame() -> dict[str, object]:
    frame: dict[str, object] = {k: v[0] for k, v in small_episode(0).items()}
    frame["task"] = "t"
    return frame


def test_missing_info_json(small_copy: Path) -> None:
    (small_copy / fmt.INFO_PATH).unlink()
    with pytest.raises(DatasetError, match="meta/info.json: not found") as err:
        LeRobotDataset(root=small_copy)
    assert err.value.path == small_copy / fmt.INFO_PATH


def test_truncated_data_parquet(small_copy: Path) -> None:
    path = small_copy / "data/chunk-000/file-001.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DatasetError, match="cannot read parquet") as err:
        LeRobotDataset(root=small_copy)
    assert err.value.path == path


def test_corrupt_episodes_parquet(small_copy: Path) -> None:
    path = small_copy / "meta/episodes/chunk-000/file-000.parquet"
    path.write_bytes(b"PAR1 not really" * 10)
    with pytest.raises(DatasetError) as err:
        LeRobotDataset(root=small_copy)
    assert err.value.path == path


def test_missing_mp4(small_copy: Path) -> None:
    path = small_copy / "videos" / FRONT / "chunk-000/file-001.mp4"
    path.unlink()
    with pytest.raises(DatasetError, match="video file not found") as err:
        LeRobotDataset(root=small_copy)
    assert err.value.path == path and err.value.field == FRONT and err.value.episode is not None


def test_truncated_mp4(small_copy: Path) -> None:
    path = small_copy / "videos" / FRONT / "chunk-000/file-000.mp4"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    ds = LeRobotDataset(root=small_copy)  # exists, so loading metadata works
    last_in_file = max(e for e in range(len(SMALL_LENGTHS)) if ds.meta.video_path(e, FRONT) == path)
    with pytest.raises(DatasetError) as err:
        ds.decode_episode_video(last_in_file, FRONT)
    assert err.value.path == path
    with pytest.raises(DatasetError) as err:
        for g in range(len(ds)):  # some item past the cut must fail, naming the file
            ds[g]
    assert err.value.path == path


def test_garbage_mp4(small_copy: Path) -> None:
    path = small_copy / "videos" / FRONT / "chunk-000/file-000.mp4"
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(DatasetError, match="cannot open video") as err:
        LeRobotDataset(root=small_copy)[0]
    assert err.value.path == path


@pytest.mark.parametrize(("version", "message"), [("v2.1", "convert it to v3.0"), ("v9.0", "newer"),
                                                  ("banana", "unknown codebase_version")])
def test_unsupported_codebase_version(small_copy: Path, version: str, message: str) -> None:
    _edit_info(small_copy, codebase_version=version)
    with pytest.raises(DatasetError, match=message) as err:
        LeRobotDataset(root=small_copy)
    assert err.value.path == small_copy / fmt.INFO_PATH and err.value.field == "codebase_version"


def test_feature_missing_from_data_parquet(small_copy: Path) -> None:
    info = json.loads((small_copy / fmt.INFO_PATH).read_text())
    info["features"]["observation.extra"] = {"dtype": "float32", "shape": [2], "names": None}
    _edit_info(small_copy, features=info["features"])
    with pytest.raises(DatasetError, match="column missing") as err:
        LeRobotDataset(root=small_copy)
    assert err.value.field == "observation.extra" and err.value.path.name.endswith(".parquet")
    assert "data/chunk-" in str(err.value)


def test_episode_length_mismatch(small_copy: Path) -> None:
    """Episodes metadata claiming more frames than the data file holds is caught at load time."""
    path = small_copy / "meta/episodes/chunk-000/file-000.parquet"
    table = fmt.read_parquet(path)
    lengths = table["length"].to_numpy().copy()
    lengths[2] += 1
    table = table.set_column(table.schema.get_field_index("length"), "length", pa.array(lengths))
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match="rows for this episode") as err:
        LeRobotDataset(root=small_copy)
    assert err.value.episode == 2


def _data_file_of(root: Path, ep: int) -> Path:
    row = fmt.read_episodes(root)[ep]
    return root / fmt.DEFAULT_DATA_PATH.format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])


def test_truncated_data_parquet_names_its_episode(small_copy: Path) -> None:
    path = _data_file_of(small_copy, 3)
    path.write_bytes(path.read_bytes()[:64])
    with pytest.raises(DatasetError, match="cannot read parquet") as err:
        LeRobotDataset(root=small_copy)
    assert (err.value.path, err.value.episode) == (path, 3)
    ds = LeRobotDataset(root=small_copy, episodes=[0, 1, 2, 4])  # the other episodes stay readable
    assert ds.num_episodes == 4


def test_truncated_mp4_names_camera_and_episode(small_copy: Path) -> None:
    path = small_copy / "videos" / FRONT / "chunk-000/file-000.mp4"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    ds = LeRobotDataset(root=small_copy)
    last_in_file = max(e for e in range(len(SMALL_LENGTHS)) if ds.meta.video_path(e, FRONT) == path)
    with pytest.raises(DatasetError) as err:
        ds.decode_episode_video(last_in_file, FRONT)
    assert (err.value.path, err.value.field, err.value.episode) == (path, FRONT, last_in_file)
    last_frame = int(ds.meta.episode(last_in_file)["dataset_to_index"]) - 1
    with pytest.raises(DatasetError) as err:
        ds[last_frame]
    assert (err.value.path, err.value.field, err.value.episode) == (path, FRONT, last_in_file)
    assert "Traceback" not in str(err.value) and str(err.value).startswith(f"{path}: episode {last_in_file}: ")


def test_corrupt_png_names_field_and_episode(small_copy: Path) -> None:
    path = _data_file_of(small_copy, 1)
    table = pq.read_table(path)
    images = table["observation.image"].combine_chunks()
    broken = pa.StructArray.from_arrays([pa.array([b"not a png"] * len(images), pa.binary()), images.field("path")],
                                        names=["bytes", "path"])
    table = table.set_column(table.schema.get_field_index("observation.image"), "observation.image", broken)
    pq.write_table(table, path)
    ds = LeRobotDataset(root=small_copy)
    with pytest.raises(DatasetError, match="cannot decode PNG") as err:
        ds[SMALL_LENGTHS[0]]  # first frame of episode 1
    assert (err.value.path, err.value.field, err.value.episode) == (path, "observation.image", 1)
    with pytest.raises(DatasetError) as err:
        ds.read_episode(1)
    assert (err.value.field, err.value.episode) == ("observation.image", 1)


def test_timestamps_outside_tolerance(small_copy: Path) -> None:
    path = _data_file_of(small_copy, 2)
    table = pq.read_table(path)
    timestamps = table["timestamp"].to_numpy().copy()
    timestamps[3:] += np.float32(0.003)  # a dropped-frame-like jump of 3 ms
    table = table.set_column(table.schema.get_field_index("timestamp"), "timestamp", pa.array(timestamps))
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match="tolerance_s=0.0001") as err:
        LeRobotDataset(root=small_copy)
    assert (err.value.path, err.value.episode, err.value.field) == (path, 2, "timestamp")
    assert "first at frame 3" in str(err.value)
    assert len(LeRobotDataset(root=small_copy, tolerance_s=0.01)) == sum(SMALL_LENGTHS)  # LeRobot's knob


def test_float32_timestamps_of_long_episodes_are_within_tolerance() -> None:
    """float32 cannot hold k/fps to 1e-4 s after ~15 minutes; the check allows that rounding, not more."""
    frame_index = np.arange(0, 30 * 3600 * 2, 997)  # two hours at 30 fps
    exact = (frame_index / 30).astype(np.float32)
    assert fmt.timestamp_problem(exact, frame_index, 30, 1e-4) is None
    assert fmt.timestamp_problem(exact + np.float32(0.01), frame_index, 30, 1e-4) is not None


@pytest.mark.parametrize("kind", ["gap", "duplicate"])
def test_episode_index_gap_or_duplicate(small_copy: Path, kind: str) -> None:
    path = small_copy / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    ids = table["episode_index"].to_numpy().copy()
    ids[3:] += 1 if kind == "gap" else -1  # 0,1,2,4,5 or 0,1,2,2,3
    pq.write_table(table.set_column(table.schema.get_field_index("episode_index"), "episode_index",
                                    pa.array(ids)), path)
    with pytest.raises(DatasetError) as err:
        LeRobotDataset(root=small_copy)
    assert err.value.field == "episode_index" and err.value.path == small_copy / "meta/episodes"
    if kind == "gap":
        assert err.value.episode == 3 and "episode 3 is missing" in str(err.value)
    else:
        assert err.value.episode == 2 and "more than once" in str(err.value)


# --------------------------------------------------------------------------------------------------- writer


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[DatasetWriter]:
    w = DatasetWriter.create(tmp_path / "ds", fps=10, features=SMALL_FEATURES)
    yield w
    w.abort()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("observation.state", np.zeros(5, np.float32), r"expected shape \[4\], got \[5\]"),
        ("observation.state", np.zeros(4, np.complex64), "expected dtype float32"),
        (FRONT, np.zeros((64, 32, 3), np.uint8), r"expected image of shape \[64, 64, 3\]"),
        (FRONT, np.full((64, 64, 3), 2.0, np.float32), r"float images must be in \[0, 1\]"),
        ("next.done", 0.5, "expected dtype bool"),
    ],
)
def test_add_frame_rejects_bad_values(writer: DatasetWriter, key: str, value: object, message: str) -> None:
    frame = _first_frame()
    frame[key] = value
    with pytest.raises(DatasetError, match=message) as err:
        writer.add_frame(frame)
    assert err.value.field == key and err.value.path == writer.root and err.value.episode == 0


def test_add_frame_rejects_missing_and_unknown_keys(writer: DatasetWriter) -> None:
    frame = _first_frame()
    del frame["action"]
    with pytest.raises(DatasetError, match="missing") as err:
        writer.add_frame(frame)
    assert err.value.field == "action"
    frame = {**_first_frame(), "observation.velocity": np.zeros(3)}
    with pytest.raises(DatasetError, match="not a declared feature") as err:
        writer.add_frame(frame)
    assert err.value.field == "observation.velocity"
    frame = _first_frame()
    del frame["task"]
    with pytest.raises(DatasetError) as err:
        writer.add_frame(frame)
    assert err.value.field == "task"


def test_add_episode_rejects_ragged_lengths(writer: DatasetWriter) -> None:
    frames = small_episode(0)
    frames["action"] = frames["action"][:-1]
    with pytest.raises(DatasetError, match="frames") as err:
        writer.add_episode(frames, task="t")
    assert err.value.field == "action"


def test_unfinalized_writer_leaves_nothing_at_root(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    w = DatasetWriter.create(root, fps=10, features=SMALL_FEATURES)
    w.add_episode(small_episode(0), task="t")
    assert not root.exists()  # written, but not finalized: invisible
    w.abort()
    assert not root.exists() and list(tmp_path.iterdir()) == []

    with pytest.raises(RuntimeError, match="boom"):
        with DatasetWriter.create(root, fps=10, features=SMALL_FEATURES) as w2:
            w2.add_episode(small_episode(1), task="t")
            raise RuntimeError("boom")
    assert not root.exists() and list(tmp_path.iterdir()) == []


def test_create_refuses_existing_dataset(small_root: Path) -> None:
    with pytest.raises(DatasetError, match="not empty") as err:
        DatasetWriter.create(small_root, fps=10, features=SMALL_FEATURES)
    assert err.value.path == small_root


@pytest.mark.parametrize(
    ("features", "field"),
    [
        ({"index": {"dtype": "int64", "shape": [1]}}, "index"),
        ({"a/b": {"dtype": "float32", "shape": [1]}}, "a/b"),
        ({"cam": {"dtype": "video", "shape": [8, 8, 1]}}, "cam"),
        ({"x": {"dtype": "float32", "shape": []}}, "x"),
        ({"x": {"dtype": "complex64", "shape": [2]}}, "x"),
    ],
)
def test_create_rejects_bad_features(tmp_path: Path, features: dict, field: str) -> None:
    with pytest.raises(DatasetError) as err:
        DatasetWriter.create(tmp_path / "ds", fps=10, features=features)
    assert err.value.field == field
    assert list(tmp_path.iterdir()) == []


def test_finalize_refuses_unsaved_frames(writer: DatasetWriter) -> None:
    writer.add_frame(_first_frame())
    with pytest.raises(DatasetError, match="never saved"):
        writer.finalize()
    assert not writer.root.exists()
