"""Data-parallel training on CPU processes (gloo), side by side in one run: 1 process vs 2-process DDP and FSDP2.

Weak scaling, as data-parallel training is used: each rank keeps ``--per-rank-batch`` samples, so 2 ranks train
a global batch twice as large. Every configuration is `roboscale train` itself (torchrun for 2 ranks, one thread
per rank, as on a 2-core machine), on the same MetaWorld dataset and policy preset; figures come from its
metrics.jsonl (median over the steps after ``--warmup``):

- samples/s per rank and the weak-scaling efficiency (per-rank rate at 2 ranks / the 1-process rate);
- ``memory/state_bytes`` per rank (parameters + gradients + optimizer state: what FSDP divides);
- the step time measured vs the one ``roboscale.plan.predict_step_time`` predicts from the 1-process rate and
  the gloo bandwidth, measured here with an all-gather between the two processes (validation of the scaling
  model on what this machine can run).

    .venv/bin/python benchmarks/training.py                  # pi0.5 demo size, ~3 minutes on 2 cores
    .venv/bin/python benchmarks/training.py --policy groot

The dataset is generated once under outputs/bench/ (gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "outputs" / "bench" / "training-data"
RUNS = ROOT / "outputs" / "bench" / "training-runs"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING"}


def ensure_dataset() -> Path:
    if not (DATA / "meta" / "info.json").is_file():
        tmp = DATA.with_name(DATA.name + ".tmp")
        subprocess.run([sys.executable, "-m", "roboscale", "data", "generate", '--tasks=["drawer-open","button-press"]',
                        "--episodes_per_task=4", f"--out={tmp}"], check=True, env=_env())
        tmp.rename(DATA)
    return DATA


def train(name: str, ranks: int, args: argparse.Namespace, *extra: str) -> list[dict]:
    out = RUNS / name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    options = ["train", f"--dataset.root={DATA}", "--dataset.num_workers=0", f"--output_dir={out}",
               f"--steps={args.steps}", f"--batch_size={args.per_rank_batch * ranks}", "--log_freq=1",
               f"--save_freq={args.steps}", f"--policy.type={args.policy}", "--num_threads=1", *extra]
    launch = [sys.executable, "-m", "roboscale"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", "roboscale"]
    subprocess.run([*launch, *options], check=True, env=_env(), stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steady(rows: list[dict], key: str, warmup: int) -> float:
    return statistics.median(r[key] for r in rows[warmup:])


def gloo_bandwidth(megabytes: int = 100) -> float:
    """Bytes/s per rank an all-gather reaches between two processes on this machine."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          __file__, "--gloo-worker", str(megabytes)], check=True, env=_env(), capture_output=True,
                         text=True).stdout
    return float(out.strip().splitlines()[-1])


def _gloo_worker(megabytes: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    shard = torch.ones(megabytes * 2**20 // 4 // dist.get_world_size())
    gathered = torch.empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(gathered, shard)  # warm-up: connections
    rounds = 5
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_gather_into_tensor(gathered, shard)
    seconds = (time.perf_counter() - start) / rounds
    if dist.get_rank() == 0:  # a ring all-gather moves (n-1)/n of the result through each rank
        n = dist.get_world_size()
        print((n - 1) / n * gathered.numel() * 4 / seconds)
    dist.destroy_process_group()


def predicted_step(rows_single: list[dict], ranks: int, strategy: str, bandwidth: float, args) -> float:
    from roboscale.config import from_dict
    from roboscale.configs.train import TrainConfig
    from roboscale.plan import Network, predict_step_time, workload_of

    cfg = from_dict(TrainConfig, json.loads((RUNS / "single" / "checkpoints" / "last" / "pretrained_model" /
                                             "train_config.json").read_text()))
    workload = workload_of(cfg.policy, precision="fp32")
    rate = steady(rows_single, "samples_per_s", args.warmup)
    step = predict_step_time(workload, ranks=ranks, batch_size=args.per_rank_batch * ranks, strategy=strategy,
                             network=Network.single_host(ranks=ranks, Bps=bandwidth), samples_per_s=rate)
    return step.step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="pi05", choices=["pi05", "groot"])
    parser.add_argument("--per-rank-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--gloo-worker", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        _gloo_worker(args.gloo_worker)
        return
    ensure_dataset()
    runs = {"single": train("single", 1, args),
            "ddp": train("ddp", 2, args, "--parallel.strategy=ddp"),
            "fsdp": train("fsdp", 2, args, "--parallel.strategy=fsdp")}
    bandwidth = gloo_bandwidth()
    single_rate = steady(runs["single"], "samples_per_s", args.warmup)
    single_state = runs["single"][-1]["memory/state_bytes"]
    print(f"\n{args.policy} (demo preset), {args.per_rank_batch} samples per rank per step, 1 thread per rank, "
          f"{args.steps} steps (median after {args.warmup}); gloo all-gather {bandwidth / 1e9:.2f} GB/s per rank\n")
    print("| run | ranks | samples/s (all) | samples/s per rank | weak-scaling eff. | state MB per rank | "
          "state vs 1 rank | step s measured | step s predicted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ranks in (("single", 1), ("ddp", 2), ("fsdp", 2)):
        rows = runs[name]
        rate = steady(rows, "samples_per_s", args.warmup)
        state = rows[-1]["memory/state_bytes"]
        measured = steady(rows, "step_time", args.warmup)
        strategy = "fsdp" if name == "single" else name
        predicted = predicted_step(runs["single"], ranks, strategy, bandwidth, args)
        print(f"| {name} | {ranks} | {rate:.1f} | {rate / ranks:.1f} | {rate / ranks / single_rate:.2f} | "
              f"{state / 2**20:.1f} | {state / single_state:.2f} | {measured:.3f} | {predicted:.3f} |")


if __name__ == "__main__":
    main()
