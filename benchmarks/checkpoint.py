"""Synchronous vs background checkpoint saves (`--checkpoint.async_save`), side by side in one run.

Each variant is `roboscale train` itself (torchrun with ``--ranks`` ranks, FSDP2, one thread per rank) on the same
dataset and policy, saving every ``--save-freq`` steps with every checkpoint kept. Figures come from its
metrics.jsonl: the seconds training stood still per save (``checkpoint_s``) and the wall time of all steps.
Variants alternate (sync, async, sync, async, ...) for ``--repeats`` rounds, and medians are reported, so that
a load that drifts during the run hits both alike.

    .venv/bin/python benchmarks/checkpoint.py                     # pi0.5 demo size, 2 ranks, ~4 minutes on 2 cores
    .venv/bin/python benchmarks/checkpoint.py --policy.width=512  # a larger state per save (any train option)

On this machine the writer threads share the same 2 cores as the training, so what the background write saves
is the time the training would have waited for the disk and the serialization, less what the writer takes from
the training's cores; on a GPU node the training runs on the GPU and the writes on otherwise idle host cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from training import RUNS, _env, ensure_dataset


def run(name: str, args: argparse.Namespace, asynchronous: bool) -> dict[str, float]:
    out = RUNS / name
    subprocess.run(["rm", "-rf", str(out)], check=True)
    options = ["train", f"--dataset.root={ensure_dataset()}", "--dataset.num_workers=0", f"--output_dir={out}",
               f"--steps={args.steps}", f"--batch_size={args.batch_size}", "--log_freq=1",
               f"--save_freq={args.save_freq}", "--checkpoint.keep_last=0", f"--checkpoint.async_save={asynchronous}",
               "--policy.type=pi05", "--parallel.strategy=fsdp", *args.train_options]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
              "-m", "roboscale"] if args.ranks > 1 else [sys.executable, "-m", "roboscale"]
    subprocess.run([*launch, *options], check=True, env=_env(), stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    saves = args.steps // args.save_freq
    state = sum(p.stat().st_size for p in (out / "checkpoints" / f"{args.steps:06d}").rglob("*") if p.is_file())
    return {"blocked_per_save": sum(r["checkpoint_s"] for r in rows) / saves,
            "wall": sum(r["step_time"] for r in rows), "checkpoint_mb": state / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-freq", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args, args.train_options = parser.parse_known_args()
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for repeat in range(args.repeats):
        for variant, rows in results.items():
            rows.append(run(f"checkpoint-{variant}", args, variant == "async"))
            print(f"round {repeat + 1} {variant}: {rows[-1]}", flush=True)
    median = {v: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for v, rows in results.items()}
    sync, background = median["sync"], median["async"]
    options = "".join(f" {option}" for option in args.train_options)
    print(f"\npi0.5 demo size{options}, {args.ranks} rank(s), {args.steps} steps, a save "
          f"every {args.save_freq} ({sync['checkpoint_mb']:.0f} MB per checkpoint), median of {args.repeats} rounds")
    print("| saves | training blocked per save | wall time of all steps |")
    print("|---|---:|---:|")
    print(f"| synchronous | {sync['blocked_per_save']:.3f} s | {sync['wall']:.1f} s |")
    print(f"| background (`--checkpoint.async_save`) | {background['blocked_per_save']:.3f} s "
          f"({sync['blocked_per_save'] / max(background['blocked_per_save'], 1e-9):.1f}x less) | "
          f"{background['wall']:.1f} s ({sync['wall'] / background['wall']:.2f}x) |")


if __name__ == "__main__":
    main()
