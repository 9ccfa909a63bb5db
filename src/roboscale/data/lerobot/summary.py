"""`roboscale data info`: what a dataset is, from its metadata and file sizes alone (instant on any size): schema,
episodes, tasks, codecs (depth maps, their quantization), LeRobot 0.6's language columns and tools, sizes on disk.
Every string the dataset holds is shown ``printable`` (a task cannot act on the terminal)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot import language
from roboscale.data.lerobot.depth import DepthQuantization, is_depth_map
from roboscale.errors import DatasetError
from roboscale.utils.text import printable


@dataclass
class FeatureSummary:
    name: str
    dtype: str
    shape: list[int]
    names: str
    codec: str = ""


@dataclass
class DatasetSummary:
    """What ``roboscale data info`` prints: read from metadata and file sizes only (no data or video decoding)."""

    root: Path
    codebase_version: str
    fps: int
    robot_type: str | None
    total_episodes: int
    total_frames: int
    tasks: list[str]
    features: list[FeatureSummary]
    lengths: np.ndarray
    bytes_by_part: dict[str, int]
    files_by_part: dict[str, int]
    quantile_stats: bool
    chunks_size: int
    data_files_size_in_mb: Any
    video_files_size_in_mb: Any
    tools: list[str] = field(default_factory=list)  # names of info.json's tool schemas (LeRobot 0.6)

    def lines(self, max_tasks: int = 20) -> list[str]:
        seconds = self.total_frames / self.fps
        out = [f"{self.root}: LeRobot {self.codebase_version}, {self.fps} fps, robot {self.robot_type}",
               f"  {self.total_episodes} episodes, {self.total_frames} frames ({_duration(seconds)}), "
               f"{len(self.tasks)} tasks"]
        if len(self.lengths):
            out.append(f"  episode length: min {self.lengths.min()}, mean {self.lengths.mean():.1f}, "
                       f"max {self.lengths.max()} frames")
        out.append(f"  files: chunks_size {self.chunks_size}, data files ≤ {self.data_files_size_in_mb} MB, "
                   f"video files ≤ {self.video_files_size_in_mb} MB")
        out.append("  features:")
        for f in self.features:
            extra = f"  {f.codec}" if f.codec else ""
            out.append(f"    {f.name:34s} {f.dtype:8s} {str(f.shape):16s} {f.names}{extra}")
        out.append("  size on disk:")
        for part in sorted(self.bytes_by_part):
            out.append(f"    {part:40s} {_size(self.bytes_by_part[part]):>10s} in {self.files_by_part[part]} files")
        out.append(f"    {'total':40s} {_size(sum(self.bytes_by_part.values())):>10s}")
        out.append(f"  stats: {'with' if self.quantile_stats else 'WITHOUT'} q01/q99 quantiles"
                   + ("" if self.quantile_stats else " (pi0.5 QUANTILES normalization needs them)"))
        if self.tools:
            out.append(f"  tools: {', '.join(self.tools)}")
        out.append("  tasks:")
        for i, task in enumerate(self.tasks[:max_tasks]):
            out.append(f"    {i}: {task}")
        if len(self.tasks) > max_tasks:
            out.append(f"    … {len(self.tasks) - max_tasks} more")
        return [printable(line) for line in out]  # tasks, feature names, robot type: the dataset's own text


def _names_summary(names: Any) -> str:
    if names is None:
        return ""
    if isinstance(names, dict):
        names = next(iter(names.values()), [])
    while isinstance(names, list) and len(names) == 1 and isinstance(names[0], list):
        names = names[0]
    text = ", ".join(str(n) for n in names) if isinstance(names, list) else str(names)
    return text if len(text) <= 60 else text[:57] + "..."


def _codec_summary(feature: Mapping[str, Any]) -> str:
    video = feature.get("info") or feature.get("video_info") or {}
    parts = [str(video[k]) for k in ("video.codec", "video.pix_fmt") if video.get(k) is not None]
    if video.get("video.g") is not None:
        parts.append(f"g={video['video.g']}")
    if is_depth_map(feature):
        try:
            q = DepthQuantization.of(feature)
            parts.append(f"depth map: {'log' if q.use_log else 'linear'} 12-bit, {q.depth_min:g}-{q.depth_max:g} m, "
                         f"recorded in {q.unit or 'an unrecorded unit'}")
        except ValueError as e:
            parts.append(f"depth map with bad settings: {e}")
    return " ".join(parts)


def _tool_names(tools: Any) -> list[str]:
    """What ``data info`` shows of info.json's ``tools``: each function's name; anything else as it is written
    (a string is one value, not one entry per character)."""
    if not tools:
        return []
    if not isinstance(tools, list):
        return [json.dumps(tools) if not isinstance(tools, str) else tools]
    return [str((t.get("function") or {}).get("name", json.dumps(t))) if isinstance(t, dict) else
            (t if isinstance(t, str) else json.dumps(t)) for t in tools]


def _language_summary(root: Path, key: str, info: fmt.DatasetInfo) -> str:
    """What a language column holds, from the parquet footer alone: its row fields."""
    files = sorted((root / "data").glob("*/*.parquet"))[:1]
    if not files:
        return "annotations"
    try:
        schema = fmt.read_parquet_schema(files[0])
    except DatasetError:
        return "annotations (data file unreadable)"
    if key not in schema.names:
        return "annotations (column missing)"
    return "annotations" + (f": {problem}" if (problem := language.arrow_type_problem(
        schema.field(key).type, key)) else f", rows of {', '.join(language.fields_of(key))}")


def _duration(seconds: float) -> str:
    minutes, sec = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h{minutes:02d}m{sec:04.1f}s" if hours else f"{minutes}m{sec:04.1f}s"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


def _disk_usage(root: Path, video_keys: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes and file counts for data/, meta/ and each camera's videos/<key>/ (and anything else as 'other')."""
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).parts
        if rel[0] == "videos" and len(rel) > 1 and rel[1] in video_keys:
            part = f"videos/{rel[1]}"
        elif rel[0] in ("data", "meta", "images"):
            part = rel[0]
        else:
            part = "other"
        sizes[part] = sizes.get(part, 0) + path.stat().st_size
        counts[part] = counts.get(part, 0) + 1
    return sizes, counts


def summarize(root: str | Path) -> DatasetSummary:
    """Schema, episodes, tasks, sizes on disk and codecs of a dataset, from its metadata (DatasetError if broken)."""
    root = Path(root)
    info = fmt.read_info(root)
    tasks = fmt.read_tasks(root)
    lengths = fmt.read_episodes_table(root)["length"].to_numpy()
    stats = fmt.read_stats(root) or {}
    features = [
        FeatureSummary(key, ft["dtype"], list(ft["shape"]), _names_summary(ft.get("names")),
                       _codec_summary(ft) if ft["dtype"] == "video" else
                       _language_summary(root, key, info) if language.is_language(ft) else "")
        for key, ft in info.features.items()
    ]
    numeric = [k for k in fmt.stats_features(info.features) if not fmt.is_camera(info.features[k])]
    quantiles = bool(numeric) and all("q01" in stats.get(k, {}) and "q99" in stats.get(k, {}) for k in numeric)
    sizes, counts = _disk_usage(root, info.video_keys)
    tools = _tool_names(info.tools)
    return DatasetSummary(root, info.codebase_version, info.fps, info.robot_type, info.total_episodes,
                          info.total_frames, tasks, features, lengths, sizes, counts, quantiles, info.chunks_size,
                          info.data_files_size_in_mb, info.video_files_size_in_mb, tools)


__all__ = ["DatasetSummary", "FeatureSummary", "summarize"]
