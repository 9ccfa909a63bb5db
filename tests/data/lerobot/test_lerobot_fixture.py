"""Reading the dataset LeRobot 0.4.4 wrote itself (tests/fixtures, described in /work/shared/fixtures/README.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from roboscale.data import CODEBASE_VERSION, LeRobotDataset, LeRobotDatasetMetadata
from roboscale.data.lerobot import format as fmt

from ..conftest import FIXTURE_LENGTHS, FIXTURE_TASKS, assert_square

CAMERAS = {"observation.images.corner": (64, 64, 0), "observation.images.gripper": (48, 64, 1)}  # H, W, episode offset
STARTS = np.cumsum([0, *FIXTURE_LENGTHS])


def _frame_of(ds: LeRobotDataset, key: str, i: int) -> np.ndarray:
    """Item i's camera frame back as uint8 HWC."""
    return (ds[i][key].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def ds(fixture_root: Path) -> LeRobotDataset:
    return LeRobotDataset(root=fixture_root)


def test_metadata(fixture_root: Path) -> None:
    meta = LeRobotDatasetMetadata(fixture_root)
    assert (meta.fps, meta.total_frames, meta.total_episodes, meta.robot_type) == (10, 58, 4, "sawyer")
    assert meta.info.codebase_version == CODEBASE_VERSION
    assert meta.tasks == {"reach the red target": 0, "open the drawer": 1}
    assert meta.task_list == ["reach the red target", "open the drawer"]
    assert meta.video_keys == list(CAMERAS) and meta.camera_keys == list(CAMERAS)
    assert list(meta.episodes["length"]) == FIXTURE_LENGTHS
    assert [row["tasks"] for row in meta.episodes] == [[FIXTURE_TASKS[e]] for e in range(4)]
    assert not any(c.startswith("stats/") for c in meta.episodes.column_names)
    assert meta.episode(2)["dataset_from_index"] == 29 and meta.episode(2)["dataset_to_index"] == 38
    assert meta.video_span(1, "observation.images.gripper") == pytest.approx((1.2, 2.9))

    assert set(meta.stats) == set(meta.features)
    expected_shapes = {"observation.state": (4,), "action": (4,), "observation.environment_state": (39,),
                       "timestamp": (1,), "index": (1,), **{k: (3, 1, 1) for k in CAMERAS}}
    for key, shape in expected_shapes.items():
        assert set(meta.stats[key]) == set(fmt.STAT_KEYS)
        for stat, value in meta.stats[key].items():
            assert value.shape == ((1,) if stat == "count" else shape), (key, stat)
    assert meta.stats["observation.state"]["max"].tolist() == [3.0, 19.0, 9.5, -1.0]
    assert meta.stats["index"]["count"].tolist() == [58]


def test_every_item_numeric(ds: LeRobotDataset, fixture_root: Path) -> None:
    table = pq.read_table(fixture_root / "data/chunk-000/file-000.parquet")
    env = np.array(table["observation.environment_state"].to_pylist(), dtype=np.float32)
    assert len(ds) == 58 and ds.num_episodes == 4 and ds.num_frames == 58
    for g in range(len(ds)):
        e = int(np.searchsorted(STARTS, g, side="right")) - 1
        i = g - STARTS[e]
        item = ds[g]
        np.testing.assert_array_equal(item["observation.state"].numpy(), np.float32([e, i, 0.5 * i, -1.0]))
        np.testing.assert_array_equal(item["action"].numpy(), np.float32([i / 10, -i / 10, e, 1.0]))
        np.testing.assert_array_equal(item["observation.environment_state"].numpy(), env[g])
        assert item["timestamp"].dtype == torch.float32 and item["timestamp"].shape == ()
        assert item["timestamp"].item() == np.float32(i / 10)
        for key, value in (("frame_index", i), ("episode_index", e), ("index", g), ("task_index", e % 2)):
            assert item[key].dtype == torch.int64 and item[key].shape == () and item[key].item() == value, key
        assert item["task"] == FIXTURE_TASKS[e]


def test_every_item_frames(ds: LeRobotDataset) -> None:
    for g in range(len(ds)):
        e = int(np.searchsorted(STARTS, g, side="right")) - 1
        i = g - STARTS[e]
        item = ds[g]
        for key, (height, width, offset) in CAMERAS.items():
            frame = item[key]
            assert frame.dtype == torch.float32 and frame.shape == (3, height, width)
            assert 0.0 <= frame.min() and frame.max() <= 1.0
            assert_square((frame.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), i, e + offset,
                          f"{key} item {g}")


def test_bulk_paths_match_items(ds: LeRobotDataset) -> None:
    episode = ds.read_episode(3)
    assert episode["observation.state"].dtype == np.float32 and episode["observation.state"].shape == (20, 4)
    np.testing.assert_array_equal(episode["index"], np.arange(38, 58))
    np.testing.assert_array_equal(episode["action"][:, 0], np.float32(np.arange(20) / 10))
    frames = ds.decode_episode_video(3, "observation.images.gripper")
    assert frames.shape == (20, 48, 64, 3) and frames.dtype == np.uint8
    for i in (0, 7, 19):
        np.testing.assert_array_equal(frames[i], _frame_of(ds, "observation.images.gripper", 38 + i))
        assert_square(frames[i], i, 4)


def test_delta_timestamps_clamp_and_pad(fixture_root: Path) -> None:
    deltas = {"action": [-0.2, -0.1, 0.0, 0.1], "observation.images.corner": [-0.1, 0.0], "observation.state": [0.0]}
    ds = LeRobotDataset(root=fixture_root, delta_timestamps=deltas)
    first = ds[12]  # frame 0 of episode 1
    assert first["action"].shape == (4, 4) and first["action_is_pad"].dtype == torch.bool
    assert first["action_is_pad"].tolist() == [True, True, False, False]
    np.testing.assert_array_equal(first["action"][:, 0].numpy(), np.float32([0, 0, 0, 0.1]))
    assert (first["action"][:, 2] == 1).all()  # never borrows from episode 0
    assert first["observation.images.corner"].shape == (2, 3, 64, 64)
    assert first["observation.images.corner_is_pad"].tolist() == [True, False]
    torch.testing.assert_close(first["observation.images.corner"][0], first["observation.images.corner"][1])
    assert first["observation.state"].shape == (1, 4) and first["observation.state_is_pad"].tolist() == [False]
    assert first["observation.images.gripper"].shape == (3, 48, 64)  # no deltas: no time dim

    last = ds[57]  # frame 19 of episode 3
    assert last["action_is_pad"].tolist() == [False, False, False, True]
    np.testing.assert_array_equal(last["action"][:, 0].numpy(), np.float32([1.7, 1.8, 1.9, 1.9]))
    corner = last["observation.images.corner"]
    assert_square((corner[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), 18, 3)
    assert_square((corner[1].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8), 19, 3)


def test_delta_timestamps_must_be_whole_frames(fixture_root: Path) -> None:
    with pytest.raises(ValueError, match="action"):
        LeRobotDataset(root=fixture_root, delta_timestamps={"action": [0.0, 0.05]})
    with pytest.raises(ValueError, match="no.such"):
        LeRobotDataset(root=fixture_root, delta_timestamps={"no.such": [0.0]})


def test_episode_selection(fixture_root: Path) -> None:
    ds = LeRobotDataset(root=fixture_root, episodes=[3, 1])
    assert ds.episodes == [1, 3] and ds.num_episodes == 2 and len(ds) == 37
    assert ds[0]["index"].item() == 12 and ds[0]["episode_index"].item() == 1
    assert ds[17]["index"].item() == 38 and ds[17]["frame_index"].item() == 0
    assert ds[-1]["index"].item() == 57
    assert_square(_frame_of(ds, "observation.images.corner", 17), 0, 3)
    with pytest.raises(IndexError):
        ds[37]
    pads = LeRobotDataset(root=fixture_root, episodes=[3, 1], delta_timestamps={"action": [-0.1, 0.0]})[17]
    assert pads["action_is_pad"].tolist() == [True, False]  # episode 2 is not selected, 1 is not adjacent


def test_info_rewrite_is_byte_exact(fixture_root: Path, tmp_path: Path) -> None:
    fmt.write_info(tmp_path, fmt.read_info(fixture_root))
    assert (tmp_path / fmt.INFO_PATH).read_bytes() == (fixture_root / fmt.INFO_PATH).read_bytes()


def test_lenient_info(fixture_copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Hub variants: CHW shapes, dict/nested names, unknown (v2.x) keys, old video size limits."""
    path = fixture_copy / fmt.INFO_PATH
    info = json.loads(path.read_text())
    info["features"]["observation.images.corner"].update(shape=[3, 64, 64], names=["channels", "height", "width"])
    info["features"]["observation.images.gripper"]["names"] = None
    info["features"]["observation.images.gripper"]["shape"] = [3, 48, 64]
    info["features"]["observation.state"]["names"] = {"motors": ["x", "y", "z", "gripper"]}
    info["features"]["action"]["names"] = [["dx", "dy", "dz", "grip"]]
    info.update(total_videos=2, total_chunks=1, video_files_size_in_mb=500)
    path.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        ds = LeRobotDataset(root=fixture_copy)
    assert "total_chunks" in caplog.text
    item = ds[40]
    assert item["observation.images.corner"].shape == (3, 64, 64)
    assert item["observation.images.gripper"].shape == (3, 48, 64)
    assert ds.meta.info.video_files_size_in_mb == 500


def test_image_transforms_uint8_and_dataloader(fixture_root: Path) -> None:
    flipped = LeRobotDataset(root=fixture_root, image_transforms=lambda img: img.flip(-1))
    plain = LeRobotDataset(root=fixture_root, return_uint8=True)
    frame = plain[5]["observation.images.corner"]
    assert frame.dtype == torch.uint8 and frame.shape == (3, 64, 64)
    torch.testing.assert_close(flipped[5]["observation.images.corner"], frame.flip(-1).float() / 255)

    loader = torch.utils.data.DataLoader(plain, batch_size=8, shuffle=False, num_workers=1)
    batch = next(iter(loader))  # decoded in a worker process (fresh video cache after fork)
    assert batch["observation.images.gripper"].shape == (8, 3, 48, 64)
    assert batch["index"].tolist() == list(range(8)) and batch["task"] == ["reach the red target"] * 8
