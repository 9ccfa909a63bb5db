"""Every damage of ``damages.DAMAGES`` against every entry point of ``entry_points.ENTRY_POINTS``.

What each case must show: a clear error (one line, naming a file of the dataset) or a counted skip of exactly the
damaged episodes; the right frames (nothing of a skipped episode, everything of the others); nothing half-written
left where a user would see it; and, after the data is repaired, a rerun of the same command that works.

A new damage or a new entry point is one line in its table; ``expected`` says what each pair should do. The
outcomes are recorded in docs/reliability.md.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from roboscale.data.lerobot.validate import validate

from .damages import DAMAGES, Damage
from .entry_points import ENTRY_POINTS, Outcome

SKIPPING = ("build_loader skipping", "train --skip-bad-episodes")


def expected(damage: Damage, entry: str) -> str:
    """ok | error | skip."""
    if entry in damage.expect:
        return damage.expect[entry]
    if entry == "data info":  # metadata only: damage to data and videos is not its business
        return "ok"
    if entry in SKIPPING and damage.bad is not None:
        return "skip"
    return "error"


def _cases():
    for damage in DAMAGES:
        for entry in ENTRY_POINTS:
            # a lake build that only a decode finds starts Ray first (~10 s): still run, in the slow set
            slow = entry == "lake build" and damage.found == "read"
            yield pytest.param(damage, entry, id=f"{damage.name}/{entry}",
                               marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("damage, entry", list(_cases()))
def test_damage(damage: Damage, entry: str, small_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "dataset"
    shutil.copytree(small_root, root)
    damage.apply(root)
    work = tmp_path / "work"
    work.mkdir()
    outcome = ENTRY_POINTS[entry](root, work)
    want = expected(damage, entry)
    if want == "skip" and entry == "train --skip-bad-episodes":
        want = "ok"  # the command line's skip is a finished training; the loader cases count the frames
    assert outcome.kind == want, f"{damage.name} / {entry}: expected {want}, got {outcome.kind}: {outcome.message}"
    if outcome.kind == "error":
        _assert_clear(outcome, root)
        _assert_nothing_half_written(entry, work)
        # the user repairs the data and runs the same command again (a lake build that failed before it started,
        # like any other entry point, has nothing to resume: rerun it only where shards were written)
        if entry == "train" or (entry == "lake build" and damage.found == "read"):
            shutil.rmtree(root)
            shutil.copytree(small_root, root)
            again = ENTRY_POINTS[entry](root, work)
            assert again.kind == "ok", f"rerun after repair failed: {again.message}"
    if outcome.kind == "skip":
        _assert_right_frames(damage, outcome, small_root)
    if entry == "data validate" and damage.bad is not None:
        assert set(validate(root).bad_episodes()) == damage.bad_episodes(small_root)


def _assert_clear(outcome: Outcome, root: Path) -> None:
    text = outcome.message.strip()
    assert "Traceback" not in text
    if outcome.exit_code:  # the command line's one error path, exit 1 for bad data: the last line, after any
        # progress bar or Ray's log lines
        *before, text = text.replace("\r", "\n").strip().splitlines()
        assert not any(line.startswith("error: ") for line in before), before
        assert text.startswith("error: ") and outcome.exit_code == 1, (outcome.exit_code, text)
    assert text.isprintable(), repr(text)
    assert "\n" not in text, f"more than one line:\n{text}"
    assert str(root) in text, f"the error does not name the dataset's file: {text}"


def _assert_nothing_half_written(entry: str, work: Path) -> None:
    if entry.startswith("train"):
        checkpoints = work / "run" / "checkpoints"
        assert not checkpoints.exists() or not any(checkpoints.iterdir()), list(checkpoints.iterdir())
    if entry == "lake build":  # shards a resumed build reuses may stay; a lake a reader would open may not
        assert not (work / "lake" / "manifest.json").exists()


def _assert_right_frames(damage: Damage, outcome: Outcome, pristine: Path) -> None:
    from roboscale.data.loading.raw_source import RawSource

    bad = damage.bad_episodes(pristine)
    lengths = RawSource(pristine).episode_lengths
    good = {ep: list(range(int(n))) for ep, n in enumerate(lengths) if ep not in bad}
    assert outcome.skipped == len(bad)
    if damage.found == "upfront":  # excluded before planning: every other frame exactly once
        assert outcome.frames == good
    else:  # found while decoding: a batch keeps its size with readable samples of the same block
        assert set(outcome.frames) == set(good)
        for ep, frames in good.items():
            assert set(outcome.frames[ep]) == set(frames)


def test_the_reliability_page_records_every_damage() -> None:
    """docs/reliability.md pastes the output of `python -m tests.faults.report`: a damage added here and not
    recorded there (or renamed) fails until the page is regenerated."""
    from .test_checkpoint_faults import DAMAGES as CHECKPOINT_DAMAGES

    page = (Path(__file__).parents[2] / "docs" / "reliability.md").read_text()
    missing = [d.name for d in [*DAMAGES, *CHECKPOINT_DAMAGES] if f"**{d.name}**: {d.what}" not in page]
    assert not missing, f"regenerate docs/reliability.md (python -m tests.faults.report): {missing}"


def _tool_calls_not_json(root: Path) -> Path:
    """LeRobot 0.6's fixture with every ``language_events`` row's ``tool_calls`` a string that is not JSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (data,) = sorted((root / "data").rglob("*.parquet"))
    table = pq.read_table(data)
    row = pa.struct([("role", pa.string()), ("content", pa.string()), ("style", pa.string()),
                     ("camera", pa.string()), ("tool_calls", pa.list_(pa.string()))])
    cells = [[{**r, "tool_calls": ["{not json"]} for r in cell or []]
             for cell in table.column("language_events").to_pylist()]
    index = table.schema.get_field_index("language_events")
    pq.write_table(table.set_column(index, pa.field("language_events", pa.list_(row)),
                                    pa.array(cells, type=pa.list_(row))), data)
    return data


def test_annotations_that_cannot_be_read_fail_only_who_reads_them(tmp_path: Path) -> None:
    """Before (issue 31): `data validate` named the bad ``tool_calls``, but `train` passed its quick check and died in
    a loader-worker traceback (every column of a data file was parsed, asked for or not), and `lake build` (which
    leaves annotations out) in a Ray traceback. Now the annotations are parsed when read: training and the lake,
    which do not read them, work; a loader asked for them stops with one line naming the file, episode and field."""
    import numpy as np

    from roboscale.data.loading.source import open_source
    from roboscale.errors import DatasetError

    from .entry_points import run_cli, train_args

    root = tmp_path / "dataset"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "lerobot-0.6-mini", root)
    data = _tool_calls_not_json(root)
    assert run_cli("data", "validate", str(root)).exit_code == 1
    assert run_cli(*train_args(root, tmp_path)).kind == "ok"
    with pytest.raises(DatasetError) as err:
        open_source(root).read(0, np.array([0]), ["language_events"])
    assert str(err.value).startswith(f"{data}: episode 0: field 'language_events': annotations that cannot be read")


def test_an_rgb_camera_marked_as_a_depth_map_is_a_problem_not_a_silent_omission(tmp_path: Path) -> None:
    """Before (issue 31): `is_depth_map: true` on an RGB camera of a 0.6 dataset validated, and training left that
    camera out of the policy without a word. Now both checks name the camera and say what to fix, and training
    refuses the dataset up front."""
    import json

    from .entry_points import run_cli, train_args

    root = tmp_path / "dataset"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "lerobot-0.6-mini", root)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.images.corner"]["info"]["is_depth_map"] = True
    info_path.write_text(json.dumps(info))
    for quick in (False, True):
        problems = [str(p) for p in validate(root, full=not quick).problems]
        assert any("field 'observation.images.corner'" in p and "not a gray depth stream" in p for p in problems), \
            (quick, problems)
    outcome = run_cli(*train_args(root, tmp_path))
    assert outcome.kind == "error" and "is_depth_map" in outcome.message, outcome.message
