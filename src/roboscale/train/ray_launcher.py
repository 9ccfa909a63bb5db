"""`roboscale train --launcher=ray`: the same training on Ray Train workers (``TorchTrainer``).

Each worker runs ``Trainer.fit`` unchanged: Ray Train starts the processes, sets up the process group (gloo on
CPU, NCCL on GPU, with the collective timeout of ``--parallel.timeout_s``) and the ``RANK`` / ``WORLD_SIZE``
environment the trainer reads. A worker that dies makes Ray restart the group (``--ray.max_failures`` times);
the restarted workers resume from the last checkpoint in ``--output_dir``, which must be on a filesystem every
worker sees. Checkpoints stay ours (Ray's own checkpoint storage is not used).

Without ``--ray.address`` a local Ray of our own is started, listening on 127.0.0.1 only; with it, an existing
cluster (token authentication as ``ray start`` sets it up; roboscale and the data on every node).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from roboscale.config import from_dict, to_dict
from roboscale.configs.train import TrainConfig
from roboscale.errors import ConfigError, RoboscaleError, TrainingError, from_record, one_line, to_record

log = logging.getLogger(__name__)


def train_on_ray(cfg: TrainConfig) -> Path:
    """Train on ``cfg.ray.num_workers`` Ray workers; returns the final checkpoint's ``pretrained_model``."""
    from roboscale.train.checkpoint import PRETRAINED, last_checkpoint
    from roboscale.utils.ray_cluster import reachable_or_raise, start_or_join_ray

    output_dir = Path(cfg.output_dir).resolve()
    if not cfg.resume and (output_dir / "checkpoints").exists():
        raise ConfigError(f"--output_dir {output_dir} already has checkpoints; pass --resume=true to continue it or "
                          "choose another --output_dir")
    if cfg.batch_size % cfg.ray.num_workers:
        raise ConfigError(f"--batch_size={cfg.batch_size} is not divisible by --ray.num_workers={cfg.ray.num_workers} "
                          "(each worker takes an equal share of the global batch)")
    if cfg.ray.address:
        reachable_or_raise(cfg.ray.address, "--ray.address")
    owned = start_or_join_ray(cfg.ray.address, None, option="--ray.address",
                              missing="--launcher=ray needs Ray Train: pip install 'roboscale[train]'")
    try:
        _fit(cfg, output_dir)
    finally:
        if owned:
            import ray

            ray.shutdown()
    final = last_checkpoint(output_dir)
    if final is None:
        raise TrainingError(f"--launcher=ray: the workers finished without a checkpoint in {output_dir}")
    return final / PRETRAINED


def _fit(cfg: TrainConfig, output_dir: Path) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    worker_cfg = to_dict(cfg)
    worker_cfg.update(launcher="local", output_dir=str(output_dir))
    ray_cfg = cfg.ray
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"config": worker_cfg},
        torch_config=TorchConfig(backend="nccl" if ray_cfg.use_gpu else "gloo", timeout_s=int(cfg.parallel.timeout_s)),
        scaling_config=ScalingConfig(num_workers=ray_cfg.num_workers, use_gpu=ray_cfg.use_gpu,
                                     resources_per_worker={"CPU": ray_cfg.cpus_per_worker},
                                     placement_strategy=ray_cfg.placement_strategy),
        run_config=RunConfig(name="roboscale-train", storage_path=str(output_dir / "ray"),
                             failure_config=FailureConfig(max_failures=ray_cfg.max_failures)),
    )
    try:
        trainer.fit()
    except Exception as exc:  # noqa: BLE001 - Ray wraps the worker's error; show the user's part of it
        record = _worker_error(exc)
        if record is not None:
            raise from_record(record) from None
        raise TrainingError(f"--launcher=ray: training failed on the Ray workers ({one_line(exc)[:500]})") from None


def _worker_error(exc: BaseException) -> dict[str, Any] | None:
    """The RoboscaleError record a worker raised, found in Ray's wrapped exception chain."""
    pending = [exc]
    while pending:
        seen = pending.pop()
        record = getattr(seen, "roboscale_record", None)
        if record is not None:
            return record
        pending += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        pending += list(getattr(seen, "worker_failures", {}).values())  # Ray Train's per-worker errors
    return None


def _worker_loop(loop_config: dict[str, Any]) -> None:
    """On each Ray worker: the training, resuming if this is a restart after a failure."""
    from roboscale.train.supervised import train

    cfg = from_dict(TrainConfig, loop_config["config"])
    try:
        train(cfg, progress=False, restartable=True)
    except RoboscaleError as exc:  # crosses the process boundary as a record (see roboscale.errors)
        error = RuntimeError(one_line(exc))
        error.roboscale_record = to_record(exc)
        raise error from None
