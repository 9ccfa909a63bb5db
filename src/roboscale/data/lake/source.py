"""``LakeSource``: a ``FrameSource`` over a lake compiled by ``roboscale lake build`` (``roboscale.data.lake.build``).

No Ray here (nor anything outside numpy/pyarrow): the loader reads lakes without the ``lake`` extra.

Construction reads ``manifest.json`` (format and version checked), ``episodes.parquet`` and ``tasks.parquet`` (their
sha256 always checked: they are small) and nothing else, so the source is cheap to create and to pickle into
loader workers. A worker opens a shard on first use: the camera ``.npy`` files are memory-mapped (``np.load(...,
mmap_mode="r")``: pages come from the page cache, nothing is decoded) and ``columns.parquet`` is read into numpy.
At most ``max_open_shards`` shards are open per process (LRU), so resident memory does not grow with the lake.
Each opened file's size is checked against the manifest (catches truncation for free), and its sha256 when it is
first opened (``verify_on_open``, on by default: altered bytes of the same size would otherwise train silently).
A file is hashed once per version of it (``utils.io.file_identity``) on a machine, whatever the number of
processes and runs reading it (``utils.io.HashChecks``): a shard the LRU evicted costs a stat per file when it is
opened again. A mismatch is a ``DatasetError`` naming the file, which the loader reports, or skips the shard's
episodes with ``skip_bad_episodes``. A shard's float columns are checked for NaN/Inf when it is opened, as a raw
dataset's are before training (a writer's bug or a crafted lake keeps its checksums consistent). ``verify=True``
hashes every shard file again at construction and opens every shard (``roboscale lake verify``), and
``verify_checksums()`` hashes on demand. Every path made from the manifest is checked to
stay inside the lake (``format.unsafe_path``) when the manifest is read.
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
    unsafe_path,
)
from roboscale.data.lerobot.format import column_to_numpy
from roboscale.errors import DatasetError
from roboscale.utils.io import HashChecks, file_identity, load_json


class _OpenShard:
    def __init__(self, frames: dict[str, np.ndarray], columns: dict[str, np.ndarray]):
        self.frames = frames
        self.columns = columns


class LakeSource:
    """Episode-indexed reads from a lake directory (see ``roboscale.data.loading.source.FrameSource``).

    Episodes are the lake's (``episode_ids`` = 0..E-1 over all sources, in build order); ``provenance(i)`` says
    which source dataset and episode each came from. ``task_tokens`` holds the precomputed token ids per task
    when the lake was built with a tokenizer (else None). ``verify_on_open=False`` trusts shard bytes of the
    manifest's sizes without hashing them (see the module doc)."""

    def __init__(self, root: str | Path, *, verify: bool = False, verify_on_open: bool = True,
                 max_open_shards: int = 8):
        self.root = Path(root)
        self.max_open_shards = max(1, int(max_open_shards))
        self.verify_on_open = verify_on_open
        self._hashes = HashChecks()  # each file hashed once per version on this machine, not once per process
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
            self._check_file(self.root / name, record, checksum=True, fresh=True)  # small: every time
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
            self.verify_values()

    # ------------------------------------------------------------------ manifest

    def _read_manifest(self) -> dict[str, Any]:
        path = self.root / MANIFEST
        try:
            manifest = load_json(path.read_text())
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
        _check_paths(path, manifest)
        return manifest

    def _check_file(self, path: Path, record: Mapping[str, Any], checksum: bool, fresh: bool = False) -> None:
        try:
            identity = file_identity(path)
        except FileNotFoundError:
            raise DatasetError(path, f"lake file listed in {MANIFEST} not found") from None
        size = identity[2]
        if size != record["bytes"]:
            raise DatasetError(path, f"size {size} B differs from the manifest's {record['bytes']} B (truncated or "
                                     "rewritten); rebuild the shard with `roboscale lake build ... --repair`",
                               field="bytes")
        if checksum and not self._hashes.matches(path, record["sha256"], identity=identity, fresh=fresh):
            raise DatasetError(path, "sha256 differs from the manifest (corrupt file); rebuild the shard with "
                                     "`roboscale lake build ... --repair`", field="sha256")

    def verify_checksums(self) -> None:
        """Hash every shard file and compare with the manifest; the first mismatch raises, naming the file."""
        for shard in self._shards:  # on demand means now: nothing hashed earlier is taken on trust
            for name, record in shard["files"].items():
                self._check_file(self._shard_dir(shard) / name, record, checksum=True, fresh=True)

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
        # every shard was decoded and checked when the lake was built; each is hashed when first opened
        # (verify_on_open), not here: up front, that would read the whole lake before the first batch
        return {}

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
        base = self._shard_dir(meta)
        for name, record in meta["files"].items():
            self._check_file(base / name, record, checksum=self.verify_on_open)
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
        self._check_finite(index, base / SHARD_COLUMNS, columns)
        shard = _OpenShard(frames, columns)
        self._open_shards[index] = shard
        while len(self._open_shards) > self.max_open_shards:
            self._open_shards.popitem(last=False)  # dropping the memmap unmaps it
        return shard

    def _check_finite(self, index: int, path: Path, columns: Mapping[str, np.ndarray]) -> None:
        """NaN or Inf in a shard's float columns (a writer's bug or a crafted lake whose checksums agree) is a
        DatasetError naming the file, the field and the lake episodes, as a raw dataset's is before training; a few
        microseconds per shard next to reading it (docs/benchmarks.md)."""
        starts = self._episodes["offset"].astype(np.int64)
        lengths = self._episodes["length"].astype(np.int64)
        mine = np.flatnonzero(self._episodes["shard"] == index)
        for key, values in columns.items():
            if values.dtype.kind != "f":
                continue
            bad = ~np.isfinite(values.reshape(len(values), -1)).all(axis=1)
            if not bad.any():
                continue
            episodes = [int(e) for e in mine if bad[starts[e]:starts[e] + lengths[e]].any()]
            raise DatasetError(path, f"{int(bad.sum())} rows with NaN or Inf (lake episodes {episodes}): a lake is "
                                     "checked for them only when a shard is opened; rebuild it from the source "
                                     "datasets, which `data validate` checks", field=key)

    def verify_values(self) -> None:
        """Open every shard once: its float columns checked for NaN/Inf (``roboscale lake verify``)."""
        for index in range(len(self._shards)):
            self._open(index)
            self._open_shards.pop(index, None)

    def _shard_dir(self, meta: Mapping[str, Any]) -> Path:
        return self.root / SHARDS_DIR / meta["name"]


def _check_paths(manifest_path: Path, manifest: Mapping[str, Any]) -> None:
    """Every path this reader makes from the manifest stays inside the lake: a shard named ``../../x`` would read
    (and verify) files elsewhere. One-line errors naming the manifest's field."""
    for key, kind in (("tables", dict), ("camera_keys", list), ("shards", list)):
        if not isinstance(manifest[key], kind):
            raise DatasetError(manifest_path, f"expected a JSON {'object' if kind is dict else 'list'}", field=key)
    names: list[tuple[str, object]] = [("tables", name) for name in manifest["tables"]]
    names += [("camera_keys", key) for key in manifest["camera_keys"]]  # -> shards/NAME/<key>.npy
    for i, shard in enumerate(manifest["shards"]):
        if not isinstance(shard, dict) or not isinstance(shard.get("files"), dict):
            raise DatasetError(manifest_path, "expected an object with 'name' and 'files'", field=f"shards[{i}]")
        names.append((f"shards[{i}].name", shard.get("name")))
        names += [(f"shards[{i}].files", name) for name in shard["files"]]
    for field, name in names:
        problem = unsafe_path(name)
        if problem is not None:
            raise DatasetError(manifest_path, problem, field=field)
