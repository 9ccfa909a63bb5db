"""`roboscale rl`: RL post-training of a flow-matching policy in closed loop (GRPO, PPO)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from roboscale.config import register_lazy
from roboscale.configs.rollout import RolloutConfig, SDESampler
from roboscale.configs.train import OptimizerConfig, TrainerConfig
from roboscale.errors import ConfigError

REWARDS = ("success", "shaped")
MODES = ("sync", "async")
SCHEDULES = ("exact", "bounded")
PLACEMENTS = ("colocated", "disaggregated")
REFUSED_TRAINER_OPTIONS = {
    "grad_accum": "RL's micro-batches are its episode groups (one per group, as they finish); a step is one rollout",
    "fp8": "not supported by `roboscale rl` yet (untried with its objective and its published weights)",
    "compile": "not supported by `roboscale rl` yet (untried with its objective's denoising chains)",
}
"""The Trainer's options `roboscale rl` does not take, and why: given, they are refused (never ignored)."""


@dataclass(frozen=True)
class Algorithm:
    """An RL algorithm (``--rl.algorithm=NAME``, its options ``--rl.algorithm.*``): its hyperparameters, what it
    needs of the policy (``critic``: a value head) and the advantages of a group of episodes; the loss is the
    clipped policy-gradient surrogate every algorithm shares (``roboscale.rl.objective``), plus ``critic_loss``
    where there is a critic. One module each under ``roboscale/rl/algorithms/``, registered in ``ALGORITHMS``
    (docs/architecture.md). This base class holds no code: it is what configs may import."""

    type: ClassVar[str] = ""
    critic: ClassVar[bool] = False
    """Whether the policy needs a value head (PPO's critic), of ``value_head_dim``."""
    value_head_dim: ClassVar[int] = 0
    min_group_size: ClassVar[int] = 1
    """Episodes per group its advantages need (2 for those that compare a group's episodes)."""

    def check(self, options: RLOptions) -> None:
        """A ConfigError for options this algorithm cannot run with (checked when the config is built)."""
        if options.group_size < self.min_group_size:
            raise ConfigError(f"--rl.group_size must be at least {self.min_group_size} for {self.type} (its "
                              "advantages compare the episodes of a group)")

    def advantages(self, returns: Any, trajectories: list[Any], reward: str) -> tuple[list[Any], list[Any] | None]:
        """Per episode of one group (``returns`` [N], their ``trajectories``): its advantage (one value, or one
        per chunk) and, with a critic, its chunks' value targets (else None)."""
        raise NotImplementedError

    def critic_loss(self, value: Any, target: Any) -> Any:
        """The critic's regression term added to the loss (an algorithm with a critic defines it)."""
        raise NotImplementedError


ALGORITHMS = {"grpo": "roboscale.rl.algorithms.grpo:GRPO", "ppo": "roboscale.rl.algorithms.ppo:PPO",
              "rloo": "roboscale.rl.algorithms.rloo:RLOO"}
"""``--rl.algorithm`` names -> their class ("module:Class", imported when chosen): the one place an algorithm
registers."""
for _name, _path in ALGORITHMS.items():
    register_lazy(Algorithm, _name, _path)


def default_algorithm() -> Algorithm:
    from roboscale.config import choices

    return choices(Algorithm)["grpo"]()


@dataclass
class RLOptions:
    """The algorithm and what one global step rolls out."""

    mode: str = "sync"
    """sync: roll out the whole rollout, then train on it (the baseline). async: the three levels decoupled (RL-VLA3):
    simulators and generators run the next rollouts while the trainer trains, up to --rl.max_staleness rollouts
    ahead, and the trainer computes the gradients of each episode group as it finishes (an optimizer step still
    sees exactly the whole rollout)."""
    max_staleness: int = 1
    """async: how many rollouts' updates the acting weights may lag behind the ones trained (0: the weights a
    sync run acts with, the same losses step by step, the gain only from overlapping the gradients with the
    simulators). PPO's clipped importance ratio corrects for the lag."""
    schedule: str = "exact"
    """async: which weights a rollout acts with. exact: rollout k acts, every chunk of it, with exactly the weights
    trained on max(0, k - max_staleness) rollouts (the generators wait for them if the trainer is late, and never
    take newer ones), so a run is reproducible and a resume continues it exactly (the checkpoint keeps the older
    weights its next rollouts act with: max_staleness copies of the model); consecutive rollouts overlap only
    while they act with the same weights. bounded: a rollout starts as soon as the weights are at most
    max_staleness rollouts behind and takes newer ones as they come (RL-VLA3's bound): the last percent of
    throughput (benchmarks/rl.py), not reproducible."""
    placement: str = "colocated"
    """colocated: generators (the inference) on the trainer's devices (GPU: the same one; CPU: all cores shared).
    disaggregated: on their own: GPU, device local_rank + ranks per node (twice the GPUs); CPU, the rollout
    processes on one half of the cores, the trainer on the other."""
    algorithm: Algorithm = field(default_factory=default_algorithm)
    """grpo: group-relative advantages over the episodes of one initial state (no critic); rloo: the return
    against the mean of the group's other episodes (leave-one-out, no critic); ppo: GAE with a value head on the
    policy's features (its options: --rl.algorithm.gamma, gae_lambda, value_coef, value_head_dim)."""
    group_size: int = 8
    """Episodes per initial state and step (GRPO's group; PPO: the same episodes, advantages from the critic)."""
    states_per_task: int = 1
    """Initial states per task and rollout: a rollout is tasks x states_per_task x group_size episodes."""
    epochs: int = 1
    """Optimizer steps on each rollout (PPO's update epochs): each takes the whole rollout, and from the second
    on the clipped importance ratio keeps the update near the weights that acted. --steps, --save_freq and
    --eval.every count optimizer steps and must be multiples of it (checkpoints fall between rollouts)."""
    reward: str = "success"
    """success: 1 at the step an episode succeeds, else 0 (sparse); shaped: the simulator's own per-step reward."""
    max_steps: int = 200
    """Steps before an episode is cut off (a failure)."""
    clip: float = 0.2
    """The clipped surrogate every algorithm trains with (PPO's, which GRPO and RLOO use too): updates stop pulling
    once a chunk's likelihood ratio leaves [1 - clip, 1 + clip]."""
    seed: int = 100_000
    """Initial states of step s are drawn from (seed, s): disjoint from the demonstrations' (0) and evaluation's
    (1000) seeds."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--rl.mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--rl.schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"--rl.placement must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        if self.max_staleness < 0:
            raise ConfigError(f"--rl.max_staleness must be >= 0, got {self.max_staleness}")
        if self.reward not in REWARDS:
            raise ConfigError(f"--rl.reward must be one of {list(REWARDS)}, got {self.reward!r}")
        for name in ("group_size", "states_per_task", "epochs", "max_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--rl.{name} must be a positive integer, got {getattr(self, name)}")
        if not 0 < self.clip < 1:
            raise ConfigError(f"--rl.clip must be in (0, 1), got {self.clip}")
        self.algorithm.check(self)


@dataclass
class RLConfig(TrainerConfig):
    """`roboscale rl`: post-train a supervised checkpoint with RL in the simulator; checkpoints that `roboscale
    eval`, `export` and `report` take like any training run's. The Trainer's options are `roboscale train`'s
    (TrainerConfig), with RL's defaults: a global batch is the episodes of one rollout (rl.*)."""

    policy_path: str = ""
    """The supervised policy to start from: a training output_dir (its last checkpoint), checkpoints/<step> or
    a pretrained_model directory."""
    env: str = "metaworld"
    """The simulator adapter (metaworld, libero, or package.module:SPEC)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    """The simulator's own options (``--env_options.NAME=VALUE``; LIBERO: settle_steps)."""
    tasks: list[str] = field(default_factory=list)
    """Tasks or suites to train on."""
    rl: RLOptions = field(default_factory=RLOptions)
    """The algorithm and the episodes of a step."""
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(workers=2, envs_per_worker=4,
                                                                         sampler=SDESampler()))
    """Env workers and inference servers, and the stochastic sampler the episodes act with and the objective's
    likelihoods are computed by (--rollout.sampler.noise_level, sde_steps). Evaluation keeps the deterministic
    sampler."""
    # RL's defaults for the Trainer's options (their meaning is TrainerConfig's)
    steps: int = 200
    output_dir: str = "outputs/rl"
    save_freq: int = 25
    log_freq: int = 1
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5, warmup_steps=0,
                                                                               min_lr_ratio=1.0))
    """AdamW; RL's default is a small constant learning rate."""

    def __post_init__(self) -> None:
        if not self.rollout.sampler.stochastic:
            raise ConfigError(f"--rollout.sampler={self.rollout.sampler.type}: RL trains on the likelihoods of the "
                              "chunks it acted with, which only the stochastic sampler has (--rollout.sampler=sde)")
        super().__post_init__()
        for name, refused in REFUSED_TRAINER_OPTIONS.items():
            if getattr(self, name) != getattr(TrainerConfig, name):
                raise ConfigError(f"--{name}: {refused}")
        epochs = self.rl.epochs
        for name, value in (("steps", self.steps), ("save_freq", self.save_freq), ("eval.every", self.eval.every)):
            if value % epochs:
                raise ConfigError(f"--{name}={value} is not a multiple of --rl.epochs={epochs}: a checkpoint must fall "
                                  "between rollouts (a resume rolls out again)")
