"""The scripted experts' own success on the evaluation's seeds: the ceiling a policy trained on their demos is
measured against (episode i of task t placed by episode_seed(seed, t, i), as `roboscale eval` places it; no
action noise; success at any step within max_steps).

    .venv/bin/python benchmarks/expert_success.py --tasks mt10 --episodes 50 --seed 1000 --max-steps 250
"""

from __future__ import annotations

import argparse

from roboscale.sim.env import episode_seed
from roboscale.sim.experts import run_expert_episode
from roboscale.sim.metaworld_experts import EXPERTS
from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig, resolve_tasks
from roboscale.utils.stats import wilson_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="mt10")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--max-steps", type=int, default=250)
    args = parser.parse_args()
    print("| task | expert success | 95% interval |")
    print("|---|---:|---|")
    rates = []
    for task in resolve_tasks(args.tasks):
        # the expert reads the full state: no cameras needed (rendering is most of a step's cost)
        with MetaWorldEnv(task, RenderConfig(16, 16, {}), max_episode_steps=args.max_steps) as env:
            wins = sum(run_expert_episode(env, EXPERTS, episode_seed(args.seed, task, i), 0.0, 0, scene=i).success
                       for i in range(args.episodes))
        low, high = wilson_interval(wins, args.episodes)
        rates.append(wins / args.episodes)
        print(f"| {task} | {wins / args.episodes:.0%} | {low:.0%}–{high:.0%} |", flush=True)
    print(f"| **mean** | **{sum(rates) / len(rates):.0%}** | |")


if __name__ == "__main__":
    main()
