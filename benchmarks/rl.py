"""Asynchronous against synchronous RL (`--rl.mode`), side by side in one run: env-steps/s, trainer samples/s, each
level's idle share, and what the rollouts achieved, on MetaWorld with a long-tailed step latency
(`roboscale.sim.latency:METAWORLD_LONG_TAIL`: lognormal, median 20 ms, p99 200 ms, a wait that takes no CPU).

Every run is the same `roboscale rl` command (the same checkpoint, tasks, seeds, steps) but for `--rl.mode`,
`--rl.max_staleness` and `--rl.schedule`: sync (roll out everything, then train), async at staleness 0 (the sync
run's updates; the gain only from computing the gradients of finished groups while others still run), and async at
staleness 1 and 2 (simulators and generators run the next rollouts with weights that many rollouts old: exactly, or
with `-bounded` at most). From each run's
`rollouts.jsonl` and `metrics.jsonl`:

- env-steps/s and trainer samples/s (episodes trained per second) over the run's wall time, and their ratio to sync;
- idle shares: the simulators' (no rollout running: the next one waiting for its turn or for fresh enough weights;
  the tail of a rollout, where environments that finished wait for its slowest episode, is not counted: it shows in
  env-steps/s), and the trainer's (waiting for trajectories);
- success of the rollouts' episodes (Wilson 95%), over the run and over its second half of rollouts (after
  the same number of episodes in every mode: the sample-efficiency comparison), the staleness the run had (mean, max), and its final loss.

On 2 CPU cores the levels share the cores (the trainer's gradients slow the simulators down), so the gain here is
a lower bound of the overlap on separate devices. The supervised checkpoint is trained first (as in
`rl_closed_loop.py`) unless `--checkpoint` names one.

    .venv/bin/python benchmarks/rl.py --checkpoint outputs/bench/rl_closed_loop/sft    # ~13 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rl_closed_loop import ROBOSCALE, stage, wilson  # noqa: E402

MODES = {"sync": ["--rl.mode=sync"], "async-0": ["--rl.mode=async", "--rl.max_staleness=0"],
         "async-1": ["--rl.mode=async", "--rl.max_staleness=1"],
         "async-2": ["--rl.mode=async", "--rl.max_staleness=2"],
         "async-1-bounded": ["--rl.mode=async", "--rl.max_staleness=1", "--rl.schedule=bounded"],
         "async-2-bounded": ["--rl.mode=async", "--rl.max_staleness=2", "--rl.schedule=bounded"]}
"""async-k: asynchronous at --rl.max_staleness=k on the exact schedule (rollout r acts with the weights trained on
max(0, r - k) rollouts: reproducible); async-k-bounded: at most k behind, whatever is newest (RL-VLA3's bound)."""


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(name: str, args: list[str], out: Path) -> dict[str, float]:
    """One `roboscale rl` run (skipped if its output is complete) and what its logs say."""
    if not (out / "checkpoints" / "last").exists():
        print(f"[{name}] roboscale {' '.join(args)}", flush=True)
        start = time.perf_counter()
        subprocess.run([*ROBOSCALE, *args], check=True, env={**os.environ, "OMP_WAIT_POLICY": "passive"})
        (out / "wall_s.txt").write_text(f"{time.perf_counter() - start:.3f}\n")
    wall = float((out / "wall_s.txt").read_text())
    rollouts = lines(out / "rollouts.jsonl")
    metrics = [m for m in lines(out / "metrics.jsonl") if "loss" in m]
    span = max(r["ended"] for r in rollouts) - min(r["started"] for r in rollouts)  # first rollout to last
    env_steps = sum(r["env_steps"] for r in rollouts)
    episodes = sum(r["episodes"] for r in rollouts)
    successes = sum(r["success"] for r in rollouts)
    low, high = wilson(successes, episodes)
    late = sorted(rollouts, key=lambda r: r["started"])[len(rollouts) // 2:]  # sample efficiency: after as many
    late_successes, late_episodes = sum(r["success"] for r in late), sum(r["episodes"] for r in late)  # env steps
    late_low, late_high = wilson(late_successes, late_episodes)
    return {"late": late_successes / late_episodes, "late_low": late_low, "late_high": late_high,
            "late_episodes": late_episodes, "wall": wall, "env_steps_s": env_steps / wall, "samples_s": episodes / wall,
            "sim_idle": sum(r["driver_wait_s"] for r in rollouts) / span,
            "trainer_idle": sum(r["trainer_wait_s"] for r in rollouts) / span,
            "success": successes / episodes, "low": low, "high": high, "episodes": episodes,
            "staleness": sum(r["staleness"] for r in rollouts) / len(rollouts),
            "staleness_max": max(r["staleness"] for r in rollouts), "loss": metrics[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/rl_async"))
    parser.add_argument("--checkpoint", type=Path, default=None, help="the supervised policy (default: trained here)")
    parser.add_argument("--tasks", default="button-press-topdown,drawer-open")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--modes", default=",".join(MODES), help="which of: " + ", ".join(MODES))
    parser.add_argument("--env", default="roboscale.sim.latency:METAWORLD_LONG_TAIL",
                        help="the simulator (roboscale.sim.latency: METAWORLD_LONG_TAIL, METAWORLD_SLOW)")
    parser.add_argument("--rl", default="--rl.group_size=4 --rl.states_per_task=2 --rl.max_steps=100 "
                                        "--rl.epochs=4 --optimizer.lr=3e-5 --rollout.workers=4 "
                                        "--rollout.envs_per_worker=2",
                        help="further `roboscale rl` options, the same for every mode (one string)")
    args = parser.parse_args()
    out: Path = args.out
    checkpoint = args.checkpoint
    if checkpoint is None:
        timings: dict[str, tuple[float, float]] = {}
        stage("demonstrations", ["data", "generate", f"--tasks=[{args.tasks}]", "--episodes_per_task=5",
                                 f"--out={out / 'data'}"], out / "data" / "meta" / "info.json", timings)
        stage("supervised training", ["train", f"--dataset.root={out / 'data'}", "--steps=400",
                                      f"--output_dir={out / 'sft'}"], out / "sft" / "checkpoints" / "last", timings)
        checkpoint = out / "sft"
    common = ["rl", f"--policy_path={checkpoint}", f"--tasks=[{args.tasks}]", f"--steps={args.steps}",
              f"--save_freq={args.steps}", f"--env={args.env}", *args.rl.split()]
    results = {}
    for name in args.modes.split(","):
        target = out / name
        results[name] = run(name, [*common, *MODES[name], f"--output_dir={target}"], target)

    sync = results.get("sync")
    print(f"\n`roboscale {' '.join(common)}`, per mode:\n")
    print("| mode | wall | env-steps/s | trainer episodes/s | vs sync | simulators idle | trainer idle | "
          "staleness mean/max | rollout success (95% CI) | last half's rollouts | final loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{r['env_steps_s'] / sync['env_steps_s']:.2f}x" if sync else "-"
        print(f"| {name} | {r['wall'] / 60:.1f} min | {r['env_steps_s']:.1f} | {r['samples_s']:.3f} | {ratio} | "
              f"{r['sim_idle']:.0%} | {r['trainer_idle']:.0%} | "
              f"{r['staleness']:.2f}/{r['staleness_max']} | {r['success']:.0%} ({r['low']:.0%}-{r['high']:.0%}, "
              f"n={r['episodes']}) | {r['late']:.0%} ({r['late_low']:.0%}-{r['late_high']:.0%}, "
              f"n={r['late_episodes']}) | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
