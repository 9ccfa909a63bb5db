"""The lake's records: the episode and task tables, the manifest (written last: the lake exists only when it
does), and the per-file sizes and hashes that ``LakeSource`` and ``lake verify`` check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from roboscale import __version__
from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.format import EPISODES_FILE, LAKE_FORMAT, LAKE_VERSION, MANIFEST, SHARD_META, TASKS_FILE
from roboscale.data.lake.planning import BuildContext, ShardSpec, SourcePlan
from roboscale.utils.io import atomic_write_bytes, load_json, sha256_file


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest and shard.json record of a file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def read_shard_meta(path: Path) -> dict[str, Any] | None:
    try:
        return load_json((path / SHARD_META).read_text())
    except (OSError, ValueError):
        return None


def write_tables(out: Path, plans: Sequence[SourcePlan], specs: Sequence[ShardSpec], tasks: Sequence[str],
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


def manifest_record(cfg: LakeConfig, plans: Sequence[SourcePlan], specs: Sequence[ShardSpec],
              metas: Sequence[Mapping[str, Any]], ctx: BuildContext, tasks: Sequence[str],
              tokenizer: dict[str, Any] | None, stats: Mapping[str, Mapping[str, np.ndarray]],
              errors: Mapping[str, np.ndarray], out: Path) -> dict[str, Any]:
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
        "config": config_record(cfg),
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


def manifest_is_current(out: Path, cfg: LakeConfig, specs: Sequence[ShardSpec],
                         tokenizer: Mapping[str, Any] | None) -> bool:
    """The existing manifest describes exactly this plan (same shards, settings, sources and tokenizer)."""
    try:
        old = load_json((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (old.get("format") == LAKE_FORMAT and old.get("version") == LAKE_VERSION
            and old.get("config") == config_record(cfg)
            and [s.get("fingerprint") for s in old.get("shards", [])] == [s.fingerprint for s in specs]
            and [s.get("uri") for s in old.get("sources", [])] == list(cfg.sources)
            and (old.get("tokenizer") or {}).get("sha256") == (tokenizer or {}).get("sha256"))


def config_record(cfg: LakeConfig) -> dict[str, Any]:
    return {"image_size": cfg.image_size, "resize": cfg.resize, "shard_frames": cfg.shard_frames,
            "stats_bins": cfg.stats_bins}
