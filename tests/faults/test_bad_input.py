"""Bad input at the command line: each is one line, ``error: <where>: <what>``, exit 2 for usage (options,
config) and 1 for data (datasets, checkpoints); the same exception types from Python. One row per mistake."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from roboscale.errors import CheckpointError, ConfigError, DatasetError

from .damages import double_fps
from .entry_points import TINY_PI05, run_cli

USAGE, DATA = 2, 1


@pytest.fixture(scope="module")
def run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bad_input") / "run"
    assert run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={out}", "--steps=1",
                   "--batch_size=4", *TINY_PI05).kind == "ok"
    return out


def _wider_state_dataset(root: Path) -> Path:
    """The tiny dataset regenerated with a 5-d state: what a checkpoint trained on the 4-d one no longer fits."""
    from roboscale.data import DatasetWriter

    features = {"observation.images.corner2": {"dtype": "video", "shape": [32, 32, 3],
                                               "names": ["height", "width", "channels"]},
                "observation.images.wrist": {"dtype": "video", "shape": [32, 32, 3],
                                             "names": ["height", "width", "channels"]},
                "observation.state": {"dtype": "float32", "shape": [5], "names": None},
                "action": {"dtype": "float32", "shape": [4], "names": None}}
    writer = DatasetWriter.create(root, fps=80, features=features)
    for _ in range(2):
        writer.add_episode({"observation.images.corner2": np.zeros((12, 32, 32, 3), np.uint8),
                            "observation.images.wrist": np.zeros((12, 32, 32, 3), np.uint8),
                            "observation.state": np.zeros((12, 5), np.float32),
                            "action": np.zeros((12, 4), np.float32)}, task="Open a drawer")
    return writer.finalize()


def _cases(run: Path, tiny: Path, tmp: Path) -> list[tuple[str, list[str], int, str]]:
    """(name, argv, exit code, regex on the error line)."""
    afile = tmp / "a_file"
    afile.write_text("x")
    all_bad = tmp / "all_bad"
    shutil.copytree(tiny, all_bad)
    double_fps(all_bad)
    moved = tmp / "moved_run"
    shutil.copytree(run, moved, symlinks=True)
    shutil.rmtree(moved / "checkpoints" / "last" / "training_state")  # not needed: refused before loading it
    wider = _wider_state_dataset(tmp / "wider")
    train = ["train", f"--dataset.root={tiny}", *TINY_PI05]
    return [
        ("unknown task (eval)", ["eval", "--tasks=[open-the-pod-bay-doors]"], USAGE,
         r"unknown MetaWorld task 'open-the-pod-bay-doors'"),
        ("unknown task (generate)", ["data", "generate", "--tasks=[nope]", f"--out={tmp / 'gen'}"], USAGE,
         r"unknown MetaWorld task 'nope'"),
        ("unknown policy (model info)", ["model", "info", "pi99"], USAGE, r"unknown policy type 'pi99'"),
        ("unknown policy (train)", ["train", "--policy.type=pi99"], USAGE, r"policy.type: 'pi99' is not one of"),
        ("output_dir is a file", [*train, f"--output_dir={afile}"], USAGE,
         r"--output_dir .*a_file: exists and is not a directory"),
        ("output_dir not writable", [*train, "--output_dir=/proc/roboscale/run"], USAGE,
         r"--output_dir /proc/roboscale/run: cannot write there"),
        ("steps 0", [*train, "--steps=0"], USAGE, r"--steps must be a positive integer, got 0"),
        # numbers with a domain are refused when parsed, not by torch after the processes started (issue 31)
        ("lr negative (train)", [*train, "--optimizer.lr=-1"], USAGE, r"--optimizer.lr must be a positive number"),
        ("lr nan (train)", [*train, "--optimizer.lr=nan"], USAGE, r"optimizer.lr: must be a finite number, got 'nan'"),
        ("lr negative (rl)", ["rl", "--optimizer.lr=-1"], USAGE, r"--optimizer.lr must be a positive number"),
        ("inf noise level (rl)", ["rl", "--rollout.sampler.noise_level=inf"], USAGE,
         r"rollout.sampler.noise_level: must be a finite number"),
        ("ppo without a critic (rl)", ["rl", "--rl.algorithm=ppo", "--rl.algorithm.value_head_dim=0"], USAGE,
         r"--rl.algorithm.value_head_dim must be a positive integer for ppo"),
        ("a remote server (rl)", ["rl", "--rollout.server=ws://127.0.0.1:9"], USAGE,
         r"--rollout.server predicts with the server's ode sampler; --rollout.sampler=sde needs the policy here"),
        ("steps negative", [*train, "--steps=-5"], USAGE, r"--steps must be a positive integer, got -5"),
        ("batch_size 0", [*train, "--batch_size=0"], USAGE, r"--batch_size must be a positive integer, got 0"),
        ("batch larger than the data", [*train, "--batch_size=100000", f"--output_dir={tmp / 'big'}"], USAGE,
         r"samples per epoch are too few for batch_size 100000"),
        ("resume with another batch size", ["train", f"--output_dir={moved}", "--resume=true", "--batch_size=8"],
         USAGE, r"--resume: 1 options differ from the checkpoint's .*--batch_size=8 \(checkpoint: 4\)"),
        ("resume on another dataset", ["train", f"--output_dir={moved}", "--resume=true", f"--dataset.root={wider}"],
         USAGE, r"--dataset.root=.*wider\" \(checkpoint: "),
        ("every episode unreadable, skipping", [*train, "--skip-bad-episodes", f"--output_dir={tmp / 'skip'}"]
         + [f"--dataset.root={all_bad}"], DATA, r"all 4 episodes were skipped because they cannot be read"),
        ("eval without a checkpoint", ["eval", "--tasks=[reach]"], USAGE, r"--checkpoint is required"),
        ("eval episodes 0", ["eval", f"--checkpoint={run}", "--episodes=0"], USAGE,
         r"--episodes must be a positive integer"),
        ("validate without a dataset", ["data", "validate"], USAGE, r"usage: roboscale data validate ROOT"),
        ("unknown option", ["train", "--stepz=3"], USAGE, r"unknown option\(s\) \['stepz'\]"),
    ]


def test_every_bad_input_is_one_line_with_its_exit_code(run: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    failures = []
    for name, argv, code, pattern in _cases(run, tiny_dataset, tmp_path):
        outcome = run_cli(*argv)
        line = outcome.message.strip().replace("\r", "\n").splitlines()[-1] if outcome.message.strip() else ""
        if (outcome.exit_code != code or not line.startswith("error: ") or "Traceback" in outcome.message
                or not re.search(pattern, line)):
            failures.append(f"{name}: exit {outcome.exit_code} (want {code}): {line or outcome.message[-300:]}")
    assert not failures, "\n".join(failures)


def test_a_checkpoint_that_no_longer_fits_its_data_names_the_feature_and_the_file(tiny_dataset: Path,
                                                                                 tmp_path: Path) -> None:
    """The dataset at the same path, regenerated with a 5-d state: resuming names the feature, the dataset and
    the checkpoint's config."""
    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(tiny_dataset, data)
    assert run_cli("train", f"--dataset.root={data}", f"--output_dir={out}", "--steps=1", "--batch_size=4",
                   *TINY_PI05).kind == "ok"
    shutil.rmtree(data)
    _wider_state_dataset(data)
    outcome = run_cli("train", f"--output_dir={out}", "--resume=true", "--steps=2")
    line = outcome.message.strip().splitlines()[-1]
    assert outcome.exit_code == USAGE, line
    assert re.search(rf"--resume: {out}/checkpoints/.*/pretrained_model/config.json does not fit the data: "
                     rf"policy.state_dim is 4 but 'observation.state' of the dataset at {data} has 5 values", line)


def test_python_callers_get_the_same_exception_types(tmp_path: Path) -> None:
    from roboscale.data import LeRobotDataset
    from roboscale.configs.eval import EvalConfig
    from roboscale.configs.rollout import RolloutConfig
    from roboscale.models.policy import Policy
    from roboscale.configs.train import TrainConfig

    with pytest.raises(ConfigError, match="--steps must be a positive integer"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match="--rollout.workers must be a positive integer"):
        EvalConfig(rollout=RolloutConfig(workers=0))
    with pytest.raises(DatasetError, match="info.json"):
        LeRobotDataset(root=tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        Policy.from_pretrained(tmp_path / "nope")
