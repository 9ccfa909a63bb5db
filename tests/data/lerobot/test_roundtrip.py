"""Write with our DatasetWriter, read back with our reader, and compare the on-disk layout with LeRobot's own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from roboscale.data import DatasetWriter, LeRobotDataset, LeRobotDatasetMetadata
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.stats import aggregate_stats, compute_episode_stats, image_sample_indices

from ..conftest import (
    SMALL_FPS,
    SMALL_LENGTHS,
    SMALL_TASKS,
    assert_square,
    small_episode,
    small_task,
)

CAMERAS = {"observation.images.front": 0, "observation.images.wrist": 1}  # camera -> square's episode offset
NUMERIC = ["observation.state", "action", "next.done", "next.reward"]
STARTS = np.cumsum([0, *SMALL_LENGTHS])


@pytest.fixture(scope="module")
def ds(small_root: Path) -> LeRobotDataset:
    return LeRobotDataset(root=small_root)


def _all_frames() -> dict[str, np.ndarray]:
    episodes = [small_episode(e) for e in range(len(SMALL_LENGTHS))]
    return {k: np.concatenate([ep[k] for ep in episodes]) for k in episodes[0]}


def test_files_rotate_and_chunk(small_root: Path) -> None:
    data_files = sorted((small_root / "data").glob("*/*.parquet"))
    assert len(data_files) >= 3 and (small_root / "data/chunk-001").is_dir()  # chunks_size=2 rolled over
    for key in CAMERAS:
        assert len(list((small_root / "videos" / key).glob("*/*.mp4"))) >= 2, key
    for path in data_files:  # one row group per episode, snappy
        meta = pq.ParquetFile(path).metadata
        episodes = pq.read_table(path, columns=["episode_index"])["episode_index"].to_numpy()
        assert meta.num_row_groups == len(np.unique(episodes))
        assert meta.row_group(0).column(0).compression == "SNAPPY"
    assert not list(small_root.parent.glob(".*partial"))  # staging directory renamed away


def test_items_read_back(ds: LeRobotDataset) -> None:
    expected = _all_frames()
    assert len(ds) == sum(SMALL_LENGTHS) and ds.num_episodes == len(SMALL_LENGTHS)
    for g in range(len(ds)):
        e = int(np.searchsorted(STARTS, g, side="right")) - 1
        i = g - STARTS[e]
        item = ds[g]
        for key in ("observation.state", "action"):
            assert item[key].dtype == torch.float32
            np.testing.assert_array_equal(item[key].numpy(), expected[key][g])
        assert item["next.done"].dtype == torch.bool and item["next.done"].shape == ()
        assert item["next.done"].item() == bool(expected["next.done"][g])
        assert item["next.reward"].shape == () and item["next.reward"].item() == expected["next.reward"][g]
        assert item["timestamp"].item() == np.float32(i / SMALL_FPS)
        assert (item["frame_index"].item(), item["episode_index"].item(), item["index"].item()) == (i, e, g)
        assert item["task"] == small_task(e) and item["task_index"].item() == SMALL_TASKS.index(small_task(e))
        image = item["observation.image"]
        assert image.dtype == torch.float32 and image.shape == (3, 16, 16)
        np.testing.assert_array_equal((image.permute(1, 2, 0).numpy() * 255).round(), expected["observation.image"][g])
        assert item["observation.images.wrist"].shape == (3, 48, 64)
        for key, offset in CAMERAS.items():
            frame = (item[key].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            assert_square(frame, i, e + offset, f"{key} item {g}")


def test_bulk_paths(ds: LeRobotDataset) -> None:
    for e in range(len(SMALL_LENGTHS)):
        expected = small_episode(e)
        got = ds.read_episode(e)
        for key in NUMERIC:
            np.testing.assert_array_equal(got[key].reshape(expected[key].shape), expected[key])
        np.testing.assert_array_equal(got["observation.image"], expected["observation.image"])
        np.testing.assert_array_equal(got["index"], np.arange(STARTS[e], STARTS[e + 1]))
        for key, offset in CAMERAS.items():
            frames = ds.decode_episode_video(e, key)
            assert frames.shape == expected[key].shape
            assert_square(frames[-1], SMALL_LENGTHS[e] - 1, e + offset, key)


def test_video_spans_are_contiguous(small_root: Path) -> None:
    meta = LeRobotDatasetMetadata(small_root)
    for key in CAMERAS:
        frames_in_file: dict[tuple[int, int], int] = {}
        for row in meta.episodes:
            shard = (row[f"videos/{key}/chunk_index"], row[f"videos/{key}/file_index"])
            before = frames_in_file.get(shard, 0)
            assert row[f"videos/{key}/from_timestamp"] == before / SMALL_FPS
            assert row[f"videos/{key}/to_timestamp"] == pytest.approx((before + row["length"]) / SMALL_FPS, abs=1e-12)
            frames_in_file[shard] = before + row["length"]


def test_delta_timestamps_on_written_dataset(small_root: Path) -> None:
    ds = LeRobotDataset(root=small_root, delta_timestamps={"observation.image": [-0.1, 0.0], "action": [0.0, 0.1]})
    expected = _all_frames()
    item = ds[STARTS[1]]  # first frame of episode 1
    assert item["observation.image_is_pad"].tolist() == [True, False]
    assert item["observation.image"].shape == (2, 3, 16, 16)
    torch.testing.assert_close(item["observation.image"][0], item["observation.image"][1])
    np.testing.assert_array_equal(item["action"].numpy(), expected["action"][STARTS[1] : STARTS[1] + 2])


# --------------------------------------------------------------------------------------------------- stats


def test_stats_aggregate_equals_whole_dataset(small_root: Path) -> None:
    stats = LeRobotDatasetMetadata(small_root).stats
    frames = _all_frames()
    for key in NUMERIC:
        values = frames[key].reshape(len(frames[key]), -1).astype(np.float64)
        np.testing.assert_allclose(stats[key]["mean"], values.mean(axis=0), rtol=1e-9, atol=1e-12, err_msg=key)
        np.testing.assert_allclose(stats[key]["std"], values.std(axis=0), rtol=1e-9, atol=1e-12, err_msg=key)
        np.testing.assert_array_equal(stats[key]["min"], values.min(axis=0))
        np.testing.assert_array_equal(stats[key]["max"], values.max(axis=0))
        assert stats[key]["count"].tolist() == [sum(SMALL_LENGTHS)]
    # episodes are shorter than 100 frames, so every frame is sampled and image stats are exact as well
    for key in [*CAMERAS, "observation.image"]:
        pixels = frames[key].reshape(-1, 3).astype(np.float64) / 255
        np.testing.assert_allclose(stats[key]["mean"].reshape(3), pixels.mean(axis=0), rtol=1e-9)
        np.testing.assert_allclose(stats[key]["std"].reshape(3), pixels.std(axis=0), rtol=1e-9)
        np.testing.assert_array_equal(stats[key]["min"].reshape(3), pixels.min(axis=0))
        assert stats[key]["mean"].shape == (3, 1, 1)
    assert stats["index"]["max"].tolist() == [sum(SMALL_LENGTHS) - 1]


def test_quantiles_use_the_conservative_envelope(small_root: Path) -> None:
    episodes = fmt.read_episodes_table(small_root, with_stats=True)
    stats = LeRobotDatasetMetadata(small_root).stats
    per_episode = np.array(episodes["stats/action/q01"].to_pylist())
    np.testing.assert_array_equal(stats["action"]["q01"], per_episode.min(axis=0))
    per_episode = np.array(episodes["stats/action/q99"].to_pylist())
    np.testing.assert_array_equal(stats["action"]["q99"], per_episode.max(axis=0))


def test_image_stats_subsample_long_episodes() -> None:
    assert len(image_sample_indices(50)) == 50
    assert len(image_sample_indices(1000)) == 177 and len(image_sample_indices(10_000)) == 1000
    big = np.zeros((3, 400, 200, 3), dtype=np.uint8)
    big[:, :, :, 0] = 255
    st = compute_episode_stats({"cam": big}, {"cam": {"dtype": "video", "shape": [400, 200, 3]}})["cam"]
    assert st["mean"].reshape(3).tolist() == [1.0, 0.0, 0.0] and st["count"].tolist() == [3]
    merged = aggregate_stats([{"x": {"min": np.array([0.0]), "max": np.array([1.0]), "mean": np.array([0.0]),
                                     "std": np.array([0.0]), "count": np.array([1])}},
                              {"x": {"min": np.array([2.0]), "max": np.array([2.0]), "mean": np.array([2.0]),
                                     "std": np.array([0.0]), "count": np.array([3])}}])["x"]
    assert merged["mean"].tolist() == [1.5] and merged["std"].tolist() == [pytest.approx(np.sqrt(0.75))]


# --------------------------------------------------------------------------------------------------- layout vs LeRobot


# (our feature, the fixture's feature) of the same kind: stored identically.
KIND_PAIRS = [
    ("observation.state", "observation.state"),  # float32 vector
    ("observation.images.front", "observation.images.corner"),  # video
    ("timestamp", "timestamp"),
    ("frame_index", "frame_index"),
    ("episode_index", "episode_index"),
    ("index", "index"),
    ("task_index", "task_index"),
]


def test_info_json_matches_lerobot_layout(small_root: Path, fixture_root: Path) -> None:
    ours = json.loads((small_root / fmt.INFO_PATH).read_text())
    theirs = json.loads((fixture_root / fmt.INFO_PATH).read_text())
    assert list(ours) == list(theirs)
    assert {k: ours[k] for k in ("codebase_version", "data_path", "video_path")} == {
        k: theirs[k] for k in ("codebase_version", "data_path", "video_path")
    }
    assert (ours["chunks_size"], ours["data_files_size_in_mb"], ours["video_files_size_in_mb"]) == (2, 0.001, 0.001)
    assert ours["splits"] == {"train": f"0:{len(SMALL_LENGTHS)}"} and ours["total_frames"] == sum(SMALL_LENGTHS)
    assert (ours["total_episodes"], ours["total_tasks"], ours["robot_type"]) == (5, 2, "test_bot")
    assert list(ours["features"])[-5:] == list(theirs["features"])[-5:]
    for key in fmt.DEFAULT_FEATURES:
        assert ours["features"][key] == theirs["features"][key]
    video_ours = ours["features"]["observation.images.front"]["info"]
    video_theirs = theirs["features"]["observation.images.corner"]["info"]
    assert list(video_theirs) == list(video_ours)[: len(video_theirs)]
    assert {k: video_ours[k] for k in ("video.codec", "video.pix_fmt", "video.fps", "video.channels", "has_audio")} \
        == {k: video_theirs[k] for k in ("video.codec", "video.pix_fmt", "video.fps", "video.channels", "has_audio")}
    assert video_ours["video.g"] == 2 and video_ours["video.video_backend"] == "pyav"
    assert (small_root / fmt.INFO_PATH).read_bytes().startswith(b'{\n    "codebase_version": "v3.0",')


def test_data_parquet_matches_lerobot_layout(small_root: Path, fixture_root: Path) -> None:
    ours = pq.read_schema(small_root / "data/chunk-000/file-000.parquet")
    theirs = pq.read_schema(fixture_root / "data/chunk-000/file-000.parquet")
    ours_hf = json.loads(ours.metadata[b"huggingface"])["info"]["features"]
    theirs_hf = json.loads(theirs.metadata[b"huggingface"])["info"]["features"]
    for mine, fixture in KIND_PAIRS:
        if mine in CAMERAS:
            assert mine not in ours.names and fixture not in theirs.names  # videos live in mp4 only
            continue
        assert ours.field(mine).type == theirs.field(fixture).type, mine
        assert ours_hf[mine] == theirs_hf[fixture], mine
    assert ours.names[-5:] == theirs.names[-5:] == list(fmt.DEFAULT_FEATURES)
    assert str(ours.field("observation.image").type) == "struct<bytes: binary, path: string>"


def test_episodes_parquet_matches_lerobot_layout(small_root: Path, fixture_root: Path) -> None:
    ours = pq.read_schema(small_root / "meta/episodes/chunk-000/file-000.parquet")
    theirs = pq.read_schema(fixture_root / "meta/episodes/chunk-000/file-000.parquet")
    general = [n for n in theirs.names if not n.startswith(("videos/", "stats/"))]
    assert [n for n in ours.names if not n.startswith(("videos/", "stats/"))] == general
    for name in general:
        assert ours.field(name).type == theirs.field(name).type, name
    for mine, fixture in KIND_PAIRS:
        for stat in fmt.STAT_KEYS:
            assert ours.field(f"stats/{mine}/{stat}").type == theirs.field(f"stats/{fixture}/{stat}").type, (mine, stat)
    for suffix in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
        assert ours.field(f"videos/observation.images.front/{suffix}").type == \
            theirs.field(f"videos/observation.images.corner/{suffix}").type
    assert ours.metadata == theirs.metadata


def test_tasks_and_stats_match_lerobot_layout(small_root: Path, fixture_root: Path) -> None:
    ours = pq.read_table(small_root / fmt.TASKS_PATH)
    theirs = pq.read_table(fixture_root / fmt.TASKS_PATH)
    assert ours.schema.remove_metadata() == theirs.schema.remove_metadata()
    pandas_ours, pandas_theirs = (json.loads(t.schema.metadata[b"pandas"]) for t in (ours, theirs))
    for meta in (pandas_ours, pandas_theirs):
        meta.pop("creator")
    assert pandas_ours == pandas_theirs
    assert fmt.read_tasks(small_root) == SMALL_TASKS

    stats_ours = json.loads((small_root / fmt.STATS_PATH).read_text())
    stats_theirs = json.loads((fixture_root / fmt.STATS_PATH).read_text())
    assert set(stats_ours) == set(fmt.stats_features(LeRobotDatasetMetadata(small_root).features))
    for mine, fixture in KIND_PAIRS:
        assert list(stats_ours[mine]) == list(stats_theirs[fixture])
        for stat in fmt.STAT_KEYS:
            assert np.shape(stats_ours[mine][stat]) == np.shape(stats_theirs[fixture][stat]), (mine, stat)
    assert isinstance(stats_ours["index"]["min"][0], int)  # integer features keep integer min/max, like LeRobot


def test_writer_context_manager_and_float_images(tmp_path: Path) -> None:
    features = {"cam": {"dtype": "image", "shape": [3, 8, 8], "names": ["channels", "height", "width"]},
                "x": {"dtype": "int64", "shape": [1], "names": None}}
    image = np.linspace(0, 1, 3 * 8 * 8, dtype=np.float32).reshape(3, 8, 8)  # CHW float input
    with DatasetWriter.create(tmp_path / "d", fps=5, features=features) as writer:
        writer.add_episode({"cam": np.stack([image, image]), "x": np.array([3, 4])}, task="only")
    ds = LeRobotDataset(root=tmp_path / "d")
    assert ds.meta.info.video_path is None and ds.meta.video_keys == []
    assert ds[1]["x"].item() == 4 and ds[1]["x"].dtype == torch.int64
    torch.testing.assert_close(ds[0]["cam"], torch.from_numpy(np.round(image * 255) / 255), atol=1e-6, rtol=0)
