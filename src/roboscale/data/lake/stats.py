"""Lake-wide stats, merged from the shards' partials: exact moments and pixel stats, quantiles within a bound.

Global stats (``manifest["stats"]``, LeRobot layout) are computed in parallel and merged exactly, see
``roboscale.data.lerobot.stats``. Pass 1 (inside the shard tasks) records per-shard ``Moments`` (count/mean/M2/min/
max, merged on the driver in shard order with Chan et al.'s formula: exact, reproducible) and exact 256-bin pixel
histograms per camera channel. Pass 2 (Ray tasks over groups of shards, reading only ``columns.parquet``: no
frames) fills per-dimension histograms of ``stats_bins`` bins over the global [min, max] from pass 1; their sum
gives q01..q99 within ``(max - min) / stats_bins`` of ``numpy.quantile`` of the pooled data
(``manifest["stats_quantile_error"]``). Camera stats are over every pixel of the resized image (not the padding)
and exact. LeRobot's ``stats.json`` quantiles merge per-episode quantiles (a count-weighted mean in releases
0.4.4-0.6.1, a min/max envelope on its main branch), neither a quantile of the dataset; the lake's are real
quantiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from safetensors.numpy import load as load_safetensors_bytes
from safetensors.numpy import load_file as load_safetensors

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.format import SHARD_STATS
from roboscale.data.lake.planning import BuildContext
from roboscale.data.lake.ray import HistogramTask, ray_map
from roboscale.data.lerobot import format as fmt
from roboscale.data.lerobot.stats import ByteHistogram, Histogram, Moments, finalize_numeric, merge_moments

_HISTOGRAM_GROUPS = 64  # stats pass 2 sums shards in at most this many tasks: bounds what returns to the driver


def merge_stats(ctx: BuildContext, metas: Sequence[Mapping[str, Any]], cfg: LakeConfig, cpus: float
                ) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Global stats from the shards' partials (moments, pixel histograms) plus pass-2 histograms."""
    partials = [load_safetensors(str(ctx.shard_dir(m["name"]) / SHARD_STATS)) for m in metas]
    moments = {key: merge_moments([Moments.from_arrays(p, f"{key}/") for p in partials]) for key in ctx.numeric}
    ranges = {key: (m.min, m.max) for key, m in moments.items()}
    names = [m["name"] for m in metas]
    per_group = -(-len(names) // _HISTOGRAM_GROUPS)
    groups = [names[i : i + per_group] for i in range(0, len(names), per_group)]
    rows = ray_map([{"shard": i} for i in range(len(groups))], HistogramTask(ctx, groups, ranges, cfg.stats_bins),
                   cpus)
    stats: dict[str, dict[str, np.ndarray]] = {}
    errors: dict[str, np.ndarray] = {}
    for key in ctx.numeric:
        lo, hi = ranges[key]
        hist = Histogram.empty(lo, hi, cfg.stats_bins)
        for row in rows:
            hist.counts += load_safetensors_bytes(bytes(row["counts"]))[key]
        ft = ctx.features[key]
        stats[key] = finalize_numeric(moments[key], hist, fmt.feature_shape(ft), ft["dtype"])
        errors[key] = hist.error_bound.reshape(fmt.feature_shape(ft))
    for key in ctx.cameras:
        pixels = ByteHistogram(sum(np.asarray(p[f"{key}/pixels"], dtype=np.int64) for p in partials))
        stats[key] = pixels.stats(frames_count=sum(int(m["num_frames"]) for m in metas))
        errors[key] = np.zeros_like(stats[key]["mean"])
    order = [k for k in ctx.features if k in stats]
    return {k: stats[k] for k in order}, {k: errors[k] for k in order}
