"""The lake's on-disk layout: format name and versions, file and directory names (what the builder writes, what
``LakeSource`` and ``open_source`` recognise).

Format (``"format": "roboscale-lake"``, version 1)::

    OUT/manifest.json                 written last, atomically: the lake exists only when this file does
    OUT/episodes.parquet              lake episode -> source, source episode_index, shard, row offset, length
    OUT/tasks.parquet                 task_index, task [, token_ids when built with --tokenizer]
    OUT/shards/shard-00000/           one directory per shard, renamed into place when complete
        <camera>.npy                  uint8 [N, S, S, C] (HWC), plain .npy: memory-mapped by the reader
        columns.parquet               numeric columns (state, action, ..., index columns), uncompressed
        stats.safetensors             mergeable stats partials of this shard (moments, pixel histograms)
        shard.json                    fingerprint, episodes, file sizes and sha256
    OUT/.build-journal.json           every shard name a build of this lake may have left on disk: what a later
                                      build may remove (and nothing else), and how it knows a partial build is its own

Nothing here imports more than the standard library: the loader's source registry reads these names to recognise
a lake without loading the lake's code.
"""

from __future__ import annotations

LAKE_FORMAT = "roboscale-lake"
LAKE_VERSION = 1  # what the builder writes
SUPPORTED_VERSIONS = (1,)  # what the reader reads

MANIFEST = "manifest.json"
EPISODES_FILE = "episodes.parquet"
TASKS_FILE = "tasks.parquet"
SHARDS_DIR = "shards"
SHARD_META = "shard.json"
SHARD_COLUMNS = "columns.parquet"
SHARD_STATS = "stats.safetensors"
STAGING_DIR = ".staging"
LOCK_NAME = ".build.lock"  # held while a build writes the lake (see roboscale.data.lake.build.build_lock)
JOURNAL = ".build-journal.json"
JOURNAL_FORMAT = "roboscale-lake-build"


def unsafe_path(value: object) -> str | None:
    """Why ``value``, a path from a manifest or journal, could leave the directory it is joined to (None: it
    cannot). Lexical on purpose: an absolute path, an empty, ``.`` or ``..`` component are refused, while a symlink
    a user placed inside the lake keeps working."""
    if not isinstance(value, str) or not value:
        return f"expected a non-empty relative path, got {value!r}"
    if "\0" in value:
        return f"{value!r} holds a NUL byte"
    if value.startswith("/"):
        return f"{value!r} is an absolute path; paths in a lake are relative to it"
    if any(part in ("", ".", "..") for part in value.split("/")):
        return f"{value!r} has an empty, '.' or '..' component; paths in a lake stay inside it"
    return None
