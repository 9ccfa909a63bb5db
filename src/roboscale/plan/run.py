"""`roboscale plan` from its config to results: the workload, the cluster, the rows (and the paper's round)."""

from __future__ import annotations

from dataclasses import dataclass

from roboscale.configs.plan import PlanConfig
from roboscale.models.flops import SampleFlops
from roboscale.plan.model import Cluster, Network, Row, Workload, plan_rows
from roboscale.plan.paper import PaperRound, paper_round
from roboscale.plan.workload import DataCost, filled, workload_of


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    workload: Workload
    flops: SampleFlops
    cluster: Cluster
    peak_source: str
    rows: list[Row]
    paper: PaperRound | None = None


def cluster_of(cfg: PlanConfig) -> tuple[Cluster, str]:
    """Effective link rates and the compute peak (bf16 datasheet; x fp8_speedup for fp8) of ``cfg``'s GPUs."""
    from roboscale.train.flops import gpu_spec

    gpu = gpu_spec(cfg.gpu)
    nvlink = cfg.network.nvlink_GBps or gpu.nvlink_GBps
    eff = cfg.network.efficiency
    network = Network(ranks_per_node=cfg.gpus_per_node, intra_Bps=nvlink / 2 * 1e9 * eff,
                      inter_Bps=cfg.network.node_gbps / 8 * 1e9 * eff, latency_s=cfg.network.latency_us * 1e-6)
    peak, source = gpu.bf16, f"{gpu.key} datasheet dense bf16 {gpu.bf16 / 1e12:,.0f} TFLOP/s"
    if cfg.precision == "fp8":
        peak *= cfg.fp8_speedup
        source += f" x fp8_speedup {cfg.fp8_speedup}"
    return Cluster(network, peak, cfg.data.cores_per_node, cfg.data.storage_GBps * 1e9), source


def make_plan(cfg: PlanConfig) -> Plan:
    """The plan's rows for ``cfg`` (and, with ``paper_round``, the seed paper's round for GR00T-N1.5 full)."""
    from roboscale.models.registry import preset_config
    from roboscale.train.flops import flops_per_sample

    data = DataCost(cfg.data.source, cfg.data.ms_per_frame)
    workload = workload_of(cfg.policy, precision=cfg.precision, data=data, shard_frozen=cfg.shard_frozen)
    cluster, source = cluster_of(cfg)
    options = dict(strategy=cfg.strategy, overlap=cfg.overlap, mfu=cfg.mfu, samples_per_s=cfg.samples_per_s)
    rows = plan_rows(workload, cluster, batch_size=cfg.batch_size, gpus=cfg.gpus,
                     dataset_frames=cfg.dataset_frames, **options)
    paper = None
    if cfg.paper_round:
        groot = workload_of(preset_config("groot", "full"), precision=cfg.precision, data=data,
                            shard_frozen=cfg.shard_frozen)
        # a measured samples/s is the configured policy's, not GR00T's
        same = type(cfg.policy).type == "groot" and cfg.preset == "full"
        paper = paper_round(groot, cluster, fixed_batch=max(cfg.batch_size, 1024),
                            **{**options, "samples_per_s": cfg.samples_per_s if same else 0.0})
    return Plan(cfg, workload, flops_per_sample(filled(cfg.policy)), cluster, source, rows, paper)
