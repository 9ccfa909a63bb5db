"""`validate` reports every problem of a damaged dataset at once, each naming its file, episode and field;
`bad_episodes` maps them to the episodes a loader should skip; the CLI prints them and exits non-zero."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roboscale.cli import main
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.summary import summarize
from roboscale.data.lerobot.validate import Problem, bad_episodes, validate
from roboscale.errors import DatasetError

from ..conftest import SMALL_LENGTHS

FRONT = "observation.images.front"
WRIST = "observation.images.wrist"
# Where the small dataset's episodes live (data files hold one episode each: a 1 kB size limit and chunks_size=2).
DATA_OF = {0: "data/chunk-000/file-000.parquet", 1: "data/chunk-000/file-001.parquet",
           2: "data/chunk-001/file-000.parquet", 3: "data/chunk-001/file-001.parquet",
           4: "data/chunk-002/file-000.parquet"}
EPISODES_FILE = "meta/episodes/chunk-000/file-000.parquet"


def _video_file(root: Path, key: str, ep: int) -> Path:
    row = fmt.read_episodes(root)[ep]
    return root / fmt.DEFAULT_VIDEO_PATH.format(video_key=key, chunk_index=row[f"videos/{key}/chunk_index"],
                                                file_index=row[f"videos/{key}/file_index"])


def _episodes_in_video(root: Path, key: str, path: Path) -> set[int]:
    return {e for e in range(len(SMALL_LENGTHS)) if _video_file(root, key, e) == path}


def _truncate(path: Path, fraction: float) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * fraction)])


def _shift_timestamps(root: Path, ep: int, seconds: float) -> Path:
    path = root / DATA_OF[ep]
    table = pq.read_table(path)
    shifted = pa.array(table["timestamp"].to_numpy() + np.float32(seconds), pa.float32())
    pq.write_table(table.set_column(table.schema.get_field_index("timestamp"), "timestamp", shifted), path)
    return path


def _drop_episode_row(root: Path, ep: int) -> None:
    """Remove one episode's metadata row, leaving a gap in episode_index (as a careless manual edit would)."""
    path = root / EPISODES_FILE
    table = pq.read_table(path)
    pq.write_table(table.filter(pa.compute.not_equal(table["episode_index"], ep)), path)


def _only(problems: list[Problem], **match: object) -> list[Problem]:
    return [p for p in problems if all(getattr(p, k) == v for k, v in match.items())]


@pytest.mark.parametrize("full", [True, False])
def test_clean_datasets_have_no_problems(small_root: Path, fixture_root: Path, full: bool) -> None:
    for root in (small_root, fixture_root):
        report = validate(root, full=full)
        assert report.ok, [str(p) for p in report.problems]
        assert report.episodes > 0 and report.frames > 0 and report.files_checked >= 4
    assert bad_episodes(small_root) == {}


@pytest.mark.parametrize("full", [True, False])
def test_truncated_mp4(small_copy: Path, full: bool) -> None:
    path = _video_file(small_copy, FRONT, 0)
    _truncate(path, 0.4)
    in_file = _episodes_in_video(small_copy, FRONT, path)
    problems = validate(small_copy, full=full).problems
    assert problems, "a truncated mp4 must be reported"
    for p in problems:  # only that file's episodes, named one by one, with the camera as the field
        assert p.path == path and p.field == FRONT and p.episode in in_file, str(p)
    assert max(in_file) in {p.episode for p in problems}  # the last episode in the file is past the cut


def test_truncated_parquet(small_copy: Path) -> None:
    path = small_copy / DATA_OF[2]
    _truncate(path, 0.5)
    problems = validate(small_copy).problems
    assert len(problems) == 1, [str(p) for p in problems]
    assert problems[0].path == path and problems[0].episodes == (2,) and "cannot read parquet" in problems[0].message
    assert bad_episodes(small_copy).keys() == {2}


def test_deleted_video_file(small_copy: Path) -> None:
    path = _video_file(small_copy, WRIST, 4)
    path.unlink()
    in_file = _episodes_in_video(small_copy, WRIST, path)
    problems = validate(small_copy).problems
    assert [(p.path, p.field, set(p.episodes)) for p in problems] == [(path, WRIST, in_file)]
    assert "not found" in problems[0].message
    # how many episodes share the file depends on the encoder's output sizes (file rotation): "episode 4" or
    # "episodes 2-4"
    assert str(problems[0]).startswith(f"{path}: episode")


def test_timestamps_beyond_tolerance(small_copy: Path) -> None:
    path = _shift_timestamps(small_copy, 1, 0.01)
    problems = validate(small_copy, tolerance_s=1e-4).problems
    assert [(p.path, p.episode, p.field) for p in problems] == [(path, 1, "timestamp")]
    assert "tolerance_s=0.0001" in problems[0].message
    assert validate(small_copy, tolerance_s=0.02).ok  # within a looser tolerance it is fine


@pytest.mark.parametrize("full", [True, False])
def test_video_span_off_by_half_a_frame(small_copy: Path, full: bool) -> None:
    """meta/episodes places episode 1 half a frame late in its mp4: the frame count still fits, the times do not."""
    path = small_copy / EPISODES_FILE
    table = pq.read_table(path)
    for column in (f"videos/{FRONT}/from_timestamp", f"videos/{FRONT}/to_timestamp"):
        values = table[column].to_numpy().copy()
        values[1] += 0.05
        table = table.set_column(table.schema.get_field_index(column), column, pa.array(values))
    pq.write_table(table, path)
    problems = validate(small_copy, full=full).problems
    mp4 = _video_file(small_copy, FRONT, 1)
    expected = {(mp4, FRONT, 1)}  # frames are not where the reader will look for them
    if _video_file(small_copy, FRONT, 2) == mp4:  # and episode 2, if it follows in the same file, now overlaps it
        expected.add((small_copy / fmt.EPISODES_DIR, f"videos/{FRONT}/from_timestamp", 2))
    assert {(p.path, p.field, p.episode) for p in problems} == expected, [str(p) for p in problems]
    assert "tolerance_s" in _only(problems, path=mp4)[0].message


def test_episode_index_gap(small_copy: Path) -> None:
    _drop_episode_row(small_copy, 2)
    problems = validate(small_copy).problems
    gap = _only(problems, field="episode_index", episode=2)
    assert gap and gap[0].path == small_copy / fmt.EPISODES_DIR and "missing 2" in gap[0].message
    # The consequences are reported too: totals, the broken global index, and the orphaned rows of episode 2.
    assert _only(problems, field="total_episodes") and _only(problems, field="total_frames")
    assert _only(problems, field="dataset_from_index", episode=3)
    orphan = _only(problems, path=small_copy / DATA_OF[2], episode=2)
    assert orphan and orphan[0].field == "episode_index"
    with pytest.raises(DatasetError, match="without gaps") as err:  # not an episode a loader can skip
        bad_episodes(small_copy)
    assert err.value.field == "episode_index"


def test_every_problem_at_once(small_copy: Path) -> None:
    """Four unrelated faults in one dataset: all four are reported in one pass, none hides another."""
    _truncate(small_copy / DATA_OF[2], 0.5)
    ts_path = _shift_timestamps(small_copy, 0, -0.05)
    wrist = _video_file(small_copy, WRIST, 4)
    wrist.unlink()
    stats = small_copy / fmt.STATS_PATH
    stats_obj = json.loads(stats.read_text())
    del stats_obj["action"]
    stats.write_text(json.dumps(stats_obj))
    problems = validate(small_copy).problems
    assert _only(problems, path=small_copy / DATA_OF[2], episodes=(2,))
    assert _only(problems, path=ts_path, episode=0, field="timestamp")
    assert _only(problems, path=wrist, field=WRIST)
    assert _only(problems, path=stats, field="action")
    assert len(problems) == 4, [str(p) for p in problems]
    with pytest.raises(DatasetError, match="no stats"):  # stats.json is dataset-level
        bad_episodes(small_copy)


def test_stats_values_that_would_break_normalization(small_copy: Path) -> None:
    stats = small_copy / fmt.STATS_PATH
    obj = json.loads(stats.read_text())
    obj["action"]["std"][0] = -1.0
    obj["action"]["q99"] = [v - 100.0 for v in obj["action"]["min"]]  # below min: quantiles out of order
    obj["observation.state"]["mean"] = obj["observation.state"]["mean"][:1]  # one value for a multi-dim feature
    obj["frame_index"]["max"] = [float("nan")]
    obj["next.reward"]["count"] = [0]
    stats.write_text(json.dumps(obj))
    by_field = {}
    for p in validate(small_copy).problems:
        assert p.path == stats
        by_field.setdefault(p.field, []).append(p.message)
    assert sorted(by_field) == ["action", "frame_index", "next.reward", "observation.state"], by_field
    assert any("'std' is negative" in m for m in by_field["action"])
    assert any("'q90' exceeds 'q99'" in m for m in by_field["action"])
    assert by_field["observation.state"] == ["'mean' has 1 values, the feature has 4"]
    assert by_field["frame_index"] == ["'max' is not finite"]
    assert "'count' must be one positive number" in by_field["next.reward"][0]


def test_bad_episodes_maps_each_episode_to_its_reason(small_copy: Path) -> None:
    _truncate(small_copy / DATA_OF[2], 0.5)
    _shift_timestamps(small_copy, 0, 0.5)
    bad = bad_episodes(small_copy)
    assert sorted(bad) == [0, 2]
    assert "timestamp" in bad[0] and DATA_OF[0] in bad[0]
    assert "cannot read parquet" in bad[2]


def test_schema_and_shape_mismatch(small_copy: Path) -> None:
    """A column whose type disagrees with info.json, and (full mode) values of the wrong size."""
    path = small_copy / DATA_OF[3]
    table = pq.read_table(path)
    i = table.schema.get_field_index("next.reward")
    table = table.set_column(i, "next.reward", table["next.reward"].cast(pa.float64()))
    i = table.schema.get_field_index("action")
    short = pa.array([row[:2] for row in table["action"].to_pylist()], pa.list_(pa.float32()))
    pq.write_table(table.set_column(i, "action", short), path)
    problems = validate(small_copy).problems
    found = [(p.path, p.field) for p in problems]
    assert found == [(path, "next.reward"), (path, "action")], [str(p) for p in problems]
    assert "float" in problems[0].message and problems[0].episodes == (3,)
    assert problems[1].episode == 3 and "expected shape [3]" in problems[1].message


def test_summary(small_root: Path) -> None:
    summary = summarize(small_root)
    assert summary.total_episodes == len(SMALL_LENGTHS) and summary.lengths.tolist() == SMALL_LENGTHS
    by_name = {f.name: f for f in summary.features}
    assert by_name[FRONT].codec.startswith("av1 yuv420p")
    assert summary.files_by_part[f"videos/{FRONT}"] == len(list((small_root / "videos" / FRONT).glob("*/*.mp4")))
    on_disk = sum(p.stat().st_size for p in small_root.rglob("*") if p.is_file())
    assert sum(summary.bytes_by_part.values()) == on_disk
    text = "\n".join(summary.lines())
    assert "pick the cube" in text and "q01/q99" in text


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_validate(small_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "validate", str(small_copy)]) == 0
    assert "no problems" in capsys.readouterr().out
    ts_path = _shift_timestamps(small_copy, 1, 0.01)
    (small_copy / DATA_OF[3]).unlink()
    assert main(["data", "validate", str(small_copy)]) == 1
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert any(line.startswith(f"{ts_path}: episode 1: field 'timestamp':") for line in lines), out
    assert any(line.startswith(f"{small_copy / DATA_OF[3]}: episode 3:") for line in lines), out
    assert "2 problems" in err and "Traceback" not in err
    assert main(["data", "validate", "--quick", str(small_copy)]) == 1


def test_cli_info(small_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "info", str(small_root)]) == 0
    out = capsys.readouterr().out
    assert f"{len(SMALL_LENGTHS)} episodes, {sum(SMALL_LENGTHS)} frames" in out
    assert "size on disk" in out and "av1" in out and "open the door" in out


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("info", "validate"):
        assert main(["data", command, str(tmp_path / "nope")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "meta/info.json: not found" in err and "Traceback" not in err
