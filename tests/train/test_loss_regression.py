"""A fixed-seed tiny training gives the losses, step by step, recorded in reference_losses.json: restructuring
the code (where things live, which hooks exist) must not change what is computed. On the machine that recorded
them they are bit-identical; on another CPU, oneDNN/MKL choose other kernels (AVX2 or AVX-512: sums reduced in
another order), and they differ in the last bits: up to 1.6e-7 relative over the 12 steps between two of our
machines. The test allows 1e-6; any change of what is computed moves them far more. If a change is meant to change
the numbers, regenerate the file and say why in the commit:

    ROBOSCALE_WRITE_REFERENCE=1 .venv/bin/pytest tests/train/test_loss_regression.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from roboscale.configs.train import DatasetConfig, OptimizerConfig, TrainConfig
from roboscale.models.registry import preset_config
from roboscale.train.supervised import train

REFERENCE = Path(__file__).with_name("reference_losses.json")
STEPS = 12

# pi0.5 in both layouts (padded rows, packed streams with micro-batches) and GR00T
POLICIES = {
    "pi05": lambda: preset_config("pi05", "tiny"),
    "pi05-packed": lambda: preset_config("pi05", "tiny", packing=True, pack_token_budget=120),
    "groot": lambda: preset_config("groot", "tiny"),
}


def _losses(run: Path) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return [e.value for e in events.Scalars("train/loss")]


@pytest.mark.parametrize("name", list(POLICIES))
def test_fixed_seed_losses_are_bit_identical_to_the_recorded_ones(name: str, tiny_dataset: Path,
                                                                  tmp_path: Path) -> None:
    cfg = TrainConfig(dataset=DatasetConfig(root=str(tiny_dataset), num_workers=0), policy=POLICIES[name](),
                      steps=STEPS, batch_size=8, seed=7, output_dir=str(tmp_path / "run"), save_freq=STEPS,
                      log_freq=1, optimizer=OptimizerConfig(lr=1e-3, warmup_steps=3))
    train(cfg, progress=False)
    losses = _losses(tmp_path / "run")
    assert len(losses) == STEPS
    reference = json.loads(REFERENCE.read_text()) if REFERENCE.is_file() else {}
    if os.environ.get("ROBOSCALE_WRITE_REFERENCE"):
        reference[name] = losses
        REFERENCE.write_text(json.dumps(reference, indent=2) + "\n")
    assert name in reference, f"no reference for {name}: regenerate {REFERENCE.name} (see the module docstring)"
    assert losses == pytest.approx(reference[name], rel=1e-6, abs=0)
