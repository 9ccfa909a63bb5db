"""Options that cannot work with the ranks started fail before anything is built, naming the option."""

from __future__ import annotations

import pytest

from roboscale.configs.train import ParallelConfig, TrainConfig
from roboscale.distributed.env import DistributedEnv
from roboscale.distributed.mesh import resolve_plan
from roboscale.errors import ConfigError
from roboscale.train.trainer import check_parallel_options, freeze


def env(world: int, local: int | None = None) -> DistributedEnv:
    return DistributedEnv(rank=0, world_size=world, local_world_size=local or world)


@pytest.mark.parametrize(("world", "options", "strategy", "mesh"), [
    (1, {}, "none", (1, 1)),
    (1, {"strategy": "fsdp"}, "none", (1, 1)),
    (4, {}, "fsdp", (1, 4)),
    (4, {"strategy": "ddp"}, "ddp", (4, 1)),
    (8, {"strategy": "hsdp"}, "hsdp", (2, 4)),  # 2 nodes of 4: shard within a node, replicate across
    (8, {"strategy": "hsdp", "dp_shard": 2}, "hsdp", (4, 2)),
])
def test_auto_and_explicit_strategies_resolve_to_a_mesh(world, options, strategy, mesh) -> None:
    local = 4 if world == 8 else None
    plan = resolve_plan(ParallelConfig(**options), env(world, local))
    assert (plan.strategy, (plan.dp_replicate, plan.dp_shard), plan.dp_size) == (strategy, mesh, world)


@pytest.mark.parametrize(("world", "options", "named"), [
    (2, {"strategy": "none"}, "--parallel.strategy=none"),
    (4, {"strategy": "fsdp", "dp_replicate": 2}, "--parallel.dp_replicate=2"),
    (4, {"strategy": "fsdp", "dp_shard": 2}, "--parallel.dp_shard=2"),
    (6, {"strategy": "hsdp", "dp_shard": 4}, "--parallel.dp_shard=4"),
])
def test_impossible_meshes_name_the_option(world, options, named) -> None:
    with pytest.raises(ConfigError, match=f"^{named}"):
        resolve_plan(ParallelConfig(**options), env(world))


def test_a_global_batch_the_ranks_cannot_share_is_refused() -> None:
    plan = resolve_plan(ParallelConfig(), env(4))
    with pytest.raises(ConfigError, match=r"^--batch_size=6 is not divisible by the 4 data-parallel ranks"):
        check_parallel_options(6, 1, plan)
    with pytest.raises(ConfigError, match=r"^--grad_accum=3 exceeds each rank's 2 samples"):
        check_parallel_options(8, 3, plan)


@pytest.mark.parametrize(("field", "value"), [("strategy", "zero3"), ("timeout_s", 0)])
def test_bad_parallel_options(field, value) -> None:
    with pytest.raises(ConfigError, match=f"^--parallel.{field}"):
        ParallelConfig(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("precision", "fp16"), ("launcher", "slurm"),
                                              ("activation_checkpointing", "some"), ("grad_accum", 0),
                                              ("ema_decay", 1.0)])
def test_bad_training_options(field, value) -> None:
    with pytest.raises(ConfigError, match=f"^--{field}"):
        TrainConfig(**{field: value})


def test_freeze_names_components_users_know(tiny_dataset) -> None:
    from roboscale.models.registry import build_policy, preset_config
    from roboscale.data.loading.meta import source_meta
    from roboscale.data.loading.source import open_source

    policy = build_policy(preset_config("pi05", "tiny"), source_meta([open_source(tiny_dataset)], [str(tiny_dataset)]))
    vision = [n for n, _ in policy.named_parameters() if n.startswith("vision.")]
    assert vision
    freeze(policy, ["vision"])
    assert all(not p.requires_grad for n, p in policy.named_parameters() if n in vision)
    assert any(p.requires_grad for n, p in policy.named_parameters() if n not in vision)
    with pytest.raises(ConfigError, match="^--freeze: pi05 has no component 'eyes'"):
        freeze(policy, ["eyes"])
