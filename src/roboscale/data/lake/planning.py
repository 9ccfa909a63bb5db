"""What a lake build will do: validated sources, the lake's feature schema, and the shards to write.

Each source is validated before anything is built (``LeRobotDatasetMetadata``; every referenced file exists;
``roboscale.data.lerobot.validate``'s quick check); sources must share fps and features. Their task lists merge
by string, in first-seen order, into the lake's. Shards hold consecutive whole episodes of one source, about
``shard_frames`` frames each, and each carries a fingerprint of everything it depends on (source metadata hash,
episodes, lake index offsets, task mapping, image settings), which is how a rebuild knows what it can keep.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.format import LAKE_VERSION, SHARDS_DIR
from roboscale.data.lake.staging import SourceHandle, stage_source
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot import language
from roboscale.data.lerobot.depth import is_depth_map
from roboscale.data.lerobot.reader import LeRobotDatasetMetadata
from roboscale.data.lerobot.validate import bad_episodes, readable_or_raise
from roboscale.errors import DatasetError
from roboscale.utils.io import sha256_bytes

log = logging.getLogger(__name__)


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
    return sha256_bytes(info), sha256_bytes(*parts)


def referenced_files(meta: LeRobotDatasetMetadata, episodes: Sequence[int]) -> list[str]:
    """Data and video files (relative paths) holding ``episodes``."""
    out: dict[str, None] = {}
    for ep in episodes:
        out[str(meta.data_path(ep).relative_to(meta.root))] = None
        for key in meta.video_keys:
            out[str(meta.video_path(ep, key).relative_to(meta.root))] = None
    return list(out)


def _quick_validate(root: Path) -> None:
    """The gate every reader of training data passes (``roboscale.data.lerobot.validate``): refuse a source with
    problems."""
    bad = bad_episodes(root)
    readable_or_raise(root, bad, len(fmt.read_episodes_table(root)), skip_bad_episodes=False)


def _check_compatible(first: SourcePlan, other: SourcePlan, cameras: list[str], numeric: list[str],
                      native: bool) -> None:
    path = other.handle.local_root / fmt.INFO_PATH
    if other.info.fps != first.info.fps:
        raise DatasetError(path, f"fps {other.info.fps} differs from {first.handle.uri}'s {first.info.fps}",
                           field="fps")
    feats, ref = other.info.features, first.info.features
    other_cams = [k for k, f in feats.items() if fmt.is_camera(f) and not is_depth_map(f)]
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
    plans: list[SourcePlan] = []
    tasks: list[str] = []
    task_index: dict[str, int] = {}
    episode, index = 0, 0
    for i, uri in enumerate(cfg.sources):
        handle = stage_source(uri, i, staging, filesystems[i] if filesystems else None)
        meta = LeRobotDatasetMetadata(handle.local_root)
        if handle.filesystem is None:
            if cfg.validate:
                _quick_validate(handle.local_root)
            for rel in referenced_files(meta, [int(e) for e in meta.episodes["episode_index"]]):
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
    # Language annotations and depth maps (LeRobot 0.6) stay in the source: a lake holds what policies batch
    left_out = [k for k, f in first.items() if language.is_language(f) or is_depth_map(f)]
    if left_out:
        log.warning("lake %s: leaving out %s (language annotations and depth maps are read from the LeRobot "
                    "dataset itself)", cfg.output, left_out)
    cameras = [k for k, f in first.items() if fmt.is_camera(f) and k not in left_out]
    numeric = [k for k, f in first.items()
               if not fmt.is_camera(f) and f["dtype"] != "string" and k not in left_out]
    for plan in plans[1:]:
        _check_compatible(plans[0], plan, cameras, numeric, cfg.image_size == 0)
    features: dict[str, dict[str, Any]] = {}
    for key, ft in first.items():
        if key in cameras:
            h, w, c = fmt.image_hwc(ft)
            side = (h, w) if cfg.image_size == 0 else (cfg.image_size, cfg.image_size)
            features[key] = {"dtype": ft["dtype"], "shape": [*side, c], "names": ["height", "width", "channels"],
                             "info": {"lake.resize": "none" if cfg.image_size == 0 else cfg.resize}}
        elif key in numeric:
            features[key] = json.loads(json.dumps(ft))
    return features, cameras, numeric


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
                                   sha256_bytes(key.encode())))
            episode += len(eps)
            index += frames
            start = stop
    return specs


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
