"""What a lake build may touch: the output it may write into, and the shards it may delete.

A build rewrites ``manifest.json`` and the tables and deletes shards its plan no longer has, so it writes only
into a directory it can tell is its own: a new or empty one, a lake (a ``roboscale-lake`` manifest), or a partial
build of one (the journal, ``format.JOURNAL``), and never into or around a source dataset. The journal lists
every shard name a build of this lake may have left on disk; it is written before the first shard task starts
(so a killed build's rerun knows the directory and its shards) and kept afterwards. A shard is deleted only when
the journal or the manifest lists it and its own shard.json names it: a directory a user put under ``shards/``
is never deleted, whatever its name.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from roboscale.data.lake.format import (
    JOURNAL,
    JOURNAL_FORMAT,
    LAKE_FORMAT,
    LOCK_NAME,
    MANIFEST,
    SHARDS_DIR,
    STAGING_DIR,
    unsafe_path,
)
from roboscale.data.lake.manifest import read_shard_meta
from roboscale.errors import ConfigError
from roboscale.utils.io import atomic_write_json, load_json, remove_stale_temporaries

log = logging.getLogger(__name__)

_BUILD_FILES = (LOCK_NAME, STAGING_DIR)  # what a build may create before its journal exists


def check_output(out: Path, sources: Sequence[Path]) -> None:
    """Refuse an ``--output`` that overlaps a local source, or that holds files no lake build wrote."""
    _refuse_overlap(out, sources)
    _refuse_foreign(out)


def _refuse_overlap(out: Path, sources: Sequence[Path]) -> None:
    for source in sources:
        real = source.resolve()
        if out == real or out.is_relative_to(real):
            raise ConfigError(f"--output {out} is {'' if out == real else 'inside '}the source dataset {source}: a "
                              "lake build writes and deletes files there; build into a directory outside every source")
        if real.is_relative_to(out):
            raise ConfigError(f"source {source} is inside --output {out}: a lake build rewrites and deletes files "
                              "there; build into a directory that holds no source")


def _refuse_foreign(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--output {out}: exists and is not a directory")
    manifest = out / MANIFEST
    if manifest.exists() and _read(manifest, LAKE_FORMAT) is None:
        raise ConfigError(f"--output {out}: {MANIFEST} there is not a roboscale lake's, and a build would replace it; "
                          "move it away, or build into a new or empty directory")
    if manifest.exists() or _read(out / JOURNAL, JOURNAL_FORMAT) is not None:
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _BUILD_FILES)
    if foreign:
        raise ConfigError(f"--output {out}: not empty ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
                          f" and neither a roboscale lake ({MANIFEST}) nor a partial build of one ({JOURNAL}); a "
                          "build rewrites and deletes files there: build into a new or empty directory")


def record_shards(out: Path, names: Iterable[str]) -> None:
    """Journal ``names`` and every shard name recorded before (atomically): what the next build may remove."""
    atomic_write_json(out / JOURNAL, {"format": JOURNAL_FORMAT, "shards": sorted(set(names) | _recorded(out))})


def forget_shards(out: Path, keep: Iterable[str]) -> None:
    """After a finished build: only ``keep`` (the manifest's shards) is left of what the journal listed."""
    atomic_write_json(out / JOURNAL, {"format": JOURNAL_FORMAT, "shards": sorted(keep)})


def remove_abandoned_temporaries(out: Path, names: Iterable[str]) -> None:
    """What killed shard tasks left (``.shard-NNNNN.*.tmp``, ``.shard-NNNNN.old``) for ``names`` and every shard
    name recorded before; a live task's temporary (its lock held) is kept."""
    remove_stale_temporaries(out / SHARDS_DIR, set(names) | _recorded(out))


def remove_stale_shards(out: Path, keep: set[str]) -> None:
    """Shards of an earlier plan that this one no longer has (fewer episodes, another shard size): those the
    journal or the manifest lists, whose shard.json says they are that shard."""
    for name in sorted(_recorded(out) - keep):
        path = out / SHARDS_DIR / name
        meta = read_shard_meta(path)
        if path.is_symlink() or meta is None or meta.get("name") != name:
            continue  # not provably a shard we wrote (or already gone)
        log.info("%s: not in the new plan; removing it", path)
        shutil.rmtree(path)


def _recorded(out: Path) -> set[str]:
    """Shard names the journal and the manifest list: single, lexically safe names only (a listed ``../x`` or
    ``.`` must not lead a build to delete anything outside ``shards/``)."""
    names = []
    for path, fmt in ((out / JOURNAL, JOURNAL_FORMAT), (out / MANIFEST, LAKE_FORMAT)):
        record = _read(path, fmt) or {}
        shards = record.get("shards")
        if isinstance(shards, list):
            names += [s.get("name") if isinstance(s, dict) else s for s in shards]
    return {n for n in names if unsafe_path(n) is None and "/" not in n}


def _read(path: Path, fmt: str) -> dict[str, Any] | None:
    """The JSON object at ``path`` if it is a record of format ``fmt`` (else None: missing, unreadable, other)."""
    try:
        record = load_json(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == fmt else None
