"""The lake's opener: how ``open_source`` (``roboscale.data.loading.source``) recognizes a lake root and opens it
as a ``LakeSource``. Light on purpose: every ``open_source`` imports it to ask ``detect``, and only opening a lake
imports the lake's reader."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roboscale.data.lake.format import LAKE_FORMAT, MANIFEST
from roboscale.data.loading.source import FrameSource, SourceOpener
from roboscale.errors import ConfigError, DatasetError
from roboscale.utils.io import load_json


def is_lake(path: Path) -> bool:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    if not (path / "meta" / "info.json").exists():  # no LeRobot dataset: a lake, whose reader names any damage
        return True
    try:
        return load_json(manifest.read_text()).get("format") == LAKE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def open_lake(path: Path, *, episodes: Sequence[int] | None = None, **options: Any) -> FrameSource:
    if episodes is not None:
        raise ConfigError(f"--dataset.episodes works with raw LeRobot v3.0 datasets only: {path} is a roboscale lake, "
                          "whose episodes are chosen when it is built (build a lake of the episodes to train on)")
    try:
        from roboscale.data.lake.source import LakeSource
    except ImportError as e:
        raise DatasetError(path, f"is a roboscale lake, but roboscale.data.lake.source cannot be imported: {e}"
                           ) from None
    return LakeSource(path, **options)



OPENER = SourceOpener(LAKE_FORMAT, is_lake, open_lake)
