"""`roboscale train --launcher=ray`: Ray Train workers run the same training, and a run resumes on them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_policy_args

pytestmark = pytest.mark.slow


def _args(dataset: Path, out: Path, *extra: str, launcher: str = "ray") -> list[str]:
    ray = ["--launcher=ray", "--ray.num_workers=2"] if launcher == "ray" else []
    return [sys.executable, "-m", "roboscale", "train", *ray, f"--dataset.root={dataset}", "--dataset.num_workers=0",
            f"--output_dir={out}", "--batch_size=8", "--log_freq=1", "--save_freq=2", "--optimizer.warmup_steps=2",
            *tiny_policy_args("pi05", chunk_size=4, n_action_steps=2), *extra]


_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING"}


def _train(dataset: Path, out: Path, *extra: str, launcher: str = "ray") -> subprocess.CompletedProcess:
    return subprocess.run(_args(dataset, out, *extra, launcher=launcher), env=_ENV, capture_output=True, text=True,
                          timeout=600)


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Ray's raylet and workers are children of the driver that started them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _ray_train_workers(driver: int) -> list[int]:
    workers = []
    for pid in _descendants(driver):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "RayTrainWorker" in title:
            workers.append(pid)
    return workers


def test_ray_workers_train_and_resume(tiny_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "ray"
    first = _train(tiny_dataset, out, "--steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "final checkpoint" in first.stdout
    second = _train(tiny_dataset, out, "--steps=4", "--resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert (out / "checkpoints" / "last").resolve().name == "000004"


def test_a_batch_the_workers_cannot_share_is_refused_before_ray_starts(tiny_dataset: Path, tmp_path: Path) -> None:
    done = _train(tiny_dataset, tmp_path / "odd", "--steps=2", "--batch_size=7")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: --batch_size=7 is not divisible")


def test_a_killed_ray_worker_is_restarted_and_the_run_resumes_to_the_same_losses(tiny_dataset: Path,
                                                                                  tmp_path: Path) -> None:
    reference = _train(tiny_dataset, tmp_path / "one", "--steps=6", launcher="local")
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "ray"
    driver = subprocess.Popen(_args(tiny_dataset, out, "--steps=6", "--ray.max_failures=1"), env=_ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while not (out / "checkpoints" / "last").exists():
            assert driver.poll() is None, driver.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 400 s"
            time.sleep(0.1)
        workers = _ray_train_workers(driver.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # a worker lost to the OOM killer or a dead node
        _, stderr = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, stderr[-3000:]
    assert (out / "checkpoints" / "last").resolve().name == "000006"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    # 2 workers compute what one process does, and the resumed steps continue exactly
    assert _losses(out) == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
