"""Agreement with LeRobot's own pi0.5, measured: LeRobot 0.4.4's ``PI05Policy`` builds a random model and computes
its action chunk and loss in its own venv (``tests/oracles/lerobot_pi05.py``); we load what it saved and compute
the same; then a random pi0.5 of ours, saved in LeRobot's format, is loaded and run by LeRobot. Printed: the relative
error of each computed tensor (float32 on both sides), whether prompts and token ids are equal, and the times.

    .venv/bin/python benchmarks/lerobot_pi05.py                      # tiny sizes (seconds)
    .venv/bin/python benchmarks/lerobot_pi05.py --size=gemma_300m    # the 1.7 B model (~9 GB each side, minutes)

Needs LeRobot's venv (``tests/oracles/README.md``; ``--lerobot-python``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.oracles
from tests.oracles.lerobot_oracle import (  # noqa: E402
    LEROBOT_PYTHON,
    SIZES,
    agreement,
    load_oracle_policy,
    randomized_copy,
    reverse_agreement,
    run_oracle,
    size_tables,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=sorted(k for k in SIZES if not k.startswith("_")))
    parser.add_argument("--lerobot-python", type=Path, default=LEROBOT_PYTHON)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="keep the oracle's files here (default: a temp dir)")
    args = parser.parse_args()
    for target, value in size_tables(args.size).items():
        module, _, name = target.rpartition(".")
        setattr(importlib.import_module(module), name, value)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        started = time.perf_counter()
        run_oracle(args.lerobot_python, "build", str(work / "lerobot"), f"--size={args.size}", f"--seed={args.seed}")
        lerobot_s = time.perf_counter() - started
        started = time.perf_counter()
        policy = load_oracle_policy(work / "lerobot")
        params = sum(p.numel() for p in policy.parameters())
        forward = agreement(work / "lerobot", policy)
        ours_s = time.perf_counter() - started
        started = time.perf_counter()
        held = [randomized_copy(policy, seed=args.seed + 1)]
        del policy
        gc.collect()
        # handed over as the only reference, which reverse_agreement drops before LeRobot loads the saved copy
        backward = reverse_agreement(args.lerobot_python, held.pop(), work / "lerobot", work, size=args.size)
        reverse_s = time.perf_counter() - started
    print(f"size {args.size}: {params / 1e6:.1f} M parameters built by us (LeRobot's dead lm_heads and last-layer "
          f"tensors not built)")
    print("| LeRobot's model, loaded by us | value |")
    print("|---|---|")
    for name in ("actions", "actions_one_camera", "loss", "loss_per_element"):
        print(f"| {name} (relative error) | {forward[name]:.2e} |")
    print(f"| normalized state (max abs difference) | {forward['state_max_abs']:.1e} |")
    print(f"| prompts equal, token ids equal | {bool(forward['prompts_equal'])}, {bool(forward['tokens_equal'])} |")
    print(f"| loss: ours / LeRobot's | {forward['loss_ours']:.6f} / {forward['loss_lerobot']:.6f} |")
    print(f"| ours, loaded by LeRobot: actions / one camera (relative error) | {backward['actions']:.2e} / "
          f"{backward['actions_one_camera']:.2e} |")
    print(f"times: LeRobot build + compute {lerobot_s:.0f} s, our load + compute {ours_s:.0f} s, "
          f"reverse {reverse_s:.0f} s")


if __name__ == "__main__":
    main()
