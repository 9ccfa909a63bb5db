"""Closed-loop rollouts of a policy in MetaWorld, in parallel worker processes, with fixed seeds.

Episode ``i`` of task ``t`` is placed by ``episode_seed(seed, t, i)`` whichever worker runs it, so a result is
reproducible for a given (checkpoint, tasks, episodes, seed) regardless of the number of workers. The default
evaluation seed (1000) is disjoint from the demonstration seed (0): the policy is scored on placements it did
not see in training.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue as queue_module
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import numpy as np

from roboscale.errors import RoboscaleError, WorkerError, from_record, to_record

log = logging.getLogger(__name__)


@dataclass
class EpisodeResult:
    task: str
    episode: int
    seed: int
    success: bool
    steps: int
    """Steps until success (or until the episode was cut off)."""
    sum_reward: float
    max_reward: float
    video: str | None = None


@dataclass
class RolloutJob:
    checkpoint: str
    task: str
    episode: int
    seed: int
    max_steps: int
    record_video: bool
    video_dir: str
    image_size: int
    cameras: dict[str, str] = field(default_factory=dict)
    video_camera: str = ""
    instruction: str = ""
    """What the policy is told to do (default: the task's own description)."""


def observation_for_policy(obs: dict, description: str, image_keys: list[str]) -> dict:
    """An env observation as a batch of one, in the dataset's feature names (uint8 CHW images)."""
    import torch

    batch = {"observation.state": torch.from_numpy(obs["state"])[None], "task": [description]}
    for key in image_keys:
        name = key.removeprefix("observation.images.")
        batch[key] = torch.from_numpy(np.ascontiguousarray(obs["images"][name].transpose(2, 0, 1)))[None]
    return batch


class ActionQueue:
    """The actions of one environment's predicted chunk not executed yet. A new chunk is predicted only when the
    queue is empty; each environment has its own, so environments that reset at different times can share one
    batched policy call."""

    def __init__(self, n_action_steps: int):
        self.n_action_steps = n_action_steps
        self._actions: deque = deque()

    def __len__(self) -> int:
        return len(self._actions)

    def reset(self) -> None:
        """At the start of every episode: what the previous episode queued is not this one's."""
        self._actions.clear()

    def pop(self, predict_chunk: Callable[[], Any]) -> Any:
        """The next action [A]; ``predict_chunk()`` -> [T, A] is called when the queue is empty."""
        if not self._actions:
            self._actions.extend(predict_chunk()[: self.n_action_steps])
        return self._actions.popleft()


def run_episode(policy, env, job: RolloutJob) -> EpisodeResult:
    """One episode: success at any step ends it (MetaWorld states can drift after success)."""
    import torch

    queue = ActionQueue(policy.config.n_action_steps)
    torch.manual_seed(job.seed)  # the flow-matching noise is part of the episode's reproducibility
    obs = env.reset(job.seed)
    frames = []
    rewards = []
    success = False
    steps = 0
    image_keys = policy.config.image_keys
    instruction = job.instruction or env.description
    for steps in range(1, job.max_steps + 1):
        if job.record_video:
            frames.append(obs["images"][job.video_camera])
        observation = observation_for_policy(obs, instruction, image_keys)
        action = queue.pop(lambda: policy.predict_action_chunk(observation)[0]).numpy()
        obs, reward, success, truncated, _ = env.step(action)
        rewards.append(reward)
        if success or truncated:
            break
    video = None
    if job.record_video:
        frames.append(obs["images"][job.video_camera])
        video = str(Path(job.video_dir) / f"{job.task}_ep{job.episode:03d}_{'success' if success else 'fail'}.mp4")
        write_video(video, np.stack(frames), fps=30)
    return EpisodeResult(
        job.task, job.episode, job.seed, bool(success), steps, float(np.sum(rewards)), float(np.max(rewards)), video
    )


def write_video(path: str, frames: np.ndarray, fps: int = 30) -> None:
    """H.264 mp4 (plays in every browser, unlike AV1 in some), upscaled 4x for viewing; written atomically."""
    from roboscale.data.lerobot.video import VideoStreamWriter
    from roboscale.utils.io import atomic_path

    frames = frames.repeat(4, axis=1).repeat(4, axis=2)
    with atomic_path(path) as tmp:
        writer = VideoStreamWriter(tmp, fps, frames.shape[2], frames.shape[1], codec="libx264")
        for frame in frames:
            writer.write(frame)
        writer.close()


def _worker(jobs: list[RolloutJob], results: mp.Queue, threads: int) -> None:
    import torch

    from roboscale.models.policy import Policy
    from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig

    torch.set_num_threads(threads)
    try:
        policy = Policy.from_pretrained(jobs[0].checkpoint).eval()
        envs: dict[str, MetaWorldEnv] = {}
        for job in jobs:
            if job.task not in envs:
                render = RenderConfig(job.image_size, job.image_size, dict(job.cameras))
                envs[job.task] = MetaWorldEnv(job.task, render, max_episode_steps=job.max_steps)
            results.put(("result", run_episode(policy, envs[job.task], job)))
        for env in envs.values():
            env.close()
        results.put(("done", None))
    except RoboscaleError as exc:  # a bad checkpoint or task: raised again in the parent as it was
        results.put(("error", to_record(exc)))
    except Exception as exc:  # report, don't hang the parent
        results.put(("error", to_record(WorkerError(f"evaluation worker failed: {type(exc).__name__}: {exc}"))))


def run_rollouts(jobs: list[RolloutJob], workers: int, progress: bool = True) -> list[EpisodeResult]:
    """Run jobs over ``workers`` processes (jobs of one task stay together to reuse the env)."""
    from tqdm import tqdm

    workers = max(1, min(workers, len(jobs)))
    shards: list[list[RolloutJob]] = [jobs[i::workers] for i in range(workers)]
    shards = [sorted(s, key=lambda j: (j.task, j.episode)) for s in shards if s]
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(s, results, 1), daemon=True) for s in shards]
    for p in procs:
        p.start()
    out: list[EpisodeResult] = []
    done = 0
    try:
        with tqdm(total=len(jobs), desc="evaluating", unit="ep", disable=not progress) as bar:
            while done < len(procs):
                try:
                    kind, payload = results.get(timeout=10.0)
                except queue_module.Empty:
                    dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead:
                        raise WorkerError(f"an evaluation worker died (exit code {dead[0].exitcode}) after "
                                          f"{len(out)} of {len(jobs)} episodes") from None
                    continue
                if kind == "result":
                    out.append(payload)
                    bar.update(1)
                    bar.set_postfix(success=f"{np.mean([r.success for r in out]):.0%}")
                elif kind == "done":
                    done += 1
                else:
                    raise from_record(payload)
    finally:
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
    return sorted(out, key=lambda r: (r.task, r.episode))
