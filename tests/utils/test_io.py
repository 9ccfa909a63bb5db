import pytest

from roboscale.utils.io import atomic_directory, atomic_write_json


def test_a_failed_directory_build_leaves_the_previous_one_intact(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(RuntimeError), atomic_directory(target, overwrite=True) as tmp:
        (tmp / "weights").write_text("half-written v2")
        raise RuntimeError("killed mid-save")
    assert (target / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary leftovers


def test_overwrite_replaces_and_refuses_without_permission(tmp_path):
    target = tmp_path / "d"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(FileExistsError), atomic_directory(target) as tmp:
        pass
    with atomic_directory(target, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]


def test_atomic_json_write_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": object()})
    assert path.read_text().strip().replace(" ", "").replace("\n", "") == '{"a":1}'


def test_json_lines_skip_a_torn_line_and_repair_cuts_it_off(tmp_path):
    from roboscale.utils.io import append_json_line, read_json_lines

    path = tmp_path / "log.jsonl"
    assert read_json_lines(path) == ([], 0)
    append_json_line(path, {"step": 1})
    with open(path, "ab") as f:
        f.write(b'{"step": 2, "succ')  # what a kill mid-write leaves
    assert read_json_lines(path) == ([{"step": 1}], 1)
    assert path.read_bytes().endswith(b'"succ')  # readers leave the file alone
    assert read_json_lines(path, repair=True) == ([{"step": 1}], 0)
    append_json_line(path, {"step": 3})
    assert read_json_lines(path) == ([{"step": 1}, {"step": 3}], 0)
