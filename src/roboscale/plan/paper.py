"""The seed paper's claim through the model: a GR00T-N1.5 fine-tuning round cut from ~15 h to ~22 min (40x) on
~1,000 GPUs with 3.2 Tb/s RDMA (arXiv 2603.11101, abstract; its baseline setup is not public).

Reading used here: the 15 h baseline ran on one 8-GPU node, the round is a fixed number of samples, and the
40x comes from scaling out. The model then gives (1) the round size that takes 15 h on the baseline node,
(2) the round's time and speed-up at ``gpus`` with the per-GPU batch kept (weak scaling), (3) the fewest GPUs
that reach the target, and (4) with the global batch fixed instead, the speed-up at ``gpus`` and the RDMA
bandwidth per node the target would need (None: bandwidth alone cannot reach it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from roboscale.plan.model import Cluster, Workload, plan_rows


@dataclass(frozen=True)
class PaperRound:
    round_samples: float
    """Samples of one round: what the baseline node trains in ``baseline_hours``."""
    baseline_gpus: int
    baseline_s: float
    gpus: int
    per_gpu_batch: int
    weak_s: float
    """The round at ``gpus`` with the per-GPU batch kept."""
    weak_speedup: float
    weak_bottleneck: str
    gpus_for_target: int | None
    """Fewest GPUs (whole nodes) reaching ``target`` with the per-GPU batch kept (None: not below 65,536)."""
    fixed_batch: int
    fixed_speedup: float
    """Speed-up at ``gpus`` with the global batch fixed at ``fixed_batch`` (the baseline node at the same batch)."""
    fixed_bottleneck: str
    inter_Bps_for_target: float | None
    """Effective RDMA bytes/s per node the fixed-batch round needs for ``target`` (None: out of reach)."""
    target: float


def _round(workload: Workload, cluster: Cluster, gpus: int, batch: int, samples: float, options: dict):
    row = plan_rows(workload, cluster, batch_size=batch, gpus=[gpus], **options)[0]
    return samples / batch * row.step_s, row


def paper_round(workload: Workload, cluster: Cluster, *, baseline_gpus: int = 8, baseline_hours: float = 15.0,
                gpus: int = 1024, per_gpu_batch: int = 32, fixed_batch: int = 1024, target: float = 40.0,
                strategy: str = "hsdp", overlap: float = 0.8, mfu: float = 0.4,
                samples_per_s: float = 0.0) -> PaperRound:
    options = dict(strategy=strategy, overlap=overlap, mfu=mfu, samples_per_s=samples_per_s)
    baseline_s = baseline_hours * 3600
    _, base = _round(workload, cluster, baseline_gpus, baseline_gpus * per_gpu_batch, 0.0, options)
    samples = baseline_s * base.samples_per_s
    weak_s, weak = _round(workload, cluster, gpus, gpus * per_gpu_batch, samples, options)
    step = cluster.network.ranks_per_node
    needed = next((n for n in range(step, 65536 + 1, step)
                   if baseline_s / _round(workload, cluster, n, n * per_gpu_batch, samples, options)[0] >= target),
                  None)

    fixed_base, _ = _round(workload, cluster, baseline_gpus, fixed_batch, samples, options)

    def fixed(inter_Bps: float):
        faster = replace(cluster, network=replace(cluster.network, inter_Bps=inter_Bps))
        return _round(workload, faster, gpus, fixed_batch, samples, options)

    fixed_s, fixed_row = fixed(cluster.network.inter_Bps)
    bandwidth = None
    if fixed_base / fixed(math.inf)[0] >= target:  # bisect (geometrically) on the node's RDMA bandwidth
        low, high = 1e3, 1e16
        for _ in range(200):
            mid = math.sqrt(low * high)
            low, high = (low, mid) if fixed_base / fixed(mid)[0] >= target else (mid, high)
        bandwidth = high
    return PaperRound(samples, baseline_gpus, baseline_s, gpus, per_gpu_batch, weak_s, baseline_s / weak_s,
                      weak.bottleneck, needed, fixed_batch, fixed_base / fixed_s, fixed_row.bottleneck, bandwidth,
                      target)
