"""Which data-parallel strategy a run uses, over which device mesh, resolved from ``--parallel.*`` and the ranks.

Every rank is a data-parallel rank (no tensor or pipeline parallelism: VLAs of a few billion parameters fit a GPU
once sharded). The mesh is ``dp_replicate x dp_shard``: FSDP shards over all ranks (1 x N), HSDP shards within
``dp_shard`` ranks (a node) and replicates across groups, DDP replicates everything (N x 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from roboscale.configs.train import ParallelConfig
from roboscale.distributed.env import DistributedEnv
from roboscale.errors import ConfigError


@dataclass(frozen=True)
class ParallelPlan:
    strategy: str
    """none | ddp | fsdp | hsdp (auto resolved)."""
    dp_replicate: int
    dp_shard: int

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")


def resolve_plan(cfg: ParallelConfig, env: DistributedEnv) -> ParallelPlan:
    """The strategy and mesh shape for ``env.world_size`` ranks; an impossible combination names the option."""
    world = env.world_size
    strategy = cfg.strategy
    if strategy == "auto" or world == 1:  # one rank has nothing to replicate or shard over (e.g. a resume at 1)
        strategy = "none" if world == 1 else "fsdp"
    if strategy == "none":
        if world > 1:
            raise ConfigError(f"--parallel.strategy=none trains one process, but {world} ranks were started; use "
                              "ddp, fsdp or hsdp")
        return ParallelPlan("none", 1, 1)
    if strategy == "ddp":
        return ParallelPlan("ddp", world, 1)
    if strategy == "fsdp":
        if cfg.dp_replicate not in (1, -1):
            raise ConfigError(f"--parallel.dp_replicate={cfg.dp_replicate} replicates shards: that is "
                              "--parallel.strategy=hsdp")
        if cfg.dp_shard not in (-1, world):
            raise ConfigError(f"--parallel.dp_shard={cfg.dp_shard} with fsdp must be the world size {world} (or -1); "
                              "to shard over fewer ranks use --parallel.strategy=hsdp")
        return ParallelPlan("fsdp", 1, world)
    shard = cfg.dp_shard if cfg.dp_shard > 0 else env.local_world_size
    replicate = cfg.dp_replicate if cfg.dp_replicate > 0 else world // max(1, shard)
    if shard * replicate != world:
        raise ConfigError(f"--parallel.dp_shard={shard} x --parallel.dp_replicate={replicate} must equal the "
                          f"{world} ranks started")
    return ParallelPlan("hsdp", replicate, shard)


def build_mesh(plan: ParallelPlan, env: DistributedEnv):
    """The DeviceMesh FSDP2 shards over (None for one process or DDP)."""
    if not plan.sharded:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if plan.strategy == "fsdp":
        return init_device_mesh(env.device.type, (plan.dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(env.device.type, (plan.dp_replicate, plan.dp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
