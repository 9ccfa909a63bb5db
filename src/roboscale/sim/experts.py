"""Scripted-expert demonstrations: MetaWorld's hand-written policies, with action noise, into a LeRobot dataset.

Episodes are generated in worker processes (one env per process, re-used across episodes) and written by the
main process, which owns the single DatasetWriter so episode indices stay contiguous and the write is atomic.
Each episode is seeded from (seed, task, episode number) alone, so a dataset is reproducible whatever the number
of workers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from roboscale.configs.data import GenerateConfig
from roboscale.errors import RoboscaleError
from roboscale.sim.env import episode_seed
from roboscale.sim.metaworld import (
    ACTION_DIM,
    FPS,
    FULL_STATE_DIM,
    STATE_DIM,
    MetaWorldEnv,
    RenderConfig,
    resolve_tasks,
)
from roboscale.utils.lifetime import run_owned, signals_deferred

# MetaWorld's scripted experts are proportional controllers with gains above 1 and warn, on every step that
# saturates, that the environment clips their action to [-1, 1]. The clipping is what they are written for, and a
# demo printed that warning dozens of times: silence exactly that message (in this process and in the expert
# workers, which import this module).
warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning)

log = logging.getLogger(__name__)


def dataset_features(image_size: int, cameras: dict[str, str]) -> dict[str, dict]:
    """The LeRobot features of a MetaWorld demonstration dataset (the 5 default features are added by the writer)."""
    features: dict[str, dict] = {
        f"observation.images.{name}": {
            "dtype": "video",
            "shape": [image_size, image_size, 3],
            "names": ["height", "width", "channels"],
        }
        for name in cameras
    }
    features.update(
        {
            "observation.state": {"dtype": "float32", "shape": [STATE_DIM], "names": ["x", "y", "z", "gripper"]},
            "observation.environment_state": {"dtype": "float32", "shape": [FULL_STATE_DIM], "names": None},
            "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": ["dx", "dy", "dz", "grip"]},
            "action.executed": {"dtype": "float32", "shape": [ACTION_DIM], "names": ["dx", "dy", "dz", "grip"]},
            "next.reward": {"dtype": "float32", "shape": [1], "names": None},
            "next.success": {"dtype": "bool", "shape": [1], "names": None},
        }
    )
    return features


@dataclass
class Episode:
    task: str
    description: str
    seed: int
    success: bool
    frames: dict[str, np.ndarray]  # feature name -> [T, ...]


def run_expert_episode(
    env: MetaWorldEnv,
    seed: int,
    action_noise: float,
    steps_after_success: int,
    noise_correlation: float = 0.0,
    record_expert_action: bool = False,
) -> Episode:
    """Roll out the task's scripted expert once, executing its actions plus AR(1) noise.

    Frames record the observation and the action for it: the expert's own (``record_expert_action``) or the
    executed one; ``action.executed`` always holds what was sent to the env.
    """
    from metaworld.policies import ENV_POLICY_MAP

    expert = ENV_POLICY_MAP[env.task]()
    rng = np.random.default_rng(seed)
    obs = env.reset(seed)
    columns: dict[str, list] = {}
    success_at = None
    noise = np.zeros(ACTION_DIM, dtype=np.float32)
    innovation = action_noise * np.sqrt(1.0 - noise_correlation**2)  # keeps the noise's std at action_noise
    for step in range(env.max_episode_steps):
        intended = np.clip(expert.get_action(obs["full_state"]).astype(np.float32), -1.0, 1.0)
        noise = noise_correlation * noise + rng.normal(0.0, innovation, size=ACTION_DIM).astype(np.float32)
        action = np.clip(intended + noise, -1.0, 1.0)
        next_obs, reward, success, truncated, _ = env.step(action)
        frame = {f"observation.images.{k}": v for k, v in obs["images"].items()}
        frame["observation.state"] = obs["state"]
        frame["observation.environment_state"] = obs["full_state"].astype(np.float32)
        frame["action"] = intended if record_expert_action else action
        frame["action.executed"] = action
        frame["next.reward"] = np.float32(reward)
        frame["next.success"] = bool(success)
        for key, value in frame.items():
            columns.setdefault(key, []).append(value)
        if success and success_at is None:
            success_at = step
        if success_at is not None and step - success_at >= steps_after_success:
            break
        if truncated:
            break
        obs = next_obs
    frames = {k: np.stack(v) for k, v in columns.items()}
    return Episode(env.task, env.instruction, seed, success_at is not None, frames)


def _worker(task: str, cfg: GenerateConfig, queue: mp.Queue) -> None:
    """Generate `episodes_per_task` successful episodes of one task and send them to the writer process."""
    render = RenderConfig(cfg.image_size, cfg.image_size, dict(cfg.cameras))
    kept = 0
    attempt = 0
    max_attempts = cfg.max_attempts or 4 * cfg.episodes_per_task + 10
    with MetaWorldEnv(task, render, max_episode_steps=cfg.max_episode_steps) as env:
        while kept < cfg.episodes_per_task:
            if attempt >= max_attempts:
                queue.put(("error", task, f"the expert succeeded only {kept} times in {attempt} attempts at "
                                          f"action_noise={cfg.action_noise}; lower the noise or raise max_attempts"))
                return
            episode = run_expert_episode(
                env,
                episode_seed(cfg.seed, task, attempt),
                cfg.action_noise,
                cfg.steps_after_success,
                cfg.noise_correlation,
                cfg.record_expert_action,
            )
            attempt += 1
            if episode.success:  # failed expert attempts are not demonstrations
                queue.put(("episode", task, episode))
                kept += 1
    queue.put(("done", task, None))


def generate_episodes(cfg: GenerateConfig) -> Iterator[tuple[str, Episode | None]]:
    """Yield ``(task, episode)`` as worker processes produce them, and ``(task, None)`` when a task is finished.

    Failed expert attempts are dropped in the workers (counted in ``Episode``-less form by the caller via
    attempts). Tasks are spread over ``cfg.workers`` processes; each task's episodes arrive in seed order.
    """
    tasks = resolve_tasks(cfg.tasks)
    ctx = mp.get_context("spawn")  # fork is unsafe with an EGL context / OpenMP threads in the parent
    queue: mp.Queue = ctx.Queue(maxsize=64)
    pending = list(tasks)
    running: dict[str, mp.Process] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, cfg.workers):
                task = pending.pop(0)
                proc = ctx.Process(target=run_owned, args=(os.getpid(), _worker, task, cfg, queue), daemon=True)
                with signals_deferred():  # never a child cut off before it has its start data
                    proc.start()
                running[task] = proc
            kind, task, payload = _get(queue, running)
            if kind == "episode":
                yield task, payload
            elif kind == "done":
                running.pop(task).join()
                yield task, None
            else:
                raise RoboscaleError(f"demonstrations for {task}: {payload}")
    finally:
        for proc in running.values():
            proc.terminate()


def _get(queue: mp.Queue, running: dict[str, mp.Process]):
    """Queue.get that notices a worker that died without reporting (e.g. a segfault in the renderer)."""
    import queue as queue_module

    while True:
        try:
            return queue.get(timeout=5.0)
        except queue_module.Empty:
            dead = [t for t, p in running.items() if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"demonstration worker for {dead[0]} died (exit code {running[dead[0]].exitcode})")


def generate_dataset(cfg: GenerateConfig) -> Path:
    """Run the experts and write the dataset atomically at ``cfg.out``. Returns the dataset path.

    Episodes are written in canonical order (tasks as given, each task's episodes in seed order) so the dataset
    does not depend on worker timing; episodes of tasks that finish early wait in memory (at most ``workers - 1``
    tasks' worth) until the tasks before them are written.
    """
    from tqdm import tqdm

    from roboscale.data import DatasetWriter

    tasks = resolve_tasks(cfg.tasks)
    out = Path(cfg.out)
    writer = DatasetWriter.create(
        out,
        fps=FPS,
        features=dataset_features(cfg.image_size, cfg.cameras),
        robot_type="sawyer",
        video_codec=cfg.video_codec,
    )
    waiting: dict[str, list[Episode]] = {t: [] for t in tasks}
    finished: set[str] = set()
    next_task = 0
    with tqdm(total=len(tasks) * cfg.episodes_per_task, desc="expert demos", unit="ep") as bar:
        for task, episode in generate_episodes(cfg):
            if episode is None:
                finished.add(task)
            else:
                waiting[task].append(episode)
                bar.update(1)
            # Write everything that is now in canonical order.
            while next_task < len(tasks):
                current = tasks[next_task]
                for ready in waiting[current]:
                    writer.add_episode(ready.frames, task=ready.description)
                waiting[current] = []
                if current not in finished:
                    break
                next_task += 1
    writer.finalize()
    log.info("wrote %d tasks x %d episodes to %s", len(tasks), cfg.episodes_per_task, out)
    return out
