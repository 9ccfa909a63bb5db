"""`roboscale plan`'s text: the inputs used, the table (Markdown), the paper's round."""

from __future__ import annotations

from roboscale.plan.run import Plan


def duration(seconds: float) -> str:
    if seconds <= 0:
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 72 * 3600 else f"{seconds / 86400:.1f} d"


def _rate(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:,.0f}"


def inputs(plan: Plan) -> list[str]:
    cfg, w, c = plan.config, plan.workload, plan.cluster
    parts = ", ".join(f"{x.name} {x.training / 1e12:.2f}{'' if x.trains else ' (frozen)'}"
                      for x in plan.flops.components)
    compute = (f"measured {cfg.samples_per_s:g} samples/s per GPU" if cfg.samples_per_s
               else f"{plan.peak_source} x MFU {cfg.mfu:g}")
    return [
        (f"{w.name} ({cfg.preset}): {w.params / 1e9:.2f} B parameters, {w.trainable_params / 1e9:.2f} B trained; "
         f"{w.flops_per_sample / 1e12:.2f} TFLOP per training sample ({parts})"),
        (f"compute: {compute}; {cfg.precision}; strategy {cfg.strategy}, {cfg.gpus_per_node} GPUs per node, "
         f"overlap {cfg.overlap:g} of compute"),
        (f"per step: all-gather {w.gather_bytes / 1e9:.1f} GB forward + {w.backward_gather_bytes / 1e9:.1f} GB "
         f"backward, reduce {w.grad_bytes / 1e9:.1f} GB of fp32 gradients; {w.units} units"),
        (f"links (effective, x{cfg.network.efficiency:g}): {c.network.intra_Bps / 1e9:.0f} GB/s per GPU each way "
         f"inside a node, {c.network.inter_Bps / 1e9:.0f} GB/s per node across nodes; "
         f"{cfg.network.latency_us:g} us per collective"),
        (f"data: {cfg.data.source}, {w.core_s_per_sample * 1e3:.2f} CPU-ms and {w.bytes_per_sample / 1e6:.2f} MB per "
         f"sample, {c.cores_per_node} loader cores per node"
         + (f", storage {c.storage_Bps / 1e9:g} GB/s per node" if c.storage_Bps else "")),
        f"global batch {cfg.batch_size}; epoch = {cfg.dataset_frames:,} frames",
    ]


def table(plan: Plan) -> list[str]:
    lines = [("| GPUs | samples/GPU | step | compute | comm (exposed) | data need / avail per node (samples/s) "
              "| GB/s per node | scaling eff. | epoch | bottleneck |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in plan.rows:
        lines.append(f"| {r.gpus:,} | {r.samples_per_gpu} | {duration(r.step_s)} | {duration(r.compute_s)} | "
                     f"{duration(r.comm_s)} ({duration(r.exposed_s)}) | {_rate(r.needed_per_node)} / "
                     f"{_rate(r.available_per_node)} | {r.bytes_per_s_per_node / 1e9:.2f} | "
                     f"{100 * r.efficiency:.0f}% | {duration(r.epoch_s)} | {r.bottleneck} |")
    return lines


def paper_lines(plan: Plan) -> list[str]:
    p = plan.paper
    if p is None:
        return []
    cfg = plan.config
    need_gpus = f"{p.gpus_for_target:,} GPUs" if p.gpus_for_target else "more than 65,536 GPUs"
    if p.inter_Bps_for_target is None:
        need_net = "is out of reach by RDMA bandwidth alone (compute and NVLink traffic bound the step)"
    else:
        nominal = p.inter_Bps_for_target / cfg.network.efficiency * 8 / 1e9
        need_net = f"would need {nominal:,.0f} Gb/s of RDMA per node (now {cfg.network.node_gbps:,.0f})"
    return [
        "",
        "Seed paper's round (GR00T-N1.5 fine-tuning, 15 h -> 22 min, 40x, on ~1,000 GPUs; arXiv 2603.11101):",
        (f"  inputs: groot full preset, the links, loader, MFU and precision above; the 15 h baseline read as one "
         f"{p.baseline_gpus}-GPU node at {p.per_gpu_batch} samples per GPU (Isaac-GR00T's fine-tuning default)"),
        f"  a 15 h round on that node is {p.round_samples / 1e6:,.0f} M samples",
        (f"  at {p.gpus:,} GPUs, {p.per_gpu_batch} samples per GPU: {duration(p.weak_s)} per round, "
         f"{p.weak_speedup:.0f}x ({p.weak_bottleneck}-bound)"),
        f"  {p.target:.0f}x with {p.per_gpu_batch} samples per GPU needs {need_gpus}",
        (f"  at {p.gpus:,} GPUs with the global batch fixed at {p.fixed_batch:,}: {p.fixed_speedup:.1f}x "
         f"({p.fixed_bottleneck}-bound); {p.target:.0f}x {need_net}"),
    ]


def render(plan: Plan) -> str:
    return "\n".join([*inputs(plan), "", *table(plan), *paper_lines(plan)])
