"""The CLI end to end on a tiny config, the way a user runs it."""

import json
import subprocess
import sys

import pytest

from tests.conftest import tiny_policy_args

TINY_POLICY = tiny_policy_args("pi05", chunk_size=8, n_action_steps=4)


def roboscale(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "roboscale", *args], capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"roboscale {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.mark.slow
def test_generate_train_eval_end_to_end(tmp_path):
    data, run, report = tmp_path / "data", tmp_path / "run", tmp_path / "eval"
    roboscale("data", "generate", "--tasks=[reach]", "--episodes_per_task=2", f"--out={data}", "--image_size=32",
              "--workers=1")
    info = roboscale("data", "info", str(data)).stdout
    assert "2 episodes" in info and "Reach a goal position" in info
    out = roboscale("train", f"--dataset.root={data}", f"--output_dir={run}", "--steps=6", "--batch_size=8",
                    "--save_freq=3", *TINY_POLICY).stdout
    assert "final checkpoint" in out
    roboscale("eval", f"--checkpoint={run}", "--tasks=[reach]", "--episodes=1", "--max_steps=8",
              "--rollout.workers=1", f"--output_dir={report}")
    result = json.loads((report / "report.json").read_text())
    assert result["per_task"]["reach-v3"]["episodes"] == 1
    assert result["episodes"][0]["steps"] <= 8


def test_help_lists_commands_and_options():
    top = roboscale("--help").stdout
    assert "data generate" in top and "train" in top and "eval" in top and "demo" in top
    train_help = roboscale("train", "--help").stdout
    assert "--optimizer.lr" in train_help and "--resume" in train_help


def test_bad_input_is_one_line_without_a_traceback(tmp_path):
    proc = roboscale("eval", f"--checkpoint={tmp_path}", check=False)
    assert proc.returncode == 1
    assert "no policy checkpoint here" in proc.stderr and "Traceback" not in proc.stderr
    proc = roboscale("train", "--stepz=3", check=False)
    assert proc.returncode == 2 and "unknown option(s) ['stepz']" in proc.stderr and "Traceback" not in proc.stderr
    proc = roboscale("data", "info", str(tmp_path), check=False)
    assert proc.returncode == 1 and "info.json" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_groot_trains_and_evaluates_from_the_cli(tmp_path):
    """`--policy.type=groot` from a fresh process: the type is registered before options are parsed, and the
    policy runs the same train -> checkpoint -> closed-loop eval path as pi0.5."""
    from roboscale.models.registry import GROOT_PRESETS

    data, run, report = tmp_path / "data", tmp_path / "run", tmp_path / "eval"
    roboscale("data", "generate", "--tasks=[reach]", "--episodes_per_task=2", f"--out={data}", "--image_size=32",
              "--workers=1")
    out = roboscale("train", *tiny_policy_args("groot"), f"--dataset.root={data}", f"--output_dir={run}",
                    "--steps=4", "--batch_size=8").stdout
    assert "final checkpoint" in out
    config = json.loads((run / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert config["type"] == "groot" and config["dit_layers"] == GROOT_PRESETS["tiny"]["dit_layers"]
    roboscale("eval", f"--checkpoint={run}", "--tasks=[reach]", "--episodes=1", "--max_steps=6",
              "--rollout.workers=1", f"--output_dir={report}")
    assert json.loads((report / "report.json").read_text())["per_task"]["reach-v3"]["episodes"] == 1
