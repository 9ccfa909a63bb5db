"""Supervised training, the Trainer's default job: LeRobot datasets (or lakes, or a mixture of them) through the
streaming loader, minimising the policy's registered objective (flow matching).

``build_policy`` opens the sources and runs the gate (``check_sources``) before anything is built on the data,
then builds the policy for it: from the dataset (``build_policy``), from a pretrained checkpoint adapted to it
(fine-tuning), or, on resume, the checkpoint's policy checked against the data as it is now. ``build`` starts the
loader with the policy's data transforms.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from roboscale.configs.train import DatasetConfig, TrainConfig
from roboscale.data.instructions import (
    InstructionVariants,
    VariantsFingerprint,
    load_instruction_variants,
    phrasings,
)
from roboscale.errors import ConfigError
from roboscale.train.components import TrainerView, TrainingComponents, TrainingJob

if TYPE_CHECKING:
    from roboscale.data.loading.loader import StreamingLoader
    from roboscale.data.loading.meta import SourceMeta
    from roboscale.data.loading.source import FrameSource
    from roboscale.models.policy import Policy

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, progress: bool = True, restartable: bool = False, job: TrainingJob | None = None
          ) -> Path:
    """`roboscale train`: train and return the final checkpoint's ``pretrained_model`` directory. ``restartable``:
    this process may be a restart of a failed one (a launcher's retry), so resume if a checkpoint exists.
    ``job``: what to train on and how (default: ``SupervisedJob(cfg)``, supervised training on ``cfg.dataset``)."""
    from roboscale.train.trainer import Trainer

    return Trainer(cfg, job or SupervisedJob(cfg), progress=progress, restartable=restartable).fit()


class SupervisedJob:
    """``cfg``: the trainer's config (the same object: ``build_policy`` fills ``cfg.policy`` from the built policy,
    which is what checkpoints record as the run's)."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.sources: list[FrameSource] = []
        self.weights: list[float | None] = []
        self.meta: SourceMeta | None = None
        self.instruction_variants: dict[str, list[str]] = {}

    @property
    def batch_size(self) -> int:
        """The global batch: ``--batch_size``."""
        return self.cfg.batch_size

    def build_policy(self, trainer: TrainerView, resumed: Policy | None) -> Policy:
        cfg = self.cfg
        if trainer.resume_from is not None:  # the options this command may not change on a resume, each named
            from roboscale.train.resume import check_resume, resuming, saved_config

            with resuming(trainer.resume_from):
                saved = saved_config(trainer.resume_from)
            check_resume(saved, cfg, trainer.resume_from)
        policy = self._policy(trainer, resumed)
        cfg.policy = policy.config
        return policy

    def _policy(self, trainer: TrainerView, resumed: Policy | None) -> Policy:
        from roboscale.data.loading.loader import check_sources
        from roboscale.data.loading.meta import source_meta
        from roboscale.models.registry import build_policy, fit_to_dataset

        cfg = self.cfg
        self.sources, names, self.weights = open_sources(cfg.dataset)
        # never build on refused data
        check_sources(self.sources, names, skip_bad_episodes=cfg.dataset.skip_bad_episodes)
        self.meta = source_meta(self.sources, names)
        if cfg.dataset.instruction_variants:
            self.instruction_variants = load_instruction_variants(cfg.dataset.instruction_variants,
                                                                  self.meta.task_list)
        if resumed is not None:
            try:
                fit_to_dataset(resumed.config, self.meta)  # the data may have changed since the checkpoint
            except ConfigError as e:
                config = trainer.resume_from / "pretrained_model" / "config.json"
                raise ConfigError(f"--resume: {config} does not fit the data: {e}") from None
            return resumed
        if cfg.policy.pretrained_path:  # fine-tuning: the checkpoint's architecture and weights, this data's stats
            from roboscale.models.finetune import policy_for_finetuning

            return policy_for_finetuning(cfg.policy, self.meta)
        return build_policy(cfg.policy, self.meta, extra_texts=phrasings(self.instruction_variants))

    def build(self, trainer: TrainerView) -> TrainingComponents:
        from roboscale.models.registry import get_spec

        policy = trainer.policy
        objective = get_spec(policy.name).loss()
        loader = self.build_loader(trainer)
        if trainer.env.is_main:
            sources = self.sources
            log.info("policy %s: %.2fM parameters; data %s: %d episodes, %d frames, %d batches per epoch, %d "
                     "loader workers per rank; %d ranks (%s, %d x %d mesh)", policy.name,
                     sum(p.numel() for p in policy.parameters()) / 1e6, self.meta.root,
                     sum(len(s.episode_lengths) for s in sources), sum(int(s.episode_lengths.sum()) for s in sources),
                     loader.batches_per_epoch, loader.num_workers, trainer.env.world_size, trainer.plan.strategy,
                     trainer.plan.dp_replicate, trainer.plan.dp_shard)
        state = {"instruction_variants": VariantsFingerprint(self.instruction_variants)} \
            if self.instruction_variants else {}
        return TrainingComponents(data=loader, objective=objective, state=state)

    def build_loader(self, trainer: TrainerView) -> StreamingLoader:
        from roboscale.data.loading.loader import LoaderConfig, build_loader

        cfg, policy, data, meta = self.cfg, trainer.policy, self.cfg.dataset, self.meta
        policy_cfg = policy.config
        transform, collate = policy.data_transforms()
        if self.instruction_variants:  # the phrasing is drawn before the policy's transform tokenizes it
            transform = InstructionVariants(self.instruction_variants, then=transform)
        loading = LoaderConfig(
            batch_size=cfg.batch_size, seed=cfg.seed, num_workers=loader_workers(data.num_workers),
            prefetch_factor=data.prefetch_factor, chunk_frames=data.chunk_frames,
            block_samples=block_samples(data, meta.features, list(policy_cfg.image_keys), cfg.batch_size),
            skip_bad_episodes=data.skip_bad_episodes,
            check=False)  # check_sources ran before the policy was built
        return build_loader(
            self.sources if not data.mixture else list(zip(self.sources, self.weights, strict=True)), loading,
            rank=trainer.env.rank, world_size=trainer.plan.dp_size,
            # LeRobot's delta_timestamps, from the policy's frame offsets
            delta_timestamps={key: [i / meta.fps for i in idx] for key, idx in policy.delta_indices().items()},
            keys=[*policy_cfg.image_keys, policy_cfg.state_key, policy_cfg.action_key],
            transform=transform, collate=collate)


def open_sources(data: DatasetConfig) -> tuple[list[FrameSource], list[str], list[float | None]]:
    """The dataset's sources (one, or a mixture's), their names and mixture weights."""
    from roboscale.data.loading.source import open_source

    entries = list(data.mixture.items()) if data.mixture else [(data.root, None)]
    options: dict[str, Any] = {"episodes": data.episodes} if data.episodes is not None else {}
    if not data.verify_lake_shards:
        options["verify_on_open"] = False
    sources = [open_source(path, **options) for path, _ in entries]
    return sources, [str(path) for path, _ in entries], [w for _, w in entries]


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
