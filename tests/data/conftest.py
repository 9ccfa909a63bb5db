"""Shared pieces of the data tests: the LeRobot-written fixture, its image pattern, and one small dataset written
by our writer (built once per session; tests that damage it work on a copy)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from roboscale.data import DatasetWriter

TESTS = Path(__file__).resolve().parent.parent

FIXTURE_TASKS = {0: "reach the red target", 1: "open the drawer", 2: "reach the red target", 3: "open the drawer"}
FIXTURE_LENGTHS = [12, 17, 9, 20]
SQUARE_RGB = np.array([230, 200, 60])
BACKGROUND = 40


def _fixture_root() -> Path:
    root = TESTS / "fixtures" / "lerobot-v3.0-mini"
    if not (root / "meta" / "info.json").is_file():
        raise FileNotFoundError(f"LeRobot v3.0 fixture not found at {root}")
    return root


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    return _fixture_root()


@pytest.fixture
def fixture_copy(fixture_root: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "lerobot-v3.0-mini"
    shutil.copytree(fixture_root, dst)
    return dst


def square_frame(height: int, width: int, i: int, e: int) -> np.ndarray:
    """The fixture README's pattern: background 40, a (230,200,60) square of side max(4, H//8) at
    rows (3i) % (H-s), columns (7e) % (W-s)."""
    s = max(4, height // 8)
    y, x = (3 * i) % (height - s), (7 * e) % (width - s)
    frame = np.full((height, width, 3), BACKGROUND, dtype=np.uint8)
    frame[y : y + s, x : x + s] = SQUARE_RGB
    return frame


def assert_square(frame: np.ndarray, i: int, e: int, what: str = "") -> None:
    """A decoded HxWx3 uint8 frame shows the pattern within codec error: the square is where it should be (its
    bright pixels' bounding box is off by at most 1 px), its colour within 40 levels, the background on average
    within 3 (AV1 at crf 30 rings by up to ~30 levels right next to the square, hence no per-pixel bound)."""
    height, width = frame.shape[:2]
    s = max(4, height // 8)
    y, x = (3 * i) % (height - s), (7 * e) % (width - s)
    bright = frame.astype(np.int32).sum(axis=2) > 3 * 120
    rows, cols = np.nonzero(bright)
    assert rows.size, f"{what}: no square found (frame {i}, episode {e})"
    where = f"{what}: square at rows {rows.min()}..{rows.max()}, cols {cols.min()}..{cols.max()}"
    assert abs(rows.min() - y) <= 1 and abs(rows.max() - (y + s - 1)) <= 1, f"{where}; expected rows {y}..{y + s - 1}"
    assert abs(cols.min() - x) <= 1 and abs(cols.max() - (x + s - 1)) <= 1, f"{where}; expected cols {x}..{x + s - 1}"
    inner = frame[y + 1 : y + s - 1, x + 1 : x + s - 1].reshape(-1, 3).mean(axis=0)
    assert np.all(np.abs(inner - SQUARE_RGB) <= 40), f"{what}: square colour {inner}, expected ~{SQUARE_RGB}"
    mask = np.ones((height, width), dtype=bool)
    mask[max(0, y - 2) : y + s + 2, max(0, x - 2) : x + s + 2] = False
    background = frame[mask].astype(np.int32)
    assert np.abs(background - BACKGROUND).mean() <= 3, f"{what}: background deviates from {BACKGROUND}"


# --------------------------------------------------------------------------------------------------- our dataset

SMALL_FPS = 10
SMALL_LENGTHS = [7, 11, 6, 9, 12]
SMALL_TASKS = ["pick the cube", "open the door"]
SMALL_FEATURES = {
    "observation.images.front": {"dtype": "video", "shape": [64, 64, 3], "names": ["height", "width", "channels"]},
    # CHW declaration, as some converters write it
    "observation.images.wrist": {"dtype": "video", "shape": [3, 48, 64], "names": ["channels", "height", "width"]},
    "observation.image": {"dtype": "image", "shape": [16, 16, 3], "names": ["height", "width", "channels"]},
    "observation.state": {"dtype": "float32", "shape": [4], "names": ["a", "b", "c", "d"]},
    "action": {"dtype": "float32", "shape": [3], "names": None},
    "next.done": {"dtype": "bool", "shape": [1], "names": None},
    "next.reward": {"dtype": "float32", "shape": [1], "names": None},
}


def small_episode(e: int) -> dict[str, np.ndarray]:
    """Deterministic frames of episode ``e`` of the small dataset, stacked over time."""
    n = SMALL_LENGTHS[e]
    i = np.arange(n)
    rng = np.random.default_rng(e)
    return {
        "observation.images.front": np.stack([square_frame(64, 64, k, e) for k in i]),
        "observation.images.wrist": np.stack([square_frame(48, 64, k, e + 1) for k in i]),
        "observation.image": rng.integers(0, 256, size=(n, 16, 16, 3), dtype=np.uint8),  # PNG is lossless
        "observation.state": np.stack([np.full(n, e), i, 0.5 * i, rng.normal(size=n)], axis=1).astype(np.float32),
        "action": rng.normal(size=(n, 3)).astype(np.float32),
        "next.done": i == n - 1,
        "next.reward": (i / 10).astype(np.float32),
    }


def small_task(e: int) -> str:
    return SMALL_TASKS[e % 2]


def write_small_dataset(root: Path) -> Path:
    """5 episodes, 2 cameras, tiny size limits so data/video files rotate and chunks roll over (chunks_size=2)."""
    writer = DatasetWriter.create(root, fps=SMALL_FPS, features=SMALL_FEATURES, robot_type="test_bot",
                                  data_files_size_in_mb=0.001, video_files_size_in_mb=0.001, chunks_size=2)
    with writer:
        for e in range(len(SMALL_LENGTHS)):
            frames = small_episode(e)
            if e % 2 == 0:  # frame by frame, the recording path
                for k in range(SMALL_LENGTHS[e]):
                    frame = {key: value[k] for key, value in frames.items()}
                    frame["next.done"] = bool(frame["next.done"])
                    frame["task"] = small_task(e)
                    writer.add_frame(frame)
                assert writer.save_episode() == e
            else:  # the bulk path
                assert writer.add_episode(frames, small_task(e)) == e
    return root


