"""`roboscale rl`: options, resume, and the Trainer run with the RL job.

``RLConfig`` is the Trainer's own options (``TrainerConfig``) plus RL's, handed to the Trainer as they are; the
job (``rl/job.py``) says what a step trains on (its global batch: one rollout's episodes). The config travels in
each checkpoint (the job's state entry, ``training_state/rl_state.json``), so that ``--resume=true`` continues
with the options the run was started with; a resume may change only what does not change the run's trajectory
(steps, logging, saving, retention, the rollout processes but not their sampler, evaluation during training,
threads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roboscale.config import flat_options, from_dict, to_dict
from roboscale.configs.rl import RLConfig
from roboscale.errors import CheckpointError, ConfigError
from roboscale.utils.io import load_json

PROG = "roboscale rl"
# a copied run resumes where it now is (output_dir), as `train`'s does
RESUMABLE_CHANGES = ("steps", "save_freq", "log_freq", "checkpoint.", "num_threads", "resume", "rollout.",
                     "eval.", "output_dir")
TRAJECTORY_OPTIONS = ("rollout.sampler",)
"""Of the resumable prefixes' options, those that change what the episodes do (the sampler's draws)."""


def parse_rl_args(argv: list[str]) -> RLConfig:
    """``roboscale rl`` options; with ``--resume``, the options not given are the checkpoint's own."""
    from roboscale.train.resume import ResumableCommand, parse_resumable

    for arg in argv:  # the option's name before the Trainer's checkpoint section took it (a clear error, not a type's)
        if arg.startswith("--checkpoint=") and not arg.partition("=")[2].lstrip().startswith("{"):
            raise ConfigError("--checkpoint: the policy to start from is --policy_path now (--checkpoint.* is the "
                              "checkpoints' retention, as for `roboscale train`)")
    return parse_resumable(ResumableCommand(RLConfig, PROG, rl_state_file, saved_rl_config, _refuse_changes), argv)


def _refuse_changes(saved: RLConfig, merged: RLConfig, checkpoint: Path) -> None:
    before = flat_options(to_dict(saved))
    changed = [key for key, value in flat_options(to_dict(merged)).items()
               if before.get(key) != value
               and (not key.startswith(RESUMABLE_CHANGES) or key.startswith(TRAJECTORY_OPTIONS))]
    if changed:
        raise ConfigError(f"--resume: {', '.join(f'--{k}' for k in changed)} differ from the run's own options "
                          f"({rl_state_file(checkpoint)}); a resume continues the same run (start a new --output_dir "
                          "to change them)")


def rl_state_file(checkpoint: Path) -> Path:
    from roboscale.rl.job import STATE
    from roboscale.train.checkpoint import TRAINING_STATE

    return checkpoint / TRAINING_STATE / f"{STATE}_state.json"


RUNNER_OPTIONS = {"device": "device", "inference_threads": "threads", "max_batch_size": "max_batch_size",
                  "batch_timeout_ms": "batch_timeout_ms"}
"""``rollout.*`` options saved before the runner's section -> their name in ``rollout.runner``."""


def upgraded(config: dict[str, Any]) -> dict[str, Any]:
    """An RL config saved by an earlier version in today's shape: ``rl.algorithm`` a name with PPO's options
    beside it (now the algorithm's own), the sampler's options under ``rl`` (now ``rollout.sampler``), the
    runner's under ``rollout`` (now ``rollout.runner``), the policy to start from ``checkpoint`` and the retention
    ``checkpoints`` (now ``policy_path`` and the Trainer's ``checkpoint``)."""
    config = dict(config)
    if isinstance(config.get("checkpoint"), str):
        config["policy_path"] = config.pop("checkpoint")
    if "checkpoints" in config:
        config["checkpoint"] = config.pop("checkpoints")
    rl = dict(config.get("rl") or {})
    rollout = dict(config.get("rollout") or {})
    if isinstance(rl.get("algorithm"), str):
        algorithm = {"type": rl["algorithm"]}
        for name in ("gamma", "gae_lambda", "value_coef", "value_head_dim"):
            if name in rl:
                value = rl.pop(name)
                if algorithm["type"] == "ppo":
                    algorithm[name] = value
        rl["algorithm"] = algorithm
    if "noise_level" in rl or "sde_steps" in rl or not isinstance(rollout.get("sampler", {}), dict):
        sampler = {"type": "sde"}
        for name in ("noise_level", "sde_steps"):
            rollout.pop(name, None)  # the run overwrote them with rl's
            if name in rl:
                sampler[name] = rl.pop(name)
        rollout["sampler"] = sampler
    runner = {new: rollout.pop(old) for old, new in RUNNER_OPTIONS.items() if old in rollout}
    if runner:
        rollout["runner"] = {**rollout.get("runner", {}), **runner}
    if rl:
        config["rl"] = rl
    if rollout:
        config["rollout"] = rollout
    return config


def saved_rl_config(checkpoint: Path) -> RLConfig:
    path = rl_state_file(checkpoint)
    try:
        return from_dict(RLConfig, upgraded(load_json(path.read_text())["config"]))
    except FileNotFoundError:
        raise CheckpointError(path, "missing: not a checkpoint of `roboscale rl`") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(path, f"damaged ({type(exc).__name__}: {exc})") from None


def run_rl(cfg: RLConfig, progress: bool = True) -> Path:
    """Post-train ``cfg.policy_path`` and return the final checkpoint's ``pretrained_model``."""
    from roboscale.models.policy import resolve_checkpoint
    from roboscale.rl.job import RLJob
    from roboscale.sim.env import env_spec
    from roboscale.train.trainer import Trainer

    if not cfg.policy_path:
        raise ConfigError("--policy_path is required: the supervised policy to start from (a training output_dir, "
                          "checkpoints/<step> or pretrained_model)")
    if not cfg.tasks:
        raise ConfigError("--tasks is empty: name the tasks or suites to train on")
    tasks = env_spec(cfg.env).resolve_tasks(cfg.tasks)
    checkpoint = resolve_checkpoint(cfg.policy_path)
    return Trainer(cfg, job=RLJob(cfg, checkpoint, tasks), progress=progress).fit()
