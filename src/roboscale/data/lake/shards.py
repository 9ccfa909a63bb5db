"""Writing one shard: read its episodes through the loader's raw ``FrameSource``, fit the cameras to the lake's
square, store frames and columns, and record the shard's stats partials and file hashes.

Shard tasks read a source through ``roboscale.data.loading.source.open_source``, so the lake holds exactly what
the loader would have decoded. Cameras are resized to ``image_size`` (aspect kept, padded with black by default;
``--resize stretch`` to fill) with torch's antialiased bilinear filter; ``image_size=0`` keeps the native
resolution (frames then equal the decoded frames exactly). A shard is built under a temporary name, fsynced and
renamed into place; a shard whose episode fails (a torn video) raises a DatasetError naming file, episode and
field, and the other shards still finish.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.numpy import save_file as save_safetensors

from roboscale.data.lake.format import SHARD_COLUMNS, SHARD_META, SHARD_STATS
from roboscale.data.lake.manifest import file_record, read_shard_meta
from roboscale.data.lake.planning import BuildContext, ShardSpec, referenced_files
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.reader import LeRobotDatasetMetadata
from roboscale.data.lerobot.stats import ByteHistogram, Histogram, Moments
from roboscale.data.loading.source import open_source
from roboscale.errors import DatasetError
from roboscale.utils.images import fitted_size, resize_with_pad
from roboscale.utils.io import atomic_write_json, fsync_dir, make_temporary_directory

_RESIZE_CHUNK = 64  # frames per resize call: bounds the temporary buffers


def fit_frames(frames: np.ndarray, size: int, mode: str = "pad") -> tuple[np.ndarray, tuple[slice, slice]]:
    """uint8 [N, H, W, C] -> [N, size, size, C] (``roboscale.utils.images.resize_with_pad``) and the (rows, cols)
    of the image content inside it. ``size == 0`` returns the frames untouched."""
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


def _numeric_arrow(values: np.ndarray, shape: tuple[int, ...]) -> pa.Array:
    if shape == (1,):
        return pa.array(values.reshape(len(values)))
    flat = np.ascontiguousarray(values).reshape(len(values), -1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel()), flat.shape[1])


def build_shard(spec: ShardSpec, ctx: BuildContext) -> dict[str, Any]:
    """Write one shard (or find it already written with the same fingerprint) and return its shard.json."""
    final = ctx.shard_dir(spec.name)
    existing = read_shard_meta(final)
    if existing is not None and existing.get("fingerprint") == spec.fingerprint:
        return {**existing, "skipped": True}
    # locked while this task lives: the next build removes it only once abandoned (remove_stale_temporaries)
    tmp, lock = make_temporary_directory(final)
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
        os.close(lock)
    return {**meta, "skipped": False}


def _write_shard(spec: ShardSpec, ctx: BuildContext, out: Path) -> dict[str, Any]:
    source = ctx.sources[spec.source]
    meta = LeRobotDatasetMetadata(source.local_root)
    source.stage(referenced_files(meta, spec.episodes))
    # The loader's FrameSource for raw datasets: reads only each episode's row group(s), decodes each camera's
    # span sequentially (cameras in parallel threads), decodes image-dtype PNGs.
    raw = open_source(source.local_root)
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


def shard_histograms(shard: Path, features: Mapping[str, Mapping[str, Any]],
                     ranges: Mapping[str, tuple[np.ndarray, np.ndarray]], bins: int) -> dict[str, np.ndarray]:
    """Stats pass 2: histograms over the global ranges of one shard's numeric columns (``features``)."""
    path = shard / SHARD_COLUMNS
    table = pq.read_table(path, columns=list(features))
    out: dict[str, np.ndarray] = {}
    for key, feature in features.items():
        lo, hi = ranges[key]
        hist = Histogram.empty(lo, hi, bins)
        hist.add(fmt.column_to_numpy(table[key], feature, path, key).reshape(table.num_rows, -1))
        out[key] = hist.counts
    return out


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
