"""`roboscale train --launcher=ray`: Ray Train workers run the same training, and a run resumes on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_policy_args

pytestmark = pytest.mark.slow


def _train(dataset: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "roboscale", "train", "--launcher=ray", "--ray.num_workers=2",
            f"--dataset.root={dataset}", "--dataset.num_workers=0", f"--output_dir={out}", "--batch_size=8",
            "--log_freq=1", "--save_freq=2", *tiny_policy_args("pi05", chunk_size=4, n_action_steps=2), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING"}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


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
