"""The lake's faults a reliability probe found (issue 18): a build that deleted and overwrote what it did not write,
manifest paths that led out of the lake, and altered shard bytes that trained silently (docs/reliability.md).

One small lake (the small dataset, 3 shards) is built for the module; each test damages a copy of it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.build import build_lake
from roboscale.data.lake.source import LakeSource
from roboscale.errors import ConfigError, DatasetError

from ..data.lake.test_lake import CAMERAS, ray_session  # noqa: F401 (a fixture; the import skips without Ray)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Data's own deprecated options

SHARD_FRAMES = 20  # the small dataset's 5 episodes (7, 11, 6, 9, 12 frames) in 3 shards: [0, 1], [2, 3], [4]


@pytest.fixture(scope="module")
def small_lake(ray_session, small_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lake") / "lake"
    build_lake(LakeConfig(sources=[str(small_root)], output=str(out), image_size=0, shard_frames=SHARD_FRAMES))
    return out


@pytest.fixture
def lake_copy(small_lake: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "work" / "lake"
    shutil.copytree(small_lake, copy)
    return copy


def _tree(root: Path) -> dict[str, bytes | None]:
    """Everything under ``root``: a file's bytes, None for a directory."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit code and the last line of stderr of `roboscale ARGV...`."""
    from roboscale.cli import main

    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def _edit_manifest(lake: Path, edit) -> None:
    manifest = json.loads((lake / "manifest.json").read_text())
    edit(manifest)
    (lake / "manifest.json").write_text(json.dumps(manifest))


# ------------------------------------------------------------------------------- 1. a build writes only its own


def _user_files(out: Path) -> None:
    (out / "shards" / "my-notes").mkdir(parents=True)
    (out / "shards" / "my-notes" / "notes.txt").write_text("mine")
    (out / "README.txt").write_text("mine too")


def _user_manifest(out: Path) -> None:
    _user_files(out)
    (out / "manifest.json").write_text(json.dumps({"what": "my own manifest"}))


@pytest.mark.parametrize("fill", [_user_files, _user_manifest], ids=["user-files", "user-manifest"])
def test_a_build_refuses_a_directory_it_did_not_write(fill, small_root: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    fill(out)
    before = _tree(out)
    code, line = _cli(capsys, "lake", "build", str(small_root), f"--output={out}", "--image-size=0")
    assert code == 2 and line.startswith(f"error: --output {out}:"), line
    assert "neither a roboscale lake" in line or "not a roboscale lake's" in line, line
    assert _tree(out) == before  # nothing deleted, overwritten or added (not even a lock file)


OVERLAPS = {"the-source": "is the source dataset", "inside-the-source": "is inside the source dataset",
            "around-the-source": "is inside --output"}


@pytest.mark.parametrize("where", list(OVERLAPS))
def test_a_build_refuses_an_output_that_overlaps_a_source(where: str, small_copy: Path, lake_copy: Path) -> None:
    source = small_copy
    out = {"the-source": small_copy, "inside-the-source": small_copy / "lake", "around-the-source": lake_copy}[where]
    if where == "around-the-source":  # a source dataset kept inside an existing lake
        source = lake_copy / "raw"
        shutil.copytree(small_copy, source)
    before_source, before_out = _tree(source), _tree(out) if out.exists() else None
    with pytest.raises(ConfigError, match="--output") as err:
        build_lake(LakeConfig(sources=[str(source)], output=str(out), image_size=0, shard_frames=SHARD_FRAMES))
    assert OVERLAPS[where] in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert _tree(source) == before_source
    assert (_tree(out) if out.exists() else None) == before_out


def _killed_build(lake: Path) -> None:
    """What a build killed after its first shard leaves: shards (and the build's journal), no manifest."""
    (lake / "manifest.json").unlink()


def _older_lake(lake: Path) -> None:
    """A finished lake of a build before the journal existed: its manifest says which shards are its own."""
    (lake / ".build-journal.json").unlink()


@pytest.mark.parametrize("state", [_killed_build, _older_lake], ids=["killed-build", "lake-without-journal"])
def test_a_rebuild_deletes_only_the_shards_it_wrote(state, ray_session, lake_copy: Path, small_root: Path) -> None:
    state(lake_copy)
    _user_files(lake_copy)
    # a user's directory with a shard's name, and a copy of a shard kept under another name
    (lake_copy / "shards" / "shard-00007").mkdir()
    (lake_copy / "shards" / "shard-00007" / "notes.txt").write_text("mine")
    shutil.copytree(lake_copy / "shards" / "shard-00001", lake_copy / "shards" / "backup-of-shard-1")
    mine = {k: v for k, v in _tree(lake_copy).items() if "notes" in k or k.startswith(("README", "shards/backup"))}
    # one shard per 100 frames: the old plan's shard-00001 and shard-00002 are stale
    report = build_lake(LakeConfig(sources=[str(small_root)], output=str(lake_copy), image_size=0, shard_frames=100))
    assert report.built == ["shard-00000"]
    left = sorted(p.name for p in (lake_copy / "shards").iterdir() if not p.name.startswith("."))
    assert left == ["backup-of-shard-1", "my-notes", "shard-00000", "shard-00007"]
    assert {k: v for k, v in _tree(lake_copy).items() if k in mine} == mine
    assert len(LakeSource(lake_copy, verify=True).episode_ids) == 5


# --------------------------------------------------------------------------- 2. manifest paths stay in the lake


def _shard_moved_out(lake: Path, name: str) -> None:
    """shard-00000 moved next to the lake, where the manifest's ``name`` reaches it: reads and checksums pass."""
    shutil.move(lake / "shards" / "shard-00000", lake.parent / "x")
    _edit_manifest(lake, lambda m: m["shards"][0].update(name=name))


ESCAPES = {
    "shard-name-dotdot": (lambda lake: _shard_moved_out(lake, "../../x"), "shards[0].name"),
    "shard-name-absolute": (lambda lake: _shard_moved_out(lake, str(lake.parent / "x")), "shards[0].name"),
    "shard-file-dotdot": (lambda lake: _edit_manifest(lake, lambda m: m["shards"][1]["files"].update(
        {"../shard-00000/columns.parquet": m["shards"][0]["files"]["columns.parquet"]})), "shards[1].files"),
    "table-dotdot": (lambda lake: _edit_manifest(lake, lambda m: m["tables"].update(
        {"../lake/tasks.parquet": m["tables"]["tasks.parquet"]})), "tables"),
    "camera-dotdot": (lambda lake: _edit_manifest(lake, lambda m: m["camera_keys"].__setitem__(0, "../../wrist")),
                      "camera_keys"),
}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_a_manifest_path_that_leaves_the_lake_is_refused(escape: str, lake_copy: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    damage, field = ESCAPES[escape]
    damage(lake_copy)
    with pytest.raises(DatasetError) as err:
        LakeSource(lake_copy)
    assert str(err.value).startswith(f"{lake_copy / 'manifest.json'}: field {field!r}: "), str(err.value)
    code, line = _cli(capsys, "lake", "verify", str(lake_copy))
    assert code == 1 and line == f"error: {err.value}"


def test_a_symlinked_shard_inside_the_lake_keeps_working(lake_copy: Path, tmp_path: Path) -> None:
    """The check is lexical: a shard a user moved to another disk and linked back is still the lake's."""
    shard = lake_copy / "shards" / "shard-00001"
    elsewhere = tmp_path / "other-disk" / "shard-00001"
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)
    src = LakeSource(lake_copy, verify=True)
    assert src.read(2, np.arange(3), ["action"])["action"].shape == (3, 3)


# ------------------------------------------------------------------------- 3. shard checksums when first opened


def _alter_camera_bytes(lake: Path) -> Path:
    """One byte of a camera frame of shard-00001 (episodes 2 and 3) altered, sizes unchanged."""
    target = lake / "shards" / "shard-00001" / "observation.images.wrist.npy"
    data = bytearray(target.read_bytes())
    data[-100] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


def _epoch(lake: Path, **options) -> tuple[set[int], dict]:
    """The episodes one unshuffled epoch of the loader yields from ``lake``, and the episodes it skipped."""
    from roboscale.data import build_loader

    loader = build_loader(str(lake), batch_size=4, num_workers=0, shuffle=False, keys=[*CAMERAS, "action"],
                          **options)
    episodes = set()
    for _ in range(loader.batches_per_epoch):
        episodes |= set(next(loader)["episode_index"].tolist())
    loader.close()
    return episodes, dict(loader.skipped_episodes)


def test_altered_shard_bytes_stop_training_naming_the_shard(lake_copy: Path) -> None:
    target = _alter_camera_bytes(lake_copy)
    with pytest.raises(DatasetError, match="sha256") as err:
        _epoch(lake_copy)
    assert str(err.value).startswith(f"{target}: field 'sha256': ") and "\n" not in str(err.value), str(err.value)
    assert "--skip-bad-episodes" in str(err.value)


def test_altered_shard_bytes_skip_the_shard_s_episodes_with_skip_bad_episodes(lake_copy: Path) -> None:
    target = _alter_camera_bytes(lake_copy)
    episodes, skipped = _epoch(lake_copy, skip_bad_episodes=True)
    assert episodes == {0, 1, 4}
    assert set(skipped) == {(str(lake_copy), 2), (str(lake_copy), 3)}
    assert all(str(target) in why for why in skipped.values())


def test_checksum_on_open_can_be_turned_off(lake_copy: Path) -> None:
    from roboscale.data.loading.source import open_source

    _alter_camera_bytes(lake_copy)
    assert _epoch(lake_copy, source_options={"verify_on_open": False}) == ({0, 1, 2, 3, 4}, {})
    src = open_source(lake_copy, verify_on_open=False)
    assert src.read(2, np.array([0]), ["action"])["action"].shape == (1, 3)


def test_each_shard_file_is_hashed_once_per_machine(lake_copy: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An LRU of one shard reopens shards all the time: each file is hashed the first time only (until it
    changes), by whichever process opens it first: the others (a loader's workers, other ranks, later runs) find
    its record. Each worker of each rank hashed the whole lake before."""
    import pickle

    import roboscale.utils.io as io

    monkeypatch.setenv("ROBOSCALE_CACHE_DIR", str(tmp_path / "cache"))
    hashed: list[str] = []
    real = io.sha256_file
    monkeypatch.setattr(io, "sha256_file", lambda path: hashed.append(str(path)) or real(path))
    src = LakeSource(lake_copy, max_open_shards=1)
    hashed.clear()  # the tables, hashed at every construction
    for episode in [0, 2, 4, 1, 3, 4, 0]:
        src.read(episode, np.array([0]), ["action"])
    files = [f for s in src.manifest["shards"] for f in s["files"]]
    assert sorted(hashed) == sorted({*hashed}) and len(hashed) == len(files)
    clone = pickle.loads(pickle.dumps(src))  # as a loader worker receives it
    another = LakeSource(lake_copy, max_open_shards=1)  # as another process (rank, run) opens the lake
    hashed.clear()
    for episode in [0, 2, 4]:
        clone.read(episode, np.array([0]), ["action"])
        another.read(episode, np.array([0]), ["action"])
    assert hashed == []
    target = _alter_camera_bytes(lake_copy)  # a new version of the file: hashed again, and refused
    hashed.clear()
    clone.read(0, np.array([0]), ["action"])  # evicts shard-00001: the next read opens it again
    with pytest.raises(DatasetError, match="sha256"):
        clone.read(2, np.array([0]), ["action"])
    assert hashed == [str(target)]
    with pytest.raises(DatasetError, match="sha256"):  # a mismatch is never recorded as verified
        LakeSource(lake_copy, max_open_shards=1).read(2, np.array([0]), ["action"])


def test_training_checks_lake_shards_unless_told_not_to(lake_copy: Path, tmp_path: Path) -> None:
    from .entry_points import run_cli, train_args

    target = _alter_camera_bytes(lake_copy)
    refused = run_cli(*train_args(lake_copy, tmp_path / "checked"))
    assert refused.exit_code == 1 and f"{target}: field 'sha256': sha256 differs" in refused.message
    trusted = run_cli(*train_args(lake_copy, tmp_path / "trusted", "--dataset.verify_lake_shards=false"))
    assert trusted.kind == "ok", trusted.message


def test_a_deeply_nested_manifest_is_one_line_in_every_command(lake_copy: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A 100,000-deep JSON array as manifest.json: a RecursionError traceback in `lake verify` and `train` before
    (issue 31); now one line naming the file."""
    from .entry_points import TINY_PI05

    (lake_copy / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    for argv in (["lake", "verify", str(lake_copy)],
                 ["train", f"--dataset.root={lake_copy}", f"--output_dir={tmp_path / 'run'}", "--steps=1",
                  "--batch_size=4", *TINY_PI05]):
        code, line = _cli(capsys, *argv)
        assert code == 1 and line.startswith(f"error: {lake_copy / 'manifest.json'}: "), (argv[0], line)
        assert "nested too deeply" in line


# ------------------------------------------------------------------------- NaN/Inf inside consistent checksums


def _nan_in_shard_actions(lake: Path) -> Path:
    """NaN in one action of episode 3 (shard-00001), the manifest's size and sha256 rewritten to match: what a
    buggy writer or a crafted lake looks like (every checksum consistent)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from roboscale.utils.io import sha256_file

    target = lake / "shards" / "shard-00001" / "columns.parquet"
    table = pq.read_table(target)
    actions = table.column("action").to_pylist()
    actions[-1] = [float("nan")] * len(actions[-1])
    index = table.schema.get_field_index("action")
    field = table.schema.field("action")
    table = table.set_column(index, field, pa.array(actions, type=field.type))
    pq.write_table(table, target)
    for name in ("manifest.json", "shards/shard-00001/shard.json"):
        path = lake / name
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        for shard in record.get("shards", [record]):
            files = shard.get("files", {})
            if "columns.parquet" in files and (name == "manifest.json" and shard.get("name") == "shard-00001"
                                               or name != "manifest.json"):
                files["columns.parquet"].update(bytes=target.stat().st_size, sha256=sha256_file(target))
        path.write_text(json.dumps(record))
    return target


def test_nan_in_a_lake_with_consistent_checksums_is_refused_like_a_datasets(lake_copy: Path, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Before (issue 31): `lake verify` said ok and `train` exited 0 with half its steps skipped. Now `lake verify`,
    the loader and `train` name the file, the field and the lake episode; --skip-bad-episodes skips that shard's
    episodes."""
    from .entry_points import TINY_PI05

    target = _nan_in_shard_actions(lake_copy)
    code, line = _cli(capsys, "lake", "verify", str(lake_copy))
    assert code == 1 and line.startswith(f"error: {target}: field 'action': ") and "lake episodes [3]" in line, line
    with pytest.raises(DatasetError, match=r"field 'action': .*NaN or Inf \(lake episodes \[3\]\)"):
        _epoch(lake_copy)
    episodes, skipped = _epoch(lake_copy, skip_bad_episodes=True)
    assert episodes == {0, 1, 4} and set(skipped) == {(str(lake_copy), 2), (str(lake_copy), 3)}
    code, line = _cli(capsys, "train", f"--dataset.root={lake_copy}", f"--output_dir={tmp_path / 'run'}",
                      "--steps=2", "--batch_size=4", *TINY_PI05)
    assert code == 1 and f"{target}: field 'action'" in line, line
