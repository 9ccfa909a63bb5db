"""What LeRobot 0.5/0.6 add to v3.0 datasets: language columns, depth-map videos, tools and encoder settings in
info.json, no subtasks. The fixture ``tests/fixtures/lerobot-0.6-mini`` is built by ``make_lerobot_v06.py`` (in that
directory) from the LeRobot 0.4.4 fixture; its depth pattern and annotations are recomputed here."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from roboscale.data import DatasetWriter, LeRobotDataset
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.depth import DepthQuantization
from roboscale.data.lerobot.language import active_row
from roboscale.data.lerobot.summary import summarize
from roboscale.data.lerobot.validate import bad_episodes, validate
from roboscale.data.loading.loader import build_loader
from roboscale.errors import ConfigError, DatasetError

from ..conftest import TESTS

V06 = TESTS / "fixtures" / "lerobot-0.6-mini"
DEPTH = "observation.images.depth"
LENGTHS = [12, 17, 9, 20]


def _builder():
    spec = importlib.util.spec_from_file_location("make_lerobot_v06", TESTS / "fixtures" / "make_lerobot_v06.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _builder()


@pytest.fixture
def v06_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "lerobot-0.6-mini"
    shutil.copytree(V06, dst)
    return dst


def _expected_depth_mm(i: int, e: int) -> np.ndarray:
    """What LeRobot's reader returns for the fixture's frame: the codes mapped back, clipped, whole millimetres."""
    codes = MAKE.quantize_mm(MAKE.depth_mm(i, e)).astype(np.float64)
    lo, hi = math.log(0.01 + 3.5), math.log(10.0 + 3.5)
    metres = np.clip(np.exp(codes * (hi - lo) / 4095 + lo) - 3.5, 0.01, 10.0)
    return np.rint(metres * 1000)


# --------------------------------------------------------------------------------------------------- read


def test_items_carry_annotations_as_rows_and_depth_in_millimetres() -> None:
    ds = LeRobotDataset(root=V06)
    start = sum(LENGTHS[:1])
    item = ds[start + 3]  # episode 1, frame 3: the VQA pair fires here
    persistent, events = MAKE.language_rows(1, LENGTHS[1], 10)
    assert item["language_persistent"] == persistent
    assert item["language_events"] == events[3]
    assert ds[start + 4]["language_events"][0]["tool_calls"] == [
        {"type": "function", "function": {"name": "say", "arguments": {"text": "on it"}}}]
    assert ds[start + 5]["language_events"] == []
    depth = item[DEPTH]
    assert depth.dtype == torch.float32 and depth.shape == (1, 48, 64)
    np.testing.assert_array_equal(depth[0].numpy(), _expected_depth_mm(3, 1))
    assert np.abs(depth[0].numpy() - MAKE.depth_mm(3, 1)).max() <= 2  # log 12-bit: ~1.4 mm steps near 1 m
    assert item["observation.images.corner"].shape == (3, 64, 64)  # RGB cameras unchanged


def test_depth_in_metres_converts_items_and_stats_and_skips_image_transforms() -> None:
    mm = LeRobotDataset(root=V06)
    m = LeRobotDataset(root=V06, depth_unit="m", image_transforms=lambda x: x * 0 - 7)
    item = m[5]
    np.testing.assert_allclose(item[DEPTH].numpy() * 1000, mm[5][DEPTH].numpy(), atol=0.51)
    assert float(item["observation.images.corner"].max()) == -7.0  # RGB transformed, depth left alone
    np.testing.assert_allclose(m.meta.stats[DEPTH]["mean"] * 1000, mm.meta.stats[DEPTH]["mean"])
    assert m.meta.stats[DEPTH]["count"][0] == 58
    frames = m.decode_episode_video(2, DEPTH)
    assert frames.shape == (9, 48, 64, 1) and frames.dtype == np.float32
    np.testing.assert_allclose(frames[4, :, :, 0] * 1000, _expected_depth_mm(4, 2), atol=0.51)


def test_depth_settings_are_read_from_info_and_bad_ones_name_the_key() -> None:
    ft = fmt.read_info(V06).features[DEPTH]
    q = DepthQuantization.of(ft)
    assert (q.depth_min, q.depth_max, q.shift, q.use_log, q.unit) == (0.01, 10.0, 3.5, True, "mm")
    codes = q.quantize(np.array([400.0, 1000.0, 9000.0]), "mm")
    np.testing.assert_allclose(q.dequantize(codes, "mm"), [400, 1000, 9000], atol=0.002 * 12500)
    with pytest.raises(ValueError, match="'video.depth_min'.*below"):
        DepthQuantization.of({"info": {"video.depth_min": 5.0, "video.depth_max": 1.0}})
    legacy = {"info": {"video.is_depth_map": True}}  # 0.4.4's marker, LeRobot's defaults
    from roboscale.data.lerobot.depth import is_depth_map
    assert is_depth_map(legacy) and DepthQuantization.of(legacy).shift == 3.5


def test_info_keeps_tools_and_encoder_settings_and_warns_once_about_unknown_keys(v06_copy: Path, caplog) -> None:
    info = fmt.read_info(v06_copy)
    assert [t["function"]["name"] for t in info.tools] == ["say"]
    corner = info.features["observation.images.corner"]["info"]
    assert corner["is_depth_map"] is False and corner["video.g"] == 2 and corner["video.video_backend"] == "pyav"
    assert "video.is_depth_map" not in corner
    raw = json.loads((v06_copy / fmt.INFO_PATH).read_text())
    raw["total_videos"] = 3  # a v2.x leftover
    (v06_copy / fmt.INFO_PATH).write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="roboscale.data.lerobot.format"):
        for _ in range(3):
            fmt.read_info(v06_copy)
    warnings = [r for r in caplog.records if "unknown keys" in r.getMessage()]
    assert len(warnings) == 1 and "total_videos" in warnings[0].getMessage()
    fmt.write_info(v06_copy, fmt.read_info(v06_copy))
    assert fmt.read_info(v06_copy).tools == info.tools  # kept on write


def test_a_lerobot_044_dataset_with_subtasks_still_reads(fixture_copy: Path) -> None:
    """0.6 dropped meta/subtasks.parquet and subtask_index; 0.4.4 datasets carrying them still read."""
    path = fixture_copy / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    subtask = pa.array((table["frame_index"].to_numpy() >= 5).astype(np.int64))
    pq.write_table(table.append_column("subtask_index", subtask), path)
    pq.write_table(pa.table({"subtask_index": [0, 1], "__index_level_0__": ["approach", "grasp"]}),
                   fixture_copy / "meta/subtasks.parquet")
    raw = json.loads((fixture_copy / fmt.INFO_PATH).read_text())
    raw["features"]["subtask_index"] = {"dtype": "int64", "shape": [1], "names": None}
    (fixture_copy / fmt.INFO_PATH).write_text(json.dumps(raw, indent=4))
    item = LeRobotDataset(root=fixture_copy)[7]
    assert int(item["subtask_index"]) == 1 and int(item["frame_index"]) == 7


# --------------------------------------------------------------------------------------------------- validate


def test_the_06_fixture_validates_and_data_info_shows_what_it_holds() -> None:
    report = validate(V06)
    assert report.ok, [str(p) for p in report.problems]
    assert bad_episodes(V06) == {}
    text = "\n".join(summarize(V06).lines())
    assert "language_persistent" in text and "rows of role, content, style, timestamp, camera, tool_calls" in text
    assert "depth map: log 12-bit, 0.01-10 m, recorded in mm" in text
    assert "tools: say" in text and "with q01/q99 quantiles" in text


def _rewrite_events(root: Path, edit) -> None:
    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    cells = table["language_events"].to_pylist()
    edit(cells)
    i = table.column_names.index("language_events")
    pq.write_table(table.set_column(i, "language_events", pa.array(cells)), path)


def test_validate_names_annotation_rows_that_break_the_camera_rule(v06_copy: Path) -> None:
    def drop_camera(cells):  # episode 2, frame 3: the VQA rows
        for row in cells[12 + 17 + 3]:
            row["camera"] = None

    _rewrite_events(v06_copy, drop_camera)
    problems = [str(p) for p in validate(v06_copy).problems]
    assert len(problems) == 1
    assert "episode 2: field 'language_events': frame 3, row 0: style 'vqa' is view-dependent" in problems[0]


def test_validate_names_a_camera_the_dataset_does_not_have_and_bad_depth_settings(v06_copy: Path) -> None:
    def wrong_camera(cells):
        cells[3][0]["camera"] = "observation.images.top"

    _rewrite_events(v06_copy, wrong_camera)
    raw = json.loads((v06_copy / fmt.INFO_PATH).read_text())
    raw["features"][DEPTH]["info"]["video.shift"] = "far"
    (v06_copy / fmt.INFO_PATH).write_text(json.dumps(raw, indent=4))
    problems = [str(p) for p in validate(v06_copy).problems]
    assert any("episode 0: field 'language_events': frame 3, row 0: 'camera' is 'observation.images.top'" in p
               for p in problems), problems
    assert any(f"field '{DEPTH}': 'video.shift' must be a number" in p for p in problems), problems
    with pytest.raises(DatasetError, match="video.shift"):
        LeRobotDataset(root=v06_copy)


# --------------------------------------------------------------------------------------------------- write


def test_writer_round_trips_annotations_tools_and_encoder_info(tmp_path: Path) -> None:
    features = {"observation.state": {"dtype": "float32", "shape": [2], "names": None},
                "observation.images.cam": {"dtype": "video", "shape": [16, 16, 3], "names": None},
                "language_persistent": {"dtype": "language", "shape": [1], "names": None},
                "language_events": {"dtype": "language", "shape": [1], "names": None}}
    persistent = [{"role": "assistant", "content": "push", "style": "subtask", "timestamp": 0.0, "camera": None,
                   "tool_calls": None}]
    vqa = {"role": "user", "content": "where?", "style": "vqa", "camera": "observation.images.cam",
           "tool_calls": None}
    say = {"role": "assistant", "content": None, "style": None, "camera": None,
           "tool_calls": [{"type": "function", "function": {"name": "say", "arguments": {"text": "hi"}}}]}
    root = tmp_path / "ds"
    with DatasetWriter.create(root, fps=10, features=features, tools=[MAKE.SAY_TOOL]) as writer:
        n = 6
        writer.add_episode({"observation.state": np.zeros((n, 2), np.float32),
                            "observation.images.cam": np.zeros((n, 16, 16, 3), np.uint8),
                            "language_persistent": [persistent] * n,
                            "language_events": [[], [vqa], [], [say], [], []]}, task="push it")
        for i in range(4):
            writer.add_frame({"observation.state": np.ones(2, np.float32),
                              "observation.images.cam": np.zeros((16, 16, 3), np.uint8),
                              "language_persistent": persistent, "language_events": [vqa, say] if i == 2 else None,
                              "task": "push it"})
        writer.save_episode()
    assert validate(root).ok, [str(p) for p in validate(root).problems]
    info = fmt.read_info(root)
    assert info.tools == [MAKE.SAY_TOOL]
    cam = info.features["observation.images.cam"]["info"]
    assert cam["is_depth_map"] is False and cam["video.g"] == 2 and cam["video.crf"] == 30
    assert "language_persistent" not in fmt.read_stats(root)
    ds = LeRobotDataset(root=root)
    assert ds[1]["language_events"] == [vqa] and ds[3]["language_events"] == [say]
    assert ds[6 + 2]["language_events"] == [vqa, say] and ds[6 + 3]["language_events"] == []
    assert all(ds[i]["language_persistent"] == persistent for i in range(10))


def test_writer_refuses_bad_annotation_rows_and_depth_maps_in_one_line(tmp_path: Path) -> None:
    features = {"observation.images.cam": {"dtype": "video", "shape": [16, 16, 3], "names": None},
                "language_events": {"dtype": "language", "shape": [1], "names": None}}
    writer = DatasetWriter.create(tmp_path / "a", fps=10, features=features)
    try:
        bad = {"role": "user", "content": "where?", "style": "vqa", "camera": None, "tool_calls": None}
        with pytest.raises(DatasetError, match="field 'language_events': row 0: style 'vqa' is view-dependent"):
            writer.add_frame({"observation.images.cam": np.zeros((16, 16, 3), np.uint8), "language_events": [bad],
                              "task": "t"})
    finally:
        writer.abort()
    depth = {DEPTH: {"dtype": "video", "shape": [8, 8, 1], "names": None, "info": {"is_depth_map": True}}}
    with pytest.raises(DatasetError, match="depth-map videos .* are read, not written"):
        DatasetWriter.create(tmp_path / "b", fps=10, features=depth)


# --------------------------------------------------------------------------------------------------- loader, train


def _subtask_prompt(sample: dict) -> dict:
    """A transform that asks for the annotations: the subtask in force becomes the prompt."""
    row = active_row(sample.pop("language_persistent"), float(sample["timestamp"]))
    sample["task"] = row["content"] if row else sample["task"]
    return sample


def test_the_loader_hands_annotations_to_a_transform_that_asks_for_them() -> None:
    loader = build_loader(V06, batch_size=58, num_workers=0, shuffle=False, check=False,
                          keys=["observation.state", "timestamp", "language_persistent"], transform=_subtask_prompt)
    batch = next(iter(loader))
    episode, frame = batch["episode_index"].tolist(), batch["frame_index"].tolist()
    expected = [f"{'move above' if f < LENGTHS[e] // 2 else 'lower onto'} target {e}" for e, f in zip(episode, frame)]
    assert batch["task"] == expected
    loader.close()
    plain = build_loader(V06, batch_size=4, num_workers=0, check=False)
    first = next(iter(plain))
    assert "language_persistent" not in first and DEPTH not in first and "observation.images.corner" in first
    plain.close()
    with pytest.raises(ConfigError, match=f"'{DEPTH}' is a depth map"):
        build_loader(V06, batch_size=4, num_workers=0, check=False, keys=[DEPTH])


def test_training_on_a_06_dataset_uses_its_rgb_cameras_and_refuses_its_depth_map(tmp_path: Path) -> None:
    from roboscale.configs.train import DatasetConfig, OptimizerConfig, TrainConfig
    from roboscale.models.pi05.config import Pi05Config
    from roboscale.models.policy import Policy
    from roboscale.train.supervised import train

    def config(out: Path, **policy) -> TrainConfig:
        return TrainConfig(dataset=DatasetConfig(root=str(V06)), steps=2, batch_size=4, output_dir=str(out),
                           optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1),
                           policy=Pi05Config(image_size=32, vit_patch_size=8, vit_dim=32, vit_depth=1, vit_heads=2,
                                             width=48, depth=2, n_action_steps=4, num_inference_steps=2, **policy))

    final = train(config(tmp_path / "run"), progress=False)
    assert Policy.from_pretrained(final).config.image_keys == ["observation.images.corner",
                                                               "observation.images.gripper"]
    with pytest.raises(ConfigError, match=f"camera '{DEPTH}' .* is a depth map"):
        train(config(tmp_path / "run2", image_keys=["observation.images.corner", DEPTH]), progress=False)


# --------------------------------------------------------------------------------------------------- stats


def test_lerobot_044_stats_json_weights_episode_quantiles_by_count(fixture_root: Path) -> None:
    """The quantile merge LeRobot 0.4.4-0.6.1 wrote into stats.json (its main branch takes a min/max envelope)."""
    stats = fmt.read_stats(fixture_root)
    episodes = fmt.read_episodes_table(fixture_root, with_stats=True)
    counts = np.array(episodes["stats/observation.state/count"].to_pylist(), dtype=np.float64).reshape(-1, 1)
    for q in fmt.QUANTILES:
        per_episode = np.array(episodes[f"stats/observation.state/{q}"].to_pylist())
        weighted = (per_episode * counts).sum(axis=0) / counts.sum()
        np.testing.assert_allclose(stats["observation.state"][q], weighted, rtol=1e-6)
        if q == "q01":
            assert not np.allclose(stats["observation.state"][q], per_episode.min(axis=0))
