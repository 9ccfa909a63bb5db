"""The variety of v3.0 datasets users have: H.264 / HEVC (with B-frames) / AV1 at any fps, cameras that rotate
their files independently of each other and of the data, image features next to videos, and delta_timestamps
windows that cross file boundaries. Every dataset here is written by our writer into tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from roboscale.data import DatasetWriter, LeRobotDataset
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.summary import summarize
from roboscale.data.lerobot.validate import validate

from ..conftest import square_frame

LENGTHS = [8, 5, 9, 6]
STARTS = np.cumsum([0, *LENGTHS])


def _write(root: Path, features: dict, frames_of, fps: int, **kwargs: object) -> Path:
    with DatasetWriter.create(root, fps=fps, features=features, **kwargs) as writer:  # type: ignore[arg-type]
        for e in range(len(LENGTHS)):
            writer.add_episode(frames_of(e), f"task {e % 2}")
    return root


# --------------------------------------------------------------------------------------------------- codecs


CAMERA = {"cam": {"dtype": "video", "shape": [64, 64, 3], "names": ["height", "width", "channels"]},
          "state": {"dtype": "float32", "shape": [2], "names": None}}


def _camera_frames(e: int) -> dict[str, np.ndarray]:
    n = LENGTHS[e]
    return {"cam": np.stack([square_frame(64, 64, k, e) for k in range(n)]),
            "state": np.stack([np.full(n, e), np.arange(n)], axis=1).astype(np.float32)}


@pytest.mark.parametrize(
    ("codec", "fps", "canonical"),
    [("libx264", 15, "h264"), ("libx265", 30, "hevc"), ("libsvtav1", 7, "av1"), ("libx264", 24, "h264")],
)
def test_codecs_and_fps(tmp_path: Path, codec: str, fps: int, canonical: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} is not in this PyAV build")
    root = _write(tmp_path / "ds", CAMERA, _camera_frames, fps, video_codec=codec)
    ds = LeRobotDataset(root=root, return_uint8=True)
    assert ds.meta.features["cam"]["info"]["video.codec"] == canonical
    with av.open(str(ds.meta.video_path(0, "cam"))) as container:
        assert container.streams.video[0].codec_context.codec.canonical_name == canonical
    for e, n in enumerate(LENGTHS):
        episode = ds.decode_episode_video(e, "cam")
        assert episode.shape == (n, 64, 64, 3)
        # Random access must return the same decoded picture as the sequential pass, for every frame (with HEVC's
        # B-frames a seek lands on a keyframe that is presented after the frame asked for).
        for k in range(n):
            np.testing.assert_array_equal(ds[int(STARTS[e]) + k]["cam"].permute(1, 2, 0).numpy(), episode[k])
        error = np.abs(episode.astype(np.int32) - _camera_frames(e)["cam"]).mean(axis=(1, 2, 3))
        assert error.max() < 4, error  # and it is the frame that was written at that time step
    assert validate(root).ok


# --------------------------------------------------------------------------------------------------- rotation


ROTATING = {
    "noisy": {"dtype": "video", "shape": [32, 32, 3], "names": ["height", "width", "channels"]},
    "flat": {"dtype": "video", "shape": [32, 32, 3], "names": ["height", "width", "channels"]},
    "observation.image": {"dtype": "image", "shape": [8, 8, 3], "names": ["height", "width", "channels"]},
    "action": {"dtype": "float32", "shape": [3], "names": None},
}


def _rotating_frames(e: int) -> dict[str, np.ndarray]:
    n = LENGTHS[e]
    rng = np.random.default_rng(e)
    return {
        "noisy": rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8),  # incompressible: big files
        "flat": np.stack([square_frame(32, 32, k, e) for k in range(n)]),  # compresses to almost nothing
        "observation.image": rng.integers(0, 256, size=(n, 8, 8, 3), dtype=np.uint8),
        "action": rng.normal(size=(n, 3)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def rotating(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("rot") / "ds", ROTATING, _rotating_frames, 10, video_codec="libx264",
                  video_files_size_in_mb=0.01, data_files_size_in_mb=0.002)


def test_cameras_rotate_independently(rotating: Path) -> None:
    episodes = fmt.read_episodes(rotating)
    noisy = list(zip(episodes["videos/noisy/chunk_index"], episodes["videos/noisy/file_index"], strict=True))
    flat = list(zip(episodes["videos/flat/chunk_index"], episodes["videos/flat/file_index"], strict=True))
    data = list(zip(episodes["data/chunk_index"], episodes["data/file_index"], strict=True))
    assert len(set(noisy)) > 1 and len(set(flat)) == 1 and len(set(data)) > 1
    assert noisy != data  # three independent rotations
    assert episodes["videos/flat/from_timestamp"].tolist() == (STARTS[:-1] / 10).tolist()


def test_rotating_dataset_reads_back(rotating: Path) -> None:
    ds = LeRobotDataset(root=rotating, return_uint8=True)
    for e, n in enumerate(LENGTHS):
        expected = _rotating_frames(e)
        got = ds.read_episode(e)
        np.testing.assert_array_equal(got["observation.image"], expected["observation.image"])
        np.testing.assert_array_equal(got["action"], expected["action"])
        noisy = ds.decode_episode_video(e, "noisy")
        assert noisy.shape == (n, 32, 32, 3)
        item = ds[int(STARTS[e])]
        np.testing.assert_array_equal(item["noisy"].permute(1, 2, 0).numpy(), noisy[0])
        np.testing.assert_array_equal(item["observation.image"].permute(1, 2, 0).numpy(),
                                      expected["observation.image"][0])
    assert validate(rotating).ok


def test_delta_timestamps_across_files(rotating: Path) -> None:
    """Windows at episode edges clamp to the episode (never into the neighbouring episode or file) and flag
    `<key>_is_pad`, for video, image and numeric keys alike."""
    deltas = [-0.2, -0.1, 0.0, 0.1, 0.2]
    ds = LeRobotDataset(root=rotating, return_uint8=True,
                        delta_timestamps={"noisy": deltas, "observation.image": deltas, "action": deltas})
    offsets = np.round(np.array(deltas) * 10).astype(int)
    for e, n in enumerate(LENGTHS):
        noisy = ds.decode_episode_video(e, "noisy")
        expected = _rotating_frames(e)
        for k in (0, 1, n - 1):
            item = ds[int(STARTS[e]) + k]
            want = np.clip(k + offsets, 0, n - 1)
            pad = ((k + offsets) < 0) | ((k + offsets) >= n)
            for key in ("noisy", "observation.image", "action"):
                assert item[f"{key}_is_pad"].tolist() == pad.tolist(), (e, k, key)
            assert item["noisy"].shape == (5, 3, 32, 32)
            np.testing.assert_array_equal(item["noisy"].permute(0, 2, 3, 1).numpy(), noisy[want])
            np.testing.assert_array_equal(item["observation.image"].permute(0, 2, 3, 1).numpy(),
                                          expected["observation.image"][want])
            np.testing.assert_array_equal(item["action"].numpy(), expected["action"][want])


# --------------------------------------------------------------------------------------------------- lenient metadata


def test_lenient_metadata_variants(small_copy: Path) -> None:
    """What other tools write: v2.1-converter ``fps`` in every non-video feature, dict/nested ``names``, optional
    keys missing, a depth marker in ``video_info``, and a tasks.parquet with a plain ``task`` column (no pandas
    index). All of it reads as the untouched dataset does."""
    before = LeRobotDataset(root=small_copy, return_uint8=True)
    expected = [before[i] for i in (0, 17, len(before) - 1)]
    path = small_copy / fmt.INFO_PATH
    info = json.loads(path.read_text())
    for ft in info["features"].values():
        if ft["dtype"] != "video":
            ft["fps"] = info["fps"]
    info["features"]["observation.state"]["names"] = {"motors": ["a", "b", "c", "d"]}
    info["features"]["action"]["names"] = [["x", "y", "z"]]
    info["features"]["observation.images.front"]["video_info"] = {"video.is_depth_map": False}
    for key in ("robot_type", "splits", "data_files_size_in_mb", "video_files_size_in_mb", "total_tasks"):
        del info[key]
    path.write_text(json.dumps(info))
    tasks = fmt.read_tasks(small_copy)
    pq.write_table(pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": tasks}),
                   small_copy / fmt.TASKS_PATH)
    after = LeRobotDataset(root=small_copy, return_uint8=True)
    for want, i in zip(expected, (0, 17, len(before) - 1), strict=True):
        got = after[i]
        assert got["task"] == want["task"]
        for key, value in want.items():
            if key != "task":
                assert torch.equal(got[key], value), key
    assert after.meta.robot_type is None and after.meta.task_list == tasks
    assert "a, b, c, d" in "\n".join(summarize(small_copy).lines())


def test_the_data_commands_default_to_the_formats_values() -> None:
    """configs/ import no data code, so the defaults the commands take from LeRobot are written out there."""
    from roboscale.configs.data import ConvertConfig, ValidateConfig

    assert ValidateConfig().tolerance_s == ConvertConfig().tolerance_s == fmt.DEFAULT_TOLERANCE_S
    assert ConvertConfig().data_files_size_in_mb == fmt.DEFAULT_DATA_FILE_SIZE_MB
    assert ConvertConfig().video_files_size_in_mb == fmt.DEFAULT_VIDEO_FILE_SIZE_MB


def test_encoding_video_leaves_the_callers_scheduling_as_it_was(tmp_path):
    """SVT-AV1 makes the thread that drives it SCHED_FIFO (as root); a training in the same process then starved
    the machine. The writer restores the caller's policy."""
    import os

    import numpy as np

    from roboscale.data.lerobot.video import VideoStreamWriter

    before = os.sched_getscheduler(0)
    writer = VideoStreamWriter(tmp_path / "v.mp4", 10, 32, 32, codec="libsvtav1")
    writer.write_many(np.zeros((4, 32, 32, 3), np.uint8))
    writer.close()
    assert os.sched_getscheduler(0) == before
