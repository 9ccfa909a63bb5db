"""`roboscale eval`: score a checkpoint in MetaWorld and write a report."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from roboscale.configs.eval import EvalConfig
from roboscale.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept pretrained_model dirs, step dirs and training output dirs."""
    path = Path(path)
    for candidate in (path, path / "pretrained_model", path / "checkpoints" / "last" / "pretrained_model"):
        # a pretrained_model directory is the checkpoint even when damaged: loading it names the missing file
        if (candidate / "config.json").is_file() or (candidate.name == "pretrained_model" and candidate.is_dir()):
            return candidate.resolve()
    last = path / "checkpoints" / "last"
    if last.is_symlink() and not last.exists():
        raise CheckpointError(last, f"points to {os.readlink(last)}, which does not exist; pass a checkpoint "
                                    "directory (checkpoints/<step>) instead")
    raise CheckpointError(path, "no policy checkpoint here (expected config.json + model.safetensors)")


def evaluate(cfg: EvalConfig, progress: bool = True, label: str = "") -> dict:
    from roboscale.eval.report import write_report
    from roboscale.eval.rollout import RolloutJob, run_rollouts
    from roboscale.models.policy import Policy, read_policy_config
    from roboscale.sim.experts import episode_seed
    from roboscale.sim.metaworld import CAMERA_ALIASES, resolve_tasks

    tasks = resolve_tasks(cfg.tasks)
    if not cfg.checkpoint:
        raise ConfigError("--checkpoint is required (a training output_dir, checkpoints/<step>, or pretrained_model)")
    checkpoint = resolve_checkpoint(cfg.checkpoint)
    Policy.from_pretrained(checkpoint)  # a bad checkpoint fails here, at once, not in every worker
    policy_cfg = read_policy_config(checkpoint)
    instructions = {resolve_tasks([t])[0]: text for t, text in cfg.instructions.items()}
    out_dir = Path(cfg.output_dir) if cfg.output_dir else checkpoint.parent / "eval"
    names = [k.removeprefix("observation.images.") for k in policy_cfg.get("image_keys", [])]
    cameras = {n: CAMERA_ALIASES.get(n, n) for n in names}
    if cfg.video_camera not in cameras:
        cameras[cfg.video_camera] = CAMERA_ALIASES.get(cfg.video_camera, cfg.video_camera)
    jobs = [
        RolloutJob(
            checkpoint=str(checkpoint),
            task=task,
            episode=i,
            seed=episode_seed(cfg.seed, task, i),
            max_steps=cfg.max_steps,
            record_video=i < cfg.videos_per_task,
            video_dir=str(out_dir / "videos"),
            image_size=int(policy_cfg.get("image_size", 64)),
            cameras=cameras,
            video_camera=cfg.video_camera,
            instruction=instructions.get(task, ""),
        )
        for task in tasks
        for i in range(cfg.episodes)
    ]
    start = time.perf_counter()
    results = run_rollouts(jobs, cfg.workers, progress)
    elapsed = time.perf_counter() - start
    meta = {
        "checkpoint": str(checkpoint),
        "label": label,
        "policy_type": policy_cfg.get("type"),
        "tasks": tasks,
        "seed": cfg.seed,
        "max_steps": cfg.max_steps,
        "episodes_per_task": cfg.episodes,
        "instructions": instructions,
        "eval_seconds": elapsed,
    }
    summary = write_report(out_dir, results, tasks, meta)
    summary["report_dir"] = str(out_dir)
    summary["eval_seconds"] = elapsed
    return summary
