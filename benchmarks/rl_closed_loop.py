"""RL's closed-loop gain: a few-shot supervised policy, then `roboscale rl` on the tasks where it is weak, evaluated
before and after on evaluation seeds (1000) that neither the demonstrations (seed 0) nor RL (seed 100000) used.

Every stage is the command a user runs (printed as it starts), so the numbers are those of the README's commands:

1. `roboscale data generate`: a few scripted-expert demonstrations per task (default: the demo's 4 tasks, 5 each)
2. `roboscale train`: the demo's pi0.5 on them (few-shot SFT)
3. `roboscale eval` of the SFT checkpoint on every task
4. `roboscale rl` (GRPO, success reward) on the tasks the SFT policy solves less than `--weak-below` of the time
5. `roboscale eval` of the RL checkpoint on every task, then `roboscale eval compare` (Wilson intervals, and which
   differences are significant)

A stage whose output exists is not run again (a rerun continues where the last stopped). Printed at the end: the
comparison, the mean over the weak tasks before and after, and each stage's wall and CPU time (of the command and
every process it started).

    .venv/bin/python benchmarks/rl_closed_loop.py --out outputs/bench/rl_closed_loop     # ~80 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROBOSCALE = [sys.executable, "-m", "roboscale"]


def stage(name: str, args: list[str], done: Path, timings: dict[str, tuple[float, float]]) -> None:
    if done.exists():
        print(f"[{name}] done before: {done}", flush=True)
        return
    print(f"[{name}] roboscale {' '.join(args)}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([*ROBOSCALE, *args], check=True, env={**os.environ, "OMP_WAIT_POLICY": "passive"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    timings[name] = (time.perf_counter() - start, cpu)


def rate(wins: int, n: int) -> str:
    """A success rate with its Wilson 95% interval, as the tables print it."""
    low, high = wilson(wins, n)
    return f"{wins / n:.0%} ({low:.0%}-{high:.0%}, n={n})"


def per_task(report: Path) -> dict[str, tuple[int, int]]:
    """task -> (successes, episodes) of an evaluation's report.json."""
    data = json.loads((report / "report.json").read_text())
    out: dict[str, tuple[int, int]] = {}
    for episode in data["episodes"]:
        wins, total = out.get(episode["task"], (0, 0))
        out[episode["task"]] = (wins + bool(episode["success"]), total + 1)
    return out


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/rl_closed_loop"))
    parser.add_argument("--tasks", default="demo")
    parser.add_argument("--demos", type=int, default=5, help="expert demonstrations per task")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--eval-episodes", type=int, default=50, help="per task, before and after RL")
    parser.add_argument("--weak-below", type=float, default=0.7, help="the target: tasks below this success")
    parser.add_argument("--rl-tasks", choices=["all", "weak"], default="all",
                        help="RL on every task (so that the strong ones are kept: trained on the weak ones alone, the "
                             "shared weights drift) or on the weak ones only")
    parser.add_argument("--rl-steps", type=int, default=64, help="optimizer steps (--rl.epochs per rollout)")
    parser.add_argument("--rl-save-freq", type=int, default=16, help="keeps these checkpoints of the RL run")
    parser.add_argument("--rl", nargs="*", default=["--rl.group_size=8", "--rl.states_per_task=2", "--rl.epochs=2",
                                                    "--rollout.sampler.noise_level=1.0", "--rl.max_steps=200",
                                                    "--optimizer.lr=3e-5"],
                        help="further `roboscale rl` options")
    args = parser.parse_args()
    out: Path = args.out
    timings: dict[str, tuple[float, float]] = {}
    evaluation = [f"--tasks=[{args.tasks}]", f"--episodes={args.eval_episodes}", "--videos_per_task=0"]

    stage("demonstrations", ["data", "generate", f"--tasks=[{args.tasks}]", f"--episodes_per_task={args.demos}",
                             f"--out={out / 'data'}"], out / "data" / "meta" / "info.json", timings)
    stage("supervised training", ["train", f"--dataset.root={out / 'data'}", f"--steps={args.sft_steps}",
                                  f"--output_dir={out / 'sft'}"], out / "sft" / "checkpoints" / "last", timings)
    stage("evaluation before RL", ["eval", f"--checkpoint={out / 'sft'}", *evaluation,
                                   f"--output_dir={out / 'eval_sft'}"], out / "eval_sft" / "report.json", timings)
    before = per_task(out / "eval_sft")
    weak = sorted(task for task, (wins, n) in before.items() if wins / n < args.weak_below)
    if not weak:
        sys.exit(f"no task is below {args.weak_below:.0%} after supervised training: nothing for RL to lift")
    print(f"weak tasks (below {args.weak_below:.0%}): {', '.join(weak)}", flush=True)
    names = ",".join(task.removesuffix("-v3") for task in (weak if args.rl_tasks == "weak" else sorted(before)))
    stage("RL post-training", ["rl", f"--policy_path={out / 'sft'}", f"--tasks=[{names}]", f"--steps={args.rl_steps}",
                               f"--save_freq={args.rl_save_freq}", "--checkpoint.keep_last=0", f"--output_dir={out / 'rl'}",
                               *args.rl],
          out / "rl" / "checkpoints" / "last", timings)
    stage("evaluation after RL", ["eval", f"--checkpoint={out / 'rl'}", *evaluation,
                                  f"--output_dir={out / 'eval_rl'}"], out / "eval_rl" / "report.json", timings)
    subprocess.run([*ROBOSCALE, "eval", "compare", str(out / "eval_sft"), str(out / "eval_rl"),
                    f"--output_dir={out}"], check=True)
    after = per_task(out / "eval_rl")

    print(f"\nRL on {names} ({args.rl_steps} steps; {' '.join(args.rl)}); weak: {', '.join(weak)}\n")
    print("| tasks | SFT | after RL | change |")
    print("|---|---:|---:|---:|")
    for label, tasks in (("weak (below the threshold)", weak), ("all", sorted(before))):
        rows = []
        for result in (before, after):
            wins, n = (sum(result[t][i] for t in tasks) for i in (0, 1))
            rows.append((wins / n, rate(wins, n)))
        print(f"| {label} | {rows[0][1]} | {rows[1][1]} | {100 * (rows[1][0] - rows[0][0]):+.0f} points |")
    print("\n| stage | wall | CPU (all processes) |")
    print("|---|---:|---:|")
    for name, (wall, cpu) in timings.items():
        print(f"| {name} | {wall / 60:.1f} min | {cpu / 60:.1f} min |")


if __name__ == "__main__":
    main()
