"""The analytical scaling model: step time of data-parallel training from compute, communication and data rates.

Pure arithmetic on a ``Workload`` (what one training sample costs, what a step moves) and a ``Cluster`` (peak rate,
links, loader cores); no torch. ``plan_rows`` is what ``roboscale plan`` prints, ``predict_step_time`` one point
of it (also for CPU processes over gloo, to check the model against measurements).

Rules, each a stated assumption:
- compute per rank = ceil(batch / ranks) x training FLOPs per sample / (peak x MFU), or / measured samples/s; the
  slowest rank sets the pace, so an uneven split costs the extra sample;
- FSDP per step: all-gather of the sharded weights in forward, again in backward (only the weights whose backward
  runs: the trainable ones, plus frozen ones that gradients flow through), reduce-scatter of the gradients. A ring
  over n ranks moves (n - 1) / n of the data through each rank's link per collective (all-reduce: twice that);
- links: inside a node, NVLink per GPU and direction; a collective spanning nodes is limited by the slower of
  NVLink and the node's RDMA bandwidth (NCCL runs one ring per NIC, so the node's data crosses its NICs once);
  where a backend's collectives differ, each has its own rate inside a node (gloo on CPU: reductions add on the
  cores that compute), and a reduce-scatter may move more than a ring's bytes (gloo's: an all-reduce's, 2x);
- HSDP: sharded within a node (NVLink), gradients all-reduced across nodes, one shard per GPU on its own NIC;
- DDP: one all-reduce of the gradients per step;
- each collective also pays a fixed latency, one per parallel unit and collective;
- overlap: communication hides behind compute up to ``overlap`` x the compute time (FSDP prefetches the next
  unit's weights; gradients reduce while earlier units run backward); what is left shows in the step;
- data: loader cores decode and transform the next batches while the GPUs step, so data bounds the step only
  when a node's cores (or its storage) cannot produce its samples in the GPU's step time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

STRATEGIES = ("fsdp", "hsdp", "ddp")


@dataclass(frozen=True)
class Workload:
    """What one policy's training costs, per sample and per step."""

    name: str
    flops_per_sample: float
    """Training FLOPs (forward + backward) of one sample."""
    params: int
    trainable_params: int
    gather_bytes: float
    """Bytes of the weights FSDP gathers for forward (every sharded weight, at its gather dtype)."""
    backward_gather_bytes: float
    """Bytes gathered again for backward (the units whose backward runs)."""
    grad_bytes: float
    """Bytes of the gradients reduced (trainable weights, at the reduce dtype)."""
    units: int
    """Parallel units (FSDP groups): collectives per pass."""
    bytes_per_sample: float
    """Bytes a sample carries from storage to the GPU (uint8 frames, numbers, token ids)."""
    core_s_per_sample: float
    """CPU-seconds the loader spends on one sample (decode, resize, transform)."""


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Network:
    """Effective bandwidths (what collectives reach, in bytes/s per direction) and per-collective latency."""

    ranks_per_node: int
    intra_Bps: float
    """Per rank, inside a node (NVLink; gloo over loopback for CPU processes)."""
    inter_Bps: float
    """Per node, across nodes (RDMA: all NICs of the node together)."""
    latency_s: float = 0.0
    collective_Bps: Mapping[str, float] = field(default_factory=dict)
    """Per rank inside a node, per collective (all_gather, reduce_scatter, all_reduce), where the backend's
    collectives run at different rates (gloo on CPU: a reduction adds as it copies, on the cores that compute);
    a collective not named runs at intra_Bps."""
    reduce_scatter_traffic: float = 1.0
    """Bytes a reduce-scatter moves through each link, in multiples of a ring reduce-scatter's ((n - 1) / n of
    the data): 1 for NCCL; 2 for gloo (torch 2.13), which all-reduces the whole tensor and keeps its shard
    (benchmarks/multihost.py counts the bytes that cross the link between two hosts)."""

    @classmethod
    def single_host(cls, ranks: int, Bps: float, latency_s: float = 0.0) -> Network:
        """Processes on one machine (CPU ranks over gloo): every collective at ``Bps`` per rank."""
        return cls(ranks_per_node=max(ranks, 1), intra_Bps=Bps, inter_Bps=Bps, latency_s=latency_s)

    def rate(self, collective: str) -> float:
        """Bytes/s per rank of ``collective`` inside a node."""
        return self.collective_Bps.get(collective, self.intra_Bps)


@dataclass(frozen=True)
class Cluster:
    network: Network
    peak_flops: float
    """Per GPU, at the precision trained."""
    cores_per_node: int
    """CPU cores of a node for the loader."""
    storage_Bps: float = 0.0
    """Read bandwidth per node (0: not a limit)."""


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float
    """All collectives of one step, as if nothing overlapped."""
    exposed_s: float
    """The part of comm_s compute does not hide."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s


def _ring(n: int, nbytes: float, Bps: float) -> float:
    return 0.0 if n <= 1 or nbytes == 0 else (n - 1) / n * nbytes / Bps


_PASSES = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}
"""A ring all-reduce is a reduce-scatter then an all-gather: twice the bytes of either."""


def _collective(network: Network, kind: str, n: int, nbytes: float, spans_nodes: bool) -> float:
    """One ring collective of ``nbytes`` over ``n`` ranks: the slower of the ranks' own rate and, for a ring that
    spans nodes, the node's link (each direction of it carries one ring edge)."""
    passes = _PASSES[kind] * (network.reduce_scatter_traffic if kind == "reduce_scatter" else 1.0)
    seconds = passes * _ring(n, nbytes, network.rate(kind))
    if spans_nodes:
        seconds = max(seconds, passes * _ring(n, nbytes, network.inter_Bps))
    return seconds


def comm_seconds(workload: Workload, ranks: int, network: Network, strategy: str) -> float:
    """Seconds of collectives per optimizer step (no overlap), by the module docstring's rules."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if ranks <= 1:
        return 0.0
    per_node = min(ranks, network.ranks_per_node)
    nodes = math.ceil(ranks / per_node)
    w = workload
    if strategy == "ddp":
        return _collective(network, "all_reduce", ranks, w.grad_bytes, nodes > 1) + w.units * network.latency_s
    if strategy == "fsdp" or nodes == 1:
        spans = nodes > 1
        seconds = (_collective(network, "all_gather", ranks, w.gather_bytes, spans)
                   + _collective(network, "all_gather", ranks, w.backward_gather_bytes, spans)
                   + _collective(network, "reduce_scatter", ranks, w.grad_bytes, spans))
        return seconds + 3 * w.units * network.latency_s
    # hsdp: shard and gather inside the node; each rank all-reduces its gradient shard across nodes, the node's
    # ranks at once sharing its link
    inside = (_collective(network, "all_gather", per_node, w.gather_bytes, False)
              + _collective(network, "all_gather", per_node, w.backward_gather_bytes, False)
              + _collective(network, "reduce_scatter", per_node, w.grad_bytes, False))
    across = max(_collective(network, "all_reduce", nodes, w.grad_bytes / per_node, False),
                 2 * _ring(nodes, w.grad_bytes, network.inter_Bps))
    return inside + across + 4 * w.units * network.latency_s


def bytes_across_nodes(workload: Workload, ranks: int, network: Network, strategy: str) -> float:
    """Bytes one node's link carries per optimizer step, both directions together, by the same rules."""
    per_node = min(ranks, network.ranks_per_node)
    nodes = math.ceil(ranks / per_node)
    if nodes <= 1:
        return 0.0
    w = workload

    def ring_bytes(n: int, nbytes: float) -> float:  # through one direction of a node's link
        return (n - 1) / n * nbytes

    if strategy == "ddp":
        one_way = 2 * ring_bytes(ranks, w.grad_bytes)
    elif strategy == "fsdp":
        one_way = (ring_bytes(ranks, w.gather_bytes) + ring_bytes(ranks, w.backward_gather_bytes)
                   + network.reduce_scatter_traffic * ring_bytes(ranks, w.grad_bytes))
    else:
        one_way = 2 * ring_bytes(nodes, w.grad_bytes)
    return 2 * one_way


def predict_step_time(workload: Workload, *, ranks: int, batch_size: int, network: Network,
                      strategy: str = "fsdp", peak_flops: float = 0.0, mfu: float = 0.4,
                      samples_per_s: float = 0.0, overlap: float = 0.0) -> StepTime:
    """One optimizer step of ``batch_size`` samples (global) over ``ranks``: compute from ``peak_flops`` x ``mfu``
    (or a measured one-rank ``samples_per_s``), collectives over ``network``, ``overlap`` x compute hiding them.
    For CPU processes over gloo: ``Network.single_host(ranks, gloo bytes/s)``, ``peak_flops`` the measured GEMM
    rate (``roboscale.train.flops.peak_flops("cpu", "fp32")``), overlap 0 (gloo works on the same cores)."""
    if ranks < 1 or batch_size < 1:
        raise ValueError(f"ranks and batch_size must be positive, got {ranks} and {batch_size}")
    per_rank = math.ceil(batch_size / ranks)
    if samples_per_s > 0:
        compute = per_rank / samples_per_s
    elif peak_flops > 0 and mfu > 0:
        compute = per_rank * workload.flops_per_sample / (peak_flops * mfu)
    else:
        raise ValueError("give samples_per_s, or peak_flops and mfu")
    comm = comm_seconds(workload, ranks, network, strategy)
    return StepTime(compute, comm, max(0.0, comm - overlap * compute))


@dataclass(frozen=True)
class Row:
    """One line of the plan: ``gpus`` ranks training ``batch_size`` samples per step."""

    gpus: int
    nodes: int
    samples_per_gpu: int
    compute_s: float
    comm_s: float
    exposed_s: float
    data_s: float
    """Seconds a node's loader cores (or storage) need for the node's samples of one step."""
    step_s: float
    needed_per_node: float
    """Samples/s a node's GPUs consume when nothing else limits them."""
    available_per_node: float
    """Samples/s a node's loader cores (and storage) can produce."""
    bytes_per_s_per_node: float
    """Storage-to-GPU bytes/s a node needs at the achieved step rate."""
    samples_per_s: float
    efficiency: float
    """Throughput over ``gpus`` x the one-GPU throughput (1.0 = perfect scaling)."""
    epoch_s: float
    bottleneck: str
    """compute | network (communication not hidden) | data (the loader cannot keep up)."""


def _row(workload: Workload, cluster: Cluster, gpus: int, batch_size: int, strategy: str, overlap: float,
         mfu: float, samples_per_s: float, dataset_frames: int, base_rate: float | None) -> Row:
    nodes = math.ceil(gpus / min(gpus, cluster.network.ranks_per_node))
    time = predict_step_time(workload, ranks=gpus, batch_size=batch_size, network=cluster.network,
                             strategy=strategy, peak_flops=cluster.peak_flops, mfu=mfu,
                             samples_per_s=samples_per_s, overlap=overlap)
    available = cluster.cores_per_node / workload.core_s_per_sample if workload.core_s_per_sample > 0 else math.inf
    if cluster.storage_Bps > 0 and workload.bytes_per_sample > 0:
        available = min(available, cluster.storage_Bps / workload.bytes_per_sample)
    per_node = batch_size / nodes
    data_s = per_node / available
    step = max(time.step_s, data_s)
    rate = batch_size / step
    if time.step_s < data_s:
        bottleneck = "data"
    elif time.exposed_s > 0:
        bottleneck = "network"
    else:
        bottleneck = "compute"
    return Row(gpus, nodes, math.ceil(batch_size / gpus), time.compute_s, time.comm_s, time.exposed_s, data_s, step,
               per_node / time.step_s, available, per_node / step * workload.bytes_per_sample, rate,
               rate / (gpus * (base_rate or rate)), dataset_frames / rate if dataset_frames else 0.0, bottleneck)


def plan_rows(workload: Workload, cluster: Cluster, *, batch_size: int, gpus: list[int], strategy: str = "hsdp",
              overlap: float = 0.8, mfu: float = 0.4, samples_per_s: float = 0.0,
              dataset_frames: int = 0) -> list[Row]:
    """The plan's table: one Row per GPU count, efficiency against one GPU with the same global batch."""
    options = dict(batch_size=batch_size, strategy=strategy, overlap=overlap, mfu=mfu, samples_per_s=samples_per_s,
                   dataset_frames=dataset_frames)
    base = _row(workload, cluster, 1, base_rate=None, **options).samples_per_s
    return [_row(workload, cluster, n, base_rate=base, **options) for n in gpus]
