"""The contract between training-data storage and the loader: episode-indexed frame reads.

The loader (``roboscale.data.loader``) never knows whether frames come from a raw LeRobot v3.0 dataset (parquet
+ mp4) or from compiled lake shards (``roboscale.data.lake``); it sees a ``FrameSource``. A source is created
in the main process (cheap: metadata only, picklable) and ``open()``-ed lazily inside each loader worker, where
it may keep file handles and decoders (bounded: resident memory must not grow with the number of files).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class FrameSource(Protocol):
    """Random access to the frames of a set of episodes.

    Episodes are addressed by position ``0..num_episodes-1`` (``episode_ids[i]`` is the dataset's own
    ``episode_index``). Frames inside an episode are addressed by their 0-based ``frame_index``.
    """

    #: LeRobot feature schema (``info.json`` "features") of what ``read`` can return.
    features: Mapping[str, Mapping[str, Any]]
    fps: float
    #: Camera features (video or image dtype), in the order the dataset declares them.
    camera_keys: Sequence[str]
    #: Task strings by ``task_index``.
    tasks: Sequence[str]
    #: Normalization statistics per feature (``mean``/``std``/``min``/``max``/``q01``.., numpy arrays), or None.
    stats: Mapping[str, Mapping[str, np.ndarray]] | None

    @property
    def episode_ids(self) -> np.ndarray:
        """int64 [E]: the dataset ``episode_index`` of each episode position."""
        ...

    @property
    def episode_lengths(self) -> np.ndarray:
        """int64 [E]: number of frames of each episode position."""
        ...

    def read(self, episode: int, frames: np.ndarray, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Values of ``keys`` at sorted, in-range ``frames`` of episode position ``episode``.

        Cameras come back uint8 ``[n, H, W, C]`` (never converted to float: the model normalizes on its device);
        numeric features ``[n, *shape]`` in their stored dtype; ``task_index`` int64 ``[n]``. Errors name the
        file, episode and feature (``roboscale.errors.DatasetError``).
        """
        ...

    def close(self) -> None:
        """Release file handles and decoders (the source can be read again afterwards; it reopens lazily)."""
        ...
