"""`roboscale rl` as users run it, on a tiny policy in MetaWorld: GRPO and PPO train and leave checkpoints `eval`
takes; losses do not depend on the number of env workers or ranks; `kill -9` then `--resume` continues with the
uninterrupted run's losses; bad options are one line before any process starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tiny_policy_args
from tests.faults.entry_points import run_cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
# small and exact: one observation per policy call and one thread, so that batching changes nothing at all
RL = ["--tasks=[reach]", "--rl.group_size=2", "--rl.max_steps=12", "--rollout.envs_per_worker=2",
      "--rollout.runner.max_batch_size=1", "--rollout.runner.threads=1", "--log_freq=1", "--optimizer.lr=1e-3"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING"}


def _rl(sft: Path, out: Path, *extra: str, ranks: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    done = subprocess.run([*head, "-m", "roboscale", "rl", f"--policy_path={sft}", f"--output_dir={out}", *RL, *extra],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _losses(out: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def test_grpo_trains_and_its_checkpoint_is_evaluated_like_any_other(sft: Path, tmp_path: Path) -> None:
    out = tmp_path / "rl"
    _rl(sft, out, "--steps=2", "--rollout.workers=1")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("loss", "success", "return", "episode_steps", "episodes", "ratio", "clip_fraction"):
        assert key in metrics[0], key
    assert metrics[0]["episodes"] == pytest.approx(2) and metrics[0]["ratio"] == pytest.approx(1.0)
    evaluated = run_cli("eval", f"--checkpoint={out}", "--tasks=[reach]", "--episodes=1", "--max_steps=5",
                        "--videos_per_task=0", "--rollout.workers=1", f"--output_dir={tmp_path / 'eval'}")
    assert evaluated.kind == "ok", evaluated.message


def test_epochs_train_each_rollout_again_against_the_acting_weights(sft: Path, tmp_path: Path) -> None:
    """With --rl.epochs=2 the second step of each rollout trains on the same chunks: its ratio has left 1 (the
    weights moved, the recorded log-probabilities are the acting ones), while a rollout's first step is on-policy."""
    out = tmp_path / "epochs"
    # a large step, so that the log-probabilities move well beyond float32's resolution of their sums
    _rl(sft, out, "--steps=4", "--save_freq=2", "--rollout.workers=1", "--rl.epochs=2", "--optimizer.lr=0.02")
    metrics = {m["step"]: m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert metrics[1]["ratio"] == pytest.approx(1.0, abs=1e-4) and metrics[3]["ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics[2]["approx_kl"] > 100 * max(metrics[1]["approx_kl"], metrics[3]["approx_kl"], 1e-12)
    assert metrics[4]["approx_kl"] > 100 * max(metrics[1]["approx_kl"], metrics[3]["approx_kl"], 1e-12)
    for first, again in ((1, 2), (3, 4)):  # the same episodes
        assert metrics[again]["success"] == metrics[first]["success"]
        assert metrics[again]["episode_steps"] == metrics[first]["episode_steps"]


def test_ppo_trains_a_value_head_the_checkpoint_keeps(sft: Path, tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    _rl(sft, out, "--steps=2", "--rollout.workers=1", "--rl.algorithm=ppo", "--rl.reward=shaped")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[1]["value_loss"] > 0 and metrics[1]["value"] != 0  # the critic moved off its zero start
    config = json.loads((out / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert config["value_head_dim"] == 64


def test_a_groot_policy_post_trains_with_ppo_too(tiny_dataset: Path, tmp_path: Path) -> None:
    """GR00T's convention (noise at t = 0) through the same sampler, objective and value head."""
    sft = tmp_path / "sft"
    assert run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={sft}", "--steps=2", "--batch_size=4",
                   *tiny_policy_args("groot", chunk_size=4, n_action_steps=2)).kind == "ok"
    out = tmp_path / "rl"
    _rl(sft, out, "--steps=2", "--rollout.workers=1", "--rl.algorithm=ppo", "--rl.reward=shaped")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[1]["value_loss"] > 0
    assert all(m["skipped_steps"] == 0 and m["grad_norm"] > 0 for m in metrics)
    config = json.loads((out / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert config["type"] == "groot" and config["value_head_dim"] == 64


def test_losses_do_not_depend_on_the_number_of_env_workers(sft: Path, tmp_path: Path) -> None:
    _rl(sft, tmp_path / "one", "--steps=3", "--rollout.workers=1")
    _rl(sft, tmp_path / "two", "--steps=3", "--rollout.workers=2", "--rollout.envs_per_worker=1")
    assert _losses(tmp_path / "one") == _losses(tmp_path / "two")


def test_two_fsdp_ranks_compute_the_one_process_losses(sft: Path, tmp_path: Path) -> None:
    """Each rank rolls out its share of the step's groups on its own engine and trains on them."""
    args = ["--steps=2", "--rollout.workers=1", "--rl.states_per_task=2"]
    _rl(sft, tmp_path / "one", *args)
    _rl(sft, tmp_path / "fsdp", *args, "--parallel.strategy=fsdp", ranks=2)
    one, fsdp = _losses(tmp_path / "one"), _losses(tmp_path / "fsdp")
    assert one.keys() == fsdp.keys() == {1, 2}
    for step in one:
        assert fsdp[step] == pytest.approx(one[step], rel=1e-4, abs=1e-7)


def test_a_run_killed_outright_resumes_to_the_uninterrupted_losses(sft: Path, tmp_path: Path) -> None:
    _rl(sft, tmp_path / "whole", "--steps=4", "--rollout.workers=1", "--save_freq=1")
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "roboscale", "rl", f"--policy_path={sft}", f"--output_dir={out}",
                             *RL, "--steps=4", "--rollout.workers=1", "--save_freq=1"], env=_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from tests.faults.test_process_faults import _wait_for

        _wait_for(lambda: (out / "checkpoints" / "000002").is_dir(), 600, "the second checkpoint")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its rollout processes, all at once
        proc.wait()
    _rl(sft, out, "--resume=true")
    assert _losses(out) == _losses(tmp_path / "whole")


def test_bad_options_are_one_line_before_anything_starts(sft: Path, tmp_path: Path) -> None:
    for args, needle in ((["--rl.algorithm=dqn"], "rl.algorithm.type: 'dqn' is not one of ['grpo', 'ppo', 'rloo']"),
                         (["--rl.algorithm.gamma=0.9"], "rl.algorithm: unknown option(s) ['gamma']"),  # grpo's
                         (["--rl.group_size=1"], "--rl.group_size must be at least 2 for grpo"),
                         (["--tasks=[reachh]"], "unknown MetaWorld task 'reachh'"),
                         (["--rl.epochs=2", "--steps=3"], "--steps=3 is not a multiple of --rl.epochs=2")):
        done = subprocess.run([sys.executable, "-m", "roboscale", "rl", f"--policy_path={sft}",
                               f"--output_dir={tmp_path / 'bad'}", *RL, *args], env=_env(), cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
        assert not (tmp_path / "bad" / "checkpoints").exists()
