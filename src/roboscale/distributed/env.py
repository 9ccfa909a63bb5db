"""The ranks this process trains with: torchrun's (or Ray Train's) environment, a process group with a timeout,
and per-rank CPU threads.

One process without ``WORLD_SIZE`` (``roboscale train``) is rank 0 of 1 and needs no process group. Under
torchrun, ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` say who we are; Ray Train sets the
same variables and may have initialized the group already. gloo on CPU, NCCL on GPU (with gloo beside it for the
few CPU tensors the trainer reduces). Every collective times out after ``timeout_s``: a dead or stopped rank ends
the others with an error instead of hanging them.

Ranks on one machine share its cores: each takes ``cores / ranks on this machine`` threads, since OpenMP's
default of every core per process makes co-located ranks spin against each other (benchmarks/shared_cpu.sh).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from roboscale.utils.lifetime import exit_with

log = logging.getLogger(__name__)

TORCHRUN = "TORCHELASTIC_RUN_ID"
"""Set by torchrun's agent in the ranks it starts."""


@dataclass(frozen=True)
class DistributedEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False
    """This process created the process group (torchrun), so it ends it; Ray Train ends its own."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def another_rank_failed(self, failed: bool) -> bool:
        """Whether a rank other than this one failed (a collective: every rank calls it). Ranks that only wait
        for the others would otherwise wait until the collective timeout for one that gave up."""
        if not self.distributed:
            return False
        flag = torch.tensor([1.0 if failed else 0.0])
        dist.all_reduce(flag)
        return not failed and flag.item() > 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def init_distributed(timeout_s: float, num_threads: int = 0) -> DistributedEnv:
    """Join the ranks the environment describes (a no-op for one process) and set this rank's CPU threads."""
    if os.environ.get(TORCHRUN):  # torchrun starts ranks in sessions of their own: nothing else ends them
        exit_with(os.getppid())  # when the launcher is killed outright (the agent is the rank's parent)
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    threads = num_threads or max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    owns_group = world_size > 1 and not dist.is_initialized()
    if owns_group:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, store=_attempt_store(rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    env = DistributedEnv(rank, world_size, local_rank, local_world_size, device, owns_group)
    if env.distributed:
        log.info("rank %d of %d (local %d of %d) on %s, %d threads", rank, world_size, local_rank,
                 local_world_size, device, threads)
    return env


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """torchrun's store for this round of ranks. The agent's shared store outlives a restart: the dead ranks'
    gloo addresses stayed under the same keys and the new ranks tried to connect to them (connection refused)
    about half the time, so each restart gets a prefix of its own. Without the shared store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, what a host joining a running job needs: README, "Clusters") each
    round's rank 0 hosts a new store, and no prefix is needed -- nor could one be agreed on, since the agents'
    restart counts differ once a host has rejoined (a restarted agent counts 1, a new one 0)."""
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "False":
        return store
    return dist.PrefixStore(f"roboscale/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown(env: DistributedEnv) -> None:
    """End the process group this process created (after a failure too: torchrun then restarts cleanly)."""
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()
