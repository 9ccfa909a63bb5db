"""Atomic file and directory writes: write to a temporary name, fsync, rename.

A reader (or a resumed run) therefore sees either the old complete file or the new complete one, never a torn
write, even after ``kill -9``. Logs that grow by records (``.jsonl``) are appended one whole line per ``write``,
so a kill leaves at most a torn last line, which readers skip. Also what tells files apart: their identity (a
replaced file) and content hashes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def file_identity(path: str | Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime): changes when a file is replaced or rewritten, so a cache of open files can
    tell a repaired file from the one it opened (raises OSError when the file is gone)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class HashChecks:
    """Whether files match their expected sha256, hashed once per version of a file (``file_identity``) on this
    machine: remembered in this process (and the loader workers it starts) and, as an empty marker file per
    (path, version, expected hash), under ``directory`` (``$ROBOSCALE_CACHE_DIR``, else ``~/.cache/roboscale``,
    then ``verified/``) for every process and later run of this user. Without that, each loader worker of each
    rank hashed every file it read once per run: a host of 8 ranks x 8 workers read a whole lake 64 times before
    its first epoch ended. Processes that would hash the same file at once take turns (flock), so the second
    finds the first's marker. A version changes when a file is rewritten or replaced; bytes that decay in place
    keep theirs, which ``fresh=True`` (`roboscale lake verify`: hash again whatever is remembered) is for. Where
    the directory cannot be written, each process hashes for itself."""

    def __init__(self, directory: str | Path | None = None):
        if directory is None:
            base = os.environ.get("ROBOSCALE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                       "roboscale")
            directory = os.path.join(base, "verified")
        self.directory = Path(directory)
        self._known: dict[str, tuple[tuple[int, int, int, int], bool]] = {}

    def matches(self, path: str | Path, sha256: str, *, identity: tuple[int, int, int, int] | None = None,
                fresh: bool = False) -> bool:
        identity = identity or file_identity(path)
        known = None if fresh else self._known.get(str(path))
        if known is None or known[0] != identity:
            known = (identity, self._check(Path(path), identity, sha256, fresh))
            self._known[str(path)] = known
        return known[1]

    def _check(self, path: Path, identity: tuple[int, int, int, int], sha256: str, fresh: bool) -> bool:
        marker = self.directory / sha256_bytes(str(path.absolute()).encode(), repr(identity).encode(),
                                               sha256.encode())
        if marker.exists() and not fresh:
            return True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(self.directory / f".{marker.name[:2]}.lock", "a")
        except OSError:  # nowhere to share the result: this process hashes for itself
            return sha256_file(path) == sha256
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if marker.exists() and not fresh:  # another process hashed it while we waited
                return True
            matches = sha256_file(path) == sha256
            if matches:
                with contextlib.suppress(OSError):
                    marker.touch()
            else:
                marker.unlink(missing_ok=True)
        return matches


def sha256_bytes(*parts: bytes) -> str:
    """Hex sha256 of the concatenated ``parts``."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def fsync_dir(path: str | Path) -> None:
    """Persist a rename/creation inside ``path`` (POSIX needs the directory itself fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write to; on success fsync it and rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def load_json(data: str | bytes) -> Any:
    """``json.loads`` of what a file or a peer gave us. Nesting deeper than Python's parser recurses (a crafted
    100,000-deep array) is a ``json.JSONDecodeError``, the ValueError every reader already turns into its one-line
    error, instead of a RecursionError traceback."""
    try:
        return json.loads(data)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", "", 0) from None


def atomic_write_json(path: str | Path, obj: Any, indent: int = 4) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode())


def append_json_line(path: str | Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line, in one ``write``, and fsync: the line is there whole or (after a kill) torn at
    the end of the file, never interleaved with another."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json_lines(path: str | Path, repair: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a ``.jsonl`` file (none if it is missing), and how many lines were not one (a line torn
    by a kill, or being written right now, must not hide the rest). ``repair``: cut a torn last line off the file,
    so that the next append starts on a line of its own (only for the file's own writer)."""
    path = Path(path)
    if not path.is_file():
        return [], 0
    data = path.read_bytes()
    if repair and data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(data))
            os.fsync(f.fileno())
    records, bad = [], 0
    for line in data.decode(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = load_json(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


@contextmanager
def exclusive_lock(path: str | Path, refuse: Callable[[str], Exception]) -> Iterator[None]:
    """Hold an OS lock (flock) on ``path`` for the block; if another process holds it, raise ``refuse(holder)``
    (holder: "pid N on HOST"). The kernel releases the lock when the holder exits, even by ``kill -9``, so a
    crashed run never leaves a stale lock behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            raise refuse(handle.read().strip() or "another process") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
        handle.flush()
        try:
            yield
        finally:
            handle.truncate(0)


def make_temporary_directory(path: str | Path, suffix: str = ".tmp") -> tuple[Path, int]:
    """A hidden sibling ``.<name>.<random><suffix>`` of ``path`` to build it in, and an open descriptor that holds
    an exclusive lock on it until closed. The lock says "a live process is writing this": the kernel drops it when
    the process dies, even by ``kill -9``, so ``remove_stale_temporaries`` can tell abandoned temporaries from
    live ones (a pid file could be stale or reused)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent))
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return tmp, fd


def remove_stale_temporaries(directory: str | Path, names: Iterable[str]) -> list[Path]:
    """Remove the temporaries of the given ``names`` (``.<name>.*.tmp``/``.partial`` directories of
    ``make_temporary_directory``, and ``.<name>.old``) that no live process holds; returns what was removed.

    ``.<name>.old`` is what ``atomic_directory(overwrite=True)`` moved aside; if a kill came before the new
    directory took its place, the old one is put back instead of deleted."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for name in names:
        for tmp in sorted(directory.glob(f".{name}.*")):
            if tmp.name == f".{name}.old" and tmp.is_dir():
                if (directory / name).exists():
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp)
                else:
                    os.replace(tmp, directory / name)
                continue
            if tmp.is_dir() and not tmp.is_symlink() and tmp.suffix in (".tmp", ".partial") and _abandoned(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    return removed


def _abandoned(tmp: Path) -> bool:
    try:
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # the lock, if taken, goes with it: removal follows at once


@contextmanager
def atomic_directory(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it into place when the block succeeds.

    With ``overwrite`` an existing ``path`` is replaced (moved aside, then deleted after the rename), so there is
    never a moment without a complete directory at ``path``. A kill leaves only a hidden temporary, which
    ``remove_stale_temporaries`` recognizes as abandoned.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists")
    tmp, lock = make_temporary_directory(path)
    try:
        yield tmp
        for root, _, files in os.walk(tmp):
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
