"""``LakeSource``: a ``FrameSource`` over a lake compiled by ``roboscale lake build`` (``roboscale.data.lake.build``).

No Ray here (nor anything outside numpy/pyarrow): the loader reads lakes without the ``lake`` extra.

Construction reads ``manifest.json`` (format and version checked), ``episodes.parquet`` and ``tasks.parquet`` (their
sha256 always checked: they are small) and nothing else, so the source is cheap to create and to pickle into
loader workers. A worker opens a shard on first use: the camera ``.npy`` files are memory-mapped (``np.load(...,
mmap_mode="r")``: pages come from the page cache, nothing is decoded) and ``columns.parquet`` is read into numpy.
At most ``max_open_shards`` shards are open per process (LRU), so resident memory does not grow with the lake.
Each opened file's size is checked against the manifest (catches truncation for free); ``verify=True``
additionally hashes every shard file (sha256) at construction, and ``verify_checksums()`` does it on demand.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from roboscale.data.lake.format import (
    EPISODES_FILE,
    LAKE_FORMAT,
    MANIFEST,
    SHARD_COLUMNS,
    SHARDS_DIR,
    SUPPORTED_VERSIONS,
    TASKS_FILE,
)
from roboscale.data.lerobot.format import column_to_numpy
from roboscale.errors import DatasetError
from roboscale.utils.io import sha256_file


class _OpenShard:
    def __init__(self, frames: dict[str, np.ndarray], columns: dict[str, np.ndarray]):
        self.frames = frames
        self.columns = columns


class LakeSource:
    """Episode-indexed reads from a lake directory (see ``roboscale.data.loading.source.FrameSource``).

    Episodes are the lake's (``episode_ids`` = 0..E-1 over all sources, in build order); ``provenance(i)`` says
    which source dataset and episode each came from. ``task_tokens`` holds the precomputed token ids per task
    when the lake was built with a tokenizer (else None)."""

    def __init__(self, root: str | Path, *, verify: bool = False, max_open_shards: int = 8):
        self.root = Path(root)
        self.max_open_shards = max(1, int(max_open_shards))
        self.manifest = self._read_manifest()
        m = self.manifest
        self.features: dict[str, dict[str, Any]] = m["features"]
        self.fps = float(m["fps"])
        self.camera_keys: list[str] = list(m["camera_keys"])
        self.numeric_keys: list[str] = list(m["numeric_keys"])
        self.stats: dict[str, dict[str, np.ndarray]] | None = {
            k: {s: np.atleast_1d(np.asarray(v)) for s, v in st.items()} for k, st in m["stats"].items()
        } or None
        self.quantile_error = {k: np.asarray(v) for k, v in m.get("stats_quantile_error", {}).items()}
        for name, record in m["tables"].items():
            self._check_file(self.root / name, record, checksum=True)
        episodes = pq.read_table(self.root / EPISODES_FILE)
        self._episodes = {name: episodes[name].to_numpy() for name in episodes.column_names}
        tasks = pq.read_table(self.root / TASKS_FILE)
        self.tasks: list[str] = tasks["task"].to_pylist()
        self.task_tokens: list[np.ndarray] | None = (
            [np.asarray(t, dtype=np.int64) for t in tasks["token_ids"].to_pylist()]
            if "token_ids" in tasks.column_names else None
        )
        self._shards: list[dict[str, Any]] = m["shards"]
        if len(self._episodes["episode_index"]) != m["total_episodes"]:
            raise DatasetError(self.root / EPISODES_FILE, f"has {len(self._episodes['episode_index'])} rows, "
                               f"the manifest says {m['total_episodes']} episodes", field="total_episodes")
        self._reset_handles()
        if verify:
            self.verify_checksums()

    # ------------------------------------------------------------------ manifest

    def _read_manifest(self) -> dict[str, Any]:
        path = self.root / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            raise DatasetError(path, "not found: not a lake, or its build has not finished "
                                     "(rerun `roboscale lake build` to resume it)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DatasetError(path, f"cannot read JSON: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != LAKE_FORMAT:
            got = manifest.get("format") if isinstance(manifest, dict) else None
            raise DatasetError(path, f"expected {LAKE_FORMAT!r}, got {got!r}", field="format")
        if manifest.get("version") not in SUPPORTED_VERSIONS:
            raise DatasetError(path, f"lake version {manifest.get('version')!r} is not supported by this reader "
                                     f"(supports {list(SUPPORTED_VERSIONS)}); rebuild the lake", field="version")
        for key in ("features", "fps", "camera_keys", "numeric_keys", "shards", "tables", "stats", "total_episodes"):
            if key not in manifest:
                raise DatasetError(path, "missing", field=key)
        return manifest

    def _check_file(self, path: Path, record: Mapping[str, Any], checksum: bool) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DatasetError(path, f"lake file listed in {MANIFEST} not found") from None
        if size != record["bytes"]:
            raise DatasetError(path, f"size {size} B differs from the manifest's {record['bytes']} B (truncated or "
                                     "rewritten); rebuild this shard with `roboscale lake build`", field="bytes")
        if checksum and sha256_file(path) != record["sha256"]:
            raise DatasetError(path, "sha256 differs from the manifest (corrupt file); delete the shard and rerun "
                                     "`roboscale lake build` to rebuild it", field="sha256")

    def verify_checksums(self) -> None:
        """Hash every shard file and compare with the manifest; the first mismatch raises, naming the file."""
        for shard in self._shards:
            for name, record in shard["files"].items():
                self._check_file(self.root / SHARDS_DIR / shard["name"] / name, record, checksum=True)

    # ------------------------------------------------------------------ FrameSource

    @property
    def episode_ids(self) -> np.ndarray:
        return self._episodes["episode_index"].astype(np.int64)

    @property
    def episode_lengths(self) -> np.ndarray:
        return self._episodes["length"].astype(np.int64)

    @property
    def sources(self) -> list[dict[str, Any]]:
        return self.manifest["sources"]

    def provenance(self, episode: int) -> tuple[str, int]:
        """(source URI, the source dataset's episode_index) of lake episode position ``episode``."""
        return (self.sources[int(self._episodes["source"][episode])]["uri"],
                int(self._episodes["source_episode_index"][episode]))

    def __len__(self) -> int:
        return int(self.episode_lengths.sum())

    def __repr__(self) -> str:
        return f"LakeSource({str(self.root)!r}, episodes={len(self.episode_ids)}, shards={len(self._shards)})"

    def read(self, episode: int, frames: np.ndarray, keys: Sequence[str]) -> dict[str, np.ndarray]:
        self._check_fork()
        frames = np.asarray(frames, dtype=np.int64)
        n = int(self._episodes["length"][episode])
        if frames.size and (frames[0] < 0 or frames[-1] >= n or np.any(np.diff(frames) < 0)):
            raise ValueError(f"{self.root}: episode {episode}: frames must be sorted within [0, {n})")
        unknown = [k for k in keys if k not in self.features]
        if unknown:
            raise KeyError(f"{unknown[0]!r} is not a feature of lake {self.root}; features: {list(self.features)}")
        shard = self._open(int(self._episodes["shard"][episode]))
        rows = int(self._episodes["offset"][episode]) + frames
        out: dict[str, np.ndarray] = {}
        for key in keys:
            if key in shard.frames:
                out[key] = np.ascontiguousarray(shard.frames[key][rows])  # copies out of the page cache
            else:
                out[key] = shard.columns[key][rows]
        return out

    def unreadable_episodes(self) -> dict[int, str]:
        return {}  # every shard was decoded and checked when the lake was built; `lake verify` re-hashes them

    def close(self) -> None:
        self._reset_handles()

    # ------------------------------------------------------------------ shards

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open_shards"] = OrderedDict()
        return state

    def _reset_handles(self) -> None:
        self._open_shards: OrderedDict[int, _OpenShard] = OrderedDict()
        self._pid = os.getpid()

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked worker maps its own shards
            self._reset_handles()

    def _open(self, index: int) -> _OpenShard:
        shard = self._open_shards.get(index)
        if shard is not None:
            self._open_shards.move_to_end(index)
            return shard
        meta = self._shards[index]
        base = self.root / SHARDS_DIR / meta["name"]
        for name, record in meta["files"].items():
            self._check_file(base / name, record, checksum=False)
        frames = {}
        for key in self.camera_keys:
            path = base / f"{key}.npy"
            try:
                frames[key] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:
                raise DatasetError(path, f"cannot memory-map: {e}", field=key) from None
        try:
            table = pq.read_table(base / SHARD_COLUMNS)
        except (OSError, pa.ArrowException) as e:
            raise DatasetError(base / SHARD_COLUMNS, f"cannot read parquet: {e}") from None
        columns = {k: column_to_numpy(table[k], self.features[k], base / SHARD_COLUMNS, k) for k in self.numeric_keys}
        shard = _OpenShard(frames, columns)
        self._open_shards[index] = shard
        while len(self._open_shards) > self.max_open_shards:
            self._open_shards.popitem(last=False)  # dropping the memmap unmaps it
        return shard
