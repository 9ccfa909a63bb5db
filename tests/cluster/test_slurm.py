"""examples/slurm/train.sbatch run by a real SLURM (Debian's slurm-wlm and munge: ``roboscale.testing.slurm``), on
2 nodes that are hosts of a cluster in a box: ``sbatch`` runs it to completion with the 1-process run's losses,
and a job cancelled mid-run (``scancel``) then requeued (``scontrol requeue``) starts the script again, which
resumes from the last checkpoint to the uninterrupted run's losses. Skipped where SLURM is not installed
(``make test-cluster``; .ci/run installs it where it can)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roboscale.testing.slurm import LocalSlurm, available
from tests.train.test_distributed import _command, _env, _losses, _metrics

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(bool(available()), reason=available() or "")]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
NODES = 2
# enough steps after the first checkpoints that a cancel lands mid-run (a step takes ~0.1 s, a save ~0.2 s)
STEPS, SAVE_FREQ = 24, 4


def _options(dataset: Path, out: Path) -> list[str]:
    """The `roboscale train` options of tests/train/test_distributed.py, at this module's steps and saves."""
    options = _command(1, dataset, out)[len([sys.executable, "-m", "roboscale", "train"]):]
    changed = {"--steps": str(STEPS), "--save_freq": str(SAVE_FREQ)}
    return [f"{key}={changed[key]}" if (key := o.split("=")[0]) in changed else o for o in options] + \
        ["--num_threads=1"]  # the nodes share this machine's cores


@pytest.fixture(scope="module")
def slurm() -> Iterator[LocalSlurm]:
    with LocalSlurm(nodes=NODES) as local:
        yield local


@pytest.fixture(scope="module")
def single(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("single") / "run"
    done = subprocess.run([sys.executable, "-m", "roboscale", "train", *_options(tiny_dataset, out)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(_metrics(out))


def _submit(slurm: LocalSlurm, dataset: Path, out: Path, log: Path) -> int:
    """sbatch of the example, driven as its header says: the run's parameters in the job's environment."""
    train_args = [o for o in _options(dataset, out) if not o.startswith(("--dataset.root=", "--output_dir=",
                                                                           "--steps="))]
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "INFO", "GLOO_SOCKET_IFNAME": "eth0",
           "DATASET": str(dataset), "OUTPUT_DIR": str(out), "STEPS": str(STEPS),
           "TRAIN_ARGS": " ".join([*train_args, "--parallel.strategy=fsdp"])}
    return slurm.submit(SCRIPT, f"--nodes={NODES}", f"--output={log}", env=env, cwd=ROOT)


def _wait(slurm: LocalSlurm, job: int, state: str, log: Path, timeout_s: float = 240.0) -> None:
    try:
        slurm.wait_for(job, {state}, timeout_s)
    except Exception as exc:
        tail = log.read_text(errors="replace")[-3000:] if log.is_file() else "(no output)"
        raise AssertionError(f"{exc}\n--- the job's output ---\n{tail}") from None


def _wait_for_checkpoint(slurm: LocalSlurm, job: int, out: Path, log: Path, timeout_s: float = 240.0) -> None:
    """Until the running job has committed its first checkpoint."""
    deadline = time.monotonic() + timeout_s
    while not (out / "checkpoints" / f"{SAVE_FREQ:06d}").is_dir():
        assert slurm.state(job) in {"PENDING", "RUNNING"}, log.read_text()[-3000:] if log.is_file() else job
        assert time.monotonic() < deadline, f"no checkpoint within {timeout_s:.0f} s"
        time.sleep(0.05)


def test_sbatch_runs_the_example_on_two_nodes_to_the_one_process_losses(slurm: LocalSlurm, single: list[float],
                                                                        tiny_dataset: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job = _submit(slurm, tiny_dataset, out, log)
    _wait(slurm, job, "COMPLETED", log)
    assert slurm.job(job)["NodeList"] == "host[0-1]"
    text = log.read_text()
    assert "2 nodes (host[0-1]) x 1 ranks, rendezvous at host0:" in text and "rank 1 of 2" in text, text[-3000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert _losses(rows) == pytest.approx(single, rel=1e-4)


def test_a_cancelled_job_requeued_resumes_to_the_uninterrupted_losses(slurm: LocalSlurm, single: list[float],
                                                                      tiny_dataset: Path, tmp_path: Path) -> None:
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job = _submit(slurm, tiny_dataset, out, log)
    _wait_for_checkpoint(slurm, job, out, log)
    slurm.cancel(job)
    _wait(slurm, job, "CANCELLED", log, timeout_s=60)  # every task has ended (not COMPLETING any more)
    kept = int(os.readlink(out / "checkpoints" / "last"))
    assert kept < STEPS, "the job had finished before the cancel landed"

    slurm.requeue(job)
    _wait(slurm, job, "COMPLETED", log)
    assert slurm.job(job)["Restarts"] == "1"
    text = log.read_text()
    assert f"job {job} (restart 0): training from the start" in text, text[-3000:]
    assert f"restart 1 of job {job}: resuming from {out}/checkpoints/{kept:06d}" in text, text[-3000:]
    assert f"at step {kept} (saved by 2 ranks, now 2)" in text, text[-3000:]  # the trainer's own word
    rows = _metrics(out)  # cut back to the checkpoint's step on resume: one run's record
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert _losses(rows) == pytest.approx(single, rel=1e-4)


def test_a_job_warned_of_its_time_limit_requeues_itself_and_resumes(slurm: LocalSlurm, single: list[float],
                                                                   tiny_dataset: Path, tmp_path: Path) -> None:
    # SIGUSR1 to the batch shell is what `#SBATCH --signal=B:USR1@300` sends 5 minutes before the time limit
    out, log = tmp_path / "run", tmp_path / "slurm.out"
    job = _submit(slurm, tiny_dataset, out, log)
    _wait_for_checkpoint(slurm, job, out, log)
    slurm.signal_batch(job, "USR1")
    _wait(slurm, job, "PENDING", log, timeout_s=60)  # requeued by the script itself
    kept = int(os.readlink(out / "checkpoints" / "last"))
    slurm.start_now(job)
    _wait(slurm, job, "COMPLETED", log)
    text = log.read_text()
    assert f"job {job} is near its time limit: requeueing it" in text, text[-3000:]
    assert f"restart 1 of job {job}: resuming from {out}/checkpoints/{kept:06d}" in text, text[-3000:]
    assert _losses(_metrics(out)) == pytest.approx(single, rel=1e-4)
