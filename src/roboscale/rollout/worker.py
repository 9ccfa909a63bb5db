"""An env worker: one process that steps several environments of one adapter and asks for their actions.

Its environments are split into ``sub_batches`` groups. The environments of a group that still have queued
actions take a step; when none has, the group sends one request for all of them and waits, while the other groups
keep stepping, so simulation overlaps with inference. Each environment runs one episode at a time, taken
from the jobs the engine sends; when it ends, the result goes back and the environment takes the next job.

Messages:

- in (its own inbox): ``("job", EpisodeJob, attempt)``, ``("stop",)``
- in (its own replies channel, from the servers): ``("actions", generation, [(slot, chunk_index, chunk)])``
- out (requests, to the servers): ``("predict", worker, generation, [PredictItem])``
- out (events, to the engine): ``("started", name, key, attempt)``, ``("result", name, EpisodeResult dict)``,
  ``("episode_error", name, key, reason)`` (the simulator raised: retried), ``("alive", name)`` at least every
  ``heartbeat_s`` while it makes progress or waits for a server, ``("stats", name, {...})`` on stop,
  ``("error", name, record)`` when it cannot work at all (bad env adapter, bad checkpoint).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.errors import RoboscaleError, WorkerError, to_record
from roboscale.rollout.episode import EpisodeJob, EpisodeResult
from roboscale.rollout.inference import PredictItem
from roboscale.rollout.queues import ActionQueue


@dataclass
class WorkerSettings:
    name: str
    index: int
    """Which replies channel is this worker's."""
    generation: int
    """Replies of an earlier pool (a restart after a crash) carry another generation and are dropped."""
    env: str
    env_options: dict[str, Any]
    """``make(task, **env_options)``: image_size, cameras, max_steps."""
    envs: int
    sub_batches: int
    n_action_steps: int
    video_camera: str = ""
    video_dir: str = ""
    render_every_step: bool = False
    """Render cameras after every step, not only before the policy looks (a baseline)."""
    local_checkpoint: str = ""
    """Predict inside this worker (no server): the baseline design."""
    device: str = "cpu"
    threads: int = 1
    heartbeat_s: float = 1.0


@dataclass
class _Slot:
    index: int
    queue: ActionQueue
    env: Any = None
    job: EpisodeJob | None = None
    attempt: int = 0
    instruction: str = ""
    observation: dict | None = None
    chunk_index: int = 0
    steps: int = 0
    rewards: list[float] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)
    started: float = 0.0


def run_env_worker(settings: WorkerSettings, inbox: Any, requests: Any, replies: Any, events: Any) -> None:
    try:
        _EnvWorker(settings, inbox, requests, replies, events).run()
    except RoboscaleError as exc:
        events.put(("error", settings.name, to_record(exc)))
    except Exception as exc:  # reported, never a silent death the engine must time out on
        events.put(("error", settings.name,
                    to_record(WorkerError(f"env worker failed: {type(exc).__name__}: {exc}"))))


class _EnvWorker:
    def __init__(self, settings: WorkerSettings, inbox: Any, requests: Any, replies: Any, events: Any):
        from roboscale.sim.env import env_spec

        self.s = settings
        self.inbox, self.requests, self.replies, self.events = inbox, requests, replies, events
        self.spec = env_spec(settings.env)
        self.slots = [_Slot(i, ActionQueue(settings.n_action_steps)) for i in range(settings.envs)]
        groups = min(settings.sub_batches, settings.envs)
        self.groups = [self.slots[g::groups] for g in range(groups)]
        self.waiting: list[set[int]] = [set() for _ in self.groups]
        self.jobs: deque[tuple[EpisodeJob, int]] = deque()
        self.stopping = False
        self.local = None
        if settings.local_checkpoint:
            from roboscale.rollout.inference import PolicyRunner

            self.local = PolicyRunner(settings.local_checkpoint, settings.device, settings.threads)
        self.stats = {"sim_s": 0.0, "render_s": 0.0, "env_steps": 0, "inference_s": 0.0, "inference_calls": 0,
                      "observations": 0}
        self.last_heartbeat = time.monotonic()

    # --- the loop ------------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            self._read_inbox(block=False)
            self._assign()
            if not any(slot.job for slot in self.slots):
                if self.stopping:
                    break
                self._read_inbox(block=True)
                continue
            progressed = False
            for g, group in enumerate(self.groups):
                progressed |= self._advance(g, group)
            self._read_replies(block=not progressed)
            self._heartbeat()
        for slot in self.slots:
            self._close_env(slot)
        self.events.put(("stats", self.s.name, self.stats))

    def _advance(self, g: int, group: list[_Slot]) -> bool:
        """One step of the group's environments that have actions; when none has, one request for all of them.

        An environment whose episode just started waits (at most n_action_steps - 1 steps) for the others of its
        group to run dry, so that the group keeps asking together: batches stay as large as the group even when
        episodes end at different times. What an episode does is unaffected (it only starts a little later)."""
        if self.waiting[g]:
            return False
        active = [slot for slot in group if slot.job is not None]
        if not active:
            return False
        ready = [slot for slot in active if slot.queue]
        if not ready:
            self._request(g, active)
            if self.waiting[g]:
                return False
            ready = active  # predicted in this process: the actions are there already
        for slot in ready:
            self._step(slot)
        return True

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat >= self.s.heartbeat_s:
            self.events.put(("alive", self.s.name))
            self.last_heartbeat = now

    # --- jobs ----------------------------------------------------------------------------------------------
    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                message = self.inbox.get(timeout=self.s.heartbeat_s) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block:
                    self.events.put(("alive", self.s.name))
                return
            block = False
            if message[0] == "stop":
                self.stopping = True
            else:
                self.jobs.append((message[1], message[2]))

    def _assign(self) -> None:
        for slot in self.slots:
            if slot.job is None and self.jobs:
                job, attempt = self.jobs.popleft()
                self._begin(slot, job, attempt)

    def _begin(self, slot: _Slot, job: EpisodeJob, attempt: int) -> None:
        self.events.put(("started", self.s.name, job.key, attempt))
        slot.job, slot.attempt = job, attempt
        slot.queue.reset()
        slot.chunk_index, slot.steps, slot.rewards, slot.frames = 0, 0, [], []
        slot.started = time.perf_counter()
        try:
            if slot.env is None or slot.env.task != job.task:
                self._close_env(slot)
                slot.env = self.spec.make(job.task, **self.s.env_options)
            slot.instruction = job.instruction or slot.env.instruction
            slot.observation = slot.env.reset(job.seed)
        except Exception as exc:
            self._fail(slot, exc)
            return
        if job.record_video:
            slot.frames.append(slot.observation["images"][self.s.video_camera])

    def _step(self, slot: _Slot) -> None:
        action = slot.queue.pop()
        # the policy looks only when the queue has run dry; video frames are needed every step
        render = self.s.render_every_step or slot.job.record_video or not slot.queue
        try:
            step = slot.env.step(action, render=render)
        except Exception as exc:
            self._fail(slot, exc)
            return
        slot.steps += 1
        self.stats["env_steps"] += 1
        slot.rewards.append(step.reward)
        slot.observation = step.observation
        if slot.job.record_video:
            slot.frames.append(step.observation["images"][self.s.video_camera])
        if step.success or step.done:  # success at any step ends it (MetaWorld can leave a success state)
            self._finish(slot, bool(step.success))

    def _finish(self, slot: _Slot, success: bool) -> None:
        job = slot.job
        video = None
        if job.record_video:
            from roboscale.rollout.video import write_video

            name = f"{job.task}_ep{job.episode:03d}_{'success' if success else 'fail'}.mp4"
            write_video(Path(self.s.video_dir) / name, np.stack(slot.frames))
            video = name
        result = EpisodeResult(job.task, job.episode, job.seed, success, slot.steps, float(np.sum(slot.rewards)),
                               float(np.max(slot.rewards)), video, attempts=slot.attempt,
                               wall_s=time.perf_counter() - slot.started)
        self.events.put(("result", self.s.name, result.to_dict()))
        slot.job, slot.frames = None, []

    def _fail(self, slot: _Slot, exc: Exception) -> None:
        """The simulator raised: drop the environment (it may be broken) and let the engine retry the episode."""
        self.events.put(("episode_error", self.s.name, slot.job.key, f"{type(exc).__name__}: {exc}"))
        self._close_env(slot, broken=True)
        slot.job, slot.frames = None, []

    def _close_env(self, slot: _Slot, broken: bool = False) -> None:
        if slot.env is None:
            return
        timings = getattr(slot.env, "timings", {})
        self.stats["sim_s"] += timings.get("sim_s", 0.0)
        self.stats["render_s"] += timings.get("render_s", 0.0)
        try:
            slot.env.close()
        except Exception:
            if not broken:
                raise
        slot.env = None

    # --- actions -------------------------------------------------------------------------------------------
    def _request(self, g: int, slots: list[_Slot]) -> None:
        items = [PredictItem(slot.index, slot.job.seed, slot.chunk_index, slot.instruction,
                             slot.observation["state"], slot.observation["images"]) for slot in slots]
        for slot in slots:
            slot.chunk_index += 1
        if self.local is not None:
            start = time.perf_counter()
            chunks = self.local.predict(items)
            self.stats["inference_s"] += time.perf_counter() - start
            self.stats["inference_calls"] += 1
            self.stats["observations"] += len(items)
            for slot, chunk in zip(slots, chunks, strict=True):
                slot.queue.fill(chunk)
            return
        self.waiting[g] = {slot.index for slot in slots}
        self.requests.put(("predict", self.s.index, self.s.generation, items))

    def _read_replies(self, block: bool) -> None:
        if self.local is not None:
            return
        while True:
            try:
                message = self.replies.get(timeout=self.s.heartbeat_s) if block else self.replies.get_nowait()
            except queue.Empty:
                return
            block = False
            _, generation, answers = message
            if generation != self.s.generation:
                continue
            for slot_index, chunk_index, chunk in answers:
                slot = self.slots[slot_index]
                if slot.job is not None and chunk_index == slot.chunk_index - 1:
                    slot.queue.fill(chunk)
                for waiting in self.waiting:
                    waiting.discard(slot_index)
