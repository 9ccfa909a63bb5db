"""Real-time chunking on a simulated real-time robot: naive chunk switching against RTC, side by side.

A robot that keeps moving while its next chunk is computed switches chunks mid-motion. Simulated here on
MetaWorld, in this process, with a trained demo-size pi0.5 (chunks of H = 16): the robot executes ``--execute``
actions of its chunk (the checkpoint's n_action_steps, 4, by default), then asks for the next chunk from the
observation it has then; the answer takes ``--delay`` action steps, during which the robot goes on with the old
chunk; then it switches to the new chunk at index ``--delay`` (the new chunk's first actions are for moments
already past). Two ways to compute that chunk, on the same scenes and the same noise:

- **naive**: the policy's plain chunk (what ``roboscale eval`` executes, but with the delay);
- **RTC**: guided to agree with the old chunk's actions not yet executed when it was asked for (``committed``;
  the delay's of them frozen, the rest with ``--schedule`` weights: ``roboscale.models.rtc``).

Reported: the mean |a_t - a_{t-1}| (over the action dimensions) where the robot switches chunks against within a
chunk, and their ratio (1: switching is as smooth as following a chunk); the episodes' success (Wilson 95%); the
time of one guided and one unguided chunk (batch 1 and 8). Predictions go through ``PolicyRunner.predict``, the
rollout engine's and the policy server's path. Without ``--checkpoint`` the policy is trained first, by the
commands of benchmarks/rl_closed_loop.py (5 expert demonstrations per task, 400 steps), into ``--out``.

    .venv/bin/python benchmarks/rtc.py --out outputs/bench/rtc        # ~10 min on 2 cores, training included
    .venv/bin/python benchmarks/rtc.py --checkpoint outputs/bench/rtc/sft --episodes 10 --delay 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rl_closed_loop import rate, stage  # the sibling benchmark's stages (this directory is on sys.path)

from roboscale.models.policy import resolve_checkpoint
from roboscale.rollout.inference import PolicyRunner, PredictItem
from roboscale.rollout.setup import policy_env_request
from roboscale.sim.env import Env, env_spec, episode_seed

MODES = ("naive", "rtc")


@dataclass
class Episode:
    success: bool = False
    actions: list[np.ndarray] = field(default_factory=list)
    switched: list[bool] = field(default_factory=list)
    """Per action: whether it is the first the robot takes from a new chunk (a chunk boundary)."""


class Robot:
    """One episode of a robot that executes one action per control step, recording what it executed."""

    def __init__(self, env: Env, seed: int):
        self.env, self.record = env, Episode()
        self.observation = env.reset(seed)
        self.over = False
        self._switching = False

    def execute(self, actions: np.ndarray, render: bool = True) -> None:
        """Execute ``actions`` in order (until the episode ends); ``render``: the observation after the last is
        rendered (the policy will look at it)."""
        for k, action in enumerate(actions):
            if self.over:
                return
            step = self.env.step(action, render=render and k == len(actions) - 1)
            self.record.actions.append(np.asarray(action, dtype=np.float32))
            self.record.switched.append(self._switching and k == 0)
            self._switching = False
            self.observation = step.observation
            self.record.success |= step.success
            self.over = step.success or step.done

    def switch(self) -> None:
        """The next action comes from a new chunk."""
        self._switching = True


def request(runner: PolicyRunner, robot: Robot, instruction: str, seed: int, chunk_index: int,
            committed: np.ndarray | None, delay: int) -> np.ndarray:
    """The chunk [H, A] for the robot's current observation (its noise from the episode seed and chunk index, as in
    evaluation: both modes draw the same)."""
    obs = robot.observation
    item = PredictItem(0, seed, chunk_index, instruction, obs["state"], obs["images"], committed, delay)
    return runner.predict([item])[0].chunk


def run_episode(runner: PolicyRunner, env: Env, instruction: str, seed: int, mode: str, execute: int,
                delay: int) -> Episode:
    robot = Robot(env, seed)
    chunk, start, index = request(runner, robot, instruction, seed, 0, None, 0), 0, 1  # the robot waits for it
    while not robot.over:
        robot.execute(chunk[start:start + execute])
        if robot.over:
            break
        asked_at = start + execute
        committed = chunk[asked_at:] if mode == "rtc" else None
        new = request(runner, robot, instruction, seed, index, committed, delay)
        robot.execute(chunk[asked_at:asked_at + delay], render=False)  # while the new chunk is computed
        robot.switch()
        chunk, start, index = new, delay, index + 1
    return robot.record


def smoothness(episodes: list[Episode]) -> tuple[float, float]:
    """(mean |a_t - a_{t-1}| at chunk boundaries, within chunks), over every episode's consecutive actions."""
    boundary, within = [], []
    for episode in episodes:
        actions = np.stack(episode.actions)
        jumps = np.abs(np.diff(actions, axis=0)).mean(1)
        for jump, switched in zip(jumps, episode.switched[1:], strict=True):
            (boundary if switched else within).append(jump)
    return float(np.mean(boundary)), float(np.mean(within))


def chunk_cost(runner: PolicyRunner, observation: dict[str, Any], instruction: str, committed: np.ndarray,
               delay: int, batch: int, repeats: int) -> tuple[float, float]:
    """Median ms of one ``predict`` of ``batch`` copies of an observation, (unguided, guided)."""
    out = []
    for guided in (False, True):
        items = [PredictItem(i, i, 0, instruction, observation["state"], observation["images"],
                             committed if guided else None, delay) for i in range(batch)]
        runner.predict(items)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.predict(items)
            times.append(1000 * (time.perf_counter() - start))
        out.append(statistics.median(times))
    return out[0], out[1]


def trained_checkpoint(out: Path) -> Path:
    """The demo-size pi0.5 trained as benchmarks/rl_closed_loop.py trains it (skipped when already there)."""
    timings: dict[str, tuple[float, float]] = {}
    stage("demonstrations", ["data", "generate", "--tasks=[demo]", "--episodes_per_task=5", f"--out={out / 'data'}"],
          out / "data" / "meta" / "info.json", timings)
    stage("supervised training", ["train", f"--dataset.root={out / 'data'}", "--steps=400",
                                  f"--output_dir={out / 'sft'}"], out / "sft" / "checkpoints" / "last", timings)
    return out / "sft"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="a trained policy (default: train one into --out)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/rtc"))
    parser.add_argument("--tasks", default="demo")
    parser.add_argument("--episodes", type=int, default=10, help="per task and mode")
    parser.add_argument("--seed", type=int, default=1000, help="scenes as `roboscale eval --seed` places them")
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--execute", type=int, default=0, help="actions per chunk before the next request "
                                                               "(default: the checkpoint's n_action_steps)")
    parser.add_argument("--delay", type=int, default=2, help="action steps an inference takes")
    parser.add_argument("--schedule", default="exp")
    parser.add_argument("--max-guidance", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=10, help="timed predictions per cost measurement")
    args = parser.parse_args()

    checkpoint = resolve_checkpoint(args.checkpoint or trained_checkpoint(args.out))
    runner = PolicyRunner(str(checkpoint), "cpu", threads=1, rtc_schedule=args.schedule,
                          rtc_max_guidance=args.max_guidance)
    config = runner.policy.config
    horizon, execute = config.chunk_size, args.execute or config.n_action_steps
    if args.delay < 0 or 2 * args.delay + execute > horizon:
        raise SystemExit(f"--delay {args.delay} and --execute {execute} do not fit a chunk of {horizon}: a chunk "
                         "serves delay + execute + delay actions")
    spec = env_spec("metaworld")
    request = policy_env_request(spec, config, checkpoint, args.max_steps)
    tasks = spec.resolve_tasks([args.tasks])

    episodes: dict[str, list[Episode]] = {mode: [] for mode in MODES}
    start = time.perf_counter()
    for task in tasks:
        env = spec.make(task, request)
        try:
            for i in range(args.episodes):
                seed = episode_seed(args.seed, task, i)
                for mode in MODES:
                    episodes[mode].append(run_episode(runner, env, env.instruction, seed, mode, execute, args.delay))
        finally:
            env.close()
        print(f"{task}: " + ", ".join(f"{mode} {sum(e.success for e in episodes[mode][-args.episodes:])}"
                                      f"/{args.episodes}" for mode in MODES), flush=True)
    episodes_s = time.perf_counter() - start

    env = spec.make(tasks[0], request)
    observation, instruction = env.reset(episode_seed(args.seed, tasks[0], 0)), env.instruction
    env.close()
    probe = PredictItem(0, 0, 0, instruction, observation["state"], observation["images"])
    committed = runner.predict([probe])[0].chunk[execute:]  # what a robot has left after executing a chunk's start
    costs = {b: chunk_cost(runner, observation, instruction, committed, args.delay, b, args.repeats) for b in (1, 8)}

    print(f"\n{checkpoint}: {len(tasks)} tasks x {args.episodes} episodes per mode (seed {args.seed}, at most "
          f"{args.max_steps} steps), H = {horizon}, execute {execute}, delay {args.delay}, RTC {args.schedule} "
          f"schedule, beta {args.max_guidance:g}, {config.num_inference_steps} Euler steps; episodes took "
          f"{episodes_s / 60:.1f} min\n")
    print(f"| | naive switching | RTC ({args.schedule}, beta {args.max_guidance:g}) |")
    print("|---|---:|---:|")
    rows: dict[str, list[str]] = {"mean abs(a_t - a_t-1) at chunk boundaries": [],
                                  "mean abs(a_t - a_t-1) within chunks": [], "boundary / within": [],
                                  "success (Wilson 95%)": [], "mean episode length (steps)": []}
    for mode in MODES:
        boundary, within = smoothness(episodes[mode])
        wins, n = sum(e.success for e in episodes[mode]), len(episodes[mode])
        rows["mean abs(a_t - a_t-1) at chunk boundaries"].append(f"{boundary:.4f}")
        rows["mean abs(a_t - a_t-1) within chunks"].append(f"{within:.4f}")
        rows["boundary / within"].append(f"{boundary / within:.2f}")
        rows["success (Wilson 95%)"].append(rate(wins, n))
        rows["mean episode length (steps)"].append(f"{np.mean([len(e.actions) for e in episodes[mode]]):.0f}")
    for name, values in rows.items():
        print(f"| {name} | {' | '.join(values)} |")
    print("\n| batch | unguided chunk | guided chunk (RTC) | guided / unguided |")
    print("|---:|---:|---:|---:|")
    for b, (plain, guided) in costs.items():
        print(f"| {b} | {plain:.1f} ms | {guided:.1f} ms | {guided / plain:.2f}x |")


if __name__ == "__main__":
    main()
