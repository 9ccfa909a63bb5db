"""A writer of the legacy LeRobot v2.1 layout, for converter tests only (our library never writes v2.x).

What it writes follows LeRobot v2.1 (see the reference notes, §1.12): one parquet and one mp4 per episode under
``chunk-{episode_chunk:03d}`` directories, ``meta/episodes.jsonl``, ``meta/episodes_stats.jsonl`` (min/max/mean/
std/count only, no quantiles) and ``meta/tasks.jsonl``. Two quirks of real Hub datasets are reproduced on purpose:
``observation.state`` is a variable-length list column (old HF ``datasets``), and the wrist camera describes itself
with the v2.0 ``video_info`` block instead of ``info``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from roboscale.data.lerobot.stats import compute_episode_stats
from roboscale.data.lerobot.video import VideoStreamWriter, encode_png

from ..conftest import square_frame

V21_FPS = 10
V21_SIZE = 32
V21_LENGTHS = [6, 9, 5]
V21_TASKS = ["pick the cube", "place the cube"]
V21_CHUNKS_SIZE = 2  # so episode 2 lives in chunk-001, as in big v2.1 datasets
V21_CAMERAS = ["observation.images.top", "observation.images.wrist"]
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"

_CAMERA = {"dtype": "video", "shape": [V21_SIZE, V21_SIZE, 3], "names": ["height", "width", "channels"]}
V21_IMAGE = "observation.image"  # an optional ``image`` feature (PNG bytes in the parquet, HF's Image struct)
V21_IMAGE_FEATURE = {"dtype": "image", "shape": [8, 8, 3], "names": ["height", "width", "channels"]}
V21_USER_FEATURES: dict[str, dict[str, Any]] = {
    "observation.images.top": _CAMERA,
    "observation.images.wrist": _CAMERA,
    "observation.state": {"dtype": "float32", "shape": [3], "names": ["x", "y", "z"]},
    "action": {"dtype": "float32", "shape": [2], "names": None},
    "next.done": {"dtype": "bool", "shape": [1], "names": None},
}
_DEFAULTS = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}


def v21_frames(e: int) -> dict[str, np.ndarray]:
    """The user features of episode ``e`` stacked over time; cameras show conftest's square pattern, the wrist
    camera with a different episode offset so the two streams differ."""
    n = V21_LENGTHS[e]
    i = np.arange(n)
    rng = np.random.default_rng(100 + e)
    return {
        "observation.images.top": np.stack([square_frame(V21_SIZE, V21_SIZE, k, e) for k in i]),
        "observation.images.wrist": np.stack([square_frame(V21_SIZE, V21_SIZE, k, e + 2) for k in i]),
        "observation.state": np.stack([i, np.full(n, e), rng.normal(size=n)], axis=1).astype(np.float32),
        "action": rng.normal(size=(n, 2)).astype(np.float32),
        "next.done": i == n - 1,
        V21_IMAGE: rng.integers(0, 256, size=(n, 8, 8, 3), dtype=np.uint8),
    }


def v21_task_indices(e: int) -> np.ndarray:
    """Episode 1 switches task halfway (a multi-task episode); the others keep task e % 2."""
    n = V21_LENGTHS[e]
    if e == 1:
        return (np.arange(n) >= n // 2).astype(np.int64)
    return np.full(n, e % 2, dtype=np.int64)


def v21_info(codec: str, with_image: bool = False) -> dict[str, Any]:
    stream_info = {
        "video.fps": float(V21_FPS), "video.height": V21_SIZE, "video.width": V21_SIZE, "video.channels": 3,
        "video.codec": "av1" if codec == "libsvtav1" else "h264", "video.pix_fmt": "yuv420p",
        "video.is_depth_map": False, "has_audio": False,
    }
    features: dict[str, Any] = {}
    for key, ft in V21_USER_FEATURES.items():
        features[key] = dict(ft)
        if key == "observation.images.top":
            features[key]["info"] = dict(stream_info)
        elif key == "observation.images.wrist":
            features[key]["video_info"] = dict(stream_info)  # the v2.0 spelling
    if with_image:
        features[V21_IMAGE] = dict(V21_IMAGE_FEATURE)
    features.update({k: dict(v) for k, v in _DEFAULTS.items()})
    total = len(V21_LENGTHS)
    return {
        "codebase_version": "v2.1", "robot_type": "test_bot", "total_episodes": total,
        "total_frames": sum(V21_LENGTHS), "total_tasks": len(V21_TASKS), "total_videos": total * len(V21_CAMERAS),
        "total_chunks": (total - 1) // V21_CHUNKS_SIZE + 1, "chunks_size": V21_CHUNKS_SIZE, "fps": V21_FPS,
        "splits": {"train": f"0:{total}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": features,
    }


def _data_table(e: int, frames: dict[str, np.ndarray], start: int, with_image: bool) -> pa.Table:
    n = V21_LENGTHS[e]
    frame_index = np.arange(n, dtype=np.int64)
    columns = {
        # variable-length lists, as old HF `datasets` wrote Sequence features
        "observation.state": pa.array(frames["observation.state"].tolist(), pa.list_(pa.float32())),
        "action": pa.FixedSizeListArray.from_arrays(pa.array(frames["action"].reshape(-1)), 2),
        "next.done": pa.array(frames["next.done"]),
        "timestamp": pa.array((frame_index / V21_FPS).astype(np.float32)),
        "frame_index": pa.array(frame_index),
        "episode_index": pa.array(np.full(n, e, dtype=np.int64)),
        "index": pa.array(start + frame_index),
        "task_index": pa.array(v21_task_indices(e)),
    }
    if with_image:
        pngs = pa.array([encode_png(image) for image in frames[V21_IMAGE]], pa.binary())
        columns[V21_IMAGE] = pa.StructArray.from_arrays([pngs, pa.nulls(n, pa.string())], names=["bytes", "path"])
    return pa.table(columns)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _stats_json(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    """v2.1 kept only min/max/mean/std/count per feature."""
    return {k: {s: st[s].tolist() for s in ("min", "max", "mean", "std", "count")} for k, st in stats.items()}


def write_v21_dataset(root: Path, codec: str = "libsvtav1", with_image: bool = False) -> Path:
    """A 3-episode, 2-camera, 2-task v2.1 dataset at ``root`` (plus an ``image`` feature when ``with_image``)."""
    root = Path(root)
    (root / "meta").mkdir(parents=True)
    info = v21_info(codec, with_image)
    features = info["features"]
    episodes, episode_stats = [], []
    start = 0
    for e, n in enumerate(V21_LENGTHS):
        chunk = e // V21_CHUNKS_SIZE
        frames = v21_frames(e)
        table = _data_table(e, frames, start, with_image)
        if not with_image:
            del frames[V21_IMAGE]
        path = root / DATA_PATH.format(episode_chunk=chunk, episode_index=e)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        for key in V21_CAMERAS:
            writer = VideoStreamWriter(root / VIDEO_PATH.format(episode_chunk=chunk, video_key=key, episode_index=e),
                                       V21_FPS, V21_SIZE, V21_SIZE, codec=codec)
            writer.write_many(frames[key])
            writer.close()
        all_columns = {**frames, **{k: table[k].to_numpy() for k in _DEFAULTS}}
        stats = compute_episode_stats(all_columns, features)
        tasks = [V21_TASKS[t] for t in dict.fromkeys(v21_task_indices(e).tolist())]
        episodes.append({"episode_index": e, "tasks": tasks, "length": n})
        episode_stats.append({"episode_index": e, "stats": _stats_json(stats)})
        start += n
    _write_jsonl(root / "meta/episodes.jsonl", episodes)
    _write_jsonl(root / "meta/episodes_stats.jsonl", episode_stats)
    _write_jsonl(root / "meta/tasks.jsonl", [{"task_index": i, "task": t} for i, t in enumerate(V21_TASKS)])
    (root / "meta/info.json").write_text(json.dumps(info, indent=4))
    return root
