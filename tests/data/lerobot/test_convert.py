"""LeRobot v2.1 (and v2.0) -> v3.0: the converted dataset reads back with our reader as the same frames, values
and tasks as the source; stream copy keeps the video packets bit-exact; bad sources fail naming file/episode/field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roboscale.cli import main
from roboscale.data import LeRobotDataset
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.convert import convert_v21_to_v30, decode_episode_file, read_v2_source
from roboscale.data.lerobot.stats import numeric_stats
from roboscale.data.lerobot.validate import validate
from roboscale.data.lerobot.video import VideoStreamWriter
from roboscale.errors import DatasetError

from .v21_factory import (
    DATA_PATH,
    V21_CAMERAS,
    V21_CHUNKS_SIZE,
    V21_FPS,
    V21_IMAGE,
    V21_LENGTHS,
    V21_TASKS,
    VIDEO_PATH,
    v21_frames,
    v21_task_indices,
    write_v21_dataset,
)

STARTS = np.cumsum([0, *V21_LENGTHS])
NUMERIC = ["observation.state", "action", "next.done"]
TOP, WRIST = V21_CAMERAS


def _source_video(src: Path, key: str, e: int) -> Path:
    return src / VIDEO_PATH.format(episode_chunk=e // V21_CHUNKS_SIZE, video_key=key, episode_index=e)


def _source_data(src: Path, e: int) -> Path:
    return src / DATA_PATH.format(episode_chunk=e // V21_CHUNKS_SIZE, episode_index=e)


@pytest.fixture(scope="module")
def v21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_v21_dataset(tmp_path_factory.mktemp("v21") / "src")


@pytest.fixture(scope="module")
def copied(v21: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stream-copied, default size limits: every episode of a camera lands in one mp4."""
    return convert_v21_to_v30(v21, tmp_path_factory.mktemp("v30") / "copy", progress=False)


@pytest.fixture
def v21_copy(v21: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(v21, tmp_path / "src"))


def _assert_same_values_and_tasks(ds: LeRobotDataset) -> None:
    assert len(ds) == sum(V21_LENGTHS) and ds.num_episodes == len(V21_LENGTHS)
    assert ds.meta.task_list == V21_TASKS
    for e in range(len(V21_LENGTHS)):
        expected = v21_frames(e)
        got = ds.read_episode(e)
        for key in NUMERIC:
            np.testing.assert_array_equal(got[key].reshape(expected[key].shape), expected[key], err_msg=key)
        np.testing.assert_array_equal(got["index"], np.arange(STARTS[e], STARTS[e + 1]))
        np.testing.assert_array_equal(got["timestamp"], (np.arange(V21_LENGTHS[e]) / V21_FPS).astype(np.float32))
        tasks = [V21_TASKS[t] for t in v21_task_indices(e)]
        assert [ds[int(g)]["task"] for g in range(STARTS[e], STARTS[e + 1])] == tasks
        assert ds.meta.episode(e)["tasks"] == list(dict.fromkeys(tasks))


def test_stream_copy_reads_back_identically(copied: Path, v21: Path) -> None:
    ds = LeRobotDataset(root=copied, return_uint8=True)
    _assert_same_values_and_tasks(ds)
    for key in V21_CAMERAS:
        assert len(list((copied / "videos" / key).glob("*/*.mp4"))) == 1  # concatenated, not one file per episode
        for e, n in enumerate(V21_LENGTHS):
            source = decode_episode_file(_source_video(v21, key, e), n, key, e)
            np.testing.assert_array_equal(ds.decode_episode_video(e, key), source)  # same packets, same pixels
            item = ds[int(STARTS[e]) + n - 1]  # random access to the last frame of each episode
            np.testing.assert_array_equal(item[key].permute(1, 2, 0).numpy(), source[-1])
    assert validate(copied).ok, [str(p) for p in validate(copied).problems]


def test_metadata_and_spans(copied: Path) -> None:
    info = fmt.read_info(copied)
    assert info.codebase_version == "v3.0" and info.fps == V21_FPS and info.robot_type == "test_bot"
    assert (info.total_episodes, info.total_frames, info.total_tasks) == (3, sum(V21_LENGTHS), 2)
    assert info.video_path == fmt.DEFAULT_VIDEO_PATH and info.splits == {"train": "0:3"}
    raw = json.loads((copied / fmt.INFO_PATH).read_text())
    assert "total_chunks" not in raw and "total_videos" not in raw
    wrist = raw["features"][WRIST]
    assert "video_info" not in wrist and wrist["info"]["video.codec"] == "av1"  # v2.0 spelling folded into info
    assert wrist["info"]["video.height"] == 32 and wrist["info"]["video.fps"] == V21_FPS
    episodes = fmt.read_episodes(copied)
    for key in V21_CAMERAS:  # contiguous spans at exact multiples of 1/fps
        np.testing.assert_array_equal(episodes[f"videos/{key}/from_timestamp"], STARTS[:-1] / V21_FPS)
        np.testing.assert_array_equal(episodes[f"videos/{key}/to_timestamp"], STARTS[1:] / V21_FPS)


def test_stats_are_recomputed_with_quantiles(copied: Path) -> None:
    stats = fmt.read_stats(copied)
    assert stats is not None
    state = np.concatenate([v21_frames(e)["observation.state"] for e in range(3)])
    expected = numeric_stats(state, (3,))
    for name in ("min", "max", "mean", "count"):
        np.testing.assert_allclose(stats["observation.state"][name], expected[name], rtol=1e-6)
    assert "q01" in stats["action"] and "q99" in stats["observation.state"]  # v2.1 never had these
    assert stats[TOP]["mean"].shape == (3, 1, 1)
    table = fmt.read_episodes_table(copied, with_stats=True)
    assert table["stats/observation.state/q99"].null_count == 0


def test_rotation_by_size(v21: Path, tmp_path: Path) -> None:
    dst = convert_v21_to_v30(v21, tmp_path / "v30", progress=False, video_files_size_in_mb=0.001,
                             data_files_size_in_mb=0.001)
    episodes = fmt.read_episodes(dst)
    for key in V21_CAMERAS:
        assert episodes[f"videos/{key}/file_index"].tolist() == [0, 1, 2]  # each episode exceeds 1 kB
        assert episodes[f"videos/{key}/from_timestamp"].tolist() == [0.0, 0.0, 0.0]
    assert len(list((dst / "data").glob("*/*.parquet"))) == 3
    _assert_same_values_and_tasks(LeRobotDataset(root=dst))


def test_reencode(v21: Path, tmp_path: Path) -> None:
    dst = convert_v21_to_v30(v21, tmp_path / "v30", progress=False, reencode=True, video_codec="libx264")
    ds = LeRobotDataset(root=dst, return_uint8=True)
    _assert_same_values_and_tasks(ds)
    assert ds.meta.features[TOP]["info"]["video.codec"] == "h264"
    with av.open(str(ds.meta.video_path(0, TOP))) as container:
        assert container.streams.video[0].codec_context.codec.canonical_name == "h264"
    for key in V21_CAMERAS:
        for e, n in enumerate(V21_LENGTHS):
            frames = ds.decode_episode_video(e, key)
            # Lossy twice (source encode, re-encode): close to the drawn pattern on average, frame by frame. At
            # 32x32 with 4:2:0 chroma the 4-px square's colour smears, so no per-pixel bound.
            error = np.abs(frames.astype(np.int32) - v21_frames(e)[key]).mean(axis=(1, 2, 3))
            assert frames.shape == (n, 32, 32, 3) and error.max() < 4, (key, e, error)
            shifted = np.abs(frames[1:].astype(np.int32) - v21_frames(e)[key][:-1]).mean(axis=(1, 2, 3))
            assert (error[1:] < shifted).all()  # each frame matches its own time step, not its neighbour
    assert validate(dst).ok


@pytest.mark.parametrize(("codec", "canonical"), [("libx264", "h264"), ("libx265", "hevc")])
def test_other_codecs_stream_copy(tmp_path: Path, codec: str, canonical: str) -> None:
    """H.264 sources, and HEVC ones with B-frames (decode order != presentation order across the joins)."""
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} is not in this PyAV build")
    src = write_v21_dataset(tmp_path / "src", codec=codec)
    dst = convert_v21_to_v30(src, tmp_path / "v30", progress=False)
    ds = LeRobotDataset(root=dst, return_uint8=True)
    assert ds.meta.features[TOP]["info"]["video.codec"] == canonical  # from the stream, not the source info.json
    for e, n in enumerate(V21_LENGTHS):
        source = decode_episode_file(_source_video(src, WRIST, e), n, WRIST, e)
        np.testing.assert_array_equal(ds.decode_episode_video(e, WRIST), source)
        for k in range(n):  # random access lands on the same pictures
            np.testing.assert_array_equal(ds[int(STARTS[e]) + k][WRIST].permute(1, 2, 0).numpy(), source[k])
    assert validate(dst).ok


def test_v20_without_episode_stats_and_sparse_task_indices(v21_copy: Path, tmp_path: Path) -> None:
    """v2.0: no episodes_stats.jsonl (camera stats decoded from the videos); tasks numbered 3 and 7 get 0 and 1."""
    (v21_copy / "meta/episodes_stats.jsonl").unlink()
    info = json.loads((v21_copy / fmt.INFO_PATH).read_text())
    info["codebase_version"] = "v2.0"
    (v21_copy / fmt.INFO_PATH).write_text(json.dumps(info))
    remap = {0: 3, 1: 7}
    (v21_copy / "meta/tasks.jsonl").write_text("".join(
        json.dumps({"task_index": remap[i], "task": t}) + "\n" for i, t in enumerate(V21_TASKS)))
    for e in range(len(V21_LENGTHS)):
        path = _source_data(v21_copy, e)
        table = pq.read_table(path)
        new = pa.array([remap[t] for t in table["task_index"].to_pylist()], pa.int64())
        pq.write_table(table.set_column(table.schema.get_field_index("task_index"), "task_index", new), path)
    dst = convert_v21_to_v30(v21_copy, tmp_path / "v30", progress=False)
    ds = LeRobotDataset(root=dst)
    _assert_same_values_and_tasks(ds)  # task strings survive the renumbering
    stats = fmt.read_stats(dst)
    assert stats is not None and stats[TOP]["count"][0] == sum(V21_LENGTHS)  # every frame sampled (short episodes)
    assert 40 / 255 < stats[TOP]["mean"].mean() < 80 / 255  # mostly background (40) with a bright square


def test_image_feature(tmp_path: Path) -> None:
    """``image`` features (PNG bytes in HF's Image struct) are copied as they are: lossless, same stats."""
    src = write_v21_dataset(tmp_path / "src", with_image=True)
    dst = convert_v21_to_v30(src, tmp_path / "v30", progress=False)
    ds = LeRobotDataset(root=dst, return_uint8=True)
    assert ds.meta.image_keys == [V21_IMAGE]
    for e in range(len(V21_LENGTHS)):
        np.testing.assert_array_equal(ds.read_episode(e)[V21_IMAGE], v21_frames(e)[V21_IMAGE])
    item = ds[int(STARTS[2])]
    np.testing.assert_array_equal(item[V21_IMAGE].permute(1, 2, 0).numpy(), v21_frames(2)[V21_IMAGE][0])
    schema = pq.read_schema(next((dst / "data").glob("*/*.parquet")))
    assert schema.field(V21_IMAGE).type == fmt.arrow_type(fmt.read_info(dst).features[V21_IMAGE])
    assert validate(dst).ok


def test_cli_convert(v21: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dst = tmp_path / "v30"
    assert main(["data", "convert", str(v21), str(dst), "--video-files-size-in-mb=0.001"]) == 0
    assert f"converted to {dst}" in capsys.readouterr().out
    assert fmt.read_episodes(dst)[f"videos/{TOP}/file_index"].tolist() == [0, 1, 2]
    assert main(["data", "convert", str(v21), str(dst)]) == 1  # dst exists now: one-line error
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err


# --------------------------------------------------------------------------------------------------- bad input


def _convert_fails(src: Path, tmp_path: Path, **kwargs: object) -> DatasetError:
    dst = tmp_path / "v30"
    with pytest.raises(DatasetError) as err:
        convert_v21_to_v30(src, dst, progress=False, **kwargs)  # type: ignore[arg-type]
    assert not dst.exists() and not list(tmp_path.glob(".v30.*"))  # nothing left behind
    return err.value


def test_missing_episode_parquet(v21_copy: Path, tmp_path: Path) -> None:
    path = _source_data(v21_copy, 2)
    path.unlink()
    err = _convert_fails(v21_copy, tmp_path)
    assert err.path == path and err.episode == 2 and "not found" in str(err)


def test_missing_episode_video(v21_copy: Path, tmp_path: Path) -> None:
    path = _source_video(v21_copy, WRIST, 1)
    path.unlink()
    err = _convert_fails(v21_copy, tmp_path)
    assert (err.path, err.episode, err.field) == (path, 1, WRIST)


def test_corrupt_episode_video(v21_copy: Path, tmp_path: Path) -> None:
    path = _source_video(v21_copy, TOP, 0)
    path.write_bytes(b"\x00" * 64)
    err = _convert_fails(v21_copy, tmp_path)
    assert (err.path, err.episode, err.field) == (path, 0, TOP)


def test_video_shorter_than_episode(v21_copy: Path, tmp_path: Path) -> None:
    """episodes.jsonl claims more frames than the mp4 has: refused on both paths."""
    lines = (v21_copy / "meta/episodes.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    rows[1]["length"] += 3
    (v21_copy / "meta/episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _convert_fails(v21_copy, tmp_path)  # the data parquet is checked first
    assert err.path == _source_data(v21_copy, 1) and err.episode == 1 and "episodes.jsonl says length" in str(err)


def test_timestamps_off_frame_index(v21_copy: Path, tmp_path: Path) -> None:
    """Capture-clock timestamps that drift from frame_index/fps would not match the remuxed video: refused."""
    path = _source_data(v21_copy, 1)
    table = pq.read_table(path)
    drifted = pa.array(table["timestamp"].to_numpy() * np.float32(1.01), pa.float32())
    pq.write_table(table.set_column(table.schema.get_field_index("timestamp"), "timestamp", drifted), path)
    err = _convert_fails(v21_copy, tmp_path)
    assert (err.path, err.episode, err.field) == (path, 1, "timestamp") and "tolerance_s" in str(err)
    assert convert_v21_to_v30(v21_copy, tmp_path / "loose", progress=False, tolerance_s=0.02).is_dir()


def test_mixed_codecs_need_reencode(v21_copy: Path, tmp_path: Path) -> None:
    """One episode recorded with another codec cannot join the camera's stream copy (info.json holds one codec);
    the error says so and re-encoding converts it."""
    path = _source_video(v21_copy, TOP, 1)
    writer = VideoStreamWriter(path.with_suffix(".tmp.mp4"), V21_FPS, 32, 32, codec="libx264")
    writer.write_many(v21_frames(1)[TOP])
    writer.close()
    path.with_suffix(".tmp.mp4").replace(path)
    err = _convert_fails(v21_copy, tmp_path)
    assert (err.path, err.episode, err.field) == (path, 1, TOP) and "--reencode" in str(err)
    dst = convert_v21_to_v30(v21_copy, tmp_path / "v30", progress=False, reencode=True)
    assert validate(dst).ok


def test_truncated_parquet(v21_copy: Path, tmp_path: Path) -> None:
    path = _source_data(v21_copy, 0)
    path.write_bytes(path.read_bytes()[:100])
    err = _convert_fails(v21_copy, tmp_path)
    assert err.path == path and "cannot read parquet" in str(err)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"codebase_version": "v3.0"}, "codebase_version"),
        ({"fps": 29.97}, "fps"),
        ({"data_path": "data/{nope}.parquet"}, "data_path"),
        # templates are metadata: no attribute access, nothing outside the dataset (issue 18)
        ({"data_path": "data/{episode_index.__class__}.parquet"}, "data_path"),
        ({"data_path": "../elsewhere/episode_{episode_index:06d}.parquet"}, "data_path"),
        ({"video_path": "/elsewhere/{video_key}/episode_{episode_index:06d}.mp4"}, "video_path"),
    ],
)
def test_bad_info(v21_copy: Path, tmp_path: Path, edit: dict, field: str) -> None:
    path = v21_copy / fmt.INFO_PATH
    info = json.loads(path.read_text())
    info.update(edit)
    path.write_text(json.dumps(info))
    err = _convert_fails(v21_copy, tmp_path)
    assert err.path == path and err.field == field


def test_episode_gap_in_episodes_jsonl(v21_copy: Path, tmp_path: Path) -> None:
    path = v21_copy / "meta/episodes.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[2] + "\n")  # episodes 0 and 2
    err = _convert_fails(v21_copy, tmp_path)
    assert err.path == path and err.field == "episode_index" and "missing [1]" in str(err)


def test_task_index_not_in_tasks_jsonl(v21_copy: Path, tmp_path: Path) -> None:
    (v21_copy / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": V21_TASKS[0]}) + "\n")
    err = _convert_fails(v21_copy, tmp_path)
    assert err.field == "task_index" and err.episode == 1  # episode 1 switches to task 1


def test_refuses_non_empty_destination(v21: Path, tmp_path: Path) -> None:
    dst = tmp_path / "v30"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(DatasetError, match="already exists"):
        convert_v21_to_v30(v21, dst, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"
    with pytest.raises(DatasetError, match="outside the source"):
        convert_v21_to_v30(v21, v21 / "inside", progress=False)


def test_reader_points_v21_users_at_convert(v21: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DatasetError, match=f"roboscale data convert {v21} NEW_DIR") as err:
        LeRobotDataset(root=v21)
    assert err.value.field == "codebase_version"
    assert main(["data", "validate", str(v21)]) == 1
    assert "roboscale data convert" in capsys.readouterr().err


def test_read_v2_source(v21: Path) -> None:
    source = read_v2_source(v21)
    assert source.lengths == V21_LENGTHS and source.tasks == V21_TASKS and source.task_remap is None
    assert source.video_keys == V21_CAMERAS and set(source.episode_stats) == {0, 1, 2}
    assert source.data_path(2) == _source_data(v21, 2)
