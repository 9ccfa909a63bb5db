"""Errors users see. Each names the file (or option) and what is wrong with it, so nobody reads a deep traceback."""

from __future__ import annotations

from pathlib import Path


class RoboscaleError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""


class ConfigError(RoboscaleError, ValueError):
    """A bad option value or config file."""


class DatasetError(RoboscaleError, ValueError):
    """A dataset file is missing, corrupt or inconsistent.

    ``DatasetError(path, "what is wrong", field="observation.state", episode=3)`` renders as
    ``<path>: episode 3: field 'observation.state': what is wrong``.
    """

    def __init__(self, path: str | Path, message: str, *, field: str | None = None, episode: int | None = None):
        self.path = Path(path)
        self.field = field
        self.episode = episode
        where = [str(path)]
        if episode is not None:
            where.append(f"episode {episode}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(": ".join(where) + f": {message}")


class CheckpointError(RoboscaleError, ValueError):
    """A checkpoint directory is missing files, is from another policy type or does not match its config."""

    def __init__(self, path: str | Path, message: str):
        self.path = Path(path)
        super().__init__(f"{path}: {message}")
