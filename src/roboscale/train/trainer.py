"""The training loop: AdamW, warmup + cosine schedule, gradient clipping, logging, atomic checkpoints, resume.

Single process for now; the loop only talks to the policy through the Policy contract and to the data through
the loader's iterator + state_dict, so the distributed engine can wrap both without changing this file's shape.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from roboscale.config import ConfigError, save_yaml
from roboscale.models.pi05 import Pi05Config
from roboscale.models.policy import PolicyConfig

log = logging.getLogger(__name__)


@dataclass
class DatasetConfig:
    root: str = "outputs/data/metaworld"
    """LeRobot v3.0 dataset directory."""
    episodes: list[int] | None = None
    """Episode indices to train on (default: all)."""


@dataclass
class OptimizerConfig:
    lr: float = 5e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (pi0.5's)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    warmup_steps: int = 100
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at the last step."""


@dataclass
class TrainConfig:
    """`roboscale train`: train a policy on a LeRobot v3.0 dataset."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Which dataset to train on."""
    policy: PolicyConfig = field(default_factory=Pi05Config)
    """Policy type and architecture."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    steps: int = 1700
    """Optimizer steps."""
    batch_size: int = 64
    """Samples per step."""
    seed: int = 0
    """Seed for initialization, shuffling and noise."""
    output_dir: str = "outputs/train/pi05"
    """Where checkpoints/ and tensorboard/ go."""
    save_freq: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    log_freq: int = 50
    """Log metrics every this many steps."""
    resume: bool = False
    """Continue from <output_dir>/checkpoints/last exactly where it stopped."""
    num_threads: int = 0
    """torch CPU threads (0: all cores)."""


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(cfg: TrainConfig, progress: bool = True) -> Path:
    """Train and return the final checkpoint's ``pretrained_model`` directory."""
    from tqdm import tqdm

    from roboscale.data import LeRobotDataset
    from roboscale.data.loader import BatchLoader, EpisodeStore
    from roboscale.models.registry import build_policy
    from roboscale.train.checkpoint import PRETRAINED, last_checkpoint, load_training_state, save_checkpoint
    from roboscale.train.telemetry import Telemetry

    output_dir = Path(cfg.output_dir)
    resume_from = None
    if cfg.resume:
        resume_from = last_checkpoint(output_dir)
        if resume_from is None:
            raise ConfigError(f"--resume: no checkpoint under {output_dir / 'checkpoints'} to resume from")
    elif (output_dir / "checkpoints").exists():
        raise ConfigError(
            f"--output_dir {output_dir} already has checkpoints; pass --resume=true to continue it "
            "or choose another --output_dir"
        )
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)

    dataset = LeRobotDataset(root=cfg.dataset.root, episodes=cfg.dataset.episodes)
    if resume_from is not None:
        from roboscale.models.policy import Policy

        policy = Policy.from_pretrained(resume_from / PRETRAINED)
        cfg.policy = policy.config
    else:
        policy = build_policy(cfg.policy, dataset.meta)
    log.info(
        "policy %s: %.2fM parameters; dataset %s: %d episodes, %d frames",
        policy.name,
        sum(p.numel() for p in policy.parameters()) / 1e6,
        cfg.dataset.root,
        dataset.num_episodes,
        dataset.num_frames,
    )
    store = EpisodeStore.from_dataset(
        dataset, policy.config.image_keys, [policy.config.state_key, policy.config.action_key], progress
    )
    loader = BatchLoader(store, cfg.batch_size, policy.delta_indices(), seed=cfg.seed)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, weight_decay=cfg.optimizer.weight_decay
    )
    scheduler = make_scheduler(optimizer, cfg.optimizer, cfg.steps)
    step = 0
    if resume_from is not None:
        step, loader_state = load_training_state(resume_from, optimizer, scheduler)
        loader.load_state_dict(loader_state)
        log.info("resumed from %s at step %d", resume_from, step)
    output_dir.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, output_dir / "train_config.yaml")

    telemetry = Telemetry(output_dir / "tensorboard", cfg.batch_size)
    policy.train()
    batches = iter(loader)
    final = None
    with tqdm(total=cfg.steps, initial=step, desc="training", unit="step", disable=not progress) as bar:
        while step < cfg.steps:
            with telemetry.data_wait():
                batch = next(batches)
            loss, metrics = policy(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.optimizer.grad_clip_norm > 0:
                metrics["grad_norm"] = float(
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optimizer.grad_clip_norm)
                )
            optimizer.step()
            scheduler.step()
            step += 1
            metrics["lr"] = scheduler.get_last_lr()[0]
            summary = telemetry.step(step, metrics, log_now=step % cfg.log_freq == 0 or step == cfg.steps)
            bar.update(1)
            if summary:
                bar.set_postfix(loss=f"{summary['loss']:.4f}", smp_s=f"{summary['samples_per_s']:.0f}")
            if step % cfg.save_freq == 0 or step == cfg.steps:
                final = save_checkpoint(output_dir, step, policy, optimizer, scheduler, loader.state_dict(), cfg)
    telemetry.close()
    if final is None:  # resumed at the last step: nothing left to train
        final = last_checkpoint(output_dir)
    return final / PRETRAINED
