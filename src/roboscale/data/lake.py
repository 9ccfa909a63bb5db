"""``roboscale lake build``: compile LeRobot v3.0 datasets into training-ready shards with Ray Data.

Why a lake. The loader's budget is >= 1,000 samples/s per CPU core with two 224² cameras, i.e. ~0.5 ms per
camera frame. Decoding AV1/H.264 (~1 ms per small frame, more at 224², plus GOP seeks) or even PNG/JPEG at that
resolution (~1-3 ms) cannot meet it, so the lake decodes every frame **once**, at build time, and stores it in the
form the model consumes.

Format (``"format": "roboscale-lake"``, version 1)::

    OUT/manifest.json                 written last, atomically: the lake exists only when this file does
    OUT/episodes.parquet              lake episode -> source, source episode_index, shard, row offset, length
    OUT/tasks.parquet                 task_index, task [, token_ids when built with --tokenizer]
    OUT/shards/shard-00000/           one directory per shard, renamed into place when complete
        <camera>.npy                  uint8 [N, S, S, C] (HWC), plain .npy: memory-mapped by the reader
        columns.parquet               numeric columns (state, action, ..., index columns), uncompressed
        stats.safetensors             mergeable stats partials of this shard (moments, pixel histograms)
        shard.json                    fingerprint, episodes, file sizes and sha256

- Frames: raw uint8 arrays in ``.npy`` files. ``np.load(mmap_mode="r")`` maps them; reading frame ``i`` is a
  copy of ``S*S*C`` contiguous bytes from the page cache (~10 µs at 224²), no decoder, no per-frame object.
  The cost is disk: 150 KB per camera frame at 224² (about 10-30× an AV1 file). That is the trade: disk is
  cheap and scales, CPU per sample does not. Cameras are resized to ``image_size`` (aspect kept, padded with
  black by default; ``--resize stretch`` to fill) with torch's antialiased bilinear filter; ``image_size=0``
  keeps the native resolution (frames then equal the decoded frames exactly).
- Numeric columns: parquet without compression, read whole per shard when a reader first touches the shard
  (they are ~1% of a shard's bytes), so a window is a numpy slice.
- Shards hold whole, consecutive episodes of one source (``shard_frames`` frames each, an episode is never
  split), so an action window ``[t, t+T)`` clamped to its episode is one contiguous slice of a shard's column.
  That is why windows are **not** materialized (that would cost T× the action storage and save nothing).

Precomputed: decoded and resized frames; lake-global ``episode_index``/``index``/``task_index`` (tasks of all
sources merged by string, in first-seen order); task -> token ids when ``tokenizer`` (a ``tokenizer.json``) is
given (fixed per tokenizer, so the loader never tokenizes); the episode -> (shard, offset) table; global stats.

Global stats (``manifest["stats"]``, LeRobot layout): computed in parallel and merged exactly, see
``roboscale.data.stats``. Pass 1 (inside the shard tasks) records per-shard ``Moments`` (count/mean/M2/min/max,
merged on the driver in shard order with Chan et al.'s formula: exact, reproducible) and exact 256-bin pixel
histograms per camera channel. Pass 2 (Ray tasks over groups of shards, reading only ``columns.parquet``: no
frames) fills per-dimension histograms of ``stats_bins`` bins over the global [min, max] from pass 1; their sum
gives q01..q99 within ``(max - min) / stats_bins`` of ``numpy.quantile`` of the pooled data
(``manifest["stats_quantile_error"]``). Camera stats are over every pixel of
the resized image (not the padding) and exact. LeRobot's ``stats.json`` quantiles are an envelope of per-episode
quantiles, not quantiles of the dataset; the lake's are real quantiles.

Elastic and restartable: shards are Ray Data tasks with fractional CPUs (``cpus_per_task``, 0.5 by default so a
2-core machine runs four at a time and the driver is never starved) on a local Ray that listens on 127.0.0.1 only
(``_ensure_ray``) or an existing cluster (``ray_address``; the workers need roboscale installed and the output on a
shared filesystem). A shard is built under a temporary name, fsynced and renamed; its ``shard.json`` carries a
fingerprint of everything it depends on (source metadata hash, episodes, lake index offsets, task mapping, image
settings). A rebuild skips every shard whose fingerprint matches, so a killed build resumes where it stopped, and
appending a source reuses every shard of the sources before it. The manifest is removed when anything must be
rebuilt and written last.

Sources are local paths or URIs that ``pyarrow.fs.FileSystem.from_uri`` understands (``s3://``, ``gs://``,
``hdfs://``, ``file://``). Remote sources are staged: ``meta/`` once on the driver, then each shard task copies
just the data and video files of its episodes into ``OUT/.staging`` (shared with other shards of that source).
Each source is validated before anything is built (``LeRobotDatasetMetadata``; every referenced file exists;
``roboscale.data.validate``'s quick check when that module is present); sources must share fps and features.
Shard tasks read a source through the loader's raw ``FrameSource`` (``roboscale.data.source.open_source``), so the
lake holds exactly what the loader would have decoded. A shard whose episode fails (a torn video) is reported by
file, episode and field after the other shards have finished, and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from safetensors.numpy import load_file as load_safetensors
from safetensors.numpy import save as safetensors_bytes
from safetensors.numpy import save_file as save_safetensors

from roboscale.data import lerobot_format as fmt
from roboscale.data.stats import ByteHistogram, Histogram, Moments, finalize_numeric, merge_moments
from roboscale.errors import ConfigError, DatasetError, from_record, to_record
from roboscale.utils.images import RESIZE_MODES, fitted_size, resize_with_pad
from roboscale.utils.io import atomic_write_bytes, atomic_write_json, exclusive_lock, fsync_dir

log = logging.getLogger(__name__)

LAKE_FORMAT = "roboscale-lake"
LAKE_VERSION = 1
MANIFEST = "manifest.json"
EPISODES_FILE = "episodes.parquet"
TASKS_FILE = "tasks.parquet"
SHARDS_DIR = "shards"
SHARD_META = "shard.json"
SHARD_COLUMNS = "columns.parquet"
SHARD_STATS = "stats.safetensors"
STAGING_DIR = ".staging"
LOCK_NAME = ".build.lock"  # held while a build writes the lake (see build_lock)
_RESIZE_CHUNK = 64  # frames per resize call: bounds the temporary buffers


@dataclass
class LakeConfig:
    """Compile LeRobot v3.0 datasets into training-ready shards with Ray Data (resumable)."""

    sources: list[str] = field(default_factory=list)
    """LeRobot v3.0 dataset roots: local paths or pyarrow filesystem URIs (s3://bucket/ds, file:///data/ds)."""
    output: str = ""
    """Lake directory (local or a shared filesystem mounted on every Ray node)."""
    image_size: int = 224
    """Square side of every camera in the shards; 0 keeps each camera's native resolution."""
    resize: str = "pad"
    """pad: keep the aspect ratio and pad with black (pi0's resize_with_pad); stretch: fill the square."""
    shard_frames: int = 2048
    """Target frames per shard (whole episodes; ~300 MB per shard with two 224² cameras)."""
    ray_address: str | None = None
    """Connect to this Ray cluster (ray.init(address=...)); default: a local Ray on this machine."""
    num_cpus: int | None = None
    """CPUs of the local Ray instance (default: all)."""
    cpus_per_task: float = 0.5
    """Ray CPUs per shard task; fractional so that Ray Data's scheduler and the driver are not starved."""
    stats_bins: int = 4096
    """Histogram bins per dimension for the quantiles: error <= (max - min) / stats_bins."""
    tokenizer: str | None = None
    """tokenizer.json whose token ids for every task are precomputed into tasks.parquet."""
    validate: bool = True
    """Run roboscale.data.validate's quick check on each local source before building (when available)."""
    repair: bool = False
    """Hash the files of already-built shards and rebuild those that differ from their shard.json (bit rot, a
    partial copy); without it a finished shard is trusted by its fingerprint."""

    def check(self) -> None:
        if not self.sources:
            raise ConfigError("lake build needs at least one source dataset: roboscale lake build SRC... --output DIR")
        if not self.output:
            raise ConfigError("lake build needs --output DIR")
        if self.image_size < 0:
            raise ConfigError(f"--image-size must be >= 0, got {self.image_size}")
        if self.resize not in RESIZE_MODES:
            raise ConfigError(f"--resize must be one of {list(RESIZE_MODES)}, got {self.resize!r}")
        if self.shard_frames < 1:
            raise ConfigError(f"--shard-frames must be >= 1, got {self.shard_frames}")
        if not 0 < self.cpus_per_task:
            raise ConfigError(f"--cpus-per-task must be > 0, got {self.cpus_per_task}")
        if self.stats_bins < 1:
            raise ConfigError(f"--stats-bins must be >= 1, got {self.stats_bins}")


@dataclass
class BuildReport:
    output: Path
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    episodes: int = 0
    frames: int = 0
    seconds: float = 0.0


# --------------------------------------------------------------------------------------------------- files


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _sha256_bytes(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------------- sources


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


def open_source(uri: str, index: int, staging: Path, filesystem: pafs.FileSystem | None = None) -> SourceHandle:
    """Resolve ``uri`` through ``pyarrow.fs.FileSystem.from_uri`` (plain paths are local); stage ``meta/`` of a
    remote source. ``filesystem`` overrides the resolution (``uri`` is then a path inside it)."""
    if filesystem is None:
        if "://" not in uri:
            return SourceHandle(index, uri, Path(uri).expanduser().resolve())
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        except (pa.ArrowException, ValueError) as e:
            raise ConfigError(f"source {uri!r}: cannot open through pyarrow.fs: {e}") from None
    else:
        path = uri
    if isinstance(filesystem, pafs.LocalFileSystem):
        return SourceHandle(index, uri, Path(path))
    local = staging / f"source-{index:03d}-{_sha256_bytes(uri.encode())[:12]}"
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


@dataclass
class SourcePlan:
    """A validated source: metadata, content hashes, task mapping into the lake's task list."""

    handle: SourceHandle
    info: fmt.DatasetInfo
    episode_ids: np.ndarray
    lengths: np.ndarray
    info_sha256: str
    meta_sha256: str
    task_map: list[int]  # source task_index -> lake task_index
    first_episode: int  # lake episode index of this source's first episode
    first_index: int  # lake global frame index of this source's first frame


def _meta_hash(root: Path) -> tuple[str, str]:
    """sha256 of info.json, and of info.json + tasks + every meta/episodes file (what the shards depend on)."""
    info = (root / fmt.INFO_PATH).read_bytes()
    parts = [info, (root / fmt.TASKS_PATH).read_bytes()] + [p.read_bytes() for p in fmt.episodes_files(root)]
    return _sha256_bytes(info), _sha256_bytes(*parts)


def _referenced_files(meta: Any, episodes: Sequence[int]) -> list[str]:
    """Data and video files (relative paths) holding ``episodes``."""
    out: dict[str, None] = {}
    for ep in episodes:
        out[str(meta.data_path(ep).relative_to(meta.root))] = None
        for key in meta.video_keys:
            out[str(meta.video_path(ep, key).relative_to(meta.root))] = None
    return list(out)


def _quick_validate(root: Path) -> None:
    """The gate every reader of training data passes (``roboscale.data.validate``): refuse a source with problems."""
    from roboscale.data.validate import bad_episodes, readable_or_raise

    bad = bad_episodes(root)
    readable_or_raise(root, bad, len(fmt.read_episodes_table(root)), skip_bad_episodes=False)


def _check_compatible(first: SourcePlan, other: SourcePlan, cameras: list[str], numeric: list[str],
                      native: bool) -> None:
    path = other.handle.local_root / fmt.INFO_PATH
    if other.info.fps != first.info.fps:
        raise DatasetError(path, f"fps {other.info.fps} differs from {first.handle.uri}'s {first.info.fps}",
                           field="fps")
    feats, ref = other.info.features, first.info.features
    other_cams = [k for k, f in feats.items() if fmt.is_camera(f)]
    if sorted(other_cams) != sorted(cameras):
        raise DatasetError(path, f"cameras {other_cams} differ from {first.handle.uri}'s {cameras}",
                           field="features")
    for key in numeric:
        if key not in feats:
            raise DatasetError(path, f"missing (present in {first.handle.uri})", field=key)
        if feats[key]["dtype"] != ref[key]["dtype"] or list(feats[key]["shape"]) != list(ref[key]["shape"]):
            raise DatasetError(path, f"dtype/shape {feats[key]['dtype']}{list(feats[key]['shape'])} differs from "
                                     f"{ref[key]['dtype']}{list(ref[key]['shape'])} in {first.handle.uri}", field=key)
    if native:
        for key in cameras:
            if fmt.image_hwc(feats[key]) != fmt.image_hwc(ref[key]):
                raise DatasetError(path, f"resolution {fmt.image_hwc(feats[key])} differs from "
                                         f"{fmt.image_hwc(ref[key])}; use --image-size to resize", field=key)


def plan_sources(cfg: LakeConfig, staging: Path,
                 filesystems: Sequence[pafs.FileSystem | None] | None = None) -> tuple[list[SourcePlan], list[str]]:
    """Open and validate every source; merge their task lists (by string, first-seen order)."""
    from roboscale.data.reader import LeRobotDatasetMetadata

    plans: list[SourcePlan] = []
    tasks: list[str] = []
    task_index: dict[str, int] = {}
    episode, index = 0, 0
    for i, uri in enumerate(cfg.sources):
        handle = open_source(uri, i, staging, filesystems[i] if filesystems else None)
        meta = LeRobotDatasetMetadata(handle.local_root)
        if handle.filesystem is None:
            if cfg.validate:
                _quick_validate(handle.local_root)
            for rel in _referenced_files(meta, [int(e) for e in meta.episodes["episode_index"]]):
                if not (handle.local_root / rel).is_file():
                    raise DatasetError(handle.local_root / rel, "file referenced by meta/episodes not found")
        ids = np.asarray(meta.episodes["episode_index"], dtype=np.int64)
        lengths = np.asarray(meta.episodes["length"], dtype=np.int64)
        if np.any(lengths <= 0):
            bad = int(ids[np.flatnonzero(lengths <= 0)[0]])
            raise DatasetError(handle.local_root / fmt.EPISODES_DIR, "episode has no frames", episode=bad,
                               field="length")
        mapping = [task_index.setdefault(t, len(task_index)) for t in meta.task_list]
        tasks += [t for t in meta.task_list if t not in tasks]
        info_sha, meta_sha = _meta_hash(handle.local_root)
        plans.append(SourcePlan(handle, meta.info, ids, lengths, info_sha, meta_sha, mapping, episode, index))
        episode += len(ids)
        index += int(lengths.sum())
    return plans, tasks


def lake_features(plans: Sequence[SourcePlan], cfg: LakeConfig) -> tuple[dict[str, dict[str, Any]], list[str],
                                                                          list[str]]:
    """The lake's feature schema (cameras at the lake resolution, HWC), camera keys and numeric keys."""
    first = plans[0].info.features
    cameras = [k for k, f in first.items() if fmt.is_camera(f)]
    numeric = [k for k, f in first.items() if not fmt.is_camera(f) and f["dtype"] != "string"]
    for plan in plans[1:]:
        _check_compatible(plans[0], plan, cameras, numeric, cfg.image_size == 0)
    features: dict[str, dict[str, Any]] = {}
    for key, ft in first.items():
        if fmt.is_camera(ft):
            h, w, c = fmt.image_hwc(ft)
            side = (h, w) if cfg.image_size == 0 else (cfg.image_size, cfg.image_size)
            features[key] = {"dtype": ft["dtype"], "shape": [*side, c], "names": ["height", "width", "channels"],
                             "info": {"lake.resize": "none" if cfg.image_size == 0 else cfg.resize}}
        elif key in numeric:
            features[key] = json.loads(json.dumps(ft))
    return features, cameras, numeric


# --------------------------------------------------------------------------------------------------- shard plan


@dataclass(frozen=True)
class ShardSpec:
    shard: int
    source: int
    episodes: tuple[int, ...]  # source episode_index values
    lengths: tuple[int, ...]
    first_episode: int  # lake episode index of episodes[0]
    first_index: int  # lake global index of the shard's first frame
    fingerprint: str

    @property
    def name(self) -> str:
        return f"shard-{self.shard:05d}"

    @property
    def num_frames(self) -> int:
        return int(sum(self.lengths))


def plan_shards(plans: Sequence[SourcePlan], cfg: LakeConfig, cameras: list[str], numeric: list[str]
                ) -> list[ShardSpec]:
    """Consecutive whole episodes of one source per shard, about ``shard_frames`` frames each."""
    settings = {"version": LAKE_VERSION, "image_size": cfg.image_size, "resize": cfg.resize, "cameras": cameras,
                "numeric": numeric}
    specs: list[ShardSpec] = []
    for plan in plans:
        start = 0
        episode, index = plan.first_episode, plan.first_index
        while start < len(plan.episode_ids):
            stop, frames = start, 0
            while stop < len(plan.episode_ids) and (stop == start or frames + plan.lengths[stop] <= cfg.shard_frames):
                frames += int(plan.lengths[stop])
                stop += 1
            eps = tuple(int(e) for e in plan.episode_ids[start:stop])
            lengths = tuple(int(n) for n in plan.lengths[start:stop])
            key = json.dumps({**settings, "source_meta": plan.meta_sha256, "episodes": eps, "lengths": lengths,
                              "first_episode": episode, "first_index": index, "tasks": plan.task_map},
                             sort_keys=True)
            specs.append(ShardSpec(len(specs), plan.handle.index, eps, lengths, episode, index,
                                   _sha256_bytes(key.encode())))
            episode += len(eps)
            index += frames
            start = stop
    return specs


# --------------------------------------------------------------------------------------------------- frames


def fit_frames(frames: np.ndarray, size: int, mode: str = "pad") -> tuple[np.ndarray, tuple[slice, slice]]:
    """uint8 [N, H, W, C] -> [N, size, size, C] (``roboscale.utils.images.resize_with_pad``) and the (rows, cols)
    of the image content inside it. ``size == 0`` returns the frames untouched."""
    import torch

    n, h, w, c = frames.shape
    everything = (slice(None), slice(None))
    if size == 0 or (h, w) == (size, size):
        return frames, everything
    out = np.empty((n, size, size, c), dtype=np.uint8)
    for s in range(0, n, _RESIZE_CHUNK):
        chunk = torch.from_numpy(np.ascontiguousarray(frames[s : s + _RESIZE_CHUNK])).permute(0, 3, 1, 2)
        out[s : s + _RESIZE_CHUNK] = resize_with_pad(chunk, size, mode).permute(0, 2, 3, 1).numpy()
    nh, nw = fitted_size(h, w, size, mode)
    if (nh, nw) == (size, size):
        return out, everything
    top, left = (size - nh) // 2, (size - nw) // 2
    return out, (slice(top, top + nh), slice(left, left + nw))


# --------------------------------------------------------------------------------------------------- shard build


@dataclass
class BuildContext:
    """Everything a shard task needs (pickled into Ray tasks)."""

    output: str
    sources: list[SourceHandle]
    task_maps: list[list[int]]
    features: dict[str, dict[str, Any]]
    cameras: list[str]
    numeric: list[str]
    image_size: int
    resize: str

    def shard_dir(self, name: str) -> Path:
        return Path(self.output) / SHARDS_DIR / name


def read_shard_meta(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / SHARD_META).read_text())
    except (OSError, ValueError):
        return None


def _numeric_arrow(values: np.ndarray, shape: tuple[int, ...]) -> pa.Array:
    if shape == (1,):
        return pa.array(values.reshape(len(values)))
    flat = np.ascontiguousarray(values).reshape(len(values), -1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel()), flat.shape[1])


def column_values(column: pa.ChunkedArray | pa.Array, shape: tuple[int, ...]) -> np.ndarray:
    """A lake column as numpy: [N] for shape (1,) features, else [N, *shape]."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if shape == (1,):
        return array.to_numpy(zero_copy_only=False)
    return array.flatten().to_numpy(zero_copy_only=False).reshape((len(array), *shape))


def build_shard(spec: ShardSpec, ctx: BuildContext) -> dict[str, Any]:
    """Write one shard (or find it already written with the same fingerprint) and return its shard.json."""
    final = ctx.shard_dir(spec.name)
    existing = read_shard_meta(final)
    if existing is not None and existing.get("fingerprint") == spec.fingerprint:
        return {**existing, "skipped": True}
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", suffix=".tmp", dir=final.parent))
    try:
        meta = _write_shard(spec, ctx, tmp)
        old = final.with_name(f".{spec.name}.old")
        if final.exists():  # a stale shard (other fingerprint): move aside, then swap in the new one
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**meta, "skipped": False}


def _write_shard(spec: ShardSpec, ctx: BuildContext, out: Path) -> dict[str, Any]:
    from roboscale.data.reader import LeRobotDatasetMetadata
    from roboscale.data.source import open_source as open_frame_source

    source = ctx.sources[spec.source]
    meta = LeRobotDatasetMetadata(source.local_root)
    source.stage(_referenced_files(meta, spec.episodes))
    # The loader's FrameSource for raw datasets: reads only each episode's row group(s), decodes each camera's
    # span sequentially (cameras in parallel threads), decodes image-dtype PNGs.
    raw = open_frame_source(source.local_root)
    position = {int(e): i for i, e in enumerate(raw.episode_ids)}
    keys = [*ctx.cameras, *(k for k in ctx.numeric if k not in ("episode_index", "index"))]
    task_map = np.asarray(ctx.task_maps[spec.source], dtype=np.int64)
    n = spec.num_frames
    frames_out = {}
    for key in ctx.cameras:
        h, w, c = fmt.image_hwc(ctx.features[key])
        frames_out[key] = np.lib.format.open_memmap(out / f"{key}.npy", mode="w+", dtype=np.uint8, shape=(n, h, w, c))
    pixels = {key: ByteHistogram.empty(fmt.image_hwc(ctx.features[key])[2]) for key in ctx.cameras}
    columns: dict[str, list[np.ndarray]] = {key: [] for key in ctx.numeric}
    offset = 0
    for i, (ep, length) in enumerate(zip(spec.episodes, spec.lengths, strict=True)):
        lake_ep = spec.first_episode + i
        table = raw.read(position[ep], np.arange(length), keys)
        for key in ctx.cameras:
            if len(table[key]) != length:
                raise DatasetError(meta.video_path(ep, key) if key in meta.video_keys else meta.data_path(ep),
                                   f"read {len(table[key])} frames, the episode has {length}", field=key, episode=ep)
            fitted, (rows, cols) = fit_frames(table[key], ctx.image_size, ctx.resize)
            frames_out[key][offset : offset + length] = fitted
            pixels[key].add(fitted[:, rows, cols])
        start = spec.first_index + offset
        lake_values = {"episode_index": np.full(length, lake_ep, dtype=np.int64),
                       "index": np.arange(start, start + length, dtype=np.int64),
                       "task_index": task_map[np.asarray(table["task_index"], dtype=np.int64)]}
        for key in ctx.numeric:
            values = lake_values[key] if key in lake_values else table[key]
            values = np.asarray(values).astype(np.dtype(ctx.features[key]["dtype"]), copy=False)
            if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
                raise DatasetError(meta.data_path(ep), "non-finite values (NaN/inf)", field=key, episode=ep)
            columns[key].append(values)
        offset += length
    raw.close()
    for mm in frames_out.values():
        mm.flush()
    del frames_out
    arrays = {key: np.concatenate(parts) for key, parts in columns.items()}
    shapes = {key: fmt.feature_shape(ctx.features[key]) for key in ctx.numeric}
    table = pa.table({key: _numeric_arrow(arrays[key], shapes[key]) for key in ctx.numeric})
    pq.write_table(table, out / SHARD_COLUMNS, compression="none")
    partials: dict[str, np.ndarray] = {}
    for key in ctx.numeric:
        partials.update(Moments.of(arrays[key].reshape(n, -1)).to_arrays(f"{key}/"))
    for key, hist in pixels.items():
        partials[f"{key}/pixels"] = hist.counts
    save_safetensors(partials, str(out / SHARD_STATS))
    files = sorted(p.name for p in out.iterdir())
    for name in files:
        _fsync_file(out / name)
    meta = {"name": spec.name, "fingerprint": spec.fingerprint, "source": spec.source, "episodes": list(spec.episodes),
            "lengths": list(spec.lengths), "first_episode": spec.first_episode, "first_index": spec.first_index,
            "num_frames": n, "files": {name: file_record(out / name) for name in files}}
    atomic_write_json(out / SHARD_META, meta)
    return meta


def shard_histograms(shard: Path, shapes: Mapping[str, tuple[int, ...]],
                     ranges: Mapping[str, tuple[np.ndarray, np.ndarray]], bins: int) -> dict[str, np.ndarray]:
    """Stats pass 2: histograms over the global ranges of one shard's numeric columns."""
    table = pq.read_table(shard / SHARD_COLUMNS, columns=list(shapes))
    out: dict[str, np.ndarray] = {}
    for key, shape in shapes.items():
        lo, hi = ranges[key]
        hist = Histogram.empty(lo, hi, bins)
        hist.add(column_values(table[key], shape).reshape(table.num_rows, -1))
        out[key] = hist.counts
    return out


# --------------------------------------------------------------------------------------------------- ray


def _ensure_ray(cfg: LakeConfig) -> bool:
    """Start (or join) Ray; True when this call started it (and so should shut it down)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("`roboscale lake build` needs Ray Data: pip install 'roboscale[lake]' (reading a built "
                          "lake does not)") from None

    if ray.is_initialized():
        return False
    if cfg.ray_address:
        try:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        except ConnectionError as e:
            raise ConfigError(
                f"--ray-address {cfg.ray_address}: {e}. A cluster with token authentication (what `ray start` does "
                "by default since Ray 2.59) also needs RAY_AUTH_MODE=token in this shell, and its token in "
                "RAY_AUTH_TOKEN or ~/.ray/auth_token") from None
    else:
        # "local": a Ray of our own, even where `ray start` left a cluster address behind (ray.init() would
        # join that cluster, and refuse num_cpus); reachable from this machine only
        with _single_node_ray():
            ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=cfg.num_cpus, include_dashboard=False,
                     log_to_driver=True)
    return True


_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _single_node_ray() -> Iterator[None]:
    """Around ``ray.init(address="local", _node_ip_address="127.0.0.1")``: make the node IP stay 127.0.0.1.

    Why: Ray binds its GCS, raylet (node and object manager), runtime-env agent and the gRPC server of the driver
    and of every worker to loopback only when the node IP is loopback, and to every interface otherwise. On Linux
    ``ray.init`` replaces a loopback ``_node_ip_address`` by the host's outward IP unless multi-node Ray is off:
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the single-machine mode Ray runs in on macOS and Windows. Ray reads
    that variable once, into ``ray_constants.ENABLE_RAY_CLUSTER``, when it is first imported (before this call),
    so both are set here and both restored afterwards: a later ``ray.init`` of the user's is unaffected. The
    processes ray.init starts (raylet, agents, and the workers they start) inherit the variable; they get their
    node IP from the raylet anyway.
    """
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_SINGLE_NODE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_SINGLE_NODE_ENV, None)
        else:
            os.environ[_SINGLE_NODE_ENV] = saved_env


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on a wrong host:port: Ray itself retries for minutes before giving up."""
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address!r}: expected HOST:PORT (the head's GCS address, port 6379 by "
                          "default), ray://HOST:PORT, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"--ray-address {address}: cannot reach it ({e.strerror or e}); is the head running "
                          "(`ray start --head`) and is the address right?") from None


def _ray_map(items: list[dict[str, Any]], fn: Callable[[dict[str, Any]], dict[str, Any]], cpus: float,
             ) -> list[dict[str, Any]]:
    """One Ray Data task per item (so each shard is its own unit of retry), results in item order."""
    import ray.data

    if not items:
        return []
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    rows = ds.map(fn, num_cpus=cpus).take_all()
    return sorted(rows, key=lambda r: r["shard"])


def _raise_task_errors(rows: Sequence[Mapping[str, Any]]) -> None:
    """Shard tasks return their DatasetError as a record: Ray would wrap the exception into a traceback string."""
    errors = [json.loads(r["error"]) for r in rows if r["error"]]
    if errors:
        more = f" ({len(errors) - 1} more shards failed; finished shards are kept, rerun to resume)" if len(
            errors) > 1 else " (finished shards are kept: rerun to resume)"
        raise from_record({**errors[0], "message": errors[0]["message"] + more})


class _BuildShardTask:
    def __init__(self, ctx: BuildContext, specs: Sequence[ShardSpec]):
        self.ctx, self.specs = ctx, {s.shard: s for s in specs}

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        # A bad episode fails its shard only: the other shards still finish (and are kept for the resumed build).
        try:
            meta = build_shard(self.specs[int(row["shard"])], self.ctx)
        except DatasetError as err:
            return {"shard": int(row["shard"]), "meta": "", "error": json.dumps(to_record(err))}
        return {"shard": int(row["shard"]), "meta": json.dumps(meta), "error": ""}


_HISTOGRAM_GROUPS = 64  # stats pass 2 sums shards in at most this many tasks: bounds what returns to the driver


class _HistogramTask:
    """Sum of the histograms of a group of shards (row ``shard`` = group index)."""

    def __init__(self, ctx: BuildContext, groups: Sequence[Sequence[str]], ranges: Mapping[str, Any], bins: int):
        self.ctx, self.groups, self.ranges, self.bins = ctx, [list(g) for g in groups], ranges, bins

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        group = int(row["shard"])
        shapes = {key: fmt.feature_shape(self.ctx.features[key]) for key in self.ctx.numeric}
        total: dict[str, np.ndarray] = {}
        for name in self.groups[group]:
            counts = shard_histograms(self.ctx.shard_dir(name), shapes, self.ranges, self.bins)
            total = {k: total[k] + v for k, v in counts.items()} if total else counts
        return {"shard": group, "counts": safetensors_bytes(total)}


# --------------------------------------------------------------------------------------------------- stats


def merge_stats(ctx: BuildContext, metas: Sequence[Mapping[str, Any]], cfg: LakeConfig, cpus: float
                ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Global stats from the shards' partials (moments, pixel histograms) plus pass-2 histograms."""
    partials = [load_safetensors(str(ctx.shard_dir(m["name"]) / SHARD_STATS)) for m in metas]
    moments = {key: merge_moments([Moments.from_arrays(p, f"{key}/") for p in partials]) for key in ctx.numeric}
    ranges = {key: (m.min, m.max) for key, m in moments.items()}
    names = [m["name"] for m in metas]
    per_group = -(-len(names) // _HISTOGRAM_GROUPS)
    groups = [names[i : i + per_group] for i in range(0, len(names), per_group)]
    rows = _ray_map([{"shard": i} for i in range(len(groups))], _HistogramTask(ctx, groups, ranges, cfg.stats_bins),
                    cpus)
    stats: dict[str, dict[str, np.ndarray]] = {}
    errors: dict[str, np.ndarray] = {}
    for key in ctx.numeric:
        lo, hi = ranges[key]
        hist = Histogram.empty(lo, hi, cfg.stats_bins)
        for row in rows:
            hist.counts += _load_safetensors_bytes(row["counts"])[key]
        ft = ctx.features[key]
        stats[key] = finalize_numeric(moments[key], hist, fmt.feature_shape(ft), ft["dtype"])
        errors[key] = hist.error_bound.reshape(fmt.feature_shape(ft))
    for key in ctx.cameras:
        pixels = ByteHistogram(sum(np.asarray(p[f"{key}/pixels"], dtype=np.int64) for p in partials))
        stats[key] = pixels.stats(frames_count=sum(int(m["num_frames"]) for m in metas))
        errors[key] = np.zeros_like(stats[key]["mean"])
    order = [k for k in ctx.features if k in stats]
    return {k: stats[k] for k in order}, {k: errors[k] for k in order}


def _load_safetensors_bytes(data: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return load(bytes(data))


# --------------------------------------------------------------------------------------------------- build


def _token_ids(tasks: Sequence[str], tokenizer: str | None) -> tuple[list[list[int]] | None, dict[str, Any] | None]:
    if tokenizer is None:
        return None, None
    from roboscale.models.tokenizer import TaskTokenizer

    tok = TaskTokenizer.from_file(tokenizer)
    return [tok.encode(t) for t in tasks], {"path": str(Path(tokenizer).resolve()), "sha256": sha256_file(tokenizer),
                                            "vocab_size": tok.vocab_size}


def _write_tables(out: Path, plans: Sequence[SourcePlan], specs: Sequence[ShardSpec], tasks: Sequence[str],
                  tokens: list[list[int]] | None) -> None:
    shard_of, offset_of, source_of, src_ep, lengths = [], [], [], [], []
    for spec in specs:
        offset = 0
        for ep, n in zip(spec.episodes, spec.lengths, strict=True):
            shard_of.append(spec.shard)
            offset_of.append(offset)
            source_of.append(spec.source)
            src_ep.append(ep)
            lengths.append(n)
            offset += n
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths_arr)
    episodes = pa.table({
        "episode_index": pa.array(np.arange(len(lengths_arr), dtype=np.int64)),
        "source": pa.array(np.asarray(source_of, dtype=np.int64)),
        "source_episode_index": pa.array(np.asarray(src_ep, dtype=np.int64)),
        "length": pa.array(lengths_arr),
        "shard": pa.array(np.asarray(shard_of, dtype=np.int64)),
        "offset": pa.array(np.asarray(offset_of, dtype=np.int64)),
        "dataset_from_index": pa.array(ends - lengths_arr),
        "dataset_to_index": pa.array(ends),
    })
    _atomic_parquet(episodes, out / EPISODES_FILE)
    columns: dict[str, Any] = {"task_index": pa.array(np.arange(len(tasks), dtype=np.int64)),
                               "task": pa.array(list(tasks), pa.string())}
    if tokens is not None:
        columns["token_ids"] = pa.array(tokens, pa.list_(pa.int32()))
    _atomic_parquet(pa.table(columns), out / TASKS_FILE)


def _atomic_parquet(table: pa.Table, path: Path) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="none")
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def _ranges(values: Sequence[int]) -> list[list[int]]:
    """[0, 1, 2, 5] -> [[0, 3], [5, 6]] (half-open)."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][1] == v:
            out[-1][1] = v + 1
        else:
            out.append([v, v + 1])
    return out


def _manifest(cfg: LakeConfig, plans: Sequence[SourcePlan], specs: Sequence[ShardSpec],
              metas: Sequence[Mapping[str, Any]], ctx: BuildContext, tasks: Sequence[str],
              tokenizer: dict[str, Any] | None, stats: Mapping[str, Mapping[str, np.ndarray]],
              errors: Mapping[str, np.ndarray], out: Path) -> dict[str, Any]:
    from roboscale import __version__

    sources = []
    for plan in plans:
        n_ep = len(plan.episode_ids)
        sources.append({
            "uri": plan.handle.uri, "path": str(plan.handle.local_root), "codebase_version": plan.info.codebase_version,
            "robot_type": plan.info.robot_type, "fps": plan.info.fps, "info_sha256": plan.info_sha256,
            "meta_sha256": plan.meta_sha256, "episodes": _ranges(plan.episode_ids.tolist()),
            "lake_episodes": [plan.first_episode, plan.first_episode + n_ep],
            "frames": int(plan.lengths.sum()), "task_index_map": plan.task_map,
        })
    shards = [{"name": m["name"], "source": spec.source,
               "episodes": [spec.first_episode, spec.first_episode + len(spec.episodes)],
               "index": [spec.first_index, spec.first_index + spec.num_frames], "num_frames": spec.num_frames,
               "fingerprint": spec.fingerprint, "files": m["files"]} for spec, m in zip(specs, metas, strict=True)]
    return {
        "format": LAKE_FORMAT,
        "version": LAKE_VERSION,
        "created_by": f"roboscale {__version__}",
        "config": _config_record(cfg),
        "fps": plans[0].info.fps,
        "features": ctx.features,
        "camera_keys": ctx.cameras,
        "numeric_keys": ctx.numeric,
        "tasks": list(tasks),
        "tokenizer": tokenizer,
        "total_episodes": sum(len(p.episode_ids) for p in plans),
        "total_frames": sum(spec.num_frames for spec in specs),
        "sources": sources,
        "tables": {name: file_record(out / name) for name in (EPISODES_FILE, TASKS_FILE)},
        "shards": shards,
        "stats": {k: {s: v.tolist() for s, v in st.items()} for k, st in stats.items()},
        "stats_quantile_error": {k: v.tolist() for k, v in errors.items()},
        "stats_method": (f"exact count/mean/std/min/max (Chan et al. merge of per-shard moments); numeric quantiles "
                         f"from {cfg.stats_bins}-bin histograms over the global [min, max], |error| <= "
                         "stats_quantile_error = (max - min) / bins; camera stats exact over every pixel of the "
                         "resized image, in [0, 1]"),
    }


def build_lock(out: Path) -> contextlib.AbstractContextManager[None]:
    """One build per lake directory: a second build (another shell, a retried job) would interleave shard
    writes and manifests."""
    return exclusive_lock(out / LOCK_NAME, lambda holder: DatasetError(
        out / LOCK_NAME, f"another lake build ({holder}) is writing {out}; wait for it to finish or build into "
                         "another --output"))


def build_lake(cfg: LakeConfig, *, filesystems: Sequence[pafs.FileSystem | None] | None = None) -> BuildReport:
    """Compile ``cfg.sources`` into a lake at ``cfg.output``; resumes a partial build (see the module doc)."""
    cfg.check()
    if cfg.ray_address:
        _check_reachable(cfg.ray_address)
    started = time.perf_counter()
    out = Path(cfg.output).expanduser().resolve()
    plans, tasks = plan_sources(cfg, out / STAGING_DIR, filesystems)  # validation first: no output dir for bad input
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        return _build_locked(cfg, out, plans, tasks, started)


def _build_locked(cfg: LakeConfig, out: Path, plans: list[SourcePlan], tasks: list[str], started: float
                  ) -> BuildReport:
    features, cameras, numeric = lake_features(plans, cfg)
    specs = plan_shards(plans, cfg, cameras, numeric)
    ctx = BuildContext(str(out), [p.handle for p in plans], [p.task_map for p in plans], features, cameras, numeric,
                       cfg.image_size, cfg.resize)
    if cfg.repair:
        _remove_damaged_shards(ctx, specs)
    todo = [s for s in specs if (read_shard_meta(ctx.shard_dir(s.name)) or {}).get("fingerprint") != s.fingerprint]
    log.info("lake %s: %d sources, %d episodes, %d frames -> %d shards (%d to build, %d already built)", out,
             len(plans), sum(len(p.episode_ids) for p in plans), sum(s.num_frames for s in specs), len(specs),
             len(todo), len(specs) - len(todo))
    tokens, tokenizer = _token_ids(tasks, cfg.tokenizer)
    if not todo and _manifest_is_current(out, cfg, specs, tokenizer):  # nothing changed: no Ray, no stats pass
        names = [s.name for s in specs]
        return BuildReport(out, [], names, sum(len(p.episode_ids) for p in plans), sum(s.num_frames for s in specs),
                           time.perf_counter() - started)
    (out / MANIFEST).unlink(missing_ok=True)  # the lake is incomplete until the new manifest is written
    owns_ray = _ensure_ray(cfg)
    try:
        t0 = time.perf_counter()
        rows = _ray_map([{"shard": s.shard} for s in todo], _BuildShardTask(ctx, specs), cfg.cpus_per_task)
        log.info("lake %s: %d shards built in %.1f s", out, len(rows), time.perf_counter() - t0)
        _raise_task_errors(rows)
        built = {int(r["shard"]): json.loads(r["meta"]) for r in rows}
        metas = [built.get(s.shard) or read_shard_meta(ctx.shard_dir(s.name)) for s in specs]
        for spec, meta in zip(specs, metas, strict=True):
            if meta is None or meta.get("fingerprint") != spec.fingerprint:
                raise DatasetError(ctx.shard_dir(spec.name), "shard missing or stale after the build",
                                   field="fingerprint")
        t0 = time.perf_counter()
        stats, errors = merge_stats(ctx, metas, cfg, cfg.cpus_per_task)
        log.info("lake %s: global stats merged from %d shards in %.1f s", out, len(metas), time.perf_counter() - t0)
    finally:
        if owns_ray:
            import ray

            ray.shutdown()
    _remove_stale_shards(out, {s.name for s in specs})
    _write_tables(out, plans, specs, tasks, tokens)
    atomic_write_json(out / MANIFEST, _manifest(cfg, plans, specs, metas, ctx, tasks, tokenizer, stats, errors, out),
                      indent=1)
    report = BuildReport(out, built=[s.name for s in specs if s.shard in built and not built[s.shard]["skipped"]],
                         episodes=sum(len(p.episode_ids) for p in plans), frames=sum(s.num_frames for s in specs))
    report.skipped = [s.name for s in specs if s.name not in report.built]
    report.seconds = time.perf_counter() - started
    return report


def _remove_damaged_shards(ctx: BuildContext, specs: Sequence[ShardSpec]) -> None:
    for spec in specs:
        path = ctx.shard_dir(spec.name)
        meta = read_shard_meta(path)
        if meta is None or meta.get("fingerprint") != spec.fingerprint:
            continue  # rebuilt anyway
        for name, record in meta["files"].items():
            file = path / name
            if not file.is_file() or file.stat().st_size != record["bytes"] or sha256_file(file) != record["sha256"]:
                log.warning("%s: damaged (sha256 or size differs from shard.json); rebuilding the shard", file)
                shutil.rmtree(path)
                break


def _manifest_is_current(out: Path, cfg: LakeConfig, specs: Sequence[ShardSpec],
                         tokenizer: Mapping[str, Any] | None) -> bool:
    """The existing manifest describes exactly this plan (same shards, settings, sources and tokenizer)."""
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (old.get("format") == LAKE_FORMAT and old.get("version") == LAKE_VERSION
            and old.get("config") == _config_record(cfg)
            and [s.get("fingerprint") for s in old.get("shards", [])] == [s.fingerprint for s in specs]
            and [s.get("uri") for s in old.get("sources", [])] == list(cfg.sources)
            and (old.get("tokenizer") or {}).get("sha256") == (tokenizer or {}).get("sha256"))


def _config_record(cfg: LakeConfig) -> dict[str, Any]:
    return {"image_size": cfg.image_size, "resize": cfg.resize, "shard_frames": cfg.shard_frames,
            "stats_bins": cfg.stats_bins}


def _remove_stale_shards(out: Path, keep: set[str]) -> None:
    """Shards of an earlier plan that this one no longer has (fewer episodes, other shard size)."""
    shards = out / SHARDS_DIR
    if not shards.is_dir():
        return
    for path in shards.iterdir():
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)

