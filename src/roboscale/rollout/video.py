"""Rollout videos: H.264 mp4 (plays in every browser, unlike AV1 in some), upscaled for viewing."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_video(path: str | Path, frames: np.ndarray, fps: int = 30, upscale: int = 4) -> None:
    """``frames`` [N, H, W, 3] uint8, written atomically."""
    from roboscale.data.lerobot.video import VideoStreamWriter
    from roboscale.utils.io import atomic_path

    frames = frames.repeat(upscale, axis=1).repeat(upscale, axis=2)
    with atomic_path(path) as tmp:
        writer = VideoStreamWriter(tmp, fps, frames.shape[2], frames.shape[1], codec="libx264")
        for frame in frames:
            writer.write(frame)
        writer.close()
