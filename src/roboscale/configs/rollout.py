"""The rollout engine's options: how many env workers and inference servers, how observations are batched, and
how crashed or hung simulators are retried (shared by `roboscale eval` and, later, RL post-training)."""

from __future__ import annotations

from dataclasses import dataclass

from roboscale.errors import ConfigError

INFERENCE_MODES = ("auto", "server", "worker")
RENDER_MODES = ("on_demand", "every_step")
SAMPLERS = ("ode", "sde")


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
    max_batch_size: int = 32
    """A server runs the policy as soon as this many observations wait... (a worker that predicts itself runs it
    on at most this many at a time)"""
    batch_timeout_ms: float = 5.0
    """...or this long after the first of them arrived."""
    device: str = "auto"
    """Where the policy runs: auto (cuda if available; on Ray, if the cluster has a GPU, which the inference
    servers then reserve), cpu, cuda, cuda:N."""
    inference_threads: int = 0
    """torch threads of each inference process (0: the machine's cores over the processes sharing them: servers
    and env workers, or the workers that predict for themselves)."""
    max_retries: int = 2
    """Times an episode whose simulator crashed or hung is retried (on new workers) before it counts as failed."""
    watchdog_s: float = 300.0
    """A worker or server silent for this long is taken for hung: it is killed and its episodes retried."""
    ray_address: str = ""
    """Run workers and servers as tasks on this Ray cluster (HOST:PORT); empty: local processes."""
    worker_cpus: float = 1.0
    """CPUs a Ray env worker reserves (fractions allowed)."""
    sampler: str = "ode"
    """How the policy samples a chunk: ode (its deterministic Euler steps from the episode's noise: evaluation),
    sde (the stochastic sampler of RL post-training, Flow-SDE: step noise drawn per episode and chunk as well,
    and the denoising chain recorded with each chunk)."""
    noise_level: float = 0.5
    """The sde sampler's noise level g (> 0): the standard deviation of a step is g * sqrt(1 / steps)."""
    sde_steps: int = 0
    """Denoising steps of each chunk that draw noise under the sde sampler, chosen per episode and chunk; the
    others are the ODE's (πRL's hybrid ODE-SDE sampling: training then recomputes only those steps). 0: all."""
    server: str = ""
    """A running policy server (`roboscale serve`) to predict with, ws://HOST:PORT, instead of loading the policy
    here: each environment is one of its clients (the server batches them), episodes end as with local inference.
    Empty: the policy runs here."""
    server_api_key_file: str = ""
    """The file whose first line is the server's API key (a server on another interface requires one)."""

    def __post_init__(self) -> None:
        for name in ("workers", "envs_per_worker", "sub_batches", "servers", "max_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--rollout.{name} must be a positive integer, got {getattr(self, name)}")
        if self.inference not in INFERENCE_MODES:
            raise ConfigError(f"--rollout.inference must be one of {list(INFERENCE_MODES)}, got {self.inference!r}")
        if self.render not in RENDER_MODES:
            raise ConfigError(f"--rollout.render must be one of {list(RENDER_MODES)}, got {self.render!r}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--rollout.sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        if self.sampler == "sde" and not self.noise_level > 0:  # `not >`: NaN too
            raise ConfigError(f"--rollout.noise_level must be > 0 for --rollout.sampler=sde, got {self.noise_level}")
        if self.server and not self.server.startswith(("ws://", "wss://")):
            raise ConfigError(f"--rollout.server must be a ws://HOST:PORT address, got {self.server!r}")
        if self.server and self.sampler != "ode":
            raise ConfigError("--rollout.server predicts with the server's ode sampler; --rollout.sampler=sde needs "
                              "the policy here")
        if self.sde_steps < 0:
            raise ConfigError(f"--rollout.sde_steps must be >= 0, got {self.sde_steps}")
        if (self.batch_timeout_ms < 0 or self.max_retries < 0 or self.watchdog_s <= 0 or self.inference_threads < 0
                or self.spare_envs < 0):
            raise ConfigError("--rollout.batch_timeout_ms, max_retries, inference_threads and spare_envs must be "
                              ">= 0 and --rollout.watchdog_s > 0")
