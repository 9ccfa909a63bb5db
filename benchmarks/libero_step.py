"""Where a LIBERO step's time goes, robosuite's own path against our adapter, side by side in one run.

robosuite's path is what LeRobot's and openpi's LIBERO evaluations run: ``OffScreenRenderEnv`` (both cameras as
observables, rendered after every control step with robosuite's render settings) and a hard reset (the scene's XML
loaded again) per episode. Ours (``roboscale.sim.libero``): no camera observables, cameras rendered by
``mujoco.Renderer`` without shadows, reflections or multisampling, only when asked, and soft resets. Each design
runs the same episodes (init states, random actions); printed: ms per step and per reset, and the ratio to
robosuite's path, median over rounds.

    .venv/bin/python benchmarks/libero_step.py                       # 64² cameras, 3 rounds
    .venv/bin/python benchmarks/libero_step.py --image-size 224 --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

import numpy as np

from roboscale.sim import libero

TASK = "pick_up_the_alphabet_soup_and_place_it_in_the_basket"


def robosuite_path(size: int, episodes: int, steps: int) -> tuple[float, float]:
    from libero.libero.envs import OffScreenRenderEnv

    info = libero.task_info(TASK)
    states = libero.load_init_states(info.init_states_file)
    with contextlib.redirect_stdout(io.StringIO()):
        env = OffScreenRenderEnv(bddl_file_name=str(info.bddl_file), camera_heights=size, camera_widths=size)
    rng = np.random.default_rng(0)
    reset_s = step_s = 0.0
    try:
        for episode in range(episodes):
            start = time.perf_counter()
            env.seed(episode)
            env.reset()
            env.set_init_state(states[episode])
            reset_s += time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(steps):
                env.step(rng.uniform(-1, 1, 7))
            step_s += time.perf_counter() - start
    finally:
        env.close()
    return 1000 * reset_s / episodes, 1000 * step_s / (episodes * steps)


def our_path(size: int, episodes: int, steps: int, render_every: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    reset_s = step_s = 0.0
    options = libero.LiberoOptions(settle_steps=0)  # as robosuite's path: the settle steps are a protocol choice
    with libero.LiberoEnv(TASK, image_size=size, cameras=dict(libero.CAMERAS), options=options) as env:
        for episode in range(episodes):
            start = time.perf_counter()
            env.reset(episode, episode)
            reset_s += time.perf_counter() - start
            start = time.perf_counter()
            for step in range(steps):
                env.step(rng.uniform(-1, 1, 7), render=render_every > 0 and step % render_every == 0)
            step_s += time.perf_counter() - start
    return 1000 * reset_s / episodes, 1000 * step_s / (episodes * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    designs = {
        "robosuite: cameras every step, hard reset": lambda: robosuite_path(args.image_size, args.episodes,
                                                                            args.steps),
        "ours: cameras every step": lambda: our_path(args.image_size, args.episodes, args.steps, 1),
        "ours: cameras every 4th step (a chunk of 4)": lambda: our_path(args.image_size, args.episodes, args.steps,
                                                                        4),
        "ours: no cameras (physics only)": lambda: our_path(args.image_size, args.episodes, args.steps, 0),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in designs}
    for _ in range(args.rounds):
        for name, run in designs.items():
            results[name].append(run())
    base = statistics.median(step for _, step in results[next(iter(designs))])
    print(f"{TASK}, 2 cameras at {args.image_size}², {args.episodes} episodes x {args.steps} steps, "
          f"{args.rounds} rounds (medians)\n")
    print("| design | reset ms | step ms | steps/s vs robosuite |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        reset = statistics.median(r for r, _ in runs)
        step = statistics.median(s for _, s in runs)
        print(f"| {name} | {reset:.0f} | {step:.1f} | {base / step:.2f}x |")


if __name__ == "__main__":
    main()
