"""Uncertainty of success rates: Wilson score intervals and the two-proportion z-test.

A success rate from 10 or 50 episodes is an estimate; reports show its interval and comparisons say whether a
difference is more than sampling noise. Standard library only (``statistics.NormalDist``): no scipy needed.
"""

from __future__ import annotations

import math
from statistics import NormalDist


def _z(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a success rate ``successes / n``.

    Unlike the normal (Wald) interval it stays inside [0, 1] and is not zero-width at 0/n or n/n, which is where
    robot policies often are. ``n == 0`` gives (0, 1): nothing is known.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, center - half)  # exactly 0 at 0/n (rounding leaves ~1e-17)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def two_proportion_test(s1: int, n1: int, s2: int, n2: int) -> float:
    """Two-sided p-value of the pooled two-proportion z-test of ``s1/n1`` against ``s2/n2``.

    z = (p1 - p2) / sqrt(p (1 - p) (1/n1 + 1/n2)) with the pooled rate p = (s1 + s2) / (n1 + n2); p-value
    = 2 (1 - Phi(|z|)). Edge cases: an empty sample (``n1`` or ``n2`` 0) gives 1.0 (no evidence of a difference);
    so does a pooled rate of 0 or 1 (both runs failed, or both succeeded, every episode: the rates are equal and
    the standard error is 0). The normal approximation is rough below ~5 successes and ~5 failures per run; the
    reports state the test so readers can judge.
    """
    for s, n in ((s1, n1), (s2, n2)):
        if n < 0 or not 0 <= s <= n:
            raise ValueError(f"need 0 <= successes <= n, got {s} of {n}")
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = (s1 + s2) / (n1 + n2)
    if pooled in (0.0, 1.0):
        return 1.0
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    z = (s1 / n1 - s2 / n2) / se
    return math.erfc(abs(z) / math.sqrt(2))  # = 2 (1 - Phi(|z|)), without cancellation for large |z|
