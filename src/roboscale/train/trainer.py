"""The training engine: a ``Trainer`` that builds, (parallelizes,) runs and checkpoints a training run.

``Trainer(cfg).fit()`` goes build -> parallelize -> restore -> loop, and the loop calls its hooks (logging,
checkpointing; evaluation beside training later) after every step. The policy is driven only through the Policy
contract and its registered objective, the data only through the loader's iterator and ``state_dict``, so the
distributed engine applies its parallelism to the plain policy in ``parallelize`` without changing the loop.

What a checkpoint restores besides the weights is the trainer's ``state_dict()`` (step, optimizer, schedule,
loader position, RNG), saved and loaded as a unit (torchtitan's ``Stateful``): a resumed run sees exactly the
batches and draws the uninterrupted run would have. Metrics stay tensors until they are logged, so a step
does not wait for the device once per micro-batch.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from roboscale.config import save_yaml
from roboscale.configs.train import DatasetConfig, OptimizerConfig, TrainConfig
from roboscale.errors import CheckpointError, ConfigError
from roboscale.train.resume import check_resume, resume_checkpoint, resuming, saved_config
from roboscale.train.telemetry import COUNTS
from roboscale.utils.io import exclusive_lock

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, progress: bool = True) -> Path:
    """Train and return the final checkpoint's ``pretrained_model`` directory."""
    return Trainer(cfg, progress=progress).fit()


class Trainer:
    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.progress = progress
        self.resume_from = resume_checkpoint(self.output_dir) if cfg.resume else None
        self.step = 0
        self.policy: Any = None
        self.loader: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.objective: Callable[..., Any] | None = None
        self.telemetry: Any = None

    def fit(self) -> Path:
        if self.resume_from is None and (self.output_dir / "checkpoints").exists():
            raise ConfigError(f"--output_dir {self.output_dir} already has checkpoints; pass --resume=true to "
                              "continue it or choose another --output_dir")
        prepare_output_dir(self.output_dir)
        # one run per output_dir: a second one (another shell, a retried job) would interleave checkpoints
        with exclusive_lock(self.output_dir / ".train.lock", lambda holder: ConfigError(
                f"--output_dir {self.output_dir}: another training ({holder}) is writing there")):
            from roboscale.train.checkpoint import remove_stale_files

            for stale in remove_stale_files(self.output_dir):
                log.info("removed %s, left by a run that was killed while saving", stale)
            self.build()
            self.parallelize()
            self.restore()
            try:
                return self.loop()
            finally:  # stop the loader's worker processes even when a step fails
                self.telemetry.close()
                self.loader.close()

    # --- build ----------------------------------------------------------------------------------------------
    def build(self) -> None:
        """Data, policy, objective, loader, optimizer and schedule, in the order whose RNG draws make runs
        reproducible (the policy's initial weights follow the seed)."""
        from roboscale.data.loading.loader import check_sources
        from roboscale.data.loading.meta import source_meta
        from roboscale.models.registry import build_policy, fit_to_dataset, get_spec
        from roboscale.train.telemetry import Telemetry

        cfg = self.cfg
        if self.resume_from is not None:
            with resuming(self.resume_from):
                saved = saved_config(self.resume_from)
            check_resume(saved, cfg, self.resume_from)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.seed()
        sources, names, weights = self.open_sources()
        check_sources(sources, names, skip_bad_episodes=cfg.dataset.skip_bad_episodes)  # never build on refused data
        meta = source_meta(sources, names)
        if self.resume_from is not None:
            from roboscale.models.policy import Policy

            pretrained = self.resume_from / "pretrained_model"
            with resuming(self.resume_from):
                self.policy = Policy.from_pretrained(pretrained)
            cfg.policy = self.policy.config
            try:
                fit_to_dataset(cfg.policy, meta)  # the data may have changed since the checkpoint was written
            except ConfigError as e:
                raise ConfigError(f"--resume: {pretrained / 'config.json'} does not fit the data: {e}") from None
        else:
            self.policy = build_policy(cfg.policy, meta)
        self.objective = get_spec(self.policy.name).loss()
        self.loader = self.build_loader(sources, weights, meta)
        log.info("policy %s: %.2fM parameters; data %s: %d episodes, %d frames, %d batches per epoch, %d loader "
                 "workers", self.policy.name, sum(p.numel() for p in self.policy.parameters()) / 1e6, meta.root,
                 sum(len(s.episode_lengths) for s in sources), sum(int(s.episode_lengths.sum()) for s in sources),
                 self.loader.batches_per_epoch, self.loader.num_workers)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas,
                                           weight_decay=cfg.optimizer.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, cfg.optimizer, cfg.steps)
        self.telemetry = Telemetry(self.output_dir / "tensorboard", cfg.batch_size)

    def seed(self) -> None:
        """Seed torch's global RNG (initial weights, noise, flow times). Where each data-parallel rank must draw
        its own noise, this is where the rank enters the seed."""
        torch.manual_seed(self.cfg.seed)

    def open_sources(self) -> tuple[list[Any], list[str], list[float | None]]:
        from roboscale.data.loading.source import open_source

        data = self.cfg.dataset
        entries = list(data.mixture.items()) if data.mixture else [(data.root, None)]
        options = {"episodes": data.episodes} if data.episodes is not None else {}
        sources = [open_source(path, **options) for path, _ in entries]
        return sources, [str(path) for path, _ in entries], [w for _, w in entries]

    def build_loader(self, sources: list[Any], weights: list[float | None], meta: Any) -> Any:
        from roboscale.data.loading.loader import build_loader

        cfg, policy_cfg, data = self.cfg, self.policy.config, self.cfg.dataset
        transform, collate = self.policy.data_transforms()
        return build_loader(
            sources if not data.mixture else list(zip(sources, weights, strict=True)),
            batch_size=cfg.batch_size,
            num_workers=loader_workers(data.num_workers),
            # LeRobot's delta_timestamps, from the policy's frame offsets
            delta_timestamps={key: [i / meta.fps for i in idx] for key, idx in self.policy.delta_indices().items()},
            keys=[*policy_cfg.image_keys, policy_cfg.state_key, policy_cfg.action_key],
            seed=cfg.seed,
            transform=transform,
            collate=collate,
            prefetch_factor=data.prefetch_factor,
            block_samples=block_samples(data, meta.features, list(policy_cfg.image_keys), cfg.batch_size),
            chunk_frames=data.chunk_frames,
            skip_bad_episodes=data.skip_bad_episodes,
            check=False,  # check_sources ran before the policy was built
        )

    def parallelize(self) -> None:
        """Where data parallelism, FSDP, activation checkpointing and compile are applied to the plain policy (its
        ``parallel_units()``); one process on one device needs none of them."""

    # --- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint restores besides the weights, as one unit."""
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict(), "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any], where: Path) -> None:
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointError(where, f"optimizer state does not fit this model ({exc})") from None
        try:
            self.scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"])
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointError(where, f"scheduler or RNG state is damaged ({exc})") from None
        try:
            self.loader.load_state_dict(state["loader"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(where / "loader_state.json",
                                  f"does not fit this data loader ({type(e).__name__}: {e})") from None
        self.step = int(state["step"])

    def restore(self) -> None:
        """Continue from the checkpoint being resumed, if any; record the run's config beside its checkpoints."""
        from roboscale.train.checkpoint import TRAINING_STATE, load_training_state

        if self.resume_from is not None:
            with resuming(self.resume_from):
                self.load_state_dict(load_training_state(self.resume_from), self.resume_from / TRAINING_STATE)
            log.info("resumed from %s at step %d", self.resume_from, self.step)
        save_yaml(self.cfg, self.output_dir / "train_config.yaml")

    # --- the loop -------------------------------------------------------------------------------------------
    def train_step(self, batch: Any) -> dict[str, torch.Tensor | float]:
        """One optimizer step over a batch (or its micro-batches); metrics as tensors."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, Any] = accumulate_gradients(self.policy, self.to_device(batch), self.objective)
        if self.cfg.optimizer.grad_clip_norm > 0:
            metrics["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.policy.parameters(),
                                                                  self.cfg.optimizer.grad_clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def to_device(self, batch: Any) -> Any:
        """Where batches move to the policy's device (CPU training: they are there)."""
        return batch

    def loop(self) -> Path:
        from tqdm import tqdm

        from roboscale.train.checkpoint import PRETRAINED, last_checkpoint

        self.policy.train()
        final = None
        with tqdm(total=self.cfg.steps, initial=self.step, desc="training", unit="step",
                  disable=not self.progress) as bar:
            while self.step < self.cfg.steps:
                with self.telemetry.data_wait():
                    batch = next(self.loader)
                metrics = self.train_step(batch)
                self.log(metrics, bar)
                final = self.checkpoint() or final
        if final is None:  # resumed at the last step: nothing left to train
            final = last_checkpoint(self.output_dir)
        return final / PRETRAINED

    # --- hooks ----------------------------------------------------------------------------------------------
    def log(self, metrics: dict[str, Any], bar: Any) -> None:
        cfg = self.cfg
        log_now = self.step % cfg.log_freq == 0 or self.step == cfg.steps
        summary = self.telemetry.step(self.step, metrics, log_now=log_now,
                                      loader_stats=self.loader.stats() if log_now else None)
        bar.update(1)
        if summary:
            shown = dict(loss=f"{summary['loss']:.4f}", smp_s=f"{summary['samples_per_s']:.0f}")
            if "tokens_per_s" in summary:
                shown["tok_s"] = f"{summary['tokens_per_s']:.0f}"
            bar.set_postfix(**shown, wait=f"{100 * summary['data_wait']:.0f}%")

    def checkpoint(self) -> Path | None:
        from roboscale.train.checkpoint import prune_checkpoints, save_checkpoint

        cfg = self.cfg
        if self.step % cfg.save_freq and self.step != cfg.steps:
            return None
        saved = save_checkpoint(self.output_dir, self.step, self.policy, self.state_dict(), cfg)
        prune_checkpoints(self.output_dir, cfg.checkpoint.keep_last)
        return saved


def prepare_output_dir(output_dir: Path) -> None:
    """Create ``output_dir`` and prove it writable now, not at the first checkpoint an hour later."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"--output_dir {output_dir}: exists and is not a directory")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as exc:
        raise ConfigError(f"--output_dir {output_dir}: cannot write there ({exc.strerror or exc})") from None


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def block_samples(data: DatasetConfig, features: dict, image_keys: list[str], batch_size: int) -> int:
    """``DatasetConfig.block_samples`` with 0 resolved from the memory budget and the cameras' frame sizes."""
    if data.block_samples > 0:
        return data.block_samples
    from roboscale.data.lerobot.format import image_hwc

    frame_bytes = sum(math.prod(image_hwc(features[k])) for k in image_keys) or 1
    return max(batch_size, data.block_memory_mb * 2**20 // frame_bytes)


def loader_workers(requested: int) -> int:
    """``DatasetConfig.num_workers`` with -1 resolved for this machine."""
    if requested >= 0:
        return requested
    if not torch.cuda.is_available():
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def accumulate_gradients(policy: torch.nn.Module, batch: Any, objective: Callable[..., Any]
                         ) -> dict[str, torch.Tensor | float]:
    """Forward and backward over a batch, or over the micro-batches of one (a list: a token-budgeted collate).

    Micro-batches leave the gradients of the whole batch's loss: sum_i w_i loss_i / sum_i w_i, where w_i is the
    ``loss_weight`` the objective reports (its loss's denominator, e.g. the unpadded action values), so a budget
    bounds activation memory without changing the update. With data-parallel ranks the sum of weights is the
    global one (reduced over ranks) so that the update is the global batch's. Returns the step's metrics, still
    tensors: the loss as that weighted mean, token counts summed, the rest averaged."""
    if not isinstance(batch, list):
        loss, metrics = objective(policy, batch)
        loss.backward()
        metrics.pop("loss_weight", None)
        return metrics
    total_weight, sums = 0.0, defaultdict(float)
    for micro in batch:
        loss, metrics = objective(policy, micro)
        weight = metrics.pop("loss_weight")
        (loss * weight).backward()
        total_weight = total_weight + weight
        for key, value in metrics.items():  # the weighted loss in float64, as the update's weights add up exactly
            sums[key] = sums[key] + (value.double() * weight.double() if key == "loss" else value)
    for p in policy.parameters():
        if p.grad is not None:
            p.grad.div_(total_weight)
    return {k: v / total_weight if k == "loss" else v if k in COUNTS else v / len(batch) for k, v in sums.items()}
