"""What a policy is built from, read off the loader's sources: features, fps, cameras, tasks and merged stats.

The same for a raw dataset, a lake or a mixture, so the model side never opens a dataset itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from roboscale.data.lerobot.depth import is_depth_map
from roboscale.data.lerobot.stats import aggregate_stats
from roboscale.data.loading.source import FrameSource


@dataclass
class SourceMeta:
    """What ``roboscale.models.registry.build_policy`` reads from a dataset, for any source or mixture."""

    root: str
    features: dict[str, Any]
    fps: float
    camera_keys: list[str]
    task_list: list[str]
    stats: dict[str, Any] | None
    depth_keys: list[str] = field(default_factory=list)  # cameras holding depth maps (LeRobot 0.6), not RGB


def source_meta(sources: Sequence[FrameSource], names: Sequence[str]) -> SourceMeta:
    """Features, fps and cameras of the first source; tasks of all; stats merged over the sources."""
    first = sources[0]
    tasks = list(dict.fromkeys(t for s in sources for t in s.tasks))
    stats = first.stats
    if len(sources) > 1 and all(s.stats for s in sources):
        common = set.intersection(*(set(s.stats) for s in sources))
        stats = aggregate_stats([{k: s.stats[k] for k in common} for s in sources])
    return SourceMeta(root=", ".join(names), features=dict(first.features), fps=float(first.fps),
                      camera_keys=list(first.camera_keys), task_list=tasks, stats=stats,
                      depth_keys=[k for k in first.camera_keys if is_depth_map(first.features[k])])
