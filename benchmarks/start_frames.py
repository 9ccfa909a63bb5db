"""How much do the start scenes of two tasks differ? Mean absolute pixel difference of the corner2 start frames.

A pair with a small difference (relative to two unrelated tasks) can only be told apart by the instruction, which
makes it a language-following check. Prints one row per pair: the mean over placements drawn with the same seeds for both tasks.

    .venv/bin/python benchmarks/start_frames.py --episodes 10 --size 64
"""

from __future__ import annotations

import argparse

import numpy as np

from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig, resolve_tasks

PAIRS = [
    ("faucet-open", "faucet-close"),
    ("door-lock", "door-unlock"),
    ("window-open", "window-close"),
    ("handle-press", "handle-pull"),
    ("handle-press-side", "handle-pull-side"),
    ("push", "push-back"),
    ("door-open", "door-close"),
    ("plate-slide", "plate-slide-back"),
    ("coffee-push", "coffee-pull"),
    ("drawer-open", "drawer-close"),
    ("button-press-topdown", "drawer-open"),
    ("faucet-open", "button-press-topdown"),
]


def start_frames(task: str, episodes: int, size: int) -> np.ndarray:
    with MetaWorldEnv(task, RenderConfig(size, size, {"corner2": "corner2"})) as env:
        # The same seed for both tasks of a pair: where their placement ranges agree, so do the placements.
        return np.stack([env.reset(1000 + i)["images"]["corner2"] for i in range(episodes)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    cache: dict[str, np.ndarray] = {}
    print(f"| pair | mean abs pixel difference at reset ({args.size}², corner2, {args.episodes} placements) |")
    print("|---|---:|")
    for a, b in PAIRS:
        for t in (a, b):
            if t not in cache:
                cache[t] = start_frames(resolve_tasks([t])[0], args.episodes, args.size).astype(np.float32)
        print(f"| {a} / {b} | {np.abs(cache[a] - cache[b]).mean():.2f} |")


if __name__ == "__main__":
    main()
