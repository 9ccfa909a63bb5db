"""The data lake: `lake build` (Ray Data) -> shards -> LakeSource reads equal the raw datasets; global stats; resume;
corruption detection. One local Ray session and one two-source lake are shared by the module (Ray starts slowly)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from roboscale.data import DatasetWriter, LeRobotDataset
from roboscale.data.lerobot.format import QUANTILES
from roboscale.data.loading.source import FrameSource
from roboscale.errors import ConfigError, DatasetError

from ..conftest import SMALL_FEATURES, SMALL_FPS, SMALL_LENGTHS, assert_square, small_episode

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Data's own deprecated options

from roboscale.configs.lake import LakeConfig  # noqa: E402
from roboscale.data.lake.build import build_lake  # noqa: E402
from roboscale.data.lake.ray import ensure_ray  # noqa: E402
from roboscale.data.lake.shards import fit_frames  # noqa: E402
from roboscale.data.lake.source import LakeSource  # noqa: E402

SECOND_EPISODES = (4, 2, 3)  # small_episode() numbers, written in this order
SECOND_FRAMES = sum(SMALL_LENGTHS[e] for e in SECOND_EPISODES)
TOTAL_FRAMES = sum(SMALL_LENGTHS) + SECOND_FRAMES
SECOND_TASKS = ["stack the blocks", "pick the cube"]  # one new task, one shared with the small dataset
CAMERAS = ["observation.images.front", "observation.images.wrist", "observation.image"]
USER_NUMERIC = ["observation.state", "action", "next.done", "next.reward", "frame_index", "timestamp"]


def write_second_source(root: Path) -> Path:
    """Three episodes with the small dataset's schema, other tasks and larger actions (other stats)."""
    writer = DatasetWriter.create(root, fps=SMALL_FPS, features=SMALL_FEATURES, robot_type="test_bot")
    with writer:
        for e in SECOND_EPISODES:
            frames = small_episode(e)
            frames["action"] = frames["action"] * 10 + 5
            writer.add_episode(frames, SECOND_TASKS[e % 2])
    return root


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray for the module, the lake's own (loopback only); build_lake joins a running Ray instead of
    starting its own. Another module's running session is shared and left running."""
    owned = ensure_ray(LakeConfig(num_cpus=2))
    yield
    if owned:
        ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from roboscale.models.tokenizer import TaskTokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    TaskTokenizer.train(["pick the cube", "open the door", "stack the blocks"], vocab_size=300).save(path)
    return path


def tokenized(tokenizer: Path) -> dict[str, Any]:
    """What `roboscale lake build --tokenizer` hands build_lake: the tokenizer as a function, and its vocabulary."""
    from roboscale.models.tokenizer import TaskTokenizer

    tok = TaskTokenizer.from_file(tokenizer)
    return {"tokenize": lambda tasks: [tok.encode(t) for t in tasks], "vocab_size": tok.vocab_size}


@pytest.fixture(scope="module")
def sources(small_root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [small_root, write_second_source(tmp_path_factory.mktemp("second") / "dataset")]


@pytest.fixture(scope="module")
def lake(ray_session, sources: list[Path], tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lake") / "lake"
    report = build_lake(LakeConfig(sources=[str(s) for s in sources], output=str(out), image_size=0,
                                   shard_frames=20, tokenizer=str(tokenizer_path)), **tokenized(tokenizer_path))
    assert report.skipped == [] and len(report.built) >= TOTAL_FRAMES // 20
    return out


def _raw_episode(root: Path, ep: int) -> tuple[dict[str, np.ndarray], str]:
    ds = LeRobotDataset(root=root, episodes=[ep])
    values = ds.read_episode(ep)
    for key in ds.meta.video_keys:
        values[key] = ds.decode_episode_video(ep, key)
    tasks = {ds.meta.task_list[int(t)] for t in values["task_index"]}
    assert len(tasks) == 1
    return values, tasks.pop()


def _assert_lake_equals_raw(src: LakeSource, roots: dict[str, Path], cameras: list[str],
                            numeric: list[str] = USER_NUMERIC) -> int:
    checked = 0
    index = 0
    for pos, length in enumerate(src.episode_lengths):
        uri, ep = src.provenance(pos)
        raw, task = _raw_episode(roots[uri], ep)
        frames = np.arange(int(length))
        got = src.read(pos, frames, [*cameras, *numeric, "task_index", "episode_index", "index"])
        for key in cameras:
            assert got[key].dtype == np.uint8
            np.testing.assert_array_equal(got[key], raw[key], err_msg=f"{key} of lake episode {pos}")
        for key in numeric:
            assert got[key].dtype == raw[key].dtype, key
            np.testing.assert_array_equal(got[key], raw[key], err_msg=f"{key} of lake episode {pos}")
        assert {src.tasks[int(t)] for t in got["task_index"]} == {task}
        assert np.all(got["episode_index"] == pos)
        np.testing.assert_array_equal(got["index"], np.arange(index, index + length))
        index += int(length)
        checked += 1
    return checked


# --------------------------------------------------------------------------------------------------- reads


def test_lake_reads_equal_both_raw_sources(lake: Path, sources: list[Path]) -> None:
    src = LakeSource(lake, verify=True)
    assert isinstance(src, FrameSource)
    assert src.camera_keys == CAMERAS and src.fps == SMALL_FPS
    roots = {str(s): s for s in sources}
    assert [s["uri"] for s in src.sources] == [str(s) for s in sources]
    assert _assert_lake_equals_raw(src, roots, CAMERAS) == 5 + 3
    # tasks merged by string: the second source's shared task maps onto the first's index
    assert src.tasks == ["pick the cube", "open the door", "stack the blocks"]
    assert src.sources[1]["task_index_map"] == [2, 0]
    # window reads: a sorted subset of frames of one episode
    got = src.read(6, np.array([0, 2, 3]), ["action", "observation.images.wrist"])
    assert got["action"].shape == (3, 3) and got["observation.images.wrist"].shape == (3, 48, 64, 3)
    with pytest.raises(ValueError, match="sorted"):
        src.read(0, np.array([3, 1]), ["action"])
    with pytest.raises(KeyError, match="not a feature"):
        src.read(0, np.array([0]), ["nope"])


def test_manifest_provenance_and_precomputed_tokens(lake: Path, sources: list[Path], tokenizer_path: Path) -> None:
    from roboscale.models.tokenizer import TaskTokenizer

    manifest = json.loads((lake / "manifest.json").read_text())
    assert manifest["format"] == "roboscale-lake" and manifest["version"] == 1
    assert manifest["total_episodes"] == 8 and manifest["total_frames"] == TOTAL_FRAMES
    first, second = manifest["sources"]
    assert first["episodes"] == [[0, 5]] and first["lake_episodes"] == [0, 5]
    assert second["lake_episodes"] == [5, 8]
    import hashlib

    assert first["info_sha256"] == hashlib.sha256((sources[0] / "meta/info.json").read_bytes()).hexdigest()
    for shard in manifest["shards"]:
        assert set(shard["files"]) >= {"columns.parquet", "stats.safetensors", *(f"{k}.npy" for k in CAMERAS)}
        assert all(len(f["sha256"]) == 64 for f in shard["files"].values())
        assert shard["num_frames"] <= 20 or shard["episodes"][1] - shard["episodes"][0] == 1
    tok = TaskTokenizer.from_file(tokenizer_path)
    src = LakeSource(lake)
    assert src.task_tokens is not None
    assert [t.tolist() for t in src.task_tokens] == [tok.encode(t) for t in src.tasks]
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    assert manifest["tokenizer"]["path"] == str(tokenizer_path.resolve())
    assert manifest["tokenizer"]["vocab_size"] == tok.vocab_size


def test_lerobot_written_fixture_round_trips(ray_session, fixture_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "lake"
    build_lake(LakeConfig(sources=[str(fixture_root)], output=str(out), image_size=0, shard_frames=30))
    src = LakeSource(out, verify=True)
    cameras = ["observation.images.corner", "observation.images.gripper"]
    assert src.camera_keys == cameras
    numeric = ["observation.state", "action", "frame_index", "timestamp"]
    assert _assert_lake_equals_raw(src, {str(fixture_root): fixture_root}, cameras, numeric) == 4
    frames = src.read(1, np.array([4]), ["observation.images.corner"])["observation.images.corner"]
    assert_square(frames[0], 4, 1, "lake corner camera")


def _free_ports(n: int) -> list[int]:
    with contextlib.ExitStack() as stack:  # all bound at once: n different ports
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _free_port() -> int:
    return _free_ports(1)[0]


# ------------------------------------------------------------------------------------ processes and sockets


def _session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid``: one started with start_new_session=True, and all it started."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited meanwhile
            continue
        state, _ppid, _pgrp, session = stat.rpartition(")")[2].split()[:4]  # after "pid (comm)"
        if int(session) == sid and state != "Z":
            pids.append(int(entry))
    return pids


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):  # exited meanwhile
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:["):-1])
    return inodes


def _proc_net_ip(hex_ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} write an address as 32-bit words in host byte order."""
    words = [bytes.fromhex(hex_ip[i:i + 8]) for i in range(0, len(hex_ip), 8)]
    return ipaddress.ip_address(b"".join(w[::-1] if sys.byteorder == "little" else w for w in words))


def _session_listening(sid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of the TCP sockets that the processes of session ``sid`` listen on. Owned by that session,
    so not confused with what other programs on this machine open meanwhile."""
    inodes = _socket_inodes(_session_pids(sid))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):  # no IPv6
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    host, port = cols[1].split(":")
                    found.append((_proc_net_ip(host), int(port, 16)))
    return found


def _beyond_loopback(sockets: list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]) -> list[str]:
    """Those reachable from another machine: not 127.0.0.0/8, ::1 or ::ffff:127.x (0.0.0.0 and :: are not)."""
    return [f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}" for ip, port in sockets
            if not (ip.is_loopback or getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)]


def _start_in_session(cmd: list[str], env: dict[str, str], log: Path, **popen) -> subprocess.Popen:
    """``cmd`` in a session of its own, so that it and every process it starts are stopped together
    (``_stop_session``). Its output goes to a file: a pipe that nobody reads fills up and blocks the writer (a
    `ray start --block` blocked so never stopped)."""
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen)


def _tail(log: Path, lines: int = 8) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def _wait_for_output(proc: subprocess.Popen, log: Path, marker: str, timeout_s: float) -> bool:
    """True once ``marker`` is in the output of ``proc``, False when ``proc`` exits without it."""
    deadline = time.monotonic() + timeout_s
    while marker not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            return marker in log.read_text(errors="replace")
        if time.monotonic() > deadline:
            pytest.fail(f"{proc.args[0]}: no {marker!r} within {timeout_s:.0f} s; it said: {_tail(log)}")
        time.sleep(0.2)
    return True


def _stop_session(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and every process of its session: SIGINT (what `ray start --block` handles by stopping its
    Ray), then SIGTERM, then SIGKILL, each after a bounded wait. Fails if a process survives them all."""
    for sig, wait_s in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):  # the group is gone already
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while True:
            proc.poll()  # reap it once it exits (its session's members are counted without zombies)
            if not _session_pids(proc.pid):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    raise AssertionError(f"{proc.args[0]}: processes {_session_pids(proc.pid)} survived SIGKILL")


# ------------------------------------------------------------------------------------------------- ray


_LOCAL_RAY = """
import sys
import ray  # first, as in a user's program (or this test module): Ray has read its settings by the time it starts

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.ray import ensure_ray

assert ensure_ray(LakeConfig(num_cpus=1))
ray.get(ray.remote(lambda: 0).remote())  # a worker up, with its gRPC server
print("ray is up", flush=True)
sys.stdin.read()  # until the test has looked
ray.shutdown()
"""


def test_a_build_s_own_local_ray_listens_on_loopback_only(tmp_path: Path) -> None:
    """Without --ray-address, build_lake starts a Ray of its own (ensure_ray): its GCS, raylet, agents, driver and
    workers must not be reachable from another machine. A fresh process: this module's Ray is running already."""
    log = tmp_path / "driver.log"
    driver = _start_in_session([sys.executable, "-c", _LOCAL_RAY], {**os.environ}, log, stdin=subprocess.PIPE)
    try:
        assert _wait_for_output(driver, log, "ray is up", timeout_s=120), f"the driver failed: {_tail(log)}"
        sockets = _session_listening(driver.pid)
        driver.stdin.close()
        driver.wait(timeout=60)
    finally:
        _stop_session(driver)
    assert len(sockets) >= 4, f"expected the GCS, raylet, agent and driver to listen, found {sockets}"
    assert _beyond_loopback(sockets) == [], f"Ray listens beyond loopback: {_beyond_loopback(sockets)}"


@contextlib.contextmanager
def _ray_head(env: dict[str, str], log: Path) -> Iterator[tuple[int, int]]:
    """A Ray head started apart, as a user would (`ray start --head --block`), on loopback only. Yields its GCS
    port and its session id; stops it and all it started afterwards, also when the test fails."""
    port, client_port = _free_ports(2)
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # the Ray Client server's port is fixed (10001) by default: another Ray on this machine would make it fail
    head = _start_in_session([ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
                              f"--ray-client-server-port={client_port}", "--num-cpus=1", "--include-dashboard=false",
                              "--disable-usage-stats"], env, log)
    try:
        if not _wait_for_output(head, log, "Ray runtime started", timeout_s=120):
            # a precondition, like CUDA for the GPU tests: this machine cannot run a Ray head
            pytest.skip(f"ray start --head exited with {head.returncode}: {_tail(log)}")
        yield port, head.pid
    finally:
        _stop_session(head)


@pytest.mark.slow
def test_build_runs_on_an_existing_ray_cluster(fixture_root: Path, tmp_path: Path) -> None:
    """`--ray-address`: a head started apart (`ray start --head`, token auth on, bound to localhost) runs the
    build; the CLI runs in its own process, as a user's shell would (this process may hold a local Ray)."""
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (single-node Ray) keeps --node-ip-address=127.0.0.1: Ray otherwise
    # replaces it by the outward IP and listens on every interface. The CLI needs it too: Ray would rewrite
    # --ray-address 127.0.0.1:PORT to the outward IP the same way, where this head does not listen.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = tmp_path / "lake"
    with _ray_head(env, tmp_path / "head.log") as (port, head_session):
        assert _beyond_loopback(_session_listening(head_session)) == [], "the test's Ray head listens beyond loopback"
        build = [sys.executable, "-m", "roboscale.cli", "lake", "build", str(fixture_root), "--output", str(out),
                 "--image-size", "0", "--ray-address", f"127.0.0.1:{port}"]
        done = subprocess.run(build, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "Connecting to existing Ray cluster" in done.stderr and "1 built" in done.stdout
    cameras = ["observation.images.corner", "observation.images.gripper"]
    numeric = ["observation.state", "action", "frame_index", "timestamp"]
    assert _assert_lake_equals_raw(LakeSource(out, verify=True), {str(fixture_root): fixture_root}, cameras,
                                   numeric) == 4


def test_an_unreachable_ray_address_fails_in_seconds_before_writing(fixture_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "lake"
    cfg = LakeConfig(sources=[str(fixture_root)], output=str(out), image_size=0,
                     ray_address=f"127.0.0.1:{_free_port()}")
    with pytest.raises(ConfigError, match=r"--ray-address 127\.0\.0\.1:\d+: cannot reach it .*ray start --head"):
        build_lake(cfg)
    assert not out.exists()
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        build_lake(LakeConfig(sources=[str(fixture_root)], output=str(out), ray_address="localhost"))


# --------------------------------------------------------------------------------------------------- stats


def test_global_stats_match_pooled_data(lake: Path, sources: list[Path]) -> None:
    src = LakeSource(lake)
    manifest = json.loads((lake / "manifest.json").read_text())
    pooled: dict[str, list[np.ndarray]] = {}
    for root in sources:
        ds = LeRobotDataset(root=root)
        for ep in ds.episode_indices:
            raw, _ = _raw_episode(root, ep)
            for key in ["observation.state", "action", "next.reward", "timestamp", *CAMERAS]:
                pooled.setdefault(key, []).append(raw[key])
    assert src.stats is not None
    for key in ["observation.state", "action", "next.reward", "timestamp"]:
        data = np.concatenate(pooled[key]).reshape(TOTAL_FRAMES, -1).astype(np.float64)
        st, bound = src.stats[key], np.asarray(manifest["stats_quantile_error"][key]).ravel()
        np.testing.assert_array_equal(st["min"].ravel(), data.min(0))
        np.testing.assert_array_equal(st["max"].ravel(), data.max(0))
        np.testing.assert_allclose(st["mean"].ravel(), data.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(st["std"].ravel(), data.std(0), rtol=1e-10, atol=1e-12)
        assert st["count"].tolist() == [TOTAL_FRAMES]
        np.testing.assert_allclose(bound, (data.max(0) - data.min(0)) / 4096)
        for name, q in QUANTILES.items():
            err = np.abs(st[name].ravel() - np.quantile(data, q, axis=0))
            assert np.all(err <= bound * (1 + 1e-9) + 1e-12), f"{key} {name}: {err} > {bound}"
    for key in CAMERAS:  # every pixel of every frame, exactly
        raw_pixels = np.concatenate(pooled[key]).reshape(-1, 3)
        pixels = raw_pixels.astype(np.float64) / 255.0
        st = src.stats[key]
        assert st["mean"].shape == (3, 1, 1)
        exact_mean = raw_pixels.sum(axis=0, dtype=np.int64) / len(raw_pixels) / 255.0  # integer sums: no rounding
        np.testing.assert_allclose(st["mean"].ravel(), exact_mean, rtol=1e-14)
        np.testing.assert_allclose(st["std"].ravel(), pixels.std(0), rtol=1e-10)
        np.testing.assert_allclose(st["q01"].ravel(), np.quantile(pixels, 0.01, axis=0), rtol=1e-12)
        np.testing.assert_allclose(st["q99"].ravel(), np.quantile(pixels, 0.99, axis=0), rtol=1e-12)


# --------------------------------------------------------------------------------------------------- resume, integrity


def _file_times(lake: Path) -> dict[str, int]:
    return {str(p.relative_to(lake)): p.stat().st_mtime_ns for p in (lake / "shards").glob("*/*")}


def test_resume_rebuilds_only_the_missing_shard(lake: Path, sources: list[Path], tokenizer_path: Path,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import roboscale.data.lake.stats as lake_stats

    monkeypatch.setattr(lake_stats, "_HISTOGRAM_GROUPS", 2)  # stats pass 2 now sums several shards per task
    copy = tmp_path / "lake"
    shutil.copytree(lake, copy)
    before = json.loads((copy / "manifest.json").read_text())
    victim = before["shards"][1]["name"]
    shutil.rmtree(copy / "shards" / victim)
    # what a build killed mid-shard leaves behind: a temp directory and no manifest
    (copy / "shards" / f".{victim}.abc.tmp").mkdir()
    (copy / "manifest.json").unlink()
    times = _file_times(copy)
    with pytest.raises(DatasetError, match="build has not finished"):
        LakeSource(copy)
    report = build_lake(LakeConfig(sources=[str(s) for s in sources], output=str(copy), image_size=0,
                                   shard_frames=20, tokenizer=str(tokenizer_path)), **tokenized(tokenizer_path))
    assert report.built == [victim]
    assert len(report.skipped) == len(before["shards"]) - 1
    after = _file_times(copy)
    assert {k: v for k, v in after.items() if not k.startswith(f"shards/{victim}/")} == times
    assert not (copy / "shards" / f".{victim}.abc.tmp").exists()
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["shards"] == before["shards"]  # same bytes: same sha256 for every file
    assert manifest["stats"] == before["stats"]
    a, b = LakeSource(lake), LakeSource(copy, verify=True)
    for pos, n in enumerate(a.episode_lengths):
        keys = [*CAMERAS, "action", "observation.state"]
        x, y = a.read(pos, np.arange(n), keys), b.read(pos, np.arange(n), keys)
        for key in keys:
            np.testing.assert_array_equal(x[key], y[key])


def test_cli_build_resumes_with_nothing_to_do(lake: Path, sources: list[Path], tokenizer_path: Path,
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from roboscale.cli import main

    copy = tmp_path / "lake"
    shutil.copytree(lake, copy)
    times = _file_times(copy)
    argv = ["lake", "build", *map(str, sources), "--output", str(copy), "--image-size", "0", "--shard-frames", "20",
            "--tokenizer", str(tokenizer_path)]
    assert main(argv) == 0
    assert "0 built" in capsys.readouterr().out
    assert _file_times(copy) == times
    assert main(["lake", "verify", str(copy)]) == 0


def test_a_second_build_into_the_same_lake_is_refused_until_the_first_dies(lake: Path, sources: list[Path],
                                                                           tokenizer_path: Path, tmp_path: Path):
    copy = tmp_path / "lake"
    shutil.copytree(lake, copy)
    holder = subprocess.Popen(  # another build, as far as the lock can tell
        [sys.executable, "-c", "import sys; from pathlib import Path\n"
         "from roboscale.data.lake.build import build_lock\n"
         "with build_lock(Path(sys.argv[1])):\n    print('locked', flush=True); sys.stdin.read()", str(copy)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        cfg = LakeConfig(sources=[str(s) for s in sources], output=str(copy), image_size=0, shard_frames=20,
                         tokenizer=str(tokenizer_path))
        with pytest.raises(DatasetError, match=rf"\.build\.lock: another lake build \(pid {holder.pid} on .*\) is "
                                               "writing"):
            build_lake(cfg, **tokenized(tokenizer_path))
    finally:
        holder.kill()  # as kill -9: the kernel drops its lock
        holder.wait()
    assert build_lake(cfg, **tokenized(tokenizer_path)).built == []  # no stale lock left behind


def test_corrupt_shard_is_detected_by_checksum_and_repaired(lake: Path, sources: list[Path], tokenizer_path: Path,
                                                            tmp_path: Path) -> None:
    copy = tmp_path / "lake"
    shutil.copytree(lake, copy)
    shard = json.loads((copy / "manifest.json").read_text())["shards"][2]["name"]
    target = copy / "shards" / shard / "observation.images.wrist.npy"
    data = bytearray(target.read_bytes())
    data[-100] ^= 0xFF  # same size: only the checksum can tell
    target.write_bytes(bytes(data))
    LakeSource(copy)  # without verify construction hashes no shard (each is hashed when first opened)
    with pytest.raises(DatasetError, match="sha256") as err:
        LakeSource(copy, verify=True)
    assert str(target) in str(err.value)
    # --repair re-hashes finished shards and rebuilds exactly the damaged one
    report = build_lake(LakeConfig(sources=[str(s) for s in sources], output=str(copy), image_size=0,
                                   shard_frames=20, tokenizer=str(tokenizer_path), repair=True),
                        **tokenized(tokenizer_path))
    assert report.built == [shard]
    LakeSource(copy, verify=True)
    # truncation is caught when a worker opens the shard, even without verify
    target.write_bytes(bytes(data[:-10]))
    src = LakeSource(copy)
    episode = int(np.flatnonzero(src._episodes["shard"] == 2)[0])
    with pytest.raises(DatasetError, match="size") as err:
        src.read(episode, np.array([0]), ["action"])
    assert str(target) in str(err.value)


def test_manifest_format_and_version_are_checked(lake: Path, tmp_path: Path) -> None:
    copy = tmp_path / "lake"
    shutil.copytree(lake, copy, ignore=shutil.ignore_patterns("shards"))
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(DatasetError, match="version"):
        LakeSource(copy)
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format": "something-else"}))
    with pytest.raises(DatasetError, match="'format'"):
        LakeSource(copy)


def test_incompatible_sources_are_refused_before_building(fixture_root: Path, small_root: Path,
                                                          tmp_path: Path) -> None:
    cfg = LakeConfig(sources=[str(small_root), str(fixture_root)], output=str(tmp_path / "lake"))
    with pytest.raises(DatasetError, match="cameras") as err:
        build_lake(cfg)
    assert "lerobot-v3.0-mini/meta/info.json" in str(err.value)


# --------------------------------------------------------------------------------------------------- reader


def test_reader_is_picklable_bounded_and_ray_free(lake: Path) -> None:
    src = LakeSource(lake, max_open_shards=2)
    for pos, n in enumerate(src.episode_lengths):
        src.read(pos, np.array([0, int(n) - 1]), ["observation.images.front", "action"])
        assert len(src._open_shards) <= 2
    clone = pickle.loads(pickle.dumps(src))
    assert len(clone._open_shards) == 0
    np.testing.assert_array_equal(clone.read(3, np.array([1]), ["action"])["action"],
                                  src.read(3, np.array([1]), ["action"])["action"])
    code = ("import sys; from roboscale.data.lake.source import LakeSource; import numpy as np; "
            f"s = LakeSource({str(lake)!r}); s.read(0, np.array([0]), ['observation.images.front']); "
            "assert 'ray' not in sys.modules, 'lake_source imported ray'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fit_frames_pads_and_keeps_exact_frames() -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(3, 48, 64, 3), dtype=np.uint8)
    same, where = fit_frames(frames, 0)
    assert same is frames
    padded, (rows, cols) = fit_frames(frames, 64)  # scale 1: pure padding, content bit-exact
    assert padded.shape == (3, 64, 64, 3) and (rows, cols) == (slice(8, 56), slice(0, 64))
    np.testing.assert_array_equal(padded[:, rows, cols], frames)
    assert not padded[:, :8].any() and not padded[:, 56:].any()
    y, x = np.mgrid[0:48, 0:64]
    ramp = np.broadcast_to((2 * y + x)[None, :, :, None], (3, 48, 64, 3)).astype(np.uint8)  # a smooth image
    small, (rows, cols) = fit_frames(ramp, 32)  # 48x64 -> 24x32 content, 4 rows of padding above and below
    assert small.shape == (3, 32, 32, 3) and (rows, cols) == (slice(4, 28), slice(0, 32))
    block_means = ramp.reshape(3, 24, 2, 32, 2, 3).mean(axis=(2, 4))
    # halving a linear ramp: every interior pixel is the mean of its 2x2 block (up to rounding to uint8)
    inner = np.abs(small[:, rows, cols].astype(np.float64) - block_means)[:, 1:-1, 1:-1]
    assert inner.max() <= 1.0
    stretched, _ = fit_frames(frames, 32, "stretch")
    assert stretched.shape == (3, 32, 32, 3)


@pytest.mark.slow
def test_resized_lake_reads_policy_resolution(ray_session, small_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "lake"
    build_lake(LakeConfig(sources=[str(small_root)], output=str(out), image_size=32, shard_frames=64))
    src = LakeSource(out)
    assert src.features["observation.images.wrist"]["shape"] == [32, 32, 3]
    got = src.read(1, np.arange(4), CAMERAS)
    raw, _ = _raw_episode(small_root, 1)
    for key in CAMERAS:
        assert got[key].shape == (4, 32, 32, 3)
        np.testing.assert_array_equal(got[key], fit_frames(raw[key][:4], 32)[0])
    assert not got["observation.images.wrist"][:, :4].any()  # the padding of the 48x64 camera


@pytest.mark.slow
def test_failed_shard_fails_the_build_and_resume_builds_only_what_is_missing(ray_session, small_copy: Path,
                                                                              tmp_path: Path) -> None:
    from roboscale.data import LeRobotDatasetMetadata

    video = LeRobotDatasetMetadata(small_copy).video_path(3, "observation.images.front")
    intact = video.read_bytes()
    video.write_bytes(intact[: len(intact) // 3])  # a torn copy: only the shard(s) reading it can fail
    out = tmp_path / "lake"
    cfg = LakeConfig(sources=[str(small_copy)], output=str(out), image_size=0, shard_frames=10, validate=False)
    with pytest.raises(DatasetError) as err:
        build_lake(cfg)
    assert video.name in str(err.value)
    assert not (out / "manifest.json").exists()
    finished = {p.name for p in (out / "shards").iterdir() if not p.name.startswith(".")}
    assert "shard-00003" not in finished  # episode 3 is alone in its shard at 10 frames per shard
    times = _file_times(out)
    video.write_bytes(intact)
    report = build_lake(cfg)
    assert "shard-00003" in report.built
    assert set(report.built) == {f"shard-{i:05d}" for i in range(5)} - finished
    assert {k: v for k, v in _file_times(out).items() if k.split("/")[1] in finished} == times
    assert _assert_lake_equals_raw(LakeSource(out, verify=True), {str(small_copy): small_copy}, CAMERAS) == 5


@pytest.mark.slow
def test_remote_source_is_staged_through_a_pyarrow_filesystem(ray_session, small_root: Path, tmp_path: Path) -> None:
    import pyarrow.fs as pafs

    from roboscale.data.lake.staging import stage_source

    local = stage_source(f"file://{small_root}", 0, tmp_path / "staging")  # file:// resolves to the path itself
    assert local.filesystem is None or isinstance(local.filesystem, pafs.LocalFileSystem)
    assert local.local_root == small_root
    # Any non-local pyarrow filesystem takes the staging path; a SubTreeFileSystem stands in for s3:// here.
    remote = pafs.SubTreeFileSystem(str(small_root.parent), pafs.LocalFileSystem())
    out = tmp_path / "lake"
    build_lake(LakeConfig(sources=["dataset"], output=str(out), image_size=0, shard_frames=20),
               filesystems=[remote])
    staged = list((out / ".staging").iterdir())
    assert len(staged) == 1 and (staged[0] / "meta" / "info.json").is_file()
    assert _assert_lake_equals_raw(LakeSource(out, verify=True), {"dataset": small_root}, CAMERAS) == 5


def test_staged_files_are_refetched_when_the_remote_file_changed(small_copy: Path, tmp_path: Path) -> None:
    import os

    import pyarrow.fs as pafs

    from roboscale.data.lake.staging import stage_source

    remote = pafs.SubTreeFileSystem(str(small_copy.parent), pafs.LocalFileSystem())
    handle = stage_source("dataset", 0, tmp_path / "staging", remote)
    target = next((small_copy / "data").rglob("*.parquet")).relative_to(small_copy).as_posix()
    handle.stage([target])
    staged = handle.local_root / target
    assert staged.read_bytes() == (small_copy / target).read_bytes()
    before = staged.stat().st_ino
    handle.stage([target])
    assert staged.stat().st_ino == before  # same size and mtime: the earlier copy is reused
    # the remote file is rewritten (same name, same size: a quick check on size alone would miss it)
    data = bytearray((small_copy / target).read_bytes())
    data[-10] ^= 0xFF
    (small_copy / target).write_bytes(bytes(data))
    stat = (small_copy / target).stat()
    os.utime(small_copy / target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    handle.stage([target])
    assert staged.read_bytes() == bytes(data)
    with pytest.raises(DatasetError, match="dataset/data/missing.parquet: cannot fetch: no such file"):
        handle.stage(["data/missing.parquet"])


def test_open_source_recognizes_a_lake(lake: Path) -> None:
    from roboscale.data.loading.source import open_source

    assert isinstance(open_source(lake), LakeSource)


def test_a_lake_refuses_an_episode_selection(lake: Path) -> None:
    from roboscale.data.loading.source import open_source

    with pytest.raises(ConfigError, match="--dataset.episodes works with raw LeRobot v3.0 datasets only: .* is a "
                                          "roboscale lake"):
        open_source(lake, episodes=[0, 1])


def test_a_tokenizer_file_comes_with_its_function(sources: list[Path], tokenizer_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "lake"
    with pytest.raises(ConfigError, match="go together"):
        build_lake(LakeConfig(sources=[str(sources[0])], output=str(out), tokenizer=str(tokenizer_path)))
    with pytest.raises(ConfigError, match="go together"):
        build_lake(LakeConfig(sources=[str(sources[0])], output=str(out)), **tokenized(tokenizer_path))
    assert not out.exists()


def test_appending_a_source_reuses_the_earlier_shards(ray_session, sources: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "lake"
    first = build_lake(LakeConfig(sources=[str(sources[0])], output=str(out), image_size=0, shard_frames=20))
    times = _file_times(out)
    both = build_lake(LakeConfig(sources=[str(s) for s in sources], output=str(out), image_size=0, shard_frames=20))
    assert both.skipped == first.built and both.built and not set(both.built) & set(first.built)
    assert {k: v for k, v in _file_times(out).items() if k in times} == times
    src = LakeSource(out, verify=True)
    assert [s["uri"] for s in src.sources] == [str(s) for s in sources]
    assert len(src.episode_ids) == len(SMALL_LENGTHS) + len(SECOND_EPISODES)


def test_loader_batches_from_a_lake_equal_those_from_the_raw_dataset(ray_session, small_root: Path,
                                                                     tmp_path: Path) -> None:
    """The training path end to end: the same loader over a native-resolution lake and over the raw dataset gives
    the same batches (uint8 cameras, windows with clamping and `_is_pad`, tasks), in the same unshuffled order."""
    import torch

    from roboscale.data import build_loader

    out = tmp_path / "lake"
    build_lake(LakeConfig(sources=[str(small_root)], output=str(out), image_size=0, shard_frames=20))
    window = {"action": [i / SMALL_FPS for i in range(-1, 5)]}
    keys = [*CAMERAS, "observation.state", "action"]

    def batches(source: Path) -> list[dict]:
        loader = build_loader(str(source), batch_size=4, num_workers=0, delta_timestamps=window, keys=keys,
                              shuffle=False)
        return [next(iter(loader)) for _ in range(loader.batches_per_epoch)]

    from_lake, from_raw = batches(out), batches(small_root)
    assert len(from_lake) == len(from_raw) == sum(SMALL_LENGTHS) // 4
    for lake_batch, raw_batch in zip(from_lake, from_raw, strict=True):
        assert lake_batch.keys() == raw_batch.keys()
        for key, value in raw_batch.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(lake_batch[key], value), key
            else:
                assert list(lake_batch[key]) == list(value), key
    assert any(bool(b["action_is_pad"].any()) for b in from_lake)  # the window crossed episode edges somewhere


def test_a_lerobot_06_dataset_builds_a_lake_of_what_policies_batch(ray_session, tmp_path: Path, caplog) -> None:
    """LeRobot 0.6's language columns and depth-map videos stay in the source (named in a warning); the RGB cameras
    and numeric columns go into the lake as from any v3.0 dataset."""
    root = Path(__file__).resolve().parents[2] / "fixtures" / "lerobot-0.6-mini"
    out = tmp_path / "lake"
    with caplog.at_level("WARNING", logger="roboscale.data.lake.planning"):
        build_lake(LakeConfig(sources=[str(root)], output=str(out), image_size=0, shard_frames=30))
    assert any("observation.images.depth" in r.getMessage() and "language_events" in r.getMessage()
               for r in caplog.records)
    src = LakeSource(out, verify=True)
    assert src.camera_keys == ["observation.images.corner", "observation.images.gripper"]
    assert "language_persistent" not in src.features and "observation.images.depth" not in src.features
    numeric = ["observation.state", "action", "frame_index", "timestamp"]
    assert _assert_lake_equals_raw(src, {str(root): root}, src.camera_keys, numeric) == 4
