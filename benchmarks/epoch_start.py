"""What the training loop waits for at an epoch's first batch with 0 loader workers (the CPU default), and over a
whole epoch: the loader as it was (every epoch decodes its one block and builds all its batches at the first
one), with decoded frames kept across epochs, and with batches also built as they are taken.

The dataset is the demo's (`roboscale demo` or `roboscale data generate --tasks=[demo] --episodes_per_task=25`),
the transforms and collate the demo policy's. All variants run in this one process, interleaved epoch by epoch.

    .venv/bin/python benchmarks/epoch_start.py outputs/demo/data --epochs 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from roboscale.configs.train import DatasetConfig, TrainConfig
from roboscale.distributed.env import init_distributed
from roboscale.distributed.mesh import resolve_plan
from roboscale.train.trainer import Trainer

VARIANTS = {  # name: (keep decoded frames across epochs, build in-process batches as they are taken)
    "before: decode + build the whole block at its first batch": (False, False),
    "decoded frames kept across epochs": (True, False),
    "kept + batches built as taken (now)": (True, True),
}


def demo_loader(root: str, keep: bool, build_as_taken: bool):
    cfg = TrainConfig(dataset=DatasetConfig(root=root, num_workers=0), output_dir="/tmp/unused")
    trainer = Trainer(cfg, progress=False)
    trainer.env = init_distributed(60.0, 0)
    trainer.plan = resolve_plan(cfg.parallel, trainer.env)
    trainer.build()
    loader = trainer.loader
    assert loader._dataset.keep_decoded, "the dataset does not fit one block: nothing to keep"
    loader._dataset.keep_decoded, loader._dataset.build_as_taken = keep, build_as_taken
    return loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    loaders = {name: demo_loader(args.root, *flags) for name, flags in VARIANTS.items()}
    first: dict[str, list[float]] = {name: [] for name in VARIANTS}
    whole: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.epochs):
        for name, loader in loaders.items():
            start = time.perf_counter()
            next(loader)
            first[name].append(time.perf_counter() - start)
            for _ in range(loader.batches_per_epoch - 1):
                next(loader)
            whole[name].append(time.perf_counter() - start)
    batches = next(iter(loaders.values())).batches_per_epoch
    print(f"{batches} batches of 64 per epoch, 0 loader workers; seconds, epochs 2..{args.epochs} (median)")
    print("| loader | epoch 1: first batch | later epochs: first batch | later epochs: whole epoch |")
    print("|---|---:|---:|---:|")
    base = None
    for name in VARIANTS:
        later_first, later_whole = np.median(first[name][1:]), np.median(whole[name][1:])
        base = base or later_whole
        print(f"| {name} | {first[name][0]:.2f} | {later_first:.2f} | {later_whole:.2f} "
              f"({base / later_whole:.2f}x) |")


if __name__ == "__main__":
    main()
