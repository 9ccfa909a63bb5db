"""`roboscale rl --rl.mode=async` (RL-VLA3's decoupled levels) on a tiny policy in MetaWorld: at staleness 0 it
computes the synchronous run's losses step by step, whatever the number of env workers or ranks and across a
`kill -9`; the staleness bound holds and is logged; both placements run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.test_rl import RL, ROOT, _env, _losses, _rl

pytestmark = pytest.mark.slow

# two groups per rollout, so that the trainer takes them as they arrive
ASYNC = ["--rl.mode=async", "--rl.states_per_task=2", "--rollout.workers=1"]


def _metrics(out: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {line["step"]: line for line in lines if "loss" in line}


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert a.keys() == b.keys()
    for step in a:  # the same episodes; the gradients summed in another order
        assert a[step] == pytest.approx(b[step], rel=1e-4, abs=1e-7), step


@pytest.fixture(scope="module")
def sync_run(sft: Path, tmp_path_factory) -> Path:
    """The synchronous run every async one is compared with (RL's learning rate is constant: its first steps are
    those of a shorter run)."""
    out = tmp_path_factory.mktemp("sync") / "run"
    _rl(sft, out, "--steps=4", "--rl.states_per_task=2", "--rollout.workers=1", "--save_freq=1")
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_async_at_staleness_zero_computes_the_sync_losses(sft: Path, sync_run: Path, tmp_path: Path,
                                                          workers: int) -> None:
    """Whatever the number of env workers (1 of 2 environments, 2 of 1)."""
    out = tmp_path / "async"
    _rl(sft, out, "--steps=3", *ASYNC, "--rl.max_staleness=0", f"--rollout.workers={workers}",
        f"--rollout.envs_per_worker={3 - workers}")
    _close(_losses(out), {step: loss for step, loss in _losses(sync_run).items() if step <= 3})
    assert all(m["staleness_max"] == 0 for m in _metrics(out).values())


def test_the_staleness_bound_holds_and_is_logged(sft: Path, tmp_path: Path) -> None:
    _rl(sft, tmp_path / "stale", "--steps=4", *ASYNC, "--rl.max_staleness=1")
    metrics = _metrics(tmp_path / "stale")
    assert metrics[1]["staleness_max"] == 0  # the first rollout acts with the checkpoint's weights
    assert all(0 <= m["staleness"] <= m["staleness_max"] <= 1 for m in metrics.values())
    # the driver starts the next rollout as soon as one ends, before the trainer's step on it: one behind
    assert max(m["staleness_max"] for m in metrics.values()) == 1


def test_an_async_run_killed_outright_resumes_to_the_sync_losses(sft: Path, sync_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    args = ["--steps=4", *ASYNC, "--rl.max_staleness=0", "--save_freq=1"]
    proc = subprocess.Popen([sys.executable, "-m", "roboscale", "rl", f"--checkpoint={sft}", f"--output_dir={out}",
                             *RL, *args], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        from tests.faults.test_process_faults import _wait_for

        _wait_for(lambda: (out / "checkpoints" / "000002").is_dir(), 600, "the second checkpoint")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer, its rollout driver and processes, all at once
        proc.wait()
    done = _rl(sft, out, "--resume=true")
    _close(_losses(out), _losses(sync_run))
    state = json.loads((out / "checkpoints" / "last" / "training_state" / "loader_state.json").read_text())
    assert state["in_flight_episodes"] == 0 and state["episodes"] == 4 * 4  # at staleness 0 nothing runs ahead
    assert "Traceback" not in done.stderr


def test_the_disaggregated_placement_runs(sft: Path, tmp_path: Path) -> None:
    """(Every other test here runs colocated, the default.) On the CPU: the rollout processes on half the cores."""
    out = tmp_path / "disaggregated"
    _rl(sft, out, "--steps=2", *ASYNC, "--rl.placement=disaggregated")
    assert sorted(_metrics(out)) == [1, 2]


def test_two_fsdp_ranks_in_async_mode_compute_the_one_process_losses(sft: Path, sync_run: Path,
                                                                    tmp_path: Path) -> None:
    _rl(sft, tmp_path / "fsdp", "--steps=2", *ASYNC, "--rl.max_staleness=0", "--parallel.strategy=fsdp", ranks=2)
    _close(_losses(tmp_path / "fsdp"), {step: loss for step, loss in _losses(sync_run).items() if step <= 2})


def test_bad_async_options_are_one_line(sft: Path, tmp_path: Path) -> None:
    for args, needle in ((["--rl.mode=later"], "--rl.mode must be one of ['sync', 'async']"),
                         (["--rl.max_staleness=-1"], "--rl.max_staleness must be >= 0"),
                         (["--rl.placement=far"], "--rl.placement must be one of ['colocated', 'disaggregated']")):
        done = _rl(sft, tmp_path / "bad", *args, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
