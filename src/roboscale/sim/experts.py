"""Scripted-expert demonstrations, with action noise, into a LeRobot dataset, for any adapter with experts.

An adapter's ``ExpertSpec`` (``EnvSpec.experts``) says what its demonstrations record and which expert acts from an
observation (privileged state included); this module runs them. Episodes are generated in worker processes (one
env per process, re-used across episodes) and written by the main process, which owns the single DatasetWriter so
episode indices stay contiguous and the write is atomic. Each episode is seeded from (seed, task, attempt) and
starts from scene ``first_scene + attempt`` alone, so a dataset is reproducible whatever the number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.configs.data import GenerateConfig
from roboscale.errors import ConfigError, RoboscaleError
from roboscale.sim.env import Env, EnvRequest, EnvSpec, env_spec, episode_seed
from roboscale.utils.imports import load
from roboscale.utils.lifetime import run_owned, signals_deferred

log = logging.getLogger(__name__)

Expert = Callable[[dict[str, Any]], np.ndarray]
"""An observation (as ``Env.reset``/``step`` return it) -> the action to take, in the env's [-1, 1] units."""


@dataclass(frozen=True)
class ExpertSpec:
    """How an adapter's scripted experts make demonstrations."""

    fps: int
    robot_type: str
    observation_features: Callable[[int, dict[str, str]], dict[str, dict]]
    """(image_size, cameras) -> the dataset features of what is observed (cameras, state features)."""
    action_names: tuple[str, ...]
    expert: Callable[[Env], Expert]
    """The task's expert for an env just reset: called once per episode (an expert may keep a plan)."""
    frame: Callable[[dict[str, Any]], dict[str, np.ndarray]]
    """An observation -> its non-image columns (each state feature)."""
    max_steps: int
    """Give up on an episode after this many steps (GenerateConfig.max_episode_steps 0)."""

    def dataset_features(self, image_size: int, cameras: dict[str, str]) -> dict[str, dict]:
        """The demonstration dataset's features (the writer adds LeRobot's 5 default ones)."""
        action = {"dtype": "float32", "shape": [len(self.action_names)], "names": list(self.action_names)}
        return {
            **self.observation_features(image_size, cameras),
            "action": action,
            "action.executed": dict(action),
            "next.reward": {"dtype": "float32", "shape": [1], "names": None},
            "next.success": {"dtype": "bool", "shape": [1], "names": None},
        }


def expert_spec(spec: EnvSpec) -> ExpertSpec:
    if not spec.experts:
        raise ConfigError(f"--env: the {spec.name} environment has no scripted experts to generate demonstrations")
    return load(spec.experts)


@dataclass
class Episode:
    task: str
    description: str
    seed: int
    success: bool
    frames: dict[str, np.ndarray]  # feature name -> [T, ...]


def run_expert_episode(
    env: Env,
    experts: ExpertSpec,
    seed: int,
    action_noise: float,
    steps_after_success: int,
    noise_correlation: float = 0.0,
    record_expert_action: bool = False,
    scene: int = 0,
) -> Episode:
    """Roll out the task's scripted expert once, executing its actions plus AR(1) noise.

    Frames record the observation and the action for it: the expert's own (``record_expert_action``) or the
    executed one; ``action.executed`` always holds what was sent to the env.
    """
    rng = np.random.default_rng(seed)
    obs = env.reset(seed, scene)
    expert = experts.expert(env)
    action_dim = len(experts.action_names)
    columns: dict[str, list] = {}
    success_at = None
    noise = np.zeros(action_dim, dtype=np.float32)
    innovation = action_noise * np.sqrt(1.0 - noise_correlation**2)  # keeps the noise's std at action_noise
    for step in range(env.max_steps):
        intended = np.clip(np.asarray(expert(obs), dtype=np.float32), -1.0, 1.0)
        noise = noise_correlation * noise + rng.normal(0.0, innovation, size=action_dim).astype(np.float32)
        action = np.clip(intended + noise, -1.0, 1.0)
        next_obs, reward, success, truncated, _ = env.step(action)
        frame = {f"observation.images.{k}": v for k, v in obs["images"].items()}
        frame.update(experts.frame(obs))
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
    spec = env_spec(cfg.env)
    experts = expert_spec(spec)
    kept = 0
    attempt = 0
    max_attempts = cfg.max_attempts or 4 * cfg.episodes_per_task + 10
    env = spec.make(task, EnvRequest(image_size=cfg.image_size, cameras=cameras_of(cfg, spec),
                                     max_steps=cfg.max_episode_steps or experts.max_steps,
                                     options=spec.parse_options(cfg.env_options)))
    try:
        while kept < cfg.episodes_per_task:
            if attempt >= max_attempts:
                if cfg.partial_tasks:
                    break  # the demos it made are kept: the writer sees the task finished short
                queue.put(("error", task, f"the expert succeeded only {kept} times in {attempt} attempts at "
                                          f"action_noise={cfg.action_noise}; lower the noise, raise max_attempts "
                                          "or keep the other tasks' demos with --partial_tasks=true"))
                return
            episode = run_expert_episode(
                env,
                experts,
                episode_seed(cfg.seed, task, attempt),
                cfg.action_noise,
                cfg.steps_after_success,
                cfg.noise_correlation,
                cfg.record_expert_action,
                scene=cfg.first_scene + attempt,
            )
            attempt += 1
            if episode.success:  # failed expert attempts are not demonstrations
                queue.put(("episode", task, episode))
                kept += 1
    finally:
        env.close()
    queue.put(("done", task, attempt))


def cameras_of(cfg: GenerateConfig, spec: EnvSpec) -> dict[str, str]:
    """Dataset camera name -> simulator camera: the user's, or the adapter's default ones."""
    return dict(cfg.cameras) if cfg.cameras else dict(spec.default_cameras)


def generate_episodes(cfg: GenerateConfig) -> Iterator[tuple[str, Episode | int]]:
    """Yield ``(task, episode)`` as worker processes produce them, and ``(task, attempts)`` when a task is finished
    (the expert's attempts it took: failed ones are dropped in the workers). Tasks are spread over ``cfg.workers``
    processes; each task's episodes arrive in seed order.
    """
    tasks = env_spec(cfg.env).tasks_or_default(cfg.tasks)
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
                yield task, payload
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

    spec = env_spec(cfg.env)
    experts = expert_spec(spec)
    tasks = spec.tasks_or_default(cfg.tasks)
    spec.parse_options(cfg.env_options)  # a bad option fails here, once, not in every worker
    out = Path(cfg.out or f"outputs/data/{spec.name}")
    writer = DatasetWriter.create(
        out,
        fps=experts.fps,
        features=experts.dataset_features(cfg.image_size, cameras_of(cfg, spec)),
        robot_type=experts.robot_type,
        video_codec=cfg.video_codec,
    )
    waiting: dict[str, list[Episode]] = {t: [] for t in tasks}
    kept: dict[str, int] = dict.fromkeys(tasks, 0)
    attempts: dict[str, int] = {}
    next_task = 0
    # finalized on leaving the block, aborted (nothing at ``out``) on an error or Ctrl-C
    with writer, tqdm(total=len(tasks) * cfg.episodes_per_task, desc="expert demos", unit="ep") as bar:
        for task, episode in generate_episodes(cfg):
            if isinstance(episode, int):
                attempts[task] = episode
            else:
                waiting[task].append(episode)
                kept[task] += 1
                bar.update(1)
            # Write everything that is now in canonical order.
            while next_task < len(tasks):
                current = tasks[next_task]
                for ready in waiting[current]:
                    writer.add_episode(ready.frames, task=ready.description)
                waiting[current] = []
                if current not in attempts:
                    break
                next_task += 1
        if sum(kept.values()) == 0:
            raise RoboscaleError(f"demonstrations: the experts succeeded in none of {sum(attempts.values())} "
                                 f"attempts at action_noise={cfg.action_noise}; nothing was written to {out}")
    short = {task: kept[task] for task in tasks if kept[task] < cfg.episodes_per_task}
    log.info("wrote %d episodes of %d tasks to %s; the expert's success per task (demos kept / attempts):\n%s",
             sum(kept.values()), len(tasks) - sum(n == 0 for n in short.values()), out, "\n".join(
                 f"  {task}: {kept[task]}/{attempts[task]} ({kept[task] / attempts[task]:.0%})"
                 + (f", short of {cfg.episodes_per_task}" if task in short else "") for task in tasks))
    if short:
        log.warning("%d of %d tasks have fewer than %d demos (--partial_tasks): %s", len(short), len(tasks),
                    cfg.episodes_per_task, ", ".join(f"{task} {n}" for task, n in short.items()))
    return out
