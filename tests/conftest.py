import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# what a test run hashes is remembered in a directory of its own (utils.io.HashChecks), not the user's cache
os.environ.setdefault("ROBOSCALE_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="roboscale-cache-"))

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


def tiny_policy_args(policy: str = "pi05", **overrides) -> list[str]:
    """Command-line options for a policy at its "tiny" preset (milliseconds per step), plus ``overrides``."""
    from roboscale.models.registry import get_spec

    options = {**get_spec(policy).presets["tiny"], **overrides}
    return [f"--policy.type={policy}", *(f"--policy.{k}={v}" for k, v in options.items())]

TASKS = ["Rotate the faucet clockwise", "Open a drawer"]


# The small dataset of tests/data/conftest.py (5 episodes, rotating files, cameras of two sizes), shared by the
# data and fault-injection tests: built once per session, damaged only in copies.
@pytest.fixture(scope="session")
def small_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.data.conftest import write_small_dataset

    return write_small_dataset(tmp_path_factory.mktemp("small") / "dataset")


@pytest.fixture
def small_copy(small_root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "dataset"
    shutil.copytree(small_root, dst)
    return dst


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "tiny")


def write_tiny_dataset(root: Path) -> Path:
    """A synthetic MetaWorld-shaped dataset (2 cameras at 32², 4 episodes): actions depend on the task and the
    image, so a policy can lower its loss on it."""
    import numpy as np

    from roboscale.data import DatasetWriter
    from roboscale.sim.metaworld_experts import EXPERTS

    writer = DatasetWriter.create(root, fps=80, features=EXPERTS.dataset_features(32, {"corner2": "", "wrist": ""}),
                                  robot_type="sawyer")
    rng = np.random.default_rng(0)
    for ep in range(4):
        n = 30
        t = np.arange(n, dtype=np.float32)
        sign = 1.0 if ep % 2 == 0 else -1.0
        img = np.full((n, 32, 32, 3), 40, np.uint8)
        img[:, 8 + ep * 4 : 12 + ep * 4, 8:12] = 220
        frames = {
            "observation.images.corner2": img,
            "observation.images.wrist": img[:, ::-1].copy(),
            "observation.state": np.stack([t / n, -t / n, t * 0, t * 0 + sign], 1).astype(np.float32),
            "observation.environment_state": rng.normal(size=(n, 39)).astype(np.float32),
            "action": np.stack([np.sin(t / 5) * sign, np.cos(t / 5), t / n, t * 0 + sign], 1).astype(np.float32),
            "action.executed": np.zeros((n, 4), np.float32),
            "next.reward": np.zeros(n, np.float32),
            "next.success": np.arange(n) == n - 1,
        }
        writer.add_episode(frames, task=TASKS[ep % 2])
    writer.finalize()
    return root


@pytest.fixture(autouse=True)
def _sigint_handler_kept(request):
    """A warning names any test after which SIGINT's handler changed: code a user calls in-process must not take
    Ctrl-C away from them. (SIGINT found ignored at the start of a test is not this: a background job of a
    non-interactive shell, such as ``make test &``, starts with SIGINT ignored and Python keeps it so.)"""
    import signal
    import warnings

    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        warnings.warn(f"{request.node.nodeid} changed SIGINT's handler from {before!r} to {after!r}", stacklevel=1)
