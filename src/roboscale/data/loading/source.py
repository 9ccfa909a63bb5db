"""The contract between training-data storage and the loader: episode-indexed frame reads.

The loader (``roboscale.data.loading.loader``) never knows whether frames come from a raw LeRobot v3.0 dataset
(parquet + mp4) or from compiled lake shards (``roboscale.data.lake``); it sees a ``FrameSource``. A source is created
in the main process (cheap: metadata only, picklable) and opens its files lazily inside each loader worker, where
it may keep file handles and decoders (bounded: resident memory must not grow with the number of files).

``open_source(path)`` picks the implementation from what the directory holds, through a small registry of
openers (``register_opener``): a lake root (``manifest.json`` with ``"format": "roboscale-lake"``) opens as
``roboscale.data.lake.source.LakeSource`` (the lake's own opener, ``roboscale.data.lake.opener``, named in
``BUILTIN_OPENERS``); a directory with ``meta/info.json`` as ``roboscale.data.loading.raw_source.RawSource``.
Openers import their module lazily, so a missing optional backend only matters to datasets that need it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from roboscale.errors import DatasetError


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

    def unreadable_episodes(self) -> dict[int, str]:
        """Cheap up-front checks (the reader's: metadata, episode indices, timestamps, file presence, one frame per
        episode and camera): dataset ``episode_index`` -> why, for the selected episodes that cannot be read.
        Problems no episode skip avoids raise ``DatasetError``. Run by the loader before it plans an epoch."""
        ...

    def close(self) -> None:
        """Release file handles and decoders (the source can be read again afterwards; it reopens lazily)."""
        ...


# --------------------------------------------------------------------------------------------------- openers


@dataclass(frozen=True)
class SourceOpener:
    """Opens a ``FrameSource`` for paths ``detect`` accepts; ``open(path, **options)`` imports its backend lazily."""

    name: str
    detect: Callable[[Path], bool]
    open: Callable[..., FrameSource]


_OPENERS: list[SourceOpener] = []
BUILTIN_OPENERS = ("roboscale.data.lake.opener:OPENER",)
"""Openers of other packages, before the raw one (``module:attribute``, imported on the first ``open_source``):
a lake registers itself from ``roboscale.data.lake``, which this module does not import."""
_builtins_loaded = False


def register_opener(opener: SourceOpener, *, first: bool = False) -> None:
    """Add an opener; the first one whose ``detect`` accepts a path opens it."""
    if first:
        _OPENERS.insert(0, opener)
    else:
        _OPENERS.append(opener)


def _load_builtin_openers() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    from roboscale.utils.imports import load

    for path in reversed(BUILTIN_OPENERS):
        register_opener(load(path), first=True)


def open_source(path: str | Path, **options: Any) -> FrameSource:
    """The ``FrameSource`` for a dataset directory, from the first registered opener that recognizes it."""
    path = Path(path)
    if not path.is_dir():
        raise DatasetError(path, "dataset directory not found")
    _load_builtin_openers()
    for opener in _OPENERS:
        if opener.detect(path):
            return opener.open(path, **options)
    raise DatasetError(path, "not a dataset: expected meta/info.json (LeRobot v3.0) or a roboscale lake "
                             f"manifest.json; known formats: {[o.name for o in _OPENERS]}")


def _is_raw(path: Path) -> bool:
    return (path / "meta" / "info.json").is_file()


def _open_raw(path: Path, *, verify_on_open: bool = True, **options: Any) -> FrameSource:
    """(``verify_on_open``: a lake's option, so that one set of options opens a mixture of both; raw files have no
    checksums to verify.)"""
    from roboscale.data.loading.raw_source import RawSource

    return RawSource(path, **options)


register_opener(SourceOpener("lerobot-v3.0", _is_raw, _open_raw))
