"""Mergeable statistics: exact moment merges, the histogram quantile bound, exact byte histograms, and why
LeRobot's quantile envelope is not a quantile."""

from __future__ import annotations

import numpy as np
import pytest

from roboscale.data.lerobot.format import QUANTILES
from roboscale.data.lerobot.stats import (
    ByteHistogram,
    Histogram,
    Moments,
    aggregate_stats,
    finalize_numeric,
    merge_moments,
    numeric_stats,
)


def _pooled_data(rng: np.random.Generator, n: int = 6000) -> np.ndarray:
    """Dimensions with different shapes: normal, heavy-tailed, discrete, constant, bimodal with a gap."""
    return np.stack([
        rng.normal(3.0, 2.0, n),
        rng.standard_cauchy(n),
        rng.integers(-3, 4, n).astype(np.float64),
        np.full(n, 0.25),
        np.where(rng.random(n) < 0.3, rng.normal(-50, 1, n), rng.normal(40, 0.5, n)),
    ], axis=1)


def _split(rng: np.random.Generator, data: np.ndarray, parts: int) -> list[np.ndarray]:
    cuts = np.sort(rng.choice(np.arange(1, len(data)), size=parts - 1, replace=False))
    return np.split(data, cuts)


@pytest.mark.parametrize("parts", [1, 2, 7, 40])
def test_moments_merge_equals_pooled(parts: int) -> None:
    rng = np.random.default_rng(parts)
    data = _pooled_data(rng) * 1e3 + 1e6  # a large offset is where naive sum-of-squares merges lose precision
    merged = merge_moments([Moments.of(p) for p in _split(rng, data, parts)])
    assert merged.count == len(data)
    np.testing.assert_array_equal(merged.min, data.min(axis=0))
    np.testing.assert_array_equal(merged.max, data.max(axis=0))
    np.testing.assert_allclose(merged.mean, data.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(merged.std, data.std(axis=0), rtol=1e-9, atol=1e-9)


def test_moments_merge_order_does_not_matter() -> None:
    rng = np.random.default_rng(0)
    parts = [Moments.of(p) for p in _split(rng, _pooled_data(rng), 9)]
    forward, backward = merge_moments(parts), merge_moments(parts[::-1])
    np.testing.assert_allclose(forward.mean, backward.mean, rtol=1e-14)
    np.testing.assert_allclose(forward.m2, backward.m2, rtol=1e-12)
    assert Moments.empty(5).merge(parts[0]) is parts[0]


@pytest.mark.parametrize("bins", [16, 256, 4096])
def test_histogram_quantiles_within_documented_bound(bins: int) -> None:
    rng = np.random.default_rng(bins)
    data = _pooled_data(rng)
    lo, hi = data.min(axis=0), data.max(axis=0)
    merged = None
    for part in _split(rng, data, 11):
        h = Histogram.empty(lo, hi, bins)
        h.add(part)
        merged = h if merged is None else merged.merge(h)
    assert merged is not None
    bound = merged.error_bound
    np.testing.assert_allclose(bound, (hi - lo) / bins)
    for q in (0.0, *QUANTILES.values(), 1.0):
        err = np.abs(merged.quantile(q) - np.quantile(data, q, axis=0))
        assert np.all(err <= bound * (1 + 1e-9) + 1e-12), f"q={q}: error {err} > bound {bound}"
    # the constant dimension is exact, and the bound is not vacuous on the normal dimension at fine bins
    assert merged.quantile(0.5)[3] == 0.25
    if bins == 4096:
        assert abs(merged.quantile(0.5)[0] - np.quantile(data[:, 0], 0.5)) < 0.01


def test_histogram_refuses_values_outside_range_and_mismatched_merge() -> None:
    h = Histogram.empty(np.zeros(2), np.ones(2), 8)
    with pytest.raises(ValueError, match="outside the histogram range"):
        h.add(np.array([[0.5, 1.5]]))
    with pytest.raises(ValueError, match="cannot be merged"):
        h.merge(Histogram.empty(np.zeros(2), np.full(2, 2.0), 8))


def test_byte_histogram_is_exact() -> None:
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, size=(30, 9, 7, 3), dtype=np.uint8)
    frames[..., 2] //= 4  # a channel that never reaches the top values
    merged = ByteHistogram.empty(3)
    for part in np.array_split(frames, 4):
        h = ByteHistogram.empty(3)
        h.add(part)
        merged = merged.merge(h)
    st = merged.stats(frames_count=len(frames))
    pixels = frames.reshape(-1, 3).astype(np.float64) / 255.0
    for name, ref in [("min", pixels.min(0)), ("max", pixels.max(0)), ("mean", pixels.mean(0)),
                      ("std", pixels.std(0))] + [(k, np.quantile(pixels, q, axis=0)) for k, q in QUANTILES.items()]:
        assert st[name].shape == (3, 1, 1)
        np.testing.assert_allclose(st[name].ravel(), ref, rtol=1e-12, atol=1e-15, err_msg=name)
    assert st["count"].tolist() == [30]


def test_finalize_numeric_keeps_lerobot_layout() -> None:
    values = np.array([[1, 0], [3, 1], [2, 1]], dtype=np.int64)
    m = Moments.of(values)
    h = Histogram.empty(m.min, m.max, 64)
    h.add(values)
    st = finalize_numeric(m, h, (2,), "int64")
    assert st["min"].dtype == np.int64 and st["min"].tolist() == [1, 0]
    assert st["max"].tolist() == [3, 1] and st["count"].tolist() == [3]
    assert set(st) == {"min", "max", "mean", "std", "count", *QUANTILES}
    ref = numeric_stats(values, (2,))  # the per-episode path agrees on a single part
    for k in ("min", "max", "mean", "std"):
        np.testing.assert_allclose(st[k], ref[k])


def test_lerobot_envelope_is_not_a_quantile() -> None:
    """The envelope of per-episode q01s is the q01 of the most extreme episode, not of the dataset."""
    rng = np.random.default_rng(5)
    # one outlier episode around -10, nineteen around 0: 5% of the frames sit at -10
    episodes = [rng.normal(loc=-10.0 if e == 0 else 0.0, scale=0.1, size=(200, 1)) for e in range(20)]
    pooled = np.concatenate(episodes)
    envelope = aggregate_stats([{"x": numeric_stats(e, (1,))} for e in episodes])["x"]
    m = merge_moments([Moments.of(e) for e in episodes])
    hist = Histogram.empty(m.min, m.max, 4096)
    for e in episodes:
        hist.add(e)
    true = np.quantile(pooled, 0.10)  # inside the bulk near 0
    assert abs(hist.quantile(0.10)[0] - true) <= hist.error_bound[0] * (1 + 1e-9)
    # LeRobot's "q10" is the outlier episode's q10, about 10 units away: thousands of bin widths off
    assert abs(envelope["q10"][0] - true) > 9.0
    assert abs(envelope["q10"][0] - true) > 1000 * hist.error_bound[0]
