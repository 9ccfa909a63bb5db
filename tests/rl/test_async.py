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
    proc = subprocess.Popen([sys.executable, "-m", "roboscale", "rl", f"--policy_path={sft}", f"--output_dir={out}",
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


# --- the exact schedule (--rl.schedule=exact, the default): reproducible, and resumed exactly -----------------
@pytest.fixture(scope="module")
def exact_runs(sft: Path, tmp_path_factory) -> dict[int, Path]:
    """Uninterrupted async runs at staleness 1 and 2: what every other run of the same options must compute."""
    runs = {}
    for staleness in (1, 2):
        out = tmp_path_factory.mktemp(f"exact{staleness}") / "run"
        _rl(sft, out, "--steps=5", *ASYNC, f"--rl.max_staleness={staleness}", "--save_freq=1")
        runs[staleness] = out
    return runs


def _rollouts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines() if line.strip()]


def test_two_runs_at_staleness_one_compute_the_same(sft: Path, exact_runs: dict[int, Path], tmp_path: Path) -> None:
    """Before (issue 31), which weights a rollout acted with depended on timing: two runs differed from step 3 on.
    Rollout k now acts with exactly the weights trained on max(0, k - 1) rollouts."""
    again = tmp_path / "again"
    _rl(sft, again, "--steps=5", *ASYNC, "--rl.max_staleness=1", "--save_freq=1")
    _close(_losses(again), _losses(exact_runs[1]))
    for out in (again, exact_runs[1]):
        assert [r["version"] for r in _rollouts(out)] == [0, 0, 1, 2, 3]
        assert [m["staleness_max"] for _, m in sorted(_metrics(out).items())] == [0, 1, 1, 1, 1]


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_run_killed_outright_at_staleness_above_zero_resumes_exactly(sft: Path, exact_runs: dict[int, Path],
                                                                        tmp_path: Path, staleness: int) -> None:
    """``kill -9`` right after a checkpoint (the rollouts after it in flight, acting with older weights), then
    ``--resume``: the uninterrupted run's losses and acting versions (before: the resumed run re-rolled rollout 4
    with weights v4 where the uninterrupted one had used v3), and each rollout logged once."""
    out = tmp_path / "killed"
    args = ["--steps=5", *ASYNC, f"--rl.max_staleness={staleness}", "--save_freq=1"]
    proc = subprocess.Popen([sys.executable, "-m", "roboscale", "rl", f"--policy_path={sft}", f"--output_dir={out}",
                             *RL, *args], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        from tests.faults.test_process_faults import _wait_for

        _wait_for(lambda: (out / "checkpoints" / "000003").is_dir(), 600, "the third checkpoint")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = json.loads((out / "checkpoints" / "last" / "training_state" / "loader_state.json").read_text())
    _rl(sft, out, "--resume=true")
    _close(_losses(out), _losses(exact_runs[staleness]))
    assert [r["rollout"] for r in _rollouts(out)] == [0, 1, 2, 3, 4]  # the rerun ones once
    assert [r["version"] for r in _rollouts(out)] == [r["version"] for r in _rollouts(exact_runs[staleness])]
    assert kept["step"] >= 3


def test_the_bounded_schedule_takes_the_weights_it_finds(sft: Path, tmp_path: Path) -> None:
    """--rl.schedule=bounded: at most max_staleness behind, whatever is newest (not reproducible)."""
    _rl(sft, tmp_path / "bounded", "--steps=4", *ASYNC, "--rl.max_staleness=1", "--rl.schedule=bounded")
    metrics = _metrics(tmp_path / "bounded")
    assert all(0 <= m["staleness"] <= m["staleness_max"] <= 1 for m in metrics.values())
