"""Training across hosts on slow links, and the scaling model checked against it: DDP, FSDP2 and HSDP on 2 hosts x
2 ranks of a cluster in a box (``roboscale.testing.cluster``: network namespaces on a bridge), with the links
between the hosts limited to 100 Mbit/s, 1 Gbit/s and not at all (``tc`` ``tbf``), side by side in one run.

Every configuration is `roboscale train` itself, torchrun on each host (c10d rendezvous on host0, gloo on eth0),
one thread per rank, the same global batches; the step time is the median of metrics.jsonl's ``step_time`` after
``--warmup``. The prediction is ``roboscale.plan.predict_step_time`` -- the model behind `roboscale plan`, whose
``--network.node_gbps`` and ``--network.efficiency`` are the link's rate and the fraction collectives reach --
given what it needs, each measured in this run (``--probe-worker``, under torchrun on the same hosts):

- compute: one process's samples/s on one thread, shared as the 4 ranks share this machine's cores;
- inside a host: each collective's rate between the 2 ranks of a host, both hosts at once, at the size training
  sends it (FSDP's per-unit gathers and reductions, DDP's bucket);
- the link: one rank on each host all-reducing 16-64 MB (both directions loaded, as a ring crossing it loads
  them), in bytes/s per direction, also shown as the efficiency it reaches of the nominal rate;
- the fixed cost of one collective: a tiny all-reduce over the 4 ranks;
- gloo's reduce-scatter moves an all-reduce's bytes (``GLOO_REDUCE_SCATTER_TRAFFIC``): the table's bytes across
  the link, counted on it and predicted, check it.

    .venv/bin/python benchmarks/multihost.py          # needs root and iproute2; ~12 minutes on 2 cores

The dataset is generated once under outputs/bench/ (gitignored); the runs go to outputs/bench/multihost-runs/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import training as single_host  # noqa: E402 - benchmarks/ is not a package

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "outputs" / "bench" / "multihost-runs"
HOSTS, RANKS_PER_HOST = 2, 2
RATES = (None, 1000.0, 100.0)
"""Link rates in Mbit/s (None: not limited)."""
STRATEGIES = ("ddp", "fsdp", "hsdp")
PORT = 29451
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING", "GLOO_SOCKET_IFNAME": "eth0",
       "PYTHONPATH": str(ROOT / "src")}


def _rate_name(rate: float | None) -> str:
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


def _torchrun(cluster, *argv: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={HOSTS}", f"--nproc-per-node={RANKS_PER_HOST}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=host0:{PORT}", f"--rdzv-id={cluster.name}-{time.monotonic_ns()}",
            *argv]


def on_hosts(cluster, argv: list[str], timeout_s: float = 900.0) -> str:
    """``argv`` under torchrun on every host; host0's stdout (rank 0 prints there)."""
    procs = [host.popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for host in cluster.hosts]
    outputs = [p.communicate(timeout=timeout_s) for p in procs]
    failed = [f"--- {host.name}\n{err[-3000:]}" for host, proc, (_, err) in zip(cluster.hosts, procs, outputs, strict=True)
              if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"`{' '.join(argv[:8])} ...` failed:\n" + "\n".join(failed))
    return outputs[0][0]


GLOO_REDUCE_SCATTER_TRAFFIC = 2.0
"""gloo's reduce-scatter (torch 2.13) all-reduces the whole tensor and keeps its shard: twice a ring
reduce-scatter's bytes through the link (counted on the link: the table's MB across, measured and predicted)."""


def probe_network(cluster, workload, link_megabytes: int) -> dict[str, float]:
    sizes = {"unit": workload.gather_bytes / workload.units, "bucket": min(workload.grad_bytes, 25 * 2**20)}
    out = on_hosts(cluster, _torchrun(cluster, __file__, "--probe-worker",
                                      json.dumps({**sizes, "link": link_megabytes * 2**20})))
    return json.loads(out.strip().splitlines()[-1])


def _probe_worker(sizes: dict[str, float]) -> None:
    """Under torchrun on every host: what the model takes of the network, each as training meets it (rank 0
    prints them as JSON) --
    - latency_s: a tiny all-reduce over every rank;
    - <collective>_Bps: each collective among the ranks of a host, every host at once (they share the machine's
      cores as in training), at the size training sends it (FSDP's per-unit gathers and reductions, DDP's
      bucket); bytes/s per rank counted as the model counts them;
    - inter_Bps: the link, one rank on each host all-reducing a large buffer (both directions at once, as a ring
      crossing it loads them), in bytes/s per direction."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    host_groups = [dist.new_group(list(range(h * local, (h + 1) * local))) for h in range(world // local)]
    mine = host_groups[rank // local]
    across = dist.new_group([0, local])  # one rank on each of two hosts

    def seconds(run, rounds: int, group=None) -> float:
        run()  # warm-up: connections
        dist.barrier(group=group)  # of the ranks that run it: a world barrier here would pair with another one
        start = time.perf_counter()
        for _ in range(rounds):
            run()
        return (time.perf_counter() - start) / rounds

    def ring_bytes(nbytes: float, members: int) -> float:
        return (members - 1) / members * nbytes

    def buffers(nbytes: float, members: int):
        numel = max(members, int(nbytes) // 4 // members * members)
        return torch.ones(numel), torch.ones(numel // members), numel * 4

    tiny = torch.ones(1)
    result = {"latency_s": seconds(lambda: dist.all_reduce(tiny), 200)}
    full, shard, nbytes = buffers(sizes["unit"], local)
    result["all_gather_Bps"] = ring_bytes(nbytes, local) / seconds(
        lambda: dist.all_gather_into_tensor(full, shard, group=mine), 20, mine)
    result["reduce_scatter_Bps"] = GLOO_REDUCE_SCATTER_TRAFFIC * ring_bytes(nbytes, local) / seconds(
        lambda: dist.reduce_scatter_tensor(shard, full, group=mine), 20, mine)
    full, _, nbytes = buffers(sizes["bucket"], local)
    result["all_reduce_Bps"] = 2 * ring_bytes(nbytes, local) / seconds(lambda: dist.all_reduce(full, group=mine), 5,
                                                                          mine)
    dist.barrier()
    if rank in (0, local):
        full, _, nbytes = buffers(sizes["link"], 2)
        result["inter_Bps"] = 2 * ring_bytes(nbytes, 2) / seconds(lambda: dist.all_reduce(full, group=across), 3,
                                                                   across)
    dist.barrier()
    if rank == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


def train_options(out: Path, args: argparse.Namespace, ranks: int, *extra: str) -> list[str]:
    return ["-m", "roboscale", "train", f"--dataset.root={single_host.DATA}", "--dataset.num_workers=0",
            f"--output_dir={out}", f"--steps={args.steps}", f"--batch_size={args.per_rank_batch * ranks}",
            "--log_freq=1", f"--save_freq={args.steps}", f"--policy.type={args.policy}", "--num_threads=1", *extra]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_process(args: argparse.Namespace) -> tuple[list[dict], Path]:
    out = RUNS / "single"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, *train_options(out, args, 1)], check=True, env={**os.environ, **ENV},
                   stdout=subprocess.DEVNULL)
    return metrics(out), out


def workload(config_dir: Path):
    from roboscale.config import from_dict
    from roboscale.configs.train import TrainConfig
    from roboscale.plan import workload_of

    cfg = from_dict(TrainConfig, json.loads((config_dir / "checkpoints" / "last" / "pretrained_model" /
                                             "train_config.json").read_text()))
    return workload_of(cfg.policy, precision="fp32")


def model_network(network: dict[str, float]):
    from roboscale.plan import Network

    return Network(ranks_per_node=RANKS_PER_HOST, intra_Bps=network["all_gather_Bps"],
                   inter_Bps=network["inter_Bps"], latency_s=network["latency_s"],
                   collective_Bps={k: network[f"{k}_Bps"] for k in ("all_gather", "reduce_scatter", "all_reduce")},
                   reduce_scatter_traffic=GLOO_REDUCE_SCATTER_TRAFFIC)


def predicted(work, args: argparse.Namespace, strategy: str, rate_per_rank: float, network: dict[str, float]):
    from roboscale.plan import bytes_across_nodes, predict_step_time

    ranks = HOSTS * RANKS_PER_HOST
    net = model_network(network)
    step = predict_step_time(work, ranks=ranks, batch_size=args.per_rank_batch * ranks, strategy=strategy,
                             samples_per_s=rate_per_rank, network=net)
    return step, bytes_across_nodes(work, ranks, net, strategy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="pi05", choices=["pi05", "groot"])
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--probe-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_worker:
        _probe_worker(json.loads(args.probe_worker))
        return
    from roboscale.testing.cluster import Cluster, available

    if reason := available():
        sys.exit(f"benchmarks/multihost.py: {reason}")
    single_host.ensure_dataset()
    single, single_dir = one_process(args)
    cores = os.cpu_count() or 1
    ranks = HOSTS * RANKS_PER_HOST
    # the 4 ranks share the machine's cores: each computes at its share of one core's rate
    rate_per_rank = single_host.steady(single, "samples_per_s", args.warmup) * min(1.0, cores / ranks)
    work = workload(single_dir)
    rows = []
    with Cluster(HOSTS) as cluster:
        for rate in RATES:
            cluster.limit(rate)
            network = probe_network(cluster, work, 16 if rate is not None and rate <= 100 else 64)
            for strategy in STRATEGIES:
                out = RUNS / f"{strategy}-{_rate_name(rate).replace(' ', '').replace('/', '')}"
                shutil.rmtree(out, ignore_errors=True)
                before = cluster.bytes_through(cluster.hosts[1])
                on_hosts(cluster, _torchrun(cluster, *train_options(out, args, ranks,
                                                                    f"--parallel.strategy={strategy}")))
                crossed = cluster.bytes_through(cluster.hosts[1]) - before
                measured = single_host.steady(metrics(out), "step_time", args.warmup)
                step, across = predicted(work, args, strategy, rate_per_rank, network)
                rows.append((rate, strategy, measured, step, crossed / args.steps, across, network))
                print(f"{_rate_name(rate)} {strategy}: {measured:.3f} s measured, {step.step_s:.3f} s predicted",
                      flush=True)
    print(f"\n{args.policy} (demo preset, {work.params / 1e6:.1f} M parameters, {work.units} FSDP units), {HOSTS} hosts "
          f"x {RANKS_PER_HOST} ranks, {args.per_rank_batch} samples per rank per step, 1 thread per rank on {cores} "
          f"cores, {args.steps} steps (median after {args.warmup}); one process: "
          f"{single_host.steady(single, 'samples_per_s', args.warmup):.1f} samples/s\n")
    print("| link | link, effective (efficiency) | all-gather / reduce-scatter / all-reduce in a host | collective | "
          "strategy | step s measured | step s predicted | error | comm s predicted | MB across the link per step, "
          "measured / predicted |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for rate, strategy, measured, step, crossed, across, network in rows:
        efficiency = "" if rate is None else f" ({network['inter_Bps'] * 8 / (rate * 1e6):.2f})"
        inside = " / ".join(f"{network[f'{k}_Bps'] / 1e6:.0f}" for k in ("all_gather", "reduce_scatter", "all_reduce"))
        print(f"| {_rate_name(rate)} | {network['inter_Bps'] / 1e6:.1f} MB/s{efficiency} | {inside} MB/s | "
              f"{network['latency_s'] * 1e3:.2f} ms | {strategy} | {measured:.3f} | {step.step_s:.3f} | "
              f"{(step.step_s - measured) / measured:+.0%} | {step.comm_s:.3f} | {crossed / 1e6:.1f} / "
              f"{across / 1e6:.1f} |")
    by = {(rate, strategy): (measured, step.step_s) for rate, strategy, measured, step, *_ in rows}
    for rate in RATES:
        (hsdp, hsdp_p), (fsdp, fsdp_p) = by[(rate, "hsdp")], by[(rate, "fsdp")]
        print(f"{_rate_name(rate)}: HSDP / FSDP2 step time {hsdp / fsdp:.2f} measured, {hsdp_p / fsdp_p:.2f} "
              "predicted")
    errors = [abs(step.step_s - measured) / measured for _, _, measured, step, *_ in rows]
    print(f"largest prediction error {max(errors):.0%}; median {statistics.median(errors):.0%}")


if __name__ == "__main__":
    main()
