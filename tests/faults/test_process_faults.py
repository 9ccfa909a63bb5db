"""Processes that die, stop or run out of disk: loader workers, evaluation workers, a training save, a dataset
writer, a training run. Each must end in an error (or a rerun that recovers), never a hang or a mess."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from roboscale.data.loading.loader import build_loader
from roboscale.data.loading.worker import LoaderError

from .entry_points import TINY_PI05, run_cli


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------------------- loader workers


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_dead_or_stopped_loader_worker_is_an_error_not_a_hang(small_root: Path, sig: int) -> None:
    """SIGSTOP (a debugger, a frozen network mount) makes a worker ignore SIGTERM: the loader escalates to SIGKILL,
    and never touches torch's shared locks again in case the worker died holding one."""
    loader = build_loader(small_root, batch_size=2, num_workers=1, keys=["action"], worker_timeout_s=2,
                          prefetch_factor=1)
    try:
        next(loader)
        (worker,) = loader._iter._workers
        os.kill(worker.pid, sig)
        started = time.monotonic()
        with pytest.raises(LoaderError, match=r"data loader failed on batch \d+ of epoch \d+"):
            for _ in range(10 * loader.batches_per_epoch):
                next(loader)
        assert time.monotonic() - started < 30
        worker.join(5)
        assert not worker.is_alive()
    finally:
        loader.close()
    # the loader starts fresh workers where it stood
    loader.take(2)
    loader.close()


# --------------------------------------------------------------------------------------------------- evaluation


@pytest.mark.slow
def test_a_killed_inference_server_is_replaced_and_the_evaluation_completes(tiny_dataset: Path,
                                                                           tmp_path: Path) -> None:
    """A dead env worker is retried (tests/rollout/test_engine.py); a dead inference server is replaced by a new
    pool (the episodes it left unfinished start again): the evaluation completes every episode, none failed."""
    import multiprocessing

    from roboscale.configs.eval import EvalConfig
    from roboscale.configs.rollout import RolloutConfig
    from roboscale.eval.closed_loop import evaluate

    run = tmp_path / "run"
    assert run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=1",
                   "--batch_size=4", *TINY_PI05).kind == "ok"

    def servers() -> list:
        return [p for p in multiprocessing.active_children() if p.name == "rollout-server0"]

    killed: list[int] = []

    def kill_the_server() -> None:
        _wait_for(servers, 60, "the inference server")
        time.sleep(1.0)  # let it serve a while: the kill lands mid-evaluation
        for server in servers():
            os.kill(server.pid, signal.SIGKILL)
            killed.append(server.pid)

    killer = threading.Thread(target=kill_the_server)
    killer.start()
    started = time.monotonic()
    report = evaluate(EvalConfig(checkpoint=str(run), tasks=["reach"], episodes=30, max_steps=50,
                                 videos_per_task=0, output_dir=str(tmp_path / "eval"),
                                 rollout=RolloutConfig(workers=1, inference="server")), progress=False)
    killer.join()
    assert killed and time.monotonic() - started < 180
    episodes = [json.loads(line) for line in (tmp_path / "eval" / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 30 and not any(e.get("error") for e in episodes)
    assert report is not None
    assert not multiprocessing.active_children()  # the replacement pool was stopped at the end too


# --------------------------------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def _small_disk(path: Path, size: str, mount: bool):
    """A size-limited filesystem at ``path`` (tmpfs); yields False where this machine cannot mount one."""
    path.mkdir(parents=True)
    mounted = mount and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                       capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("disk_kind, save", [("tmpfs", "sync"), ("failing-write", "sync"), ("tmpfs", "async")])
def test_a_full_disk_during_a_save_keeps_the_last_checkpoint_and_a_rerun_recovers(tiny_dataset: Path,
                                                                                   tmp_path: Path, monkeypatch,
                                                                                   disk_kind: str, save: str) -> None:
    from roboscale.train.checkpoint import step_directories

    disk = tmp_path / "disk"
    with _small_disk(disk, "5000k", mount=disk_kind == "tmpfs") as mounted:
        run = disk / "run"
        args = ["train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=6", "--save_freq=1",
                "--batch_size=4", "--checkpoint.keep_last=0", f"--checkpoint.async_save={save == 'async'}", *TINY_PI05]
        if not mounted:  # (or no privilege to mount): a save's write fails as on a full disk
            import safetensors.torch

            real, calls = safetensors.torch.save_file, []

            def fill_up(*a, **kw):
                calls.append(1)
                if len(calls) >= 5:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real(*a, **kw)

            monkeypatch.setattr(safetensors.torch, "save_file", fill_up)
            monkeypatch.setattr("roboscale.train.checkpoint.save_file", fill_up)
        outcome = run_cli(*args)
        assert outcome.kind == "error", "the disk never filled up: make it smaller"
        line = outcome.message.strip().replace("\r", "\n").splitlines()[-1]
        assert outcome.exit_code == 1 and line.startswith(f"error: {run / 'checkpoints'}/0000")
        assert "cannot write the checkpoint (No space left on device); the previous checkpoint 0000" in line
        checkpoints = run / "checkpoints"
        saved = step_directories(checkpoints)
        assert saved and (checkpoints / "last").resolve() == saved[-1].resolve()
        assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # no temporaries left
        # the user makes room and resumes
        monkeypatch.undo()
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        again = run_cli("train", f"--output_dir={run}", "--resume=true", "--checkpoint.keep_last=1")
        assert again.kind == "ok", again.message
        assert [p.name for p in step_directories(checkpoints)] == ["000006"]


# --------------------------------------------------------------------------------------------------- kill -9


_WRITE_AND_DIE = """
import os, signal, sys
import numpy as np
from roboscale.data import DatasetWriter
features = {"x": {"dtype": "float32", "shape": [2], "names": None}}
writer = DatasetWriter.create(sys.argv[1], fps=10, features=features)
writer.add_episode({"x": np.zeros((5, 2), np.float32)}, task="t")
print(writer.staging, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_dataset_writer_leaves_nothing_a_rerun_does_not_clean(tmp_path: Path) -> None:
    import numpy as np

    from roboscale.data import DatasetWriter

    out = tmp_path / "gen"
    died = subprocess.run([sys.executable, "-c", _WRITE_AND_DIE, str(out)], capture_output=True, text=True)
    assert died.returncode == -signal.SIGKILL
    staging = Path(died.stdout.strip())
    assert staging.is_dir() and staging.name.startswith(".gen.") and not out.exists()
    live = DatasetWriter.create(tmp_path / "other", fps=10, features={"x": {"dtype": "float32", "shape": [2]}})
    writer = DatasetWriter.create(out, fps=10, features={"x": {"dtype": "float32", "shape": [2]}})
    assert not staging.exists()  # the dead writer's, removed
    assert live.staging.is_dir()  # another writer's, alive: kept
    writer.add_episode({"x": np.ones((3, 2), np.float32)}, task="t")
    writer.finalize()
    live.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen"]


@pytest.mark.slow
def test_a_training_killed_at_any_moment_resumes(tiny_dataset: Path, tmp_path: Path) -> None:
    from roboscale.train.checkpoint import step_directories

    run = tmp_path / "run"
    args = ["train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=40", "--save_freq=1",
            "--batch_size=4", "--checkpoint.keep_last=2", *TINY_PI05]
    proc = subprocess.Popen([sys.executable, "-m", "roboscale", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: len(step_directories(run / "checkpoints")) >= 2, 120, "two checkpoints")
    finally:
        proc.kill()
        proc.wait()
    assert (run / "checkpoints" / "last").resolve().is_dir()
    assert run_cli("train", f"--output_dir={run}", "--resume=true").kind == "ok"
    checkpoints = run / "checkpoints"
    assert [p.name for p in step_directories(checkpoints)] == ["000039", "000040"]
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]
