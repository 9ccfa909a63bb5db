"""The rollout engine's options: how many env workers and inference servers, how observations are batched, and
how crashed or hung simulators are retried (shared by `roboscale eval` and, later, RL post-training)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from roboscale.config import register_lazy
from roboscale.errors import ConfigError

INFERENCE_MODES = ("auto", "server", "worker")
RENDER_MODES = ("on_demand", "every_step")


@dataclass
class Sampler:
    """How the policy samples a chunk (``--rollout.sampler=NAME``, its options ``--rollout.sampler.*``): the one
    place its options live, read by the processes that predict and by RL's objective (whose likelihoods are the
    sampler's)."""

    type: ClassVar[str] = ""
    stochastic: ClassVar[bool] = False
    """Whether a chunk's denoising chain is drawn and recorded with it (a likelihood exists: RL)."""


@dataclass
class ODESampler(Sampler):
    """ode: the policy's deterministic Euler steps from the episode's noise (evaluation, serving)."""

    type: ClassVar[str] = "ode"


@dataclass
class SDESampler(Sampler):
    """sde: the stochastic sampler of RL post-training (Flow-SDE): step noise drawn per episode and chunk as well,
    and the denoising chain recorded with each chunk."""

    type: ClassVar[str] = "sde"
    stochastic: ClassVar[bool] = True
    noise_level: float = 1.0
    """The noise level g (> 0): the standard deviation of a step is g * sqrt(1 / steps). Exploration, and what
    makes a chunk's likelihood exist; only the stochastic steps' noise is credited by the likelihood, not the
    chunk's starting noise. At 1.0 (with one stochastic step) it spreads the demo policy's actions ~1.5x more than
    the starting noise does, at 0.5 only half as much, and RL did not lift the weak tasks (docs/benchmarks.md)."""
    sde_steps: int = 1
    """Denoising steps per chunk that draw noise (chosen per episode and chunk), the others following the ODE:
    πRL's hybrid ODE-SDE sampling. A chunk's likelihood is that of its stochastic steps, so RL's training runs the
    action expert this many times per chunk instead of num_inference_steps. 0: every step (the full Flow-SDE
    chain)."""

    def __post_init__(self) -> None:
        if not self.noise_level > 0:  # `not >`: NaN too
            raise ConfigError(f"--rollout.sampler.noise_level must be > 0, got {self.noise_level}")
        if self.sde_steps < 0:
            raise ConfigError(f"--rollout.sampler.sde_steps must be >= 0, got {self.sde_steps}")


SAMPLERS = {"ode": "roboscale.configs.rollout:ODESampler", "sde": "roboscale.configs.rollout:SDESampler"}
for _name, _path in SAMPLERS.items():
    register_lazy(Sampler, _name, _path)


@dataclass
class RunnerConfig:
    """The process that runs the policy: where, with how many threads, and on what batches (the rollout's
    inference servers and workers, and `roboscale serve`, which nest it with their own defaults)."""

    device: str = "auto"
    """Where the policy runs: auto (cuda if available; on Ray, if the cluster has a GPU, which the inference
    servers then reserve), cpu, cuda, cuda:N."""
    threads: int = 0
    """torch threads of each process that runs the policy (0: the machine's cores over the processes sharing
    them)."""
    max_batch_size: int = 32
    """Observations predicted together at most: a batch goes as soon as this many wait..."""
    batch_timeout_ms: float = 5.0
    """...or this long after the first of them arrived (sooner when every client that may ask has asked)."""

    def __post_init__(self) -> None:
        if self.max_batch_size <= 0:
            raise ConfigError(f"runner.max_batch_size must be a positive integer, got {self.max_batch_size}")
        if self.threads < 0:
            raise ConfigError(f"runner.threads must be >= 0, got {self.threads}")
        if not (math.isfinite(self.batch_timeout_ms) and self.batch_timeout_ms >= 0):
            raise ConfigError(f"runner.batch_timeout_ms must be >= 0, got {self.batch_timeout_ms}")


@dataclass
class RolloutConfig:
    """Env workers step simulators; inference servers run the policy on dynamic batches of their observations."""

    workers: int = 2
    """Env worker processes."""
    envs_per_worker: int = 4
    """Environments each worker steps (episodes it runs at once)."""
    sub_batches: int = 2
    """Groups a worker's environments are split into: one group steps while another waits for its actions, so
    simulation overlaps with inference."""
    spare_envs: int = 4
    """Built environments each env worker keeps for reuse after their slots moved to other tasks (the oldest
    beyond this many is closed): a MetaWorld environment takes ~0.8 s of CPU to build and ~120 MB to keep, and
    runs that alternate between tasks (RL steps, evaluation of several tasks) would otherwise rebuild them."""
    inference: str = "auto"
    """server: inference servers batch the observations of all workers (one copy of the policy per server, on its
    GPU); worker: each worker holds its own policy and predicts for its own environments, in one batch (or in
    slices of max_batch_size); auto: worker where the policy runs on the CPU (there a server only takes a core from
    the workers: 3.18x the batch-of-one baseline against the server's 2.31x on 2 cores, docs/benchmarks.md),
    server where it runs on a GPU."""
    render: str = "on_demand"
    """on_demand: cameras render only the observations the policy will see (the step before each new chunk, every
    n_action_steps) and video frames; every_step: render every step (the design before the engine; a baseline)."""
    servers: int = 1
    """Inference server processes (one per GPU on a GPU machine)."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Where and on what batches the policy runs: in each inference server (--rollout.runner.max_batch_size
    observations of all workers at most), or in each worker that predicts for itself (its environments' in one
    batch, or in slices of max_batch_size); threads: 0 shares the cores among servers and env workers, or among
    the workers that predict for themselves."""
    sampler: Sampler = field(default_factory=ODESampler)
    """ode (deterministic: evaluation) or sde (stochastic: RL post-training; --rollout.sampler.noise_level,
    sde_steps)."""
    max_retries: int = 2
    """Times an episode whose simulator crashed or hung is retried (on new workers) before it counts as failed."""
    watchdog_s: float = 300.0
    """A worker or server silent for this long is taken for hung: it is killed and its episodes retried."""
    ray_address: str = ""
    """Run workers and servers as tasks on this Ray cluster (HOST:PORT); empty: local processes."""
    worker_cpus: float = 1.0
    """CPUs a Ray env worker reserves (fractions allowed)."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each env worker and inference server also reserves: they run only on nodes that
    offer them (`ray start --resources='{"sim": 8}'` on the simulation hosts, then '{"sim": 1}' here). The
    channels between the engine and its processes stay on the engine's own node."""
    server: str = ""
    """A running policy server (`roboscale serve`) to predict with, ws://HOST:PORT, instead of loading the policy
    here: each environment is one of its clients (the server batches them), episodes end as with local inference.
    Empty: the policy runs here."""
    server_api_key_file: str = ""
    """The file whose first line is the server's API key (a server on another interface requires one)."""

    def __post_init__(self) -> None:
        for name in ("workers", "envs_per_worker", "sub_batches", "servers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--rollout.{name} must be a positive integer, got {getattr(self, name)}")
        if self.inference not in INFERENCE_MODES:
            raise ConfigError(f"--rollout.inference must be one of {list(INFERENCE_MODES)}, got {self.inference!r}")
        if self.render not in RENDER_MODES:
            raise ConfigError(f"--rollout.render must be one of {list(RENDER_MODES)}, got {self.render!r}")
        if self.server and not self.server.startswith(("ws://", "wss://")):
            raise ConfigError(f"--rollout.server must be a ws://HOST:PORT address, got {self.server!r}")
        if self.server_api_key_file and not self.server:
            raise ConfigError("--rollout.server_api_key_file is the key of a --rollout.server, and none is given")
        if self.server and self.sampler.stochastic:
            raise ConfigError("--rollout.server predicts with the server's ode sampler; --rollout.sampler=sde needs "
                              "the policy here")
        if self.ray_resources and not self.ray_address:
            raise ConfigError("--rollout.ray_resources places Ray tasks: give --rollout.ray_address too")
        if any(not isinstance(v, int | float) or v <= 0 for v in self.ray_resources.values()):
            raise ConfigError(f"--rollout.ray_resources: each amount must be a positive number, got "
                              f"{self.ray_resources}")
        if self.max_retries < 0 or self.watchdog_s <= 0 or self.spare_envs < 0:
            raise ConfigError("--rollout.max_retries and spare_envs must be >= 0 and --rollout.watchdog_s > 0")
