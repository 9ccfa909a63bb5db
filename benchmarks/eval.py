"""Closed-loop evaluation throughput: the design before the rollout engine (each worker holds its own policy and
predicts for its one environment, batches of one, rendering every step) vs the engine (env workers of several
environments, one inference server batching their observations, cameras rendered only for the observations the
policy sees), and in between the baseline with only the rendering change, at 1 and 2 env workers, on the same
checkpoint and episodes.

Printed per configuration: env-steps/s, the ratio to the baseline with the same number of workers, the mean
inference batch, where the processes' time went (simulation, rendering, inference; shares of the summed busy
time), and whether every episode ended as in the baseline (same steps, same success).

    .venv/bin/python benchmarks/eval.py                       # demo-size pi0.5, demo tasks, ~12 minutes on 2 cores
    .venv/bin/python benchmarks/eval.py --episodes 2 --max-steps 20 --policy-preset tiny   # a quick check
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from roboscale.configs.rollout import RolloutConfig
from roboscale.models.registry import build_policy, preset_config
from roboscale.rollout.engine import EnvSetup, RolloutEngine
from roboscale.rollout.episode import EpisodeJob
from roboscale.sim.experts import episode_seed
from roboscale.sim.metaworld import CAMERA_ALIASES, FPS, resolve_tasks, task_description

CAMERAS = ["observation.images.corner2", "observation.images.wrist"]


def demo_checkpoint(directory: Path, preset: str, tasks: list[str]) -> Path:
    """An untrained policy with MetaWorld's features (its actions are as costly to compute as a trained one's;
    every episode runs to max_steps, the most work per episode)."""
    ones, zeros = np.ones(4), np.zeros(4)
    stats = {key: {"q01": -ones, "q99": ones, "mean": zeros, "std": ones, "min": -ones, "max": ones}
             for key in ("observation.state", "action")}
    cfg = preset_config("pi05", preset)
    size = cfg.image_size
    features = {"observation.state": {"shape": [4]}, "action": {"shape": [4]},
                **{k: {"dtype": "video", "shape": [size, size, 3]} for k in CAMERAS}}
    meta = SimpleNamespace(root="<benchmark>", features=features, camera_keys=list(CAMERAS), fps=FPS,
                           task_list=[task_description(t) for t in tasks], stats=stats)
    policy = build_policy(cfg, meta)
    path = directory / "pretrained_model"
    policy.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="demo")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per task")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--sub-batches", type=int, default=2)
    parser.add_argument("--batch-timeout-ms", type=float, default=5.0)
    parser.add_argument("--policy-preset", default="demo")
    args = parser.parse_args()
    tasks = resolve_tasks(args.tasks)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = demo_checkpoint(Path(tmp), args.policy_preset, tasks)
        from roboscale.models.policy import Policy

        policy_cfg = Policy.from_pretrained(checkpoint).config
        cameras = {n.removeprefix("observation.images."): CAMERA_ALIASES.get(n.removeprefix("observation.images."), n)
                   for n in CAMERAS}
        setup = EnvSetup("metaworld", str(checkpoint), policy_cfg.n_action_steps,
                         {"image_size": policy_cfg.image_size, "cameras": cameras, "max_steps": args.max_steps})
        jobs = [EpisodeJob(t, i, episode_seed(1000, t, i)) for t in tasks for i in range(args.episodes)]
        print(f"{len(jobs)} episodes ({', '.join(tasks)}), max {args.max_steps} steps, pi0.5 {args.policy_preset} "
              f"({policy_cfg.image_size}², {len(CAMERAS)} cameras, chunk {policy_cfg.chunk_size}, "
              f"n_action_steps {policy_cfg.n_action_steps}, {policy_cfg.num_inference_steps} Euler steps)\n")
        print("| design | env workers | envs/worker | env-steps/s | vs baseline | mean batch | sim | render | "
              "inference | same episodes |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        baseline: dict[int, tuple[float, list]] = {}
        for workers in (1, 2):
            runs = [("baseline: policy per worker, batch of one", RolloutConfig(
                         workers=workers, envs_per_worker=1, inference="worker", render="every_step")),
                    ("baseline + render on demand", RolloutConfig(
                        workers=workers, envs_per_worker=1, inference="worker")),
                    ("engine: server, dynamic batch, render on demand", RolloutConfig(
                        workers=workers, envs_per_worker=args.envs_per_worker // workers,
                        sub_batches=args.sub_batches, max_batch_size=32, batch_timeout_ms=args.batch_timeout_ms))]
            for name, cfg in runs:
                results, stats = RolloutEngine(cfg, setup).run(jobs)
                rate = stats.env_steps / stats.wall_s
                outcome = [(r.steps, r.success) for r in results]
                if workers not in baseline:
                    baseline[workers] = (rate, outcome)
                busy = stats.sim_s + stats.render_s + stats.inference_s
                shares = [f"{100 * part / busy:.0f}%" for part in (stats.sim_s, stats.render_s, stats.inference_s)]
                same = "yes" if outcome == baseline[workers][1] else "NO"
                print(f"| {name} | {workers} | {cfg.envs_per_worker} | {rate:.0f} | "
                      f"{rate / baseline[workers][0]:.2f}x | {stats.mean_batch_size:.1f} | {' | '.join(shares)} | "
                      f"{same} |", flush=True)


if __name__ == "__main__":
    main()
