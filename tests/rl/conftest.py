from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.entry_points import TINY_PI05, run_cli


@pytest.fixture(scope="package")
def sft(tiny_dataset: Path, tmp_path_factory) -> Path:
    """A tiny pi0.5 after 2 supervised steps: what RL starts from."""
    run = tmp_path_factory.mktemp("sft") / "run"
    assert run_cli("train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=2", "--batch_size=4",
                   *TINY_PI05).kind == "ok"
    return run
