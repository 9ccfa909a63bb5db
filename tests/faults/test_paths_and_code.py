"""Paths and names read from files (issue 18): path templates that leave the dataset or evaluate attributes, a
checkpoint's config that names code to import, a dataset's strings that carry terminal escapes.

Each test states the behaviour a probe found broken: a template in ``meta/info.json`` was followed outside the
dataset (or ``str.format`` evaluated ``{chunk_index.__class__}``), a resumed training imported the module its
checkpoint's ``eval.env`` named, ``roboscale data info`` printed a task's escape sequences raw.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from roboscale.data.lerobot import format as fmt
from roboscale.errors import CheckpointError, ConfigError, DatasetError

from .entry_points import data_info, data_validate, lake_build, lerobot_dataset, loader, train

PATH_ENTRY_POINTS = {"data validate": data_validate, "LeRobotDataset": lerobot_dataset, "build_loader": loader,
                     "train": train, "lake build": lake_build}
DATA = 1


@pytest.fixture
def dataset(tiny_dataset: Path, tmp_path: Path) -> Path:
    root = tmp_path / "dataset"
    shutil.copytree(tiny_dataset, root)
    return root


def _set_info(root: Path, **fields: object) -> None:
    path = root / fmt.INFO_PATH
    info = json.loads(path.read_text())
    info.update(fields)
    path.write_text(json.dumps(info, indent=4))


def _assert_one_line_error(outcome, *needles: str) -> str:
    assert outcome.kind == "error", f"expected an error, got {outcome.kind}: {outcome.message[-300:]}"
    if outcome.exit_code:  # the command line: exit 1 and one `error:` line, no traceback
        lines = outcome.message.strip().splitlines()
        assert outcome.exit_code == DATA and len(lines) == 1 and lines[0].startswith("error: "), outcome.message
    for needle in needles:
        assert needle in outcome.message, outcome.message
    return outcome.message


# --------------------------------------------------------------------------------------------------- templates


@pytest.mark.parametrize("entry", list(PATH_ENTRY_POINTS))
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_template_that_leads_outside_the_dataset_is_refused_not_followed(dataset: Path, tmp_path: Path,
                                                                           entry: str, where: str) -> None:
    """The data files moved next to the dataset and info.json pointing there (``../``) or at them by absolute
    path: before, every entry point read them (``data validate``: "no problems")."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(dataset / "data", outside / "data")
    prefix = "../outside" if where == "relative" else str(outside)
    _set_info(dataset, data_path=f"{prefix}/data/chunk-{{chunk_index:03d}}/file-{{file_index:03d}}.parquet")
    outcome = PATH_ENTRY_POINTS[entry](dataset, tmp_path / "work")
    _assert_one_line_error(outcome, str(dataset / fmt.INFO_PATH), "'data_path'", "a path outside the dataset")


@pytest.mark.parametrize("entry", ["data validate", "train", "lake build"])
@pytest.mark.parametrize(("field", "template", "says"), [
    ("data_path", "data/{chunk_index.__class__}/file-{file_index:03d}.parquet", "uses {chunk_index.__class__}"),
    ("data_path", "data/{chunk_index[0]}/file-{file_index:03d}.parquet", "uses {chunk_index[0]}"),
    ("data_path", "data/{bogus}/file-{file_index:03d}.parquet", "uses {bogus}"),
    ("data_path", "data/chunk-{chunk_index", "is not a path template"),
    ("data_path", "data/chunk-{chunk_index:03d}/file-{file_index:s}.parquet", "bad format spec 's'"),
    ("video_path", "videos/{video_key!r}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4", "uses {video_key!r}"),
    ("video_path", "videos/{video_key}/{chunk_index:{file_index}}.mp4", "uses {chunk_index:{file_index}}"),
])
def test_a_template_with_more_than_its_fields_is_one_line_naming_info_json(dataset: Path, tmp_path: Path,
                                                                          entry: str, field: str, template: str,
                                                                          says: str) -> None:
    """Templates take their documented fields with a format spec and nothing else; before, ``{bogus}`` and an
    unmatched brace ended in a traceback and attribute access was evaluated."""
    _set_info(dataset, **{field: template})
    outcome = PATH_ENTRY_POINTS[entry](dataset, tmp_path / "work")
    _assert_one_line_error(outcome, str(dataset / fmt.INFO_PATH), f"'{field}'", says)


def test_a_camera_named_to_leave_the_dataset_is_refused(dataset: Path, tmp_path: Path) -> None:
    """A video feature's key is a directory of the video template: ``../..`` in it leaves the dataset."""
    info = json.loads((dataset / fmt.INFO_PATH).read_text())
    info["features"]["../../elsewhere"] = info["features"].pop("observation.images.wrist")
    (dataset / fmt.INFO_PATH).write_text(json.dumps(info, indent=4))
    _assert_one_line_error(data_validate(dataset, tmp_path), "'video_path'", "video_key='../../elsewhere'",
                           "a path outside the dataset")


def test_the_path_is_checked_after_formatting(dataset: Path, tmp_path: Path) -> None:
    """``{chunk_index:c}`` passes the template check (0 gives a NUL) but chunk and file 46 format to ``..``:
    each path is checked as it is made; validate names every episode it affects."""
    _set_info(dataset, data_path="{chunk_index:c}{file_index:c}/file.parquet")
    for path in fmt.episodes_files(dataset):
        table = pq.read_table(path)
        for column in ("data/chunk_index", "data/file_index"):
            table = table.set_column(table.schema.get_field_index(column), column,
                                     pa.array(np.full(table.num_rows, 46), pa.int64()))
        pq.write_table(table, path)
    message = _assert_one_line_error(data_validate(dataset, tmp_path), "problems (4 episodes affected)")
    assert "no problems" not in message
    from roboscale.data.lerobot.validate import validate

    problems = [p for p in validate(dataset).problems if p.field == "data_path"]
    assert sorted(p.episodes for p in problems) == [(0,), (1,), (2,), (3,)]
    assert all("gives '../file.parquet', a path outside the dataset" in p.message for p in problems)
    from roboscale.data import LeRobotDataset

    with pytest.raises(DatasetError, match=r"info.json: field 'data_path': .*a path outside the dataset"):
        LeRobotDataset(root=dataset)


def test_a_symlink_placed_inside_the_dataset_keeps_working(dataset: Path, tmp_path: Path) -> None:
    """The check is lexical: data/ as a symlink to storage elsewhere (how users share files) still reads."""
    storage = tmp_path / "storage"
    shutil.move(dataset / "data", storage)
    (dataset / "data").symlink_to(storage, target_is_directory=True)
    assert data_validate(dataset, tmp_path).kind == "ok"
    assert lerobot_dataset(dataset, tmp_path).kind == "ok"


def _image_dataset(root: Path) -> Path:
    from roboscale.data import DatasetWriter

    features = {"cam": {"dtype": "image", "shape": [8, 8, 3], "names": ["height", "width", "channels"]},
                "x": {"dtype": "int64", "shape": [1], "names": None}}
    frames = np.random.default_rng(0).integers(0, 256, size=(2, 8, 8, 3), dtype=np.uint8)
    with DatasetWriter.create(root, fps=5, features=features) as writer:
        writer.add_episode({"cam": frames, "x": np.array([3, 4])}, task="only")
    return root


@pytest.mark.parametrize("where", ["absolute", "relative"])
def test_an_image_row_that_refers_to_a_file_outside_the_dataset_is_refused(tmp_path: Path, where: str) -> None:
    """HF Image rows may hold a path instead of bytes; before, an absolute one (or ``../``) was read wherever it
    pointed."""
    from roboscale.data import LeRobotDataset
    from roboscale.data.loading.raw_source import RawSource

    root = _image_dataset(tmp_path / "d")
    data = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(data)
    column = table["cam"].combine_chunks()
    outside = tmp_path / "outside.png"
    outside.write_bytes(column.field("bytes")[0].as_py())  # a valid PNG: the old code decoded it
    ref = str(outside) if where == "absolute" else "../outside.png"
    rows = column.to_pylist()
    rows[0] = {"bytes": None, "path": ref}
    table = table.set_column(table.schema.get_field_index("cam"), "cam", pa.array(rows, column.type))
    pq.write_table(table, data)
    with pytest.raises(DatasetError, match=r"refers to .*outside.png', outside the dataset"):
        LeRobotDataset(root=root)[0]
    with pytest.raises(DatasetError, match=r"refers to .*outside.png', outside the dataset"):
        RawSource(root).read(0, np.array([0]), ["cam"])


# ------------------------------------------------------------------------------------------ code named in files

PLANTED = """
from pathlib import Path
Path({marker!r}).write_text("imported")
SPEC = object()
"""


def _planted_module(directory: Path) -> Path:
    """``planted.py`` in ``directory``: importing it writes ``imported`` next to it."""
    marker = directory / "imported"
    (directory / "planted.py").write_text(PLANTED.format(marker=str(marker)))
    return marker


def _checkpoint_naming_code(out: Path, dataset: Path) -> Path:
    """An output dir whose last checkpoint's train_config.json sets ``eval.env`` to ``planted:SPEC`` (all a
    resume reads before it builds anything)."""
    from roboscale.config import to_dict
    from roboscale.configs.train import TrainConfig

    cfg = to_dict(TrainConfig(output_dir=str(out)))
    cfg["dataset"]["root"] = str(dataset)
    cfg["eval"].update(env="planted:SPEC", every=1)
    pretrained = out / "checkpoints" / "000001" / "pretrained_model"
    pretrained.mkdir(parents=True)
    (pretrained / "train_config.json").write_text(json.dumps(cfg, indent=4))
    (out / "checkpoints" / "last").symlink_to("000001")
    return pretrained / "train_config.json"


def _rl_checkpoint_naming_code(out: Path, key: str, value: str) -> Path:
    """An RL output dir whose last checkpoint's ``rl_state.json`` sets ``key`` (``env`` or ``eval.env``) to
    ``value``: what ``roboscale rl --resume`` reads before it builds anything."""
    from roboscale.config import to_dict
    from roboscale.configs.rl import RLConfig

    cfg = to_dict(RLConfig(output_dir=str(out), policy_path=str(out / "sft")))
    section, _, name = key.rpartition(".")
    (cfg[section] if section else cfg)[name] = value
    state = out / "checkpoints" / "000001" / "training_state"
    state.mkdir(parents=True)
    (state / "rl_state.json").write_text(json.dumps({"config": cfg}))
    (out / "checkpoints" / "last").symlink_to("000001")
    return state / "rl_state.json"


@pytest.mark.parametrize("command, key", [("train", "eval.env"), ("rl", "env"), ("rl", "eval.env")])
def test_a_resume_does_not_import_the_code_a_checkpoint_names(command: str, key: str, tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    """``python -m roboscale COMMAND --resume=true`` in a directory holding ``planted.py``, with a checkpoint whose
    options say ``KEY: planted:SPEC``: before, the module was imported (``-m`` puts the working directory on
    sys.path; `rl` did not even check, and a real SPEC would have run the whole job). Now one line naming the file
    and the option, and how to allow it, for every command that resumes (one resume path)."""
    work = tmp_path / "cwd"
    work.mkdir()
    marker = _planted_module(work)
    if command == "train":
        saved = _checkpoint_naming_code(work / "run", request.getfixturevalue("tiny_dataset"))
    else:
        saved = _rl_checkpoint_naming_code(work / "run", key, "planted:SPEC")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "roboscale", command, "--resume=true", "--output_dir=run"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "the checkpoint's module was imported"
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: {saved.resolve()}: --{key}=planted:SPEC names code to import"), lines
    assert f"give --{key}=planted:SPEC on the command line" in lines[0]


def test_an_rl_resume_does_not_run_a_standard_library_module_its_state_names(tmp_path: Path) -> None:
    """``"this:s"`` printed the Zen of Python under the console script (no working directory on its path)."""
    _rl_checkpoint_naming_code(tmp_path / "run", "env", "this:s")
    console = Path(sys.executable).with_name("roboscale")
    done = subprocess.run([str(console), "rl", "--resume=true", f"--output_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=300)
    assert "Beautiful is better than ugly" not in done.stdout + done.stderr
    assert done.returncode == 2 and "--env=this:s names code to import" in done.stderr


def test_every_command_that_resumes_parses_through_the_one_resume_path() -> None:
    """The configs with a ``resume`` option that takes a run's options from its checkpoint are exactly those of the
    ResumableCommands (train's and rl's), so a new command that resumes has to be one, and gets the code-name
    guard with it."""
    import dataclasses
    import importlib
    import pkgutil

    import roboscale.configs
    from roboscale.rl import run as rl_run
    from roboscale.train.resume import TRAIN, ResumableCommand, parse_resumable

    resumable = set()
    for info in pkgutil.iter_modules(roboscale.configs.__path__):
        module = importlib.import_module(f"roboscale.configs.{info.name}")
        for value in vars(module).values():
            if dataclasses.is_dataclass(value) and isinstance(value, type) and value.__module__ == module.__name__ \
                    and "resume" in {f.name for f in dataclasses.fields(value)}:
                resumable.add(value)
    calls = []
    original = parse_resumable

    def recording(command: ResumableCommand, argv: list[str]):
        calls.append(command.config)
        return original(command, argv)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("roboscale.train.resume.parse_resumable", recording)
        from roboscale.train.resume import parse_train_args

        parse_train_args([])
        rl_run.parse_rl_args([])
    # `roboscale eval --resume` takes no options from its directory: it compares protocol.json with the command
    # line's (test_an_evaluation_dirs_protocol_is_compared_never_imported); TrainerConfig is no command's: the
    # Trainer's part of train's and rl's configs
    from roboscale.configs.eval import EvalConfig
    from roboscale.configs.train import TrainerConfig

    assert resumable - {EvalConfig, TrainerConfig} == {TRAIN.config, *calls} == set(calls), (resumable, calls)
    assert all(issubclass(config, TrainerConfig) for config in calls)


def test_a_copied_rl_run_resumes_where_it_now_is(tmp_path: Path) -> None:
    """`train` resumes a copied output dir; `rl` refused it (--output_dir differed from the run's own)."""
    from roboscale.rl.run import parse_rl_args

    _rl_checkpoint_naming_code(tmp_path / "run", "env", "metaworld")
    shutil.copytree(tmp_path / "run", tmp_path / "copy", symlinks=True)
    assert parse_rl_args(["--resume=true", f"--output_dir={tmp_path / 'copy'}"]).output_dir == str(tmp_path / "copy")


def test_a_code_name_given_again_on_the_command_line_is_the_users_choice(tiny_dataset: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Giving the option again (or overriding it) resumes; parsing imports nothing either way."""
    from roboscale.train.resume import parse_train_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = _planted_module(tmp_path)
    _checkpoint_naming_code(tmp_path / "run", tiny_dataset)
    resume = ["--resume=true", "--output_dir=run"]
    with pytest.raises(ConfigError, match=r"train_config.json: --eval.env=planted:SPEC names code to import"):
        parse_train_args(resume)
    assert parse_train_args([*resume, "--eval.env=planted:SPEC"]).eval.env == "planted:SPEC"
    assert parse_train_args([*resume, "--eval.env=metaworld"]).eval.env == "metaworld"
    assert not marker.exists() and "planted" not in sys.modules


def test_a_checkpoint_policy_type_naming_code_is_refused_without_importing(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json's ``type`` is looked up among registered policies only (guards what already held)."""
    from roboscale.models.policy import Policy

    monkeypatch.syspath_prepend(str(tmp_path))
    marker = _planted_module(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"type": "planted:SPEC"}))
    with pytest.raises(CheckpointError, match="unknown policy type 'planted:SPEC'"):
        Policy.from_pretrained(tmp_path / "ckpt")
    assert not marker.exists()


def test_an_evaluation_dirs_protocol_is_compared_never_imported(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``roboscale eval`` resuming an output dir reads protocol.json's env only to compare it with the command
    line's (guards what already held)."""
    from roboscale.eval.closed_loop import PROTOCOL_FILE, _previous_episodes
    from roboscale.eval.episode_log import EpisodeLog

    monkeypatch.syspath_prepend(str(tmp_path))
    marker = _planted_module(tmp_path)
    out = tmp_path / "eval"
    out.mkdir()
    protocol = {"env": "metaworld", "tasks": ["reach"], "episodes_per_task": 1}
    (out / PROTOCOL_FILE).write_text(json.dumps({**protocol, "env": "planted:SPEC"}))
    with pytest.raises(ConfigError, match=r"another protocol \(differs in: env\)"):
        _previous_episodes(out, EpisodeLog(out), protocol, resume=True)
    assert not marker.exists()


class _RunsCode:
    """Unpickled, it calls ``exec`` on its payload (what a crafted pickle does)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def test_resume_refuses_a_sharded_state_whose_index_names_code(tiny_dataset: Path, tmp_path: Path) -> None:
    """DCP reads the sharded state's index (.metadata) with pickle: a crafted one ran code on `train --resume`.
    It may now only build the classes of DCP's metadata; the run resumes from a genuine one."""
    import pickle

    from roboscale.train.checkpoint import SHARDED, TRAINING_STATE

    from .entry_points import TINY_PI05, run_cli

    run = tmp_path / "run"
    assert run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=1", "--batch_size=4",
                   *TINY_PI05).kind == "ok"
    index = run / "checkpoints" / "last" / TRAINING_STATE / SHARDED / ".metadata"
    genuine = index.read_bytes()
    marker = tmp_path / "ran"
    index.write_bytes(pickle.dumps(_RunsCode(f"open({str(marker)!r}, 'w').close()")))
    outcome = run_cli("train", f"--output_dir={run}", "--resume=true", "--steps=2")
    assert not marker.exists(), "the checkpoint's pickle ran code"
    assert outcome.kind == "error" and outcome.exit_code == 1
    assert "refused: the checkpoint's index names builtins.exec, which is not part of a checkpoint" in \
        outcome.message.strip().splitlines()[-1]
    index.write_bytes(genuine)
    assert run_cli("train", f"--output_dir={run}", "--resume=true", "--steps=2").kind == "ok"


# --------------------------------------------------------------------------------------------- terminal escapes

FORGED = "\x1b[2J\x1b[Hreach\nerror: forged line\u202e"


def _dataset_with_task(root: Path, task: str) -> Path:
    from roboscale.data import DatasetWriter

    features = {"x": {"dtype": "float32", "shape": [2], "names": None}}
    with DatasetWriter.create(root, fps=5, features=features, robot_type="bot\x1b]0;title\x07") as writer:
        writer.add_episode({"x": np.zeros((3, 2), np.float32)}, task=task)
    return root


def _assert_escaped(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\u202e"), repr(text)
    assert not any(line.startswith("error: forged") for line in text.splitlines()), text


def test_data_info_prints_a_tasks_control_characters_escaped(tmp_path: Path) -> None:
    root = _dataset_with_task(tmp_path / "d", FORGED)
    outcome = data_info(root, tmp_path)
    assert outcome.kind == "ok", outcome.message
    _assert_escaped(outcome.message)
    assert r"0: \x1b[2J\x1b[Hreach\nerror: forged line\u202e" in outcome.message
    assert r"robot bot\x1b]0;title\x07" in outcome.message


def test_validate_prints_the_names_it_quotes_escaped(tmp_path: Path) -> None:
    """A stray file in data/ whose name carries escapes: its problem line shows them escaped."""
    from roboscale.cli import main

    root = _dataset_with_task(tmp_path / "d", "reach")
    (root / "data" / "\x1b[2Jerror: forged.parquet").write_bytes(b"not parquet")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["data", "validate", str(root)]) == DATA
    problems = out.getvalue().splitlines()
    assert len(problems) == 1 and r"data/\x1b[2Jerror: forged.parquet: cannot read parquet" in problems[0]
    _assert_escaped(out.getvalue() + err.getvalue())
