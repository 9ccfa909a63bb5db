"""Simulators as slow as real ones: an adapter whose every step also waits a random time with a long tail.

RL frameworks idle on slow simulators (GPU physics, photoreal rendering, a remote or real robot), and the slowest
episode of a rollout sets its pace; asynchronous RL exists for exactly that (RL-VLA3, arXiv 2602.05765). MetaWorld
steps in ~10 ms of CPU and evenly, so benchmarks and tests add the latency on top, as a wait that takes no CPU (the
sleeping simulator is somewhere else): lognormal per step, with ``median_ms`` and p99 = ``p99_ratio`` x the
median (sigma = ln(p99_ratio) / 2.326). The draws follow the episode's seed, so an episode is as reproducible as
without the wrapper.

    --env=roboscale.sim.latency:METAWORLD_LONG_TAIL     # MetaWorld, +20 ms median per step, p99 200 ms
    --env=roboscale.sim.latency:METAWORLD_SLOW          # +100 ms median, p99 1 s: a LIBERO-class simulator elsewhere
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from roboscale.sim.env import Env, EnvRequest, EnvSpec, Step

Z_99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(frozen=True)
class StepLatency:
    median_ms: float
    p99_ratio: float = 10.0

    @property
    def sigma(self) -> float:
        return math.log(self.p99_ratio) / Z_99

    def draws(self, seed: int) -> np.random.Generator:
        return np.random.default_rng([seed, 0x5EED])


class SlowEnv:
    """``env`` whose ``step`` also waits its latency draw (counted in ``timings["latency_s"]``)."""

    def __init__(self, env: Env, latency: StepLatency):
        self.env, self.latency = env, latency
        self.task, self.instruction, self.camera_names = env.task, env.instruction, env.camera_names
        self.timings, self.max_steps = env.timings, env.max_steps
        self.timings.setdefault("latency_s", 0.0)
        self._rng = latency.draws(0)

    def reset(self, seed: int, scene: int = 0) -> dict[str, Any]:
        self._rng = self.latency.draws(seed)
        return self.env.reset(seed, scene)

    def step(self, action: Any, render: bool = True) -> Step:
        wait = self.latency.median_ms / 1000 * math.exp(self.latency.sigma * self._rng.standard_normal())
        time.sleep(wait)
        self.timings["latency_s"] += wait
        return self.env.step(action, render=render)

    def close(self) -> None:
        self.env.close()


def with_latency(spec: EnvSpec, latency: StepLatency, name: str) -> EnvSpec:
    """``spec`` whose environments are ``SlowEnv``s. ``name``: how ``env_spec`` finds it (``module:ATTRIBUTE``; the
    rollout workers receive the name alone)."""
    def make(task: str, request: EnvRequest) -> SlowEnv:
        return SlowEnv(spec.make(task, request), latency)

    return dataclasses.replace(spec, name=name, make=make)


def _metaworld_with(latency: StepLatency, name: str) -> EnvSpec:
    from roboscale.sim.metaworld import ENV_SPEC

    return with_latency(ENV_SPEC, latency, f"{__name__}:{name}")


METAWORLD_LONG_TAIL = _metaworld_with(StepLatency(median_ms=20.0, p99_ratio=10.0), "METAWORLD_LONG_TAIL")
"""MetaWorld with a lognormal step latency of median 20 ms and p99 200 ms (mean ~33 ms)."""
METAWORLD_SLOW = _metaworld_with(StepLatency(median_ms=100.0, p99_ratio=10.0), "METAWORLD_SLOW")
"""MetaWorld with a lognormal step latency of median 100 ms and p99 1 s (mean ~163 ms): a simulator as slow as a
LIBERO step on the CPU (~100-150 ms: docs/benchmarks.md), run on other machines."""
