import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


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
