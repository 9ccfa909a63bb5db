"""Ray for ``lake build``: start a local Ray of its own (loopback only) or join a cluster, run one Ray Data task
per item, and the tasks themselves (build a shard, sum a group of shards' histograms).

Shards are Ray Data tasks with fractional CPUs (``cpus_per_task``, 0.5 by default so a 2-core machine runs four at
a time and the driver is never starved) on a local Ray that listens on 127.0.0.1 only (``ensure_ray``) or an
existing cluster (``ray_address``; the workers need roboscale installed and the output on a shared filesystem).
Tasks return their errors as records: Ray would wrap an exception into a traceback string.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.planning import BuildContext, ShardSpec
from roboscale.data.lake.shards import build_shard, shard_histograms
from roboscale.errors import DatasetError, from_record, to_record
from roboscale.utils.ray_cluster import reachable_or_raise, start_or_join_ray


def ensure_ray(cfg: LakeConfig) -> bool:
    """Start (or join) Ray for a lake build; True when this call started it (and so should shut it down)."""
    return start_or_join_ray(cfg.ray_address, cfg.num_cpus, option="--ray-address",
                             missing="`roboscale lake build` needs Ray Data: pip install 'roboscale[lake]' (reading a "
                                     "built lake does not)")


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    reachable_or_raise(address, "--ray-address", timeout_s)


def ray_map(items: list[dict[str, Any]], fn: Callable[[dict[str, Any]], dict[str, Any]], cpus: float,
             ) -> list[dict[str, Any]]:
    """One Ray Data task per item (so each shard is its own unit of retry), results in item order."""
    import ray.data

    if not items:
        return []
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    rows = ds.map(fn, num_cpus=cpus).take_all()
    return sorted(rows, key=lambda r: r["shard"])


def raise_task_errors(rows: Sequence[Mapping[str, Any]]) -> None:
    """Shard tasks return their DatasetError as a record: Ray would wrap the exception into a traceback string."""
    errors = [json.loads(r["error"]) for r in rows if r["error"]]
    if errors:
        more = f" ({len(errors) - 1} more shards failed; finished shards are kept, rerun to resume)" if len(
            errors) > 1 else " (finished shards are kept: rerun to resume)"
        raise from_record({**errors[0], "message": errors[0]["message"] + more})


class BuildShardTask:
    """Builds the shard of a row (``build_shard``) and returns its shard.json, or its error as a record."""

    def __init__(self, ctx: BuildContext, specs: Sequence[ShardSpec]):
        self.ctx, self.specs = ctx, {s.shard: s for s in specs}

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        # A bad episode fails its shard only: the other shards still finish (and are kept for the resumed build).
        try:
            meta = build_shard(self.specs[int(row["shard"])], self.ctx)
        except DatasetError as err:
            return {"shard": int(row["shard"]), "meta": "", "error": json.dumps(to_record(err))}
        return {"shard": int(row["shard"]), "meta": json.dumps(meta), "error": ""}


class HistogramTask:
    """Sum of the histograms of a group of shards (row ``shard`` = group index)."""

    def __init__(self, ctx: BuildContext, groups: Sequence[Sequence[str]], ranges: Mapping[str, Any], bins: int):
        self.ctx, self.groups, self.ranges, self.bins = ctx, [list(g) for g in groups], ranges, bins

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        group = int(row["shard"])
        features = {key: self.ctx.features[key] for key in self.ctx.numeric}
        total: dict[str, np.ndarray] = {}
        for name in self.groups[group]:
            counts = shard_histograms(self.ctx.shard_dir(name), features, self.ranges, self.bins)
            total = {k: total[k] + v for k, v in counts.items()} if total else counts
        return {"shard": group, "counts": safetensors_bytes(total)}
