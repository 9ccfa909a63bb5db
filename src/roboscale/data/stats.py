"""Feature statistics with LeRobot's semantics: per episode, then aggregated over episodes.

Per episode (``compute_episode_stats``):
- numeric features: exact min/max/mean/std (population std) over the episode's frames, reduced over time, so a
  (D,) feature has (D,) stats and a scalar has (1,). Quantiles come from ``np.quantile`` (linear interpolation) over
  the episode; LeRobot uses a 5000-bin histogram instead, so our quantiles are exact where LeRobot's are
  approximate (they agree to the histogram's resolution).
- images/videos (uint8 HxWxC): a subset of frames (evenly spaced, ``num_image_samples``), downsampled to a longest
  side of ~150 px when larger than 300 px, scaled to [0, 1]; stats per channel with shape (C, 1, 1).
  ``count`` is the number of sampled frames.

Aggregation (``aggregate_stats``): min of mins, max of maxes, count-weighted mean, pooled variance
``Σ c_i (σ_i² + (μ_i − μ)²) / Σ c_i``, summed count. Quantiles cannot be merged exactly; we keep LeRobot's
conservative envelope: the min over episodes for q01/q10/q50 and the max for q90/q99.

min/max keep integer and bool dtypes (as LeRobot's stats do); everything else is float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from roboscale.data.lerobot_format import QUANTILES, feature_shape, is_camera, stats_features

Stats = dict[str, np.ndarray]

_MIN_SAMPLES = 100
_MAX_SAMPLES = 10_000
_DOWNSAMPLE_ABOVE = 300
_DOWNSAMPLE_TARGET = 150


def num_image_samples(n_frames: int) -> int:
    """How many frames of an episode feed the image stats: all when < 100, else max(100, min(N^0.75, 10000))."""
    if n_frames < _MIN_SAMPLES:
        return n_frames
    return max(_MIN_SAMPLES, min(int(n_frames**0.75), _MAX_SAMPLES))


def image_sample_indices(n_frames: int) -> np.ndarray:
    return np.round(np.linspace(0, n_frames - 1, num_image_samples(n_frames))).astype(np.int64)


def _downsample(frames: np.ndarray) -> np.ndarray:
    """Stride-subsample [N,H,W,C] frames so the longest side is ~150 px (only when it is over 300 px)."""
    longest = max(frames.shape[1], frames.shape[2])
    if longest <= _DOWNSAMPLE_ABOVE:
        return frames
    step = longest // _DOWNSAMPLE_TARGET
    return frames[:, ::step, ::step]


def _reduce(values: np.ndarray, axis: tuple[int, ...], minmax_dtype: np.dtype) -> Stats:
    """Stats of ``values`` over ``axis``; ``values`` must already be float64 except for min/max."""
    as_float = values.astype(np.float64, copy=False)
    stats: Stats = {
        "min": np.min(values, axis=axis).astype(minmax_dtype),
        "max": np.max(values, axis=axis).astype(minmax_dtype),
        "mean": np.mean(as_float, axis=axis),
        "std": np.std(as_float, axis=axis),
    }
    quantiles = np.quantile(as_float, list(QUANTILES.values()), axis=axis)
    stats.update({name: quantiles[i] for i, name in enumerate(QUANTILES)})
    return stats


_MINMAX_DTYPE = {"i": np.int64, "u": np.int64, "b": np.bool_}


def numeric_stats(values: np.ndarray, shape: tuple[int, ...]) -> Stats:
    """Stats over time of ``values`` [N, *shape] (scalars may come as [N])."""
    values = np.asarray(values).reshape((len(values), *shape))
    stats = _reduce(values, (0,), np.dtype(_MINMAX_DTYPE.get(values.dtype.kind, np.float64)))
    stats["count"] = np.array([len(values)], dtype=np.int64)
    return stats


def image_stats(frames: np.ndarray) -> Stats:
    """Per-channel stats in [0, 1] of uint8 frames [N, H, W, C]; each stat has shape (C, 1, 1)."""
    sampled = _downsample(frames[image_sample_indices(len(frames))])
    scaled = sampled.astype(np.float64) / 255.0
    stats = {k: v.reshape(-1, 1, 1) for k, v in _reduce(scaled, (0, 1, 2), np.dtype(np.float64)).items()}
    stats["count"] = np.array([len(sampled)], dtype=np.int64)
    return stats


def compute_episode_stats(
    episode: Mapping[str, np.ndarray], features: Mapping[str, Mapping[str, Any]]
) -> dict[str, Stats]:
    """Stats of one episode; ``episode[key]`` is [N, *shape] (cameras uint8 [N,H,W,C]) for every stats feature."""
    out: dict[str, Stats] = {}
    for key in stats_features(features):
        ft = features[key]
        out[key] = image_stats(episode[key]) if is_camera(ft) else numeric_stats(episode[key], feature_shape(ft))
    return out


def _aggregate_feature(per_episode: Sequence[Stats]) -> Stats:
    counts = np.array([int(s["count"][0]) for s in per_episode], dtype=np.float64)
    total = counts.sum()
    weights = counts.reshape((-1,) + (1,) * per_episode[0]["mean"].ndim)
    means = np.stack([s["mean"] for s in per_episode])
    stds = np.stack([s["std"] for s in per_episode])
    mean = (weights * means).sum(axis=0) / total
    var = (weights * (stds**2 + (means - mean) ** 2)).sum(axis=0) / total
    out: Stats = {
        "min": np.min(np.stack([s["min"] for s in per_episode]), axis=0),
        "max": np.max(np.stack([s["max"] for s in per_episode]), axis=0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.array([int(total)], dtype=np.int64),
    }
    for name, q in QUANTILES.items():
        if all(name in s for s in per_episode):
            stacked = np.stack([s[name] for s in per_episode])
            out[name] = np.min(stacked, axis=0) if q <= 0.5 else np.max(stacked, axis=0)
    return out


def aggregate_stats(per_episode: Sequence[Mapping[str, Stats]]) -> dict[str, Stats]:
    """Merge per-episode stats (``[{feature: {stat: array}}]``); associative, so it can run incrementally."""
    keys: list[str] = []
    for ep in per_episode:
        keys += [k for k in ep if k not in keys]
    return {k: _aggregate_feature([ep[k] for ep in per_episode if k in ep]) for k in keys}
