"""The training loop: AdamW, warmup + cosine schedule, gradient clipping, logging, atomic checkpoints, resume.

Single process for now; the loop only talks to the policy through the Policy contract and to the data through
the loader's iterator + state_dict, so the distributed engine can wrap both without changing this file's shape.
Data comes from ``roboscale.data.build_loader`` (raw LeRobot v3.0 datasets, lakes or weighted mixtures; worker
processes run the policy's ``data_transforms()`` when it has them), and the loader's position is part of every
checkpoint, so a resumed run sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roboscale.config import ConfigError, save_yaml, to_dict
from roboscale.errors import CheckpointError
from roboscale.models.registry import PolicyConfig, default_policy_config
from roboscale.train.telemetry import COUNTS
from roboscale.utils.io import exclusive_lock

log = logging.getLogger(__name__)


@dataclass
class DatasetConfig:
    root: str = "outputs/data/metaworld"
    """LeRobot v3.0 dataset directory, or a roboscale lake directory."""
    mixture: dict[str, float] = field(default_factory=dict)
    """Train on several datasets instead of root: directory -> weight (its share of every epoch)."""
    episodes: list[int] | None = None
    """Episode indices to train on (default: all; raw LeRobot datasets only)."""
    num_workers: int = -1
    """Loader worker processes (video decoding, windows, the policy's per-sample transforms); 0: in the training
    process; -1: 0 without a GPU (CPU training needs every core: 2 workers made a 2-core demo step 20% slower),
    else half the cores, at most 8."""
    prefetch_factor: int = 2
    """Batches each loader worker prepares ahead."""
    block_samples: int = 0
    """Samples a loader worker decodes together and shuffles among; consecutive batches come from one block.
    0: as many as fit in block_memory_mb (the whole dataset when it fits, which makes batches independent)."""
    block_memory_mb: int = 512
    """Camera-frame memory of one block when block_samples is 0 (per loader worker)."""
    chunk_frames: int = 4
    """Consecutive frames of an episode decoded in one pass (more: fewer seeks, less diverse batches). Training
    wants diverse batches (single demo runs with 256-1,024-sample blocks scored 79-80%, whole-dataset blocks 84-91%;
    docs/benchmarks.md). With LeRobot's GOP of 2, 4-frame chunks cost little extra decoding."""
    skip_bad_episodes: bool = False
    """Skip and count unreadable episodes instead of stopping."""


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
class CheckpointConfig:
    keep_last: int = 3
    """Keep this many most recent checkpoints (0: all); `last` (and the best evaluated one) are always kept."""

    def __post_init__(self) -> None:
        if self.keep_last < 0:
            raise ConfigError(f"checkpoint.keep_last must be >= 0, got {self.keep_last}")


@dataclass
class TrainConfig:
    """`roboscale train`: train a policy on a LeRobot v3.0 dataset."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Which dataset to train on."""
    policy: PolicyConfig = field(default_factory=default_policy_config)
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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint retention."""
    log_freq: int = 50
    """Log metrics every this many steps."""
    resume: bool = False
    """Continue from <output_dir>/checkpoints/last exactly where it stopped. Options not given are the
    checkpoint's; steps, save_freq, log_freq, checkpoint.*, num_threads and the loader's worker settings may
    change, anything else that differs is refused."""
    num_threads: int = 0
    """torch CPU threads (0: all cores)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "save_freq", "log_freq"):
            value = getattr(self, name)
            if isinstance(value, int) and value <= 0:
                raise ConfigError(f"--{name} must be a positive integer, got {value}")
        if self.num_threads < 0:
            raise ConfigError(f"--num_threads must be >= 0, got {self.num_threads}")


# Options a resumed run may change: they do not alter the model, the data order or the optimizer's trajectory
# (steps moves the end of the cosine schedule, which is what a user extending a run wants).
RESUMABLE_CHANGES = ("steps", "save_freq", "log_freq", "checkpoint.", "num_threads", "resume",
                     "dataset.num_workers", "dataset.prefetch_factor")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}"))
    return out


def resume_conflicts(saved: TrainConfig, cfg: TrainConfig) -> list[str]:
    """``--option=value (checkpoint: value)`` for every option of ``cfg`` that a resume may not change. Policy
    fields left to be filled from the dataset (0 / empty) take the checkpoint's value; another policy type is one
    conflict, not one per option."""
    from roboscale.models.registry import FILLED_AT_BUILD

    old, new = _flatten(to_dict(saved)), _flatten(to_dict(cfg))
    for name in FILLED_AT_BUILD:
        key = f"policy.{name}"
        if not new.get(key) and key in old:
            new[key] = old[key]
    other_type = old["policy.type"] != new["policy.type"]
    conflicts = []
    for key in sorted(set(old) | set(new)):
        if key.startswith(RESUMABLE_CHANGES) or key == "output_dir":
            continue
        if key.startswith("policy.") and key != "policy.type" and other_type:
            continue
        if key in old and key in new and _same(old[key], new[key]):
            continue
        conflicts.append(f"--{key}={json.dumps(new.get(key))} (checkpoint: {json.dumps(old.get(key))})")
    return conflicts


def saved_config(checkpoint: Path) -> TrainConfig:
    """The TrainConfig a checkpoint was saved with; options it predates take their defaults."""
    from roboscale.config import from_dict
    from roboscale.train.checkpoint import PRETRAINED, TRAIN_CONFIG, saved_train_config

    path = checkpoint / PRETRAINED / TRAIN_CONFIG
    try:
        return from_dict(TrainConfig, saved_train_config(checkpoint), where=str(path))
    except ConfigError as e:
        raise CheckpointError(path, f"not a training config this roboscale reads ({e})") from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def parse_train_args(argv: list[str]) -> TrainConfig:
    """``roboscale train`` options; with ``--resume``, the options not given are the checkpoint's own."""
    from roboscale.config import parse

    cfg = parse(TrainConfig, argv, prog="roboscale train")
    if not cfg.resume:
        return cfg
    checkpoint = _resume_checkpoint(Path(cfg.output_dir))
    with resuming(checkpoint):
        saved = saved_config(checkpoint)
    return parse(TrainConfig, argv, defaults=saved, prog="roboscale train")


def _resume_checkpoint(output_dir: Path) -> Path:
    from roboscale.train.checkpoint import last_checkpoint

    checkpoint = last_checkpoint(output_dir)
    if checkpoint is None:
        last = output_dir / "checkpoints" / "last"
        if last.is_symlink():
            raise CheckpointError(last, f"points to {os.readlink(last)}, which does not exist{_earlier_hint(last)}")
        raise ConfigError(f"--resume: no checkpoint under {output_dir / 'checkpoints'} to resume from")
    return checkpoint


@contextmanager
def resuming(checkpoint: Path) -> Iterator[None]:
    """A damaged checkpoint is an error that names the file and how to resume from an earlier one instead."""
    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(e.path, f"{_message(e)}; cannot resume from it{_earlier_hint(checkpoint)}") from None


def _message(err: CheckpointError) -> str:
    return str(err).removeprefix(f"{err.path}: ")


def _earlier_hint(checkpoint: Path) -> str:
    from roboscale.train.checkpoint import step_directories

    checkpoints = checkpoint.parent
    current = checkpoint.resolve().name if checkpoint.exists() else os.readlink(checkpoint)
    if not current.isdigit():
        return ""
    earlier = [p.name for p in step_directories(checkpoints) if int(p.name) < int(current)]
    if not earlier:
        return ""
    return f" (to resume from the previous checkpoint: ln -sfn {earlier[-1]} {checkpoints / 'last'})"


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


def accumulate_gradients(policy: torch.nn.Module, batch: Any, objective: Callable[..., Any]) -> dict[str, float]:
    """Forward and backward over a batch, or over the micro-batches of one (a list: a token-budgeted collate).

    Micro-batches leave the gradients of the whole batch's loss: sum_i w_i loss_i / sum_i w_i, where w_i is the
    ``loss_weight`` the objective reports (its loss's denominator, e.g. the unpadded action values), so a budget
    bounds activation memory without changing the update. Returns the step's metrics: the loss as that weighted
    mean, token counts summed, the rest averaged."""
    if not isinstance(batch, list):
        loss, metrics = objective(policy, batch)
        loss.backward()
        metrics.pop("loss_weight", None)
        return {k: float(v) for k, v in metrics.items()}
    total_weight, sums = 0.0, defaultdict(float)
    for micro in batch:
        loss, metrics = objective(policy, micro)
        weight = float(metrics.pop("loss_weight"))
        (loss * weight).backward()
        total_weight += weight
        for key, value in metrics.items():
            sums[key] += float(value) * weight if key == "loss" else float(value)
    for p in policy.parameters():
        if p.grad is not None:
            p.grad.div_(total_weight)
    return {k: v / total_weight if k == "loss" else v if k in COUNTS else v / len(batch) for k, v in sums.items()}


def train(cfg: TrainConfig, progress: bool = True) -> Path:
    """Train and return the final checkpoint's ``pretrained_model`` directory."""
    output_dir = Path(cfg.output_dir)
    resume_from = _resume_checkpoint(output_dir) if cfg.resume else None
    if resume_from is None and (output_dir / "checkpoints").exists():
        raise ConfigError(
            f"--output_dir {output_dir} already has checkpoints; pass --resume=true to continue it "
            "or choose another --output_dir"
        )
    prepare_output_dir(output_dir)
    # one run per output_dir: a second one (another shell, a retried job) would interleave checkpoints
    with exclusive_lock(output_dir / ".train.lock", lambda holder: ConfigError(
            f"--output_dir {output_dir}: another training ({holder}) is writing there")):
        from roboscale.train.checkpoint import remove_stale_files

        for stale in remove_stale_files(output_dir):
            log.info("removed %s, left by a run that was killed while saving", stale)
        return _train(cfg, output_dir, resume_from, progress)


def _train(cfg: TrainConfig, output_dir: Path, resume_from: Path | None, progress: bool) -> Path:
    from tqdm import tqdm

    from roboscale.data.loading.loader import build_loader, check_sources
    from roboscale.data.loading.meta import source_meta
    from roboscale.data.loading.source import open_source
    from roboscale.models.registry import build_policy, fit_to_dataset, get_spec
    from roboscale.train.checkpoint import (
        PRETRAINED,
        last_checkpoint,
        load_training_state,
        prune_checkpoints,
        save_checkpoint,
    )
    from roboscale.train.telemetry import Telemetry

    if resume_from is not None:
        with resuming(resume_from):
            saved = saved_config(resume_from)
        conflicts = resume_conflicts(saved, cfg)
        if conflicts:
            raise ConfigError(f"--resume: {len(conflicts)} options differ from the checkpoint's "
                              f"({resume_from / PRETRAINED / 'train_config.json'}): {'; '.join(conflicts)}. A resumed "
                              "run continues the same run; drop them, or train into a new --output_dir")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)

    data = cfg.dataset
    entries = list(data.mixture.items()) if data.mixture else [(data.root, None)]
    options = {"episodes": data.episodes} if data.episodes is not None else {}
    try:
        sources = [open_source(path, **options) for path, _ in entries]
    except TypeError as e:  # a source type without episode selection (a lake)
        raise ConfigError(f"--dataset.episodes works with raw LeRobot v3.0 datasets only: {e}") from None
    names = [str(path) for path, _ in entries]
    check_sources(sources, names, skip_bad_episodes=data.skip_bad_episodes)  # never build on data we would refuse
    meta = source_meta(sources, names)
    if resume_from is not None:
        from roboscale.models.policy import Policy

        with resuming(resume_from):
            policy = Policy.from_pretrained(resume_from / PRETRAINED)
        cfg.policy = policy.config
        try:
            fit_to_dataset(cfg.policy, meta)  # the data may have changed since the checkpoint was written
        except ConfigError as e:
            raise ConfigError(f"--resume: {resume_from / PRETRAINED / 'config.json'} does not fit the data: {e}"
                              ) from None
    else:
        policy = build_policy(cfg.policy, meta)
    pc = policy.config
    objective = get_spec(policy.name).loss()
    # LeRobot's delta_timestamps, from the policy's frame offsets
    delta_timestamps = {key: [i / meta.fps for i in idx] for key, idx in policy.delta_indices().items()}
    transform, collate = policy.data_transforms()
    loader = build_loader(
        sources if not data.mixture else list(zip(sources, [w for _, w in entries], strict=True)),
        batch_size=cfg.batch_size,
        num_workers=loader_workers(data.num_workers),
        delta_timestamps=delta_timestamps,
        keys=[*pc.image_keys, pc.state_key, pc.action_key],
        seed=cfg.seed,
        transform=transform,
        collate=collate,
        prefetch_factor=data.prefetch_factor,
        block_samples=block_samples(data, meta.features, list(pc.image_keys), cfg.batch_size),
        chunk_frames=data.chunk_frames,
        skip_bad_episodes=data.skip_bad_episodes,
    )
    log.info(
        "policy %s: %.2fM parameters; data %s: %d episodes, %d frames, %d batches per epoch, %d loader workers",
        policy.name,
        sum(p.numel() for p in policy.parameters()) / 1e6,
        meta.root,
        sum(len(s.episode_lengths) for s in sources),
        sum(int(s.episode_lengths.sum()) for s in sources),
        loader.batches_per_epoch,
        loader.num_workers,
    )
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas, weight_decay=cfg.optimizer.weight_decay
    )
    scheduler = make_scheduler(optimizer, cfg.optimizer, cfg.steps)
    step = 0
    if resume_from is not None:
        with resuming(resume_from):
            step, loader_state = load_training_state(resume_from, optimizer, scheduler)
            try:
                loader.load_state_dict(loader_state)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(resume_from / "training_state" / "loader_state.json",
                                      f"does not fit this data loader ({type(e).__name__}: {e})") from None
        log.info("resumed from %s at step %d", resume_from, step)
    save_yaml(cfg, output_dir / "train_config.yaml")

    telemetry = Telemetry(output_dir / "tensorboard", cfg.batch_size)
    policy.train()
    final = None
    try:
        with tqdm(total=cfg.steps, initial=step, desc="training", unit="step", disable=not progress) as bar:
            while step < cfg.steps:
                with telemetry.data_wait():
                    batch = next(loader)
                optimizer.zero_grad(set_to_none=True)
                metrics = accumulate_gradients(policy, batch, objective)
                if cfg.optimizer.grad_clip_norm > 0:
                    metrics["grad_norm"] = float(
                        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optimizer.grad_clip_norm)
                    )
                optimizer.step()
                scheduler.step()
                step += 1
                metrics["lr"] = scheduler.get_last_lr()[0]
                log_now = step % cfg.log_freq == 0 or step == cfg.steps
                stats = loader.stats() if log_now else None
                summary = telemetry.step(step, metrics, log_now=log_now, loader_stats=stats)
                bar.update(1)
                if summary:
                    shown = dict(loss=f"{summary['loss']:.4f}", smp_s=f"{summary['samples_per_s']:.0f}")
                    if "tokens_per_s" in summary:
                        shown["tok_s"] = f"{summary['tokens_per_s']:.0f}"
                    bar.set_postfix(**shown, wait=f"{100 * summary['data_wait']:.0f}%")
                if step % cfg.save_freq == 0 or step == cfg.steps:
                    final = save_checkpoint(output_dir, step, policy, optimizer, scheduler, loader.state_dict(), cfg)
                    prune_checkpoints(output_dir, cfg.checkpoint.keep_last)
    finally:  # stop the loader's worker processes even when a step fails
        telemetry.close()
        loader.close()
    if final is None:  # resumed at the last step: nothing left to train
        final = last_checkpoint(output_dir)
    return final / PRETRAINED
