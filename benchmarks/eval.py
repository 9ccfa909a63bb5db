"""Closed-loop evaluation throughput: the design before the rollout engine (each worker holds its own policy and
predicts for its one environment, batches of one, rendering every step), the baseline with only the rendering
change, and the engine's designs (dynamic batches on an inference server, or one batch per worker), on the same
checkpoint and episodes, measured side by side: every design once per round, rounds repeated, medians printed.

Each design runs the episodes twice on one started engine: ``cold`` is the first run (processes started, policy
loaded, environments built: what one ``roboscale eval`` sees), ``warm`` the second (what each step of a generator
that keeps its engine sees, e.g. RL post-training). Printed per design: env-steps/s and the ratio to the baseline
in the same round (median over rounds), the mean inference batch, environments built, CPU time per env-step of the
env workers and of the servers (all their threads), the share of wall time env workers waited for actions and
servers had no request, and whether every episode ended as in the baseline (same steps, same success). Below the
table: each design's batch sizes and why its batches went (``rollout.batcher``), from its last warm run.

    .venv/bin/python benchmarks/eval.py                        # demo-size pi0.5, demo tasks; ~40 min on 2 cores
    .venv/bin/python benchmarks/eval.py --rounds 1 --episodes 2 --max-steps 20 --policy-preset tiny  # a quick check
    .venv/bin/python benchmarks/eval.py --env libero --tasks libero_object   # LIBERO, its cameras and state
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from roboscale.configs.rollout import RolloutConfig, RunnerConfig
from roboscale.models.registry import build_policy, preset_config
from roboscale.rollout.engine import EnvSetup, RolloutEngine, RolloutStats
from roboscale.rollout.episode import EpisodeJob
from roboscale.sim.env import EnvRequest, EnvSpec, env_spec, episode_seed
from roboscale.sim.experts import expert_spec


def demo_checkpoint(directory: Path, preset: str, spec: EnvSpec, tasks: list[str], policy: str = "pi05") -> Path:
    """An untrained ``policy`` with the features of the env's demonstrations (its actions are as costly to compute
    as a trained one's; every episode runs to max_steps, the most work per episode)."""
    cfg = preset_config(policy, preset)
    size = cfg.image_size
    demo_features = expert_spec(spec).dataset_features(size, spec.default_cameras)
    cameras = [key for key, f in demo_features.items() if f["dtype"] == "video"]
    features = {key: {"shape": demo_features[key]["shape"]} for key in ("observation.state", "action")}
    features.update({k: {"dtype": "video", "shape": [size, size, 3]} for k in cameras})
    stats = {key: {"q01": -np.ones(f["shape"]), "q99": np.ones(f["shape"]), "mean": np.zeros(f["shape"]),
                   "std": np.ones(f["shape"]), "min": -np.ones(f["shape"]), "max": np.ones(f["shape"])}
             for key, f in features.items() if key in ("observation.state", "action")}
    meta = SimpleNamespace(root="<benchmark>", features=features, camera_keys=cameras,
                           fps=expert_spec(spec).fps, task_list=[spec.instruction(t) for t in tasks], stats=stats)
    path = directory / "pretrained_model"
    build_policy(cfg, meta).save_pretrained(path)
    return path


def designs(workers: int, envs: int) -> list[tuple[str, RolloutConfig]]:
    """The first is the baseline the others are compared with."""
    local = {"workers": workers, "inference": "worker"}
    server = {"workers": workers, "envs_per_worker": envs, "inference": "server"}
    return [
        ("baseline: policy per worker, batch of one", RolloutConfig(**local, envs_per_worker=1,
                                                                    render="every_step")),
        ("baseline + render on demand", RolloutConfig(**local, envs_per_worker=1)),
        ("server, 2 sub-batches, 5 ms (defaults)", RolloutConfig(
            **server, sub_batches=2, runner=RunnerConfig(max_batch_size=32, batch_timeout_ms=5))),
        # one request per worker; the batch waits for every worker that has episodes (the producers rule), so the
        # workers step together while the server waits, and wait while it predicts (with both cores: 2 threads)
        ("server, 1 sub-batch, 200 ms", RolloutConfig(**server, sub_batches=1,
                                                               runner=RunnerConfig(batch_timeout_ms=200))),
        ("server, 1 sub-batch, 200 ms, 2 server threads", RolloutConfig(
            **server, sub_batches=1, runner=RunnerConfig(batch_timeout_ms=200, threads=2))),
        ("batch per worker (no server)", RolloutConfig(**local, envs_per_worker=envs)),
    ]


def run_twice(cfg: RolloutConfig, setup: EnvSetup, jobs: list[EpisodeJob]) -> tuple[list, RolloutStats, RolloutStats]:
    start = time.perf_counter()
    with RolloutEngine(cfg, setup) as engine:
        _, cold = engine.run(jobs)
        cold.wall_s = time.perf_counter() - start  # with the processes' start and the policy's loading
        results, warm = engine.run(jobs)
    return [(r.steps, r.success) for r in results], cold, warm


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="metaworld")
    parser.add_argument("--tasks", default="", help="tasks or suites (default: the env's default)")
    parser.add_argument("--episodes", type=int, default=10, help="episodes per task")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=4, help="of the engine's designs")
    parser.add_argument("--rounds", type=int, default=3, help="every design once per round")
    parser.add_argument("--policy-preset", default="demo")
    args = parser.parse_args()
    spec = env_spec(args.env)
    tasks = spec.tasks_or_default([t for t in args.tasks.split(",") if t])
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = demo_checkpoint(Path(tmp), args.policy_preset, spec, tasks)
        from roboscale.models.policy import Policy

        policy_cfg = Policy.from_pretrained(checkpoint).config
        cameras = spec.sim_cameras([key.removeprefix("observation.images.") for key in policy_cfg.image_keys])
        setup = EnvSetup(args.env, str(checkpoint), policy_cfg.n_action_steps,
                         EnvRequest(image_size=policy_cfg.image_size, cameras=cameras, max_steps=args.max_steps,
                                    options=spec.parse_options({})))
        jobs = [EpisodeJob(t, i, episode_seed(1000, t, i)) for t in tasks for i in range(args.episodes)]
        print(f"{spec.name}: {len(jobs)} episodes ({', '.join(tasks)}), max {args.max_steps} steps, pi0.5 "
              f"{args.policy_preset} ({policy_cfg.image_size}², {len(cameras)} cameras, chunk {policy_cfg.chunk_size}, "
              f"n_action_steps {policy_cfg.n_action_steps}, {policy_cfg.num_inference_steps} Euler steps), "
              f"{os.cpu_count()} CPUs, {args.rounds} rounds; {load()}", flush=True)
        runs = designs(args.workers, args.envs_per_worker)
        rates: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": []} for name, _ in runs}
        ratios: dict[str, dict[str, list[float]]] = {name: {"cold": [], "warm": []} for name, _ in runs}
        last: dict[str, tuple[RolloutStats, RolloutStats]] = {}
        same: dict[str, bool] = {name: True for name, _ in runs}
        reference = None
        for round_ in range(args.rounds):
            base: dict[str, float] = {}
            for name, cfg in runs:
                outcome, cold, warm = run_twice(cfg, setup, jobs)
                reference = reference or outcome
                same[name] &= outcome == reference
                for kind, stats in (("cold", cold), ("warm", warm)):
                    rate = stats.env_steps / stats.wall_s
                    base.setdefault(kind, rate)
                    rates[name][kind].append(rate)
                    ratios[name][kind].append(rate / base[kind])
                last[name] = cold, warm
                print(f"round {round_ + 1}: {name}: cold {cold.env_steps / cold.wall_s:.1f}, warm "
                      f"{warm.env_steps / warm.wall_s:.1f} env-steps/s; {load()}", flush=True)

        print("\n| design | workers x envs | cold env-steps/s | vs baseline | warm env-steps/s | vs baseline | "
              "mean batch | envs built (cold, warm) | CPU ms/env-step: workers + servers | workers waiting | "
              "server idle | same episodes |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for name, cfg in runs:
            cold, warm = last[name]
            wall = warm.wall_s * cfg.workers
            serving = cfg.inference == "server"
            cpu = [1000 * seconds / warm.env_steps for seconds in (warm.worker_cpu_s, warm.server_cpu_s)]
            print(f"| {name} | {cfg.workers} x {cfg.envs_per_worker} | "
                  f"{statistics.median(rates[name]['cold']):.1f} | {statistics.median(ratios[name]['cold']):.2f}x | "
                  f"{statistics.median(rates[name]['warm']):.1f} | {statistics.median(ratios[name]['warm']):.2f}x | "
                  f"{warm.mean_batch_size:.1f} | {cold.envs_made}, {warm.envs_made} | "
                  f"{cpu[0]:.1f} + {cpu[1]:.1f} | "
                  f"{100 * warm.worker_wait_s / wall:.0f}% | "
                  f"{f'{100 * warm.batching.idle_s / warm.wall_s:.0f}%' if serving else '-'} | "
                  f"{'yes' if same[name] else 'NO'} |")
        print()
        for name, cfg in runs:
            warm = last[name][1]
            if cfg.inference == "server":
                print(f"{name}: batch sizes {dict(sorted(warm.batching.sizes.items()))}, went because "
                      f"{dict(warm.batching.reasons)}; server held requests back {warm.batching.fill_s:.1f} s of "
                      f"{warm.wall_s:.1f} s")
        print(load())


if __name__ == "__main__":
    main()
