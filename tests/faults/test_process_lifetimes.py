"""Every process roboscale starts ends with its owner, whatever ended the owner (roboscale.utils.lifetime): loader
workers and their forkserver, torchrun's ranks, evaluation workers and inference servers, expert workers. Each
test lists the process's descendants before the kill and checks that every one of them is gone after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roboscale.train.checkpoint import step_directories

from .entry_points import TINY_PI05, run_cli
from .test_process_faults import _wait_for as wait_for

ROOT = Path(__file__).parents[2]
GONE_WITHIN_S = 30.0  # lifetime.GRACE_S plus a loaded machine's slack


# --------------------------------------------------------------------------------------------------- /proc


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every live descendant of ``pid`` (Linux /proc)."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found and _running(child):
                    found[child] = _cmdline(child)
                    todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it: it holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def assert_all_gone(processes: dict[int, str]) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (alive := {p: c for p, c in processes.items() if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # leave no leak to the other tests
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"outlived their owner: {alive}"


def start(args: list[str], log: Path, *, torchrun: bool = False) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
    head = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if torchrun
            else [sys.executable])
    # a session of its own: the kill below reaches this process only, as a scheduler's or the OOM killer's does
    return subprocess.Popen([*head, "-m", "roboscale", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"), start_new_session=True)


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _training(tiny_dataset: Path, run: Path, workers: int) -> list[str]:
    return ["train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=100000", "--save_freq=5",
            "--batch_size=4", f"--dataset.num_workers={workers}", *TINY_PI05]


def _checkpointed(run: Path) -> bool:
    return len(step_directories(run / "checkpoints")) >= 1


# --------------------------------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_training_takes_its_loader_workers_with_it(tiny_dataset: Path, tmp_path: Path, sig: int) -> None:
    """Loader workers come from a forkserver: they are not the trainer's children, and the forkserver stays alive
    while they hold its pipe, so before they watched the trainer all of them (and the resource tracker) lived on.
    SIGTERM is Ctrl-C's twin: a message, the last checkpoint intact, exit 143."""
    run, log = tmp_path / "run", tmp_path / "train.log"
    trainer = start(_training(tiny_dataset, run, workers=2), log)
    try:
        # the resource tracker, the forkserver and its two workers
        wait_for(lambda: _checkpointed(run) and len(descendants(trainer.pid)) >= 4, 180, "workers and a checkpoint")
        before = descendants(trainer.pid)
        assert sum("forkserver" in c for c in before.values()) >= 3, before
        trainer.send_signal(sig)
        code = trainer.wait(60)
    finally:
        trainer.kill()
    assert_all_gone(before)
    if sig == signal.SIGTERM:
        assert code == 143
        line = last_line(log)
        assert line.startswith("terminated (SIGTERM) at step ") and "is intact (continue with --resume=true)" in line
        assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
        last = int((run / "checkpoints" / "last").resolve().name)
        assert run_cli("train", f"--output_dir={run}", "--resume=true", f"--steps={last + 1}").kind == "ok"
    else:
        assert code == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["launcher", "rank"])
def test_killing_torchrun_or_a_rank_leaves_no_rank_or_worker_behind(tiny_dataset: Path, tmp_path: Path,
                                                                    victim: str) -> None:
    """torchrun starts each rank in a session of its own: `kill -9` of the launcher left both ranks training,
    holding the run's lock. Now the ranks end with the launcher (and their workers with them), and the run
    resumes."""
    run, log = tmp_path / "run", tmp_path / "torchrun.log"
    launcher = start(_training(tiny_dataset, run, workers=1), log, torchrun=True)
    try:
        def ranks() -> list[int]:
            return [p for p, c in descendants(launcher.pid).items() if " roboscale train" in c and
                    "forkserver" not in c and "resource_tracker" not in c]

        wait_for(lambda: _checkpointed(run) and len(ranks()) == 2 and len(descendants(launcher.pid)) >= 8, 240,
                 "two ranks, their workers and a checkpoint")
        before = descendants(launcher.pid)
        os.kill(launcher.pid if victim == "launcher" else max(ranks()), signal.SIGKILL)
        launcher.wait(120)
    finally:
        launcher.kill()
    assert_all_gone(before)
    last = int((run / "checkpoints" / "last").resolve().name)
    resumed = run_cli("train", f"--output_dir={run}", "--resume=true", f"--steps={last + 1}")
    assert resumed.kind == "ok", resumed.message  # the lock went with the ranks


# --------------------------------------------------------------------------------------------------- evaluation


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_dataset: Path, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("lifetimes") / "run"
    assert run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=1", "--batch_size=4",
                   *TINY_PI05).kind == "ok"
    return run


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_evaluation_takes_its_env_workers_and_server_with_it(tiny_checkpoint: Path, tmp_path: Path,
                                                                     sig: int) -> None:
    """The evaluation's spawned env workers and inference server (about 1.3 GB together) lived on forever; an
    evaluation that training started runs the same command, under a supervisor that watches the trainer."""
    log = tmp_path / "eval.log"
    evaluation = start(["eval", f"--checkpoint={tiny_checkpoint}", "--tasks=[reach]", "--episodes=40",
                        "--max_steps=500", "--videos_per_task=0", "--rollout.workers=2", "--rollout.inference=server",
                        f"--output_dir={tmp_path / 'eval'}"], log)
    try:
        def started() -> bool:
            names = " ".join(descendants(evaluation.pid).values())
            return names.count("spawn_main") >= 3  # the server and two env workers
        wait_for(started, 180, "the evaluation's workers and server")
        before = descendants(evaluation.pid)
        evaluation.send_signal(sig)
        code = evaluation.wait(60)
    finally:
        evaluation.kill()
    assert_all_gone(before)
    assert code == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
    if sig == signal.SIGTERM:
        line = last_line(log)
        assert line.startswith("terminated (SIGTERM) after ") and "episodes; the finished ones are kept in" in line


@pytest.mark.slow
def test_a_killed_dataset_generation_takes_its_expert_workers_with_it(tmp_path: Path) -> None:
    log = tmp_path / "generate.log"
    generation = start(["data", "generate", "--tasks=[reach,push]", "--episodes_per_task=200", "--workers=2",
                        f"--out={tmp_path / 'data'}"], log)
    try:
        wait_for(lambda: " ".join(descendants(generation.pid).values()).count("spawn_main") >= 2, 120,
                 "two expert workers")
        before = descendants(generation.pid)
        generation.kill()
        generation.wait(60)
    finally:
        generation.kill()
    assert_all_gone(before)


# --------------------------------------------------------------------------------------------------- the mechanism


_OWNED_CHILD = """
import os, sys, time
from roboscale.utils.lifetime import exit_with
exit_with(int(sys.argv[1]))
print(os.getpid(), flush=True)
time.sleep(600)
"""


def test_a_process_ends_with_an_owner_that_is_not_its_parent(tmp_path: Path) -> None:
    """The owner is a sibling here (as the trainer is to its forkserver's workers): no kernel notice reaches
    the watcher, only its own pidfd."""
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    watcher = subprocess.Popen([sys.executable, "-c", _OWNED_CHILD, str(owner.pid)], stdout=subprocess.PIPE,
                               cwd=ROOT, text=True)
    try:
        assert int(watcher.stdout.readline()) == watcher.pid  # watching by now
        assert watcher.poll() is None
        owner.kill()
        owner.wait()
        assert watcher.wait(GONE_WITHIN_S) == -signal.SIGTERM  # SIGTERM first: its handlers may clean up
    finally:
        owner.kill()
        watcher.kill()


def test_an_owner_already_gone_ends_the_process_at_once(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    watcher = subprocess.run([sys.executable, "-c", _OWNED_CHILD, str(gone.pid)], cwd=ROOT, capture_output=True,
                             timeout=GONE_WITHIN_S)
    assert watcher.returncode == -signal.SIGTERM


# --------------------------------------------------------------------------------------------------- interrupts


@pytest.mark.parametrize("where", ["dcp", "consolidated"])
def test_ctrl_c_during_a_save_says_interrupted_and_names_the_intact_checkpoint(tiny_dataset: Path, tmp_path: Path,
                                                                               monkeypatch, where: str) -> None:
    """It said "cannot write the checkpoint (KeyboardInterrupt)", exit 1. DCP wraps a Ctrl-C inside its write in
    its own exception; the consolidated weights are written outside DCP."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from roboscale.models.policy import Policy

    def interrupt_the_second(real):
        def write(self, *args, **kwargs):
            if "000002" in str(getattr(self, "path", "")) + str(args[:1]):
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)
        return write

    if where == "dcp":
        monkeypatch.setattr(FileSystemWriter, "write_data", interrupt_the_second(FileSystemWriter.write_data))
    else:
        monkeypatch.setattr(Policy, "save_pretrained", interrupt_the_second(Policy.save_pretrained))
    run = tmp_path / "run"
    outcome = run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=4", "--save_freq=1",
                      "--batch_size=4", *TINY_PI05)
    assert outcome.exit_code == 130
    assert outcome.message.strip().splitlines()[-1] == \
        "interrupted while checkpoint 000002 was being written (not saved); the previous checkpoint 000001 is intact"
    checkpoints = run / "checkpoints"
    assert [p.name for p in step_directories(checkpoints)] == ["000001"]
    assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".")]  # no temporary left
    monkeypatch.undo()
    assert run_cli("train", f"--output_dir={run}", "--resume=true").kind == "ok"
    assert [p.name for p in step_directories(checkpoints)][-1] == "000004"
