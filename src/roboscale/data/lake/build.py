"""``roboscale lake build``: compile LeRobot v3.0 datasets into training-ready shards with Ray Data.

Why a lake. The loader's budget is >= 1,000 samples/s per CPU core with two 224² cameras, i.e. ~0.5 ms per
camera frame. Decoding AV1/H.264 (~1 ms per small frame, more at 224², plus GOP seeks) or even PNG/JPEG at that
resolution (~1-3 ms) cannot meet it, so the lake decodes every frame **once**, at build time, and stores it in the
form the model consumes (the layout: ``roboscale.data.lake.format``).

Precomputed: decoded and resized frames; lake-global ``episode_index``/``index``/``task_index`` (tasks of all
sources merged by string, in first-seen order); task -> token ids when a tokenizer is given (fixed per tokenizer,
so the loader never tokenizes; the tokenizer comes as a function, so the lake does not import the models); the
episode -> (shard, offset) table; global stats (``roboscale.data.lake.stats``).

Elastic and restartable: one Ray Data task per shard (``roboscale.data.lake.ray``). A shard is built under a
temporary name, fsynced and renamed; its ``shard.json`` carries a fingerprint of everything it depends on
(``roboscale.data.lake.planning``). A rebuild skips every shard whose fingerprint matches, so a killed build
resumes where it stopped, and appending a source reuses every shard of the sources before it; ``repair`` also
hashes finished shards and rebuilds those that differ from their record. The manifest is removed when anything
must be rebuilt and written last. One build at a time writes a lake (``build_lock``), and only into a directory
it can tell is its own, deleting only shards it wrote (``roboscale.data.lake.journal``). A shard whose episode fails
is reported by file, episode and field after the other shards have finished, and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.format import LOCK_NAME, MANIFEST, STAGING_DIR
from roboscale.data.lake.journal import (
    check_output,
    forget_shards,
    record_shards,
    remove_abandoned_temporaries,
    remove_stale_shards,
)
from roboscale.data.lake.manifest import manifest_is_current, manifest_record, read_shard_meta, write_tables
from roboscale.data.lake.planning import BuildContext, ShardSpec, SourcePlan, lake_features, plan_shards, plan_sources
from roboscale.data.lake.ray import BuildShardTask, check_reachable, ensure_ray, raise_task_errors, ray_map
from roboscale.data.lake.staging import local_path
from roboscale.data.lake.stats import merge_stats
from roboscale.errors import ConfigError, DatasetError
from roboscale.utils.io import atomic_write_json, exclusive_lock, sha256_file

log = logging.getLogger(__name__)

#: task strings -> their token ids (the CLI builds it from ``LakeConfig.tokenizer``)
Tokenize = Callable[[Sequence[str]], list[list[int]]]


@dataclass
class BuildReport:
    """What a build did: shards built and reused, and what the lake holds."""

    output: Path
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    episodes: int = 0
    frames: int = 0
    seconds: float = 0.0


def _token_ids(tasks: Sequence[str], tokenizer: str | None, tokenize: Tokenize | None, vocab_size: int | None
               ) -> tuple[list[list[int]] | None, dict[str, Any] | None]:
    """The tasks' token ids and what the manifest records about the tokenizer (None, None without one)."""
    if tokenizer is None or tokenize is None:
        return None, None
    return tokenize(tasks), {"path": str(Path(tokenizer).resolve()), "sha256": sha256_file(tokenizer),
                             "vocab_size": vocab_size}


def build_lock(out: Path) -> contextlib.AbstractContextManager[None]:
    """One build per lake directory: a second build (another shell, a retried job) would interleave shard
    writes and manifests."""
    return exclusive_lock(out / LOCK_NAME, lambda holder: DatasetError(
        out / LOCK_NAME, f"another lake build ({holder}) is writing {out}; wait for it to finish or build into "
                         "another --output"))


def build_lake(cfg: LakeConfig, *, tokenize: Tokenize | None = None, vocab_size: int | None = None,
               filesystems: Sequence[pafs.FileSystem | None] | None = None) -> BuildReport:
    """Compile ``cfg.sources`` into a lake at ``cfg.output``; resumes a partial build (see the module doc).

    ``tokenize`` turns the task strings into token ids, stored in tasks.parquet; it is the tokenizer in
    ``cfg.tokenizer`` (whose path and sha256 the manifest records, with ``vocab_size``), and is required with it.
    ``filesystems`` (one per source, None for the default) override how each source URI is opened."""
    cfg.check()
    if (cfg.tokenizer is None) != (tokenize is None):
        raise ConfigError("lake build: a tokenizer file (--tokenizer) and the function that tokenizes with it "
                          "(build_lake(..., tokenize=...)) go together")
    if cfg.ray_address:
        check_reachable(cfg.ray_address)
    started = time.perf_counter()
    out = Path(cfg.output).expanduser().resolve()
    check_output(out, _local_sources(cfg, filesystems))
    plans, tasks = plan_sources(cfg, out / STAGING_DIR, filesystems)  # validation first: no output dir for bad input
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        return _build_locked(cfg, out, plans, tasks, started, tokenize, vocab_size)


def _local_sources(cfg: LakeConfig, filesystems: Sequence[pafs.FileSystem | None] | None) -> list[Path]:
    found = (local_path(uri, filesystems[i] if filesystems else None) for i, uri in enumerate(cfg.sources))
    return [path for path in found if path is not None]


def _build_locked(cfg: LakeConfig, out: Path, plans: list[SourcePlan], tasks: list[str], started: float,
                  tokenize: Tokenize | None, vocab_size: int | None) -> BuildReport:
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
    tokens, tokenizer = _token_ids(tasks, cfg.tokenizer, tokenize, vocab_size)
    names = [s.name for s in specs]
    if not todo and manifest_is_current(out, cfg, specs, tokenizer):  # nothing changed: no Ray, no stats pass
        return BuildReport(out, [], names, sum(len(p.episode_ids) for p in plans), sum(s.num_frames for s in specs),
                           time.perf_counter() - started)
    record_shards(out, names)  # before any shard is written: a rerun of a killed build knows the directory as ours
    remove_abandoned_temporaries(out, names)
    (out / MANIFEST).unlink(missing_ok=True)  # the lake is incomplete until the new manifest is written
    owns_ray = ensure_ray(cfg)
    try:
        t0 = time.perf_counter()
        rows = ray_map([{"shard": s.shard} for s in todo], BuildShardTask(ctx, specs), cfg.cpus_per_task)
        log.info("lake %s: %d shards built in %.1f s", out, len(rows), time.perf_counter() - t0)
        raise_task_errors(rows)
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
    remove_stale_shards(out, set(names))
    write_tables(out, plans, specs, tasks, tokens)
    atomic_write_json(out / MANIFEST, manifest_record(cfg, plans, specs, metas, ctx, tasks, tokenizer, stats, errors,
                                                      out), indent=1)
    forget_shards(out, names)
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

