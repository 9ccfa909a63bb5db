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
``Σ c_i (σ_i² + (μ_i − μ)²) / Σ c_i``, summed count. Quantiles cannot be merged exactly from per-episode
quantiles, and LeRobot has used two rules: releases 0.4.4 to 0.6.1 average the per-episode quantiles weighted by
their counts (what the ``meta/stats.json`` of datasets they wrote holds; ``tests/data/lerobot/test_lerobot_v06.py::
test_lerobot_044_stats_json_weights_episode_quantiles_by_count`` checks it on the 0.4.4 fixture), its main branch
(after 0.6.1) keeps a conservative envelope (the min over episodes for q01/q10/q50, the max for q90/q99). We keep
the envelope, main's rule. Neither is a quantile of the pooled data: the envelope's "q01" is the q01 of the most
extreme episode, so it drifts outward as episodes are added (see
``tests/data/lerobot/test_stats.py::test_lerobot_envelope_is_not_a_quantile``); the weighted mean can miss the
pooled quantile either way. The lake's stats (below) are real quantiles.

Mergeable global stats (``Moments``, ``Histogram``, ``ByteHistogram``; used by ``roboscale.data.lake``) are the
alternative when whole-dataset quantiles matter (pi0.5 normalizes with q01/q99):

- ``Moments``: count, mean, M2 (sum of squared deviations), min, max per dimension, merged with Chan et al.'s
  parallel update (``δ = μ_b − μ_a``, ``M2 = M2_a + M2_b + δ² n_a n_b / n``). Exact up to float64 rounding,
  independent of how the data was split; min/max are exact.
- ``Histogram``: a fixed-bin histogram per dimension over the **global** ``[min, max]`` (known from the merged
  ``Moments`` first, so partial histograms share their bins and merge by adding counts). Quantile ``q`` follows
  ``numpy.quantile``'s default (linear) definition: with ``h = q (n − 1)`` it interpolates the order statistics
  ``x_(⌊h⌋)`` and ``x_(⌊h⌋+1)``. Each order statistic is estimated inside the bin that holds it (ranks spread
  evenly through the bin), so each is off by at most one bin width and so is their interpolation:
  **|q̂ − q| ≤ (max − min) / bins** per dimension (plus float rounding at bin edges). ``Histogram.error_bound``
  returns that bound; the lake records it in its manifest.
- ``ByteHistogram``: uint8 camera pixels, 256 exact bins per channel, so mean/std/min/max and quantiles of the
  pooled pixels are all exact (no bound needed).

min/max keep integer and bool dtypes (as LeRobot's stats do); everything else is float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from roboscale.data.lerobot.format import QUANTILES, feature_shape, is_camera, stats_features

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


# --------------------------------------------------------------------------------------------------- mergeable


@dataclass
class Moments:
    """Exact, mergeable first and second moments plus min/max of ``D`` dimensions (float64)."""

    count: int
    mean: np.ndarray
    m2: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray) -> Moments:
        """Moments of ``values`` [N, D] (any numeric or bool dtype) over N."""
        x = np.asarray(values).reshape(len(values), -1).astype(np.float64, copy=False)
        if len(x) == 0:
            return cls.empty(x.shape[1])
        mean = x.mean(axis=0)
        return cls(len(x), mean, ((x - mean) ** 2).sum(axis=0), x.min(axis=0), x.max(axis=0))

    @classmethod
    def empty(cls, dim: int) -> Moments:
        return cls(0, np.zeros(dim), np.zeros(dim), np.full(dim, np.inf), np.full(dim, -np.inf))

    def merge(self, other: Moments) -> Moments:
        """Chan, Golub & LeVeque's pairwise update; associative and commutative up to float64 rounding."""
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / n)
        return Moments(n, mean, m2, np.minimum(self.min, other.min), np.maximum(self.max, other.max))

    @property
    def std(self) -> np.ndarray:
        """Population std (ddof=0), LeRobot's convention."""
        return np.sqrt(self.m2 / max(self.count, 1))

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}count": np.array([self.count], dtype=np.int64), f"{prefix}mean": self.mean,
                f"{prefix}m2": self.m2, f"{prefix}min": self.min, f"{prefix}max": self.max}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], prefix: str) -> Moments:
        return cls(int(arrays[f"{prefix}count"][0]), *(np.asarray(arrays[f"{prefix}{k}"], dtype=np.float64)
                                                      for k in ("mean", "m2", "min", "max")))


def merge_moments(parts: Sequence[Moments]) -> Moments:
    """Merge in the given order (callers pass a fixed order so results are reproducible bit for bit)."""
    out = parts[0]
    for part in parts[1:]:
        out = out.merge(part)
    return out


@dataclass
class Histogram:
    """Counts of ``D`` dimensions in ``bins`` equal bins over ``[lo, hi]`` (per dimension); merge by adding."""

    lo: np.ndarray
    hi: np.ndarray
    counts: np.ndarray  # int64 [D, bins]

    @classmethod
    def empty(cls, lo: np.ndarray, hi: np.ndarray, bins: int) -> Histogram:
        lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
        if bins < 1 or lo.shape != hi.shape or np.any(hi < lo):
            raise ValueError(f"bad histogram range/bins: bins={bins}, lo={lo}, hi={hi}")
        return cls(lo, hi, np.zeros((lo.size, bins), dtype=np.int64))

    @property
    def bins(self) -> int:
        return self.counts.shape[1]

    @property
    def error_bound(self) -> np.ndarray:
        """Largest |estimated − numpy.quantile| per dimension: one bin width."""
        return (self.hi - self.lo) / self.bins

    def add(self, values: np.ndarray) -> None:
        """Count ``values`` [N, D]; values outside [lo, hi] are an error (the range must be the global one)."""
        x = np.asarray(values).reshape(len(values), -1).astype(np.float64, copy=False)
        if len(x) == 0:
            return
        if np.any(x < self.lo) or np.any(x > self.hi):
            raise ValueError("values outside the histogram range: compute the range over all data first")
        width = self.hi - self.lo
        # Constant dimensions (width 0) put everything in bin 0; the multiply is monotone in x, which is all the
        # error bound needs (each value lands in the bin that contains it, up to rounding at the bin edges).
        scale = np.divide(self.bins, width, out=np.zeros_like(width), where=width > 0)
        idx = np.clip(np.floor((x - self.lo) * scale), 0, self.bins - 1).astype(np.int64)
        flat = idx + np.arange(x.shape[1], dtype=np.int64) * self.bins
        self.counts += np.bincount(flat.ravel(), minlength=self.counts.size).reshape(self.counts.shape)

    def merge(self, other: Histogram) -> Histogram:
        if self.counts.shape != other.counts.shape or not (
            np.array_equal(self.lo, other.lo) and np.array_equal(self.hi, other.hi)
        ):
            raise ValueError("histograms with different bins cannot be merged")
        return Histogram(self.lo, self.hi, self.counts + other.counts)

    def _order_statistic(self, rank: np.ndarray) -> np.ndarray:
        """Estimate of the ``rank``-th smallest value (0-based, one rank per dimension), inside its bin."""
        cum = np.cumsum(self.counts, axis=1)
        b = np.minimum((cum <= rank[:, None]).sum(axis=1), self.bins - 1)
        rows = np.arange(len(b))
        before = np.where(b > 0, cum[rows, np.maximum(b - 1, 0)], 0)
        inside = np.maximum(self.counts[rows, b], 1)
        position = (rank - before + 0.5) / inside  # ranks spread evenly through the bin, in (0, 1)
        return self.lo + (b + np.clip(position, 0.0, 1.0)) * (self.hi - self.lo) / self.bins

    def quantile(self, q: float) -> np.ndarray:
        """numpy.quantile(pooled, q, axis=0) within ``error_bound``."""
        n = int(self.counts[0].sum()) if len(self.counts) else 0
        if n == 0:
            raise ValueError("quantile of an empty histogram")
        h = q * (n - 1)
        k = int(np.floor(h))
        frac = h - k
        ranks = np.full(len(self.counts), float(k))
        lower = self._order_statistic(ranks)
        upper = self._order_statistic(np.minimum(ranks + 1, n - 1))
        return np.clip((1 - frac) * lower + frac * upper, self.lo, self.hi)

    def to_arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}lo": self.lo, f"{prefix}hi": self.hi, f"{prefix}counts": self.counts}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], prefix: str) -> Histogram:
        return cls(np.asarray(arrays[f"{prefix}lo"], dtype=np.float64), np.asarray(arrays[f"{prefix}hi"],
                   dtype=np.float64), np.asarray(arrays[f"{prefix}counts"], dtype=np.int64))


@dataclass
class ByteHistogram:
    """Exact per-channel histogram of uint8 pixels: counts [C, 256]."""

    counts: np.ndarray

    @classmethod
    def empty(cls, channels: int) -> ByteHistogram:
        return cls(np.zeros((channels, 256), dtype=np.int64))

    def add(self, frames: np.ndarray) -> None:
        """Count every pixel of uint8 frames [..., C]."""
        if frames.dtype != np.uint8:
            raise TypeError(f"ByteHistogram needs uint8 frames, got {frames.dtype}")
        flat = frames.reshape(-1, frames.shape[-1])
        for c in range(flat.shape[1]):
            self.counts[c] += np.bincount(flat[:, c], minlength=256)

    def merge(self, other: ByteHistogram) -> ByteHistogram:
        return ByteHistogram(self.counts + other.counts)

    def stats(self, frames_count: int) -> Stats:
        """LeRobot camera stats in [0, 1], shape (C, 1, 1): all exact (every pixel counted, integer bins).

        ``count`` is the number of frames (LeRobot's is the number of sampled frames)."""
        values = np.arange(256, dtype=np.float64) / 255.0
        n = self.counts.sum(axis=1).astype(np.float64)
        if np.any(n == 0):
            raise ValueError("stats of an empty ByteHistogram")
        mean = (self.counts * values).sum(axis=1) / n
        var = (self.counts * (values[None, :] - mean[:, None]) ** 2).sum(axis=1) / n
        present = self.counts > 0
        lo = np.array([values[np.flatnonzero(p)[0]] for p in present])
        hi = np.array([values[np.flatnonzero(p)[-1]] for p in present])
        out: Stats = {"min": lo, "max": hi, "mean": mean, "std": np.sqrt(var)}
        cum = np.cumsum(self.counts, axis=1)
        for name, q in QUANTILES.items():
            out[name] = np.array([_exact_quantile(cum[c], values, q) for c in range(len(cum))])
        out = {k: v.reshape(-1, 1, 1) for k, v in out.items()}
        out["count"] = np.array([frames_count], dtype=np.int64)
        return out


def _exact_quantile(cum: np.ndarray, values: np.ndarray, q: float) -> float:
    """numpy.quantile (linear) from the cumulative counts of a discrete variable taking ``values``."""
    n = int(cum[-1])
    h = q * (n - 1)
    k = int(np.floor(h))
    lower = values[int(np.searchsorted(cum, k, side="right"))]
    upper = values[int(np.searchsorted(cum, min(k + 1, n - 1), side="right"))]
    return float(lower + (h - k) * (upper - lower))


def finalize_numeric(moments: Moments, histogram: Histogram | None, shape: tuple[int, ...], dtype: Any) -> Stats:
    """LeRobot-layout stats of a numeric feature from merged partials; quantiles come from the histogram."""
    minmax = np.dtype(_MINMAX_DTYPE.get(np.dtype(dtype).kind, np.float64))
    out: Stats = {
        "min": moments.min.astype(minmax).reshape(shape),
        "max": moments.max.astype(minmax).reshape(shape),
        "mean": moments.mean.reshape(shape),
        "std": moments.std.reshape(shape),
        "count": np.array([moments.count], dtype=np.int64),
    }
    if histogram is not None:
        out.update({name: histogram.quantile(q).reshape(shape) for name, q in QUANTILES.items()})
    return out
