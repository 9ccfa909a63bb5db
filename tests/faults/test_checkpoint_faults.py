"""Damaged checkpoints against everything that reads one: `roboscale eval`, `roboscale train --resume` and
``Policy.from_pretrained``. The damage hits the newest checkpoint (``last``) of a run that has an older, intact
one: each case must be a one-line error naming the file (or, where the file is not needed, work), and the
rerun the error suggests (resume from the previous checkpoint) must work.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from roboscale.models.policy import Policy

from .entry_points import TINY_PI05, Outcome, run_cli, run_python

STEP = "000002"  # the damaged checkpoint; 000001 stays intact


@dataclass(frozen=True)
class CheckpointDamage:
    name: str
    what: str
    apply: Callable[[Path], None]  # gets checkpoints/<STEP>
    expect: dict[str, str] = field(default_factory=dict)  # entry -> ok, where the damaged file is not needed


def _rewrite_json(path: Path, edit: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _garble(path: Path, start: int = 0, size: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[start:start + size] = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


PRE = "pretrained_model"
STATE = "training_state"
NOT_FOR_INFERENCE = {"eval": "ok", "Policy.from_pretrained": "ok"}

DAMAGES = [
    CheckpointDamage("weights-truncated", "model.safetensors cut in half",
                     lambda c: _truncate(c / PRE / "model.safetensors")),
    CheckpointDamage("weights-header-garbled", "random bytes over model.safetensors' header",
                     lambda c: _garble(c / PRE / "model.safetensors", 8)),
    CheckpointDamage("weights-deleted", "model.safetensors deleted", lambda c: (c / PRE / "model.safetensors").unlink()),
    CheckpointDamage("config-deleted", "config.json deleted", lambda c: (c / PRE / "config.json").unlink()),
    CheckpointDamage("config-not-json", "config.json overwritten with bytes that are not JSON",
                     lambda c: _garble(c / PRE / "config.json")),
    CheckpointDamage("config-type-a-list", 'config.json "type": ["pi05"] (a JSON list, not a string)',
                     lambda c: _rewrite_json(c / PRE / "config.json", lambda d: d.update(type=["pi05"]))),
    CheckpointDamage("config-type-unknown", 'config.json "type": "pi99"',
                     lambda c: _rewrite_json(c / PRE / "config.json", lambda d: d.update(type="pi99"))),
    CheckpointDamage("config-width-edited", "config.json width changed, so the weights no longer fit",
                     lambda c: _rewrite_json(c / PRE / "config.json", lambda d: d.update(width=64))),
    CheckpointDamage("tokenizer-deleted", "tokenizer.json deleted", lambda c: (c / PRE / "tokenizer.json").unlink()),
    CheckpointDamage("sharded-metadata-deleted", "the sharded model/optimizer state's DCP .metadata deleted",
                     lambda c: (c / STATE / "model_optimizer" / ".metadata").unlink(), expect=NOT_FOR_INFERENCE),
    CheckpointDamage("sharded-shard-truncated", "a shard of the model/optimizer state (__0_0.distcp) cut in half",
                     lambda c: _truncate(c / STATE / "model_optimizer" / "__0_0.distcp"), expect=NOT_FOR_INFERENCE),
    CheckpointDamage("trainer-state-edited", "trainer_state.json without its step",
                     lambda c: _rewrite_json(c / STATE / "trainer_state.json", lambda d: d.pop("step")),
                     expect=NOT_FOR_INFERENCE),
    CheckpointDamage("loader-state-edited", "loader_state.json without its position",
                     lambda c: _rewrite_json(c / STATE / "loader_state.json", lambda d: d.pop("position")),
                     expect=NOT_FOR_INFERENCE),
    CheckpointDamage("train-config-not-json", "train_config.json overwritten with bytes that are not JSON",
                     lambda c: _garble(c / PRE / "train_config.json"), expect=NOT_FOR_INFERENCE),
    CheckpointDamage("step-deleted", "the whole step directory deleted, `last` left dangling",
                     lambda c: shutil.rmtree(c)),
]


@pytest.fixture(scope="module")
def trained_run(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("faults") / "run"
    outcome = run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=2",
                      "--save_freq=1", "--batch_size=4", *TINY_PI05)
    assert outcome.kind == "ok", outcome.message
    return run


def evaluate(run: Path, work: Path) -> Outcome:
    return run_cli("eval", f"--checkpoint={run}", "--tasks=[reach]", "--episodes=1", "--max_steps=2",
                   "--rollout.workers=1", "--videos_per_task=0", f"--output_dir={work / 'eval'}")


def resume(run: Path, work: Path) -> Outcome:
    return run_cli("train", f"--output_dir={run}", "--resume=true", "--steps=3")


def from_pretrained(run: Path, work: Path) -> Outcome:
    def load() -> Outcome:
        Policy.from_pretrained(run / "checkpoints" / "last" / PRE)
        return Outcome("ok")

    return run_python(load)


ENTRY_POINTS = {"eval": evaluate, "train --resume": resume, "Policy.from_pretrained": from_pretrained}


def _cases():
    for damage in DAMAGES:
        for entry in ENTRY_POINTS:
            # an evaluation that works runs MetaWorld in a worker process (seconds): in the slow set
            slow = entry == "eval" and damage.expect.get(entry) == "ok"
            yield pytest.param(damage, entry, id=f"{damage.name}/{entry}", marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("damage, entry", list(_cases()))
def test_damaged_checkpoint(damage: CheckpointDamage, entry: str, trained_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run, symlinks=True)
    step = run / "checkpoints" / STEP
    damage.apply(step)
    want = damage.expect.get(entry, "error")
    outcome = ENTRY_POINTS[entry](run, tmp_path)
    assert outcome.kind == want, f"{damage.name} / {entry}: expected {want}, got {outcome.kind}: {outcome.message}"
    if outcome.kind == "ok":
        return
    text = outcome.message.strip().replace("\r", "\n").splitlines()[-1]
    assert "Traceback" not in outcome.message and text.isprintable()
    assert str(run / "checkpoints") in text, f"the error does not name the checkpoint's file: {text}"
    if outcome.exit_code:
        assert text.startswith("error: ") and outcome.exit_code == 1, (outcome.exit_code, text)
    if entry == "train --resume":
        # the error says how to go on from the intact checkpoint; doing so works
        assert f"ln -sfn 000001 {run / 'checkpoints' / 'last'}" in text, text
        (run / "checkpoints" / "last").unlink()
        (run / "checkpoints" / "last").symlink_to("000001")
        again = resume(run, tmp_path)
        assert again.kind == "ok", again.message
