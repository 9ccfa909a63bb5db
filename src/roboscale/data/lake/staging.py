"""Where a lake's sources live: local directories read in place, or remote datasets staged onto local disk.

Sources are local paths or URIs that ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://``, ``gs://``,
``hdfs://``, ``file://``). Remote sources are staged: ``meta/`` once on the driver (``stage_source``), then each
shard task copies just the data and video files of its episodes into ``OUT/.staging`` (``SourceHandle.stage``,
shared with other shards of that source).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from roboscale.errors import ConfigError, DatasetError
from roboscale.utils.io import sha256_bytes


@dataclass
class SourceHandle:
    """Where a source lives. ``local_root`` holds its files (all of them for a local source; ``meta/`` plus
    whatever shard tasks staged for a remote one)."""

    index: int
    uri: str
    local_root: Path
    filesystem: pafs.FileSystem | None = None  # None: local, read in place
    remote_path: str = ""

    def stage(self, relpaths: Sequence[str]) -> None:
        """Copy files from the remote filesystem into ``local_root`` unless an earlier build staged the same
        version (rsync's quick check: same size and modification time), atomically: other shard tasks of the
        same source may stage the same file concurrently."""
        if self.filesystem is None:
            return
        for rel in relpaths:
            dst = self.local_root / rel
            remote = f"{self.remote_path}/{rel}"
            try:
                info = self.filesystem.get_file_info(remote)
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{self.uri}/{rel}", f"cannot fetch: {e}") from None
            if info.type != pafs.FileType.File:
                raise DatasetError(f"{self.uri}/{rel}", "cannot fetch: no such file")
            if _staged_copy_is_current(dst, info):
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", dir=dst.parent)
            os.close(fd)
            try:
                pafs.copy_files(remote, tmp, source_filesystem=self.filesystem,
                                destination_filesystem=pafs.LocalFileSystem())
                if info.mtime_ns is not None:  # what the next build's quick check compares
                    os.utime(tmp, ns=(info.mtime_ns, info.mtime_ns))
                os.replace(tmp, dst)
            except (OSError, pa.ArrowException) as e:
                raise DatasetError(f"{self.uri}/{rel}", f"cannot fetch: {e}") from None
            finally:
                Path(tmp).unlink(missing_ok=True)


def _staged_copy_is_current(dst: Path, remote: pafs.FileInfo) -> bool:
    try:
        local = dst.stat()
    except FileNotFoundError:
        return False
    return local.st_size == remote.size and (remote.mtime_ns is None or local.st_mtime_ns == remote.mtime_ns)


def _locate(uri: str, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem | None, str]:
    """(None, the local path) for a local source, else (its filesystem, the path inside it)."""
    path = uri
    if filesystem is None:
        if "://" not in uri:
            return None, str(Path(uri).expanduser().resolve())
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        except (pa.ArrowException, ValueError) as e:
            raise ConfigError(f"source {uri!r}: cannot open through pyarrow.fs: {e}") from None
    return (None, path) if isinstance(filesystem, pafs.LocalFileSystem) else (filesystem, path)


def local_path(uri: str, filesystem: pafs.FileSystem | None = None) -> Path | None:
    """Where a local source lives on this machine (None for a remote one); resolved as ``stage_source`` does."""
    remote, path = _locate(uri, filesystem)
    return Path(path) if remote is None else None


def stage_source(uri: str, index: int, staging: Path, filesystem: pafs.FileSystem | None = None) -> SourceHandle:
    """Resolve ``uri`` through ``pyarrow.fs.FileSystem.from_uri`` (plain paths are local); stage ``meta/`` of a
    remote source. ``filesystem`` overrides the resolution (``uri`` is then a path inside it)."""
    filesystem, path = _locate(uri, filesystem)
    if filesystem is None:
        return SourceHandle(index, uri, Path(path))
    local = staging / f"source-{index:03d}-{sha256_bytes(uri.encode())[:12]}"
    handle = SourceHandle(index, uri, local, filesystem, path.rstrip("/"))
    # meta/ is fetched on every build (it is small, and decides the fingerprints), into a temporary name first
    local.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".meta.", dir=local))
    try:
        pafs.copy_files(f"{handle.remote_path}/meta", str(tmp), source_filesystem=filesystem,
                        destination_filesystem=pafs.LocalFileSystem())
        shutil.rmtree(local / "meta", ignore_errors=True)
        os.replace(tmp, local / "meta")
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"{uri}/meta", f"cannot fetch dataset metadata: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return handle
