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
