"""The distributed engine on CPU with gloo, run as users run it: `torchrun ... -m roboscale train`.

One process, 2-process DDP and 2-process FSDP2 train the same global batches to the same losses; FSDP2 divides
the per-rank state; a 2-rank run killed with SIGKILL resumes to the uninterrupted run's losses; a checkpoint
saved by 2 ranks resumes on 1; export gives what eval loads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_policy_args

pytestmark = pytest.mark.slow

STEPS = 6


def _env() -> dict[str, str]:
    # ranks share the machine's cores: one thread each, and no OpenMP spinning against each other
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING"}


PI05 = tiny_policy_args("pi05", chunk_size=4, n_action_steps=2)


def _command(ranks: int, dataset: Path, out: Path, *extra: str, policy: list[str] = PI05) -> list[str]:
    args = ["train", f"--dataset.root={dataset}", "--dataset.num_workers=0", f"--output_dir={out}",
            f"--steps={STEPS}", "--batch_size=8", "--log_freq=1", "--save_freq=2", "--optimizer.warmup_steps=2",
            *policy, *extra]
    if ranks == 1:
        return [sys.executable, "-m", "roboscale", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "roboscale", *args]


def _train(ranks: int, dataset: Path, out: Path, *extra: str, policy: list[str] = PI05) -> list[dict]:
    done = subprocess.run(_command(ranks, dataset, out, *extra, policy=policy), env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return _metrics(out)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows]


@pytest.fixture(scope="module")
def runs(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    root = tmp_path_factory.mktemp("distributed")
    out = {}
    for name, ranks, extra in (("single", 1, ()), ("ddp", 2, ("--parallel.strategy=ddp",)),
                               ("fsdp", 2, ("--parallel.strategy=fsdp",))):
        out[name] = (root / name, _train(ranks, tiny_dataset, root / name, *extra))
    return out


def test_one_process_ddp_and_fsdp_compute_the_same_losses(runs) -> None:
    single = _losses(runs["single"][1])
    assert len(single) == STEPS and single[-1] < single[0]
    for name in ("ddp", "fsdp"):
        assert _losses(runs[name][1]) == pytest.approx(single, rel=1e-4), name


def test_gr00t_with_dropout_computes_the_same_losses_on_one_and_two_ranks(tiny_dataset: Path, tmp_path: Path) -> None:
    """Dropout masks come from each sample's seed (models.dropout), not from a rank's RNG stream: GR00T with
    dropout trains the same global batches to the same losses on 1 process and on 2 FSDP2 ranks."""
    groot = tiny_policy_args("groot", chunk_size=4, n_action_steps=2, dropout=0.3)
    single = _losses(_train(1, tiny_dataset, tmp_path / "single", policy=groot))
    fsdp = _losses(_train(2, tiny_dataset, tmp_path / "fsdp", "--parallel.strategy=fsdp", policy=groot))
    assert len(single) == STEPS and fsdp == pytest.approx(single, rel=1e-4)


def test_fsdp_divides_the_state_each_rank_holds(runs) -> None:
    one = runs["single"][1][-1]["memory/state_bytes"]
    assert runs["fsdp"][1][-1]["memory/state_bytes"] <= 0.6 * one
    assert runs["ddp"][1][-1]["memory/state_bytes"] == pytest.approx(one, rel=0.01)  # DDP replicates


def test_metrics_report_throughput_and_stragglers(runs) -> None:
    row = runs["fsdp"][1][-1]
    for key in ("step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "data_wait", "step_time",
                "step_time_spread", "memory/state_bytes", "skipped_steps", "distinct_episodes"):
        assert key in row, key
    assert [r["step"] for r in runs["fsdp"][1]] == list(range(1, STEPS + 1))


def test_a_killed_two_rank_run_resumes_to_the_same_losses(runs, tiny_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    proc = subprocess.Popen(_command(2, tiny_dataset, out, "--parallel.strategy=fsdp"), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "000002").is_dir():
        assert proc.poll() is None or (out / "checkpoints" / "000002").is_dir(), "the run ended before a checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks, at once
    proc.wait()
    # wherever the kill landed, resume from step 2 (later checkpoints, if the run got there, are dropped)
    checkpoints = out / "checkpoints"
    for later in [p for p in checkpoints.iterdir() if p.name.isdigit() and int(p.name) > 2]:
        shutil.rmtree(later)
    (checkpoints / "last").unlink(missing_ok=True)
    (checkpoints / "last").symlink_to("000002")
    resumed = _train(2, tiny_dataset, out, "--parallel.strategy=fsdp", "--resume=true")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert _losses(resumed) == pytest.approx(_losses(runs["fsdp"][1]), rel=1e-4)


@pytest.mark.parametrize("save", ["sync", "async"])
def test_torchrun_restarts_a_run_whose_rank_died_and_it_resumes(runs, tiny_dataset: Path, tmp_path: Path,
                                                                 save: str) -> None:
    out = tmp_path / "restarted"
    command = _command(2, tiny_dataset, out, "--parallel.strategy=fsdp", "--checkpoint.keep_last=0",
                       f"--checkpoint.async_save={save == 'async'}")
    at = command.index("--nproc-per-node=2")
    command[at + 1:at + 3] = ["-m", "tests.train.crash_once"]  # rank 1 dies after its first checkpoint, once
    command.insert(at, "--max-restarts=1")
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarted: resuming from the last checkpoint" in done.stderr
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert _losses(rows) == pytest.approx(_losses(runs["fsdp"][1]), rel=1e-4)
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["000002", "000004", "000006", "last"]  # each committed once, no temporaries left


def test_hsdp_shards_within_groups_and_replicates_across_them(runs, tiny_dataset: Path, tmp_path: Path) -> None:
    # 4 ranks as 2 "nodes" of 2: parameters sharded within a pair, the pairs replicas of each other
    rows = _train(4, tiny_dataset, tmp_path / "hsdp", "--parallel.strategy=hsdp", "--parallel.dp_shard=2")
    assert _losses(rows) == pytest.approx(_losses(runs["single"][1]), rel=1e-4)
    one, fsdp = runs["single"][1][-1]["memory/state_bytes"], runs["fsdp"][1][-1]["memory/state_bytes"]
    assert rows[-1]["memory/state_bytes"] == pytest.approx(fsdp, rel=0.05)  # halves, as over 2 ranks
    assert rows[-1]["memory/state_bytes"] <= 0.6 * one


def test_a_stopped_rank_is_an_error_naming_it_not_a_hang(tiny_dataset: Path, tmp_path: Path) -> None:
    command = _command(2, tiny_dataset, tmp_path / "stopped", "--parallel.strategy=fsdp", "--parallel.timeout_s=10")
    at = command.index("--nproc-per-node=2")
    command[at + 1:at + 3] = ["-m", "tests.train.crash_once"]  # rank 1 stops (SIGSTOP) after its first checkpoint
    start = time.monotonic()
    done = subprocess.run(command, env={**_env(), "CRASH_ONCE_SIGNAL": "SIGSTOP"}, capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode != 0
    assert time.monotonic() - start < 200  # the collective timed out; nobody waited forever
    stderr = done.stderr.lower()
    assert "rank" in stderr and ("timed out" in stderr or "timeout" in stderr), done.stderr[-3000:]


def test_two_rank_checkpoint_resumes_on_one_and_exports_for_eval(runs, tiny_dataset: Path, tmp_path: Path) -> None:
    from roboscale.models.policy import Policy

    out = tmp_path / "reshard"
    shutil.copytree(runs["fsdp"][0], out, symlinks=True)
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints / f"{STEPS:06d}")
    (checkpoints / "last").unlink()
    (checkpoints / "last").symlink_to(f"{STEPS - 2:06d}")
    resumed = _train(1, tiny_dataset, out, "--resume=true")
    assert _losses(resumed) == pytest.approx(_losses(runs["fsdp"][1]), rel=1e-4)

    exported = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "roboscale", "export", str(out), f"--output={exported}"],
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    policy = Policy.from_pretrained(exported)
    reference = Policy.from_pretrained(checkpoints / "last" / "pretrained_model")
    for (name, a), (_, b) in zip(policy.state_dict().items(), reference.state_dict().items(), strict=True):
        assert (a == b).all(), name


def test_bf16_with_activation_checkpointing_trains_like_fp32(runs, tiny_dataset: Path, tmp_path: Path) -> None:
    rows = _train(2, tiny_dataset, tmp_path / "bf16", "--parallel.strategy=fsdp", "--precision=bf16",
                  "--activation_checkpointing=full")
    assert _losses(rows) == pytest.approx(_losses(runs["fsdp"][1]), rel=0.05)


@pytest.mark.parametrize("ranks", [1, 2])
def test_compiled_blocks_train_to_the_same_losses(runs, tiny_dataset: Path, tmp_path: Path, ranks: int) -> None:
    # 2 ranks: compiled blocks inside FSDP2 units (compile is applied per block before sharding)
    rows = _train(ranks, tiny_dataset, tmp_path / "compiled", "--compile=true", "--activation_checkpointing=selective")
    reference = runs["single" if ranks == 1 else "fsdp"][1]
    assert _losses(rows) == pytest.approx(_losses(reference), rel=1e-3)
