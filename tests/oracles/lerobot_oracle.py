"""What our tests need to run LeRobot's own pi0.5 (``lerobot_pi05.py``) as an oracle: its venv, the sizes both
sides build, and the fixture it wrote (``tests/fixtures/lerobot-pi05-tiny``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ORACLE = HERE / "lerobot_pi05.py"
FIXTURE = HERE.parent / "fixtures" / "lerobot-pi05-tiny"
SIZES = json.loads((HERE / "lerobot_pi05_sizes.json").read_text())
LEROBOT_PYTHON = Path(os.environ.get("ROBOSCALE_LEROBOT_PYTHON", HERE.parents[1] / ".venv-lerobot" / "bin" / "python"))
ORACLE_TIMEOUT_S = 600  # building and running a tiny model takes ~10 s; the venv's first imports more


def use_sizes(monkeypatch: pytest.MonkeyPatch, size: str = "tiny") -> None:
    """Make our LeRobot adapter read LeRobot's variant names as ``size`` builds them on LeRobot's side (config values
    only, as the oracle changes on its side)."""
    spec = SIZES[size]
    if spec["gemma"]:
        fields = ("width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim")
        monkeypatch.setattr("roboscale.models.pi05.lerobot.GEMMA_VARIANTS",
                            {name: tuple(dims[f] for f in fields) for name, dims in spec["gemma"].items()})
    if spec["vision"]:
        v = spec["vision"]
        monkeypatch.setattr("roboscale.models.pi05.lerobot.SIGLIP", dict(
            vit_patch_size=v["patch_size"], vit_dim=v["hidden_size"], vit_depth=v["num_hidden_layers"],
            vit_heads=v["num_attention_heads"], vit_mlp_dim=v["intermediate_size"], vit_norm_eps=1e-6))


def lerobot_python() -> Path:
    """The LeRobot venv's python, or a skip saying why there is none (tests/oracles/README.md builds it)."""
    if not LEROBOT_PYTHON.is_file():
        pytest.skip(f"LeRobot's venv is not at {LEROBOT_PYTHON} (tests/oracles/README.md builds it; "
                    "ROBOSCALE_LEROBOT_PYTHON points elsewhere)")
    probe = subprocess.run([str(LEROBOT_PYTHON), "-c", "from transformers.models.siglip import check; "
                            "import lerobot.policies.pi05.modeling_pi05; "
                            "assert check.check_whether_transformers_replace_is_installed_correctly()"],
                           capture_output=True, text=True, timeout=ORACLE_TIMEOUT_S)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"LeRobot's venv at {LEROBOT_PYTHON} cannot build PI05Policy ({last}): see tests/oracles/README.md")
    return LEROBOT_PYTHON


def run_oracle(python: Path, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(python), str(ORACLE), *args], capture_output=True, text=True, env=env,
                          timeout=ORACLE_TIMEOUT_S)
    if done.returncode:
        raise AssertionError(f"LeRobot's oracle failed ({' '.join(args)}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
