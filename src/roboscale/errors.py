"""Errors users see. Each names the file (or option) and what is wrong with it, so nobody reads a deep traceback.

The command line prints every ``RoboscaleError`` as one line, ``error: <where>: <what>``, and exits with the
error's ``exit_code``: 2 for a bad option or config (usage), 1 for bad data or checkpoints. Python callers catch
the same types. Errors raised in worker processes (loader workers, Ray tasks, evaluation workers) travel back as
records (``to_record`` / ``from_record``) and are raised again with their type and message unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar


class RoboscaleError(Exception):
    """Base class: the CLI prints these as one line, without a traceback."""

    exit_code: ClassVar[int] = 1
    _types: ClassVar[dict[str, type[RoboscaleError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RoboscaleError._types[cls.__name__] = cls


class ConfigError(RoboscaleError, ValueError):
    """A bad option value or config file (a usage error: exit code 2)."""

    exit_code = 2


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


class TrainingError(RoboscaleError, RuntimeError):
    """Training cannot go on: losses that stay NaN/Inf, a rank that failed."""


class WorkerError(RoboscaleError, RuntimeError):
    """A worker process (an evaluation worker, a simulator) died or failed on something that is not the user's."""


def one_line(exc: BaseException) -> str:
    """The message on one printable line (library errors quoted inside ours carry newlines, and sometimes bytes
    of the damaged file)."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(exc)).split())


_ATTRIBUTES = ("path", "field", "episode")


def to_record(exc: RoboscaleError) -> dict[str, Any]:
    """A JSON-able record of an error, to cross a process boundary (pickling would lose custom constructors)."""
    record: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    for name in _ATTRIBUTES:
        value = getattr(exc, name, None)
        if value is not None:
            record[name] = str(value) if isinstance(value, Path) else value
    return record


def from_record(record: dict[str, Any]) -> RoboscaleError:
    """The error ``to_record`` described, with its type, message and attributes (unknown types: RoboscaleError)."""
    cls = RoboscaleError._types.get(record.get("type", ""), RoboscaleError)
    err = cls.__new__(cls)
    Exception.__init__(err, record["message"])  # already formatted: keep it as it was
    for name in _ATTRIBUTES:
        value = record.get(name)
        setattr(err, name, Path(value) if name == "path" and value is not None else value)
    return err
