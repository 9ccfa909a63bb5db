"""The scripted experts' own success on the evaluation's episodes: the ceiling a policy trained on their demos is
measured against (episode i of task t starts from reset(episode_seed(seed, t, i), scene=i), as `roboscale eval`
places it; no action noise; success at any step within max_steps; no cameras, which the experts do not need).
With --action-noise, the experts act as `data generate` runs them: that correlated noise added to their actions,
from scene --first-scene on (with --seed 0, the generator's own attempts at its default seed).

    .venv/bin/python benchmarks/expert_success.py --tasks mt10 --episodes 50 --seed 1000 --max-steps 250
    .venv/bin/python benchmarks/expert_success.py --env libero --tasks libero_object,libero_spatial --episodes 20
    .venv/bin/python benchmarks/expert_success.py --env libero --tasks libero_goal --episodes 10 \
        --action-noise 0.1 --first-scene 25
"""

from __future__ import annotations

import argparse
import time

from roboscale.configs.data import GenerateConfig
from roboscale.sim.env import EnvRequest, env_spec, episode_seed
from roboscale.sim.experts import expert_spec, run_expert_episode
from roboscale.utils.stats import wilson_interval

NOISE_CORRELATION = GenerateConfig.noise_correlation  # the generator's default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="metaworld")
    parser.add_argument("--tasks", default="mt10")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--max-steps", type=int, default=0, help="0: the simulator's limit for the task")
    parser.add_argument("--action-noise", type=float, default=0.0, help="as data generate's --action_noise")
    parser.add_argument("--first-scene", type=int, default=0, help="episode i starts from scene first-scene + i")
    args = parser.parse_args()
    spec = env_spec(args.env)
    experts = expert_spec(spec)
    print("| task | expert success | 95% interval | mean steps |")
    print("|---|---:|---|---:|")
    rates = []
    start = time.perf_counter()
    for task in spec.resolve_tasks(args.tasks):
        env = spec.make(task, EnvRequest(image_size=16, max_steps=args.max_steps, options=spec.parse_options({})))
        try:
            episodes = [run_expert_episode(env, experts, episode_seed(args.seed, task, i), args.action_noise, 0,
                                           noise_correlation=NOISE_CORRELATION, scene=args.first_scene + i)
                        for i in range(args.episodes)]
        finally:
            env.close()
        wins = sum(episode.success for episode in episodes)
        steps = sum(len(episode.frames["action"]) for episode in episodes) / len(episodes)
        low, high = wilson_interval(wins, args.episodes)
        rates.append(wins / args.episodes)
        print(f"| {task} | {wins / args.episodes:.0%} | {low:.0%}–{high:.0%} | {steps:.0f} |", flush=True)
    print(f"| **mean** | **{sum(rates) / len(rates):.0%}** | | |")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
