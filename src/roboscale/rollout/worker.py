"""An env worker: one process that steps several environments of one adapter and asks for their actions.

Its environments are split into ``sub_batches`` groups. The environments of a group that still have queued
actions take a step; when none has, the group sends one request for all of them and waits, while the other groups
keep stepping, so simulation overlaps with inference. Each environment runs one episode at a time, taken
from the jobs the engine sends; when it ends, the result goes back and the environment takes the next job.

A job with ``record_trajectory`` is recorded chunk by chunk (``rollout.trajectory``): what the policy saw, what
it predicted (and by which weights), the action steps executed and their rewards; the record goes back with the
result. Messages (``rollout.messages``):

- in (its own inbox): ``Job``, ``LoadWeights`` (when it predicts itself), ``Report``, ``Stop``
- in (its own replies channel, from the servers): ``Actions``
- out (requests, to the servers): ``Predict``
- out (events, to the engine): ``Started``, ``Result`` (with the trajectory), ``EpisodeFailed`` (the simulator
  raised: retried), ``Alive`` at least every ``heartbeat_s`` while it makes progress or waits (for a server, or
  for jobs between runs), ``WeightsLoaded``, ``Stats`` (answering ``Report``), ``Failed`` when it cannot work at
  all (bad env adapter, bad checkpoint or weights).
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
from roboscale.rollout import messages
from roboscale.rollout.episode import EpisodeJob, EpisodeResult
from roboscale.rollout.inference import Prediction, PredictItem, RunnerSettings
from roboscale.rollout.queues import ActionQueue
from roboscale.rollout.remote import RemoteSettings
from roboscale.rollout.trajectory import TrajectoryRecorder
from roboscale.rollout.weights import decode_state
from roboscale.sim.env import EnvRequest

STATS = ("env_steps", "sim_s", "render_s", "inference_s", "inference_calls", "observations", "envs_made",
         "env_make_s", "worker_cpu_s", "worker_wait_s")


@dataclass
class WorkerSettings:
    name: str
    index: int
    """Which replies channel is this worker's."""
    generation: int
    """Replies of an earlier pool (a restart after a crash) carry another generation and are dropped."""
    env: str
    env_request: EnvRequest
    """What each environment is built with (``EnvSpec.make(task, env_request)``)."""
    envs: int
    sub_batches: int
    n_action_steps: int
    video_camera: str = ""
    video_dir: str = ""
    announce_groups: bool = False
    """Tell the server how many groups have episodes (``Producing``); only a lone server hears every worker's."""
    spare_envs: int = 0
    """Built environments kept for reuse once their slots have moved to other tasks."""
    render_every_step: bool = False
    """Render cameras after every step, not only before the policy looks (a baseline)."""
    local: RunnerSettings | RemoteSettings | None = None
    """Predict inside this worker with this policy (no inference server), or through a remote policy server."""
    max_batch_size: int = 0
    """Predicting itself: observations per policy call at most (0: all of a request)."""
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
    asked: PredictItem | None = None
    """What the policy was last asked for this environment (what a trajectory records with the answer)."""
    steps: int = 0
    rewards: list[float] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)
    recorder: TrajectoryRecorder | None = None
    started: float = 0.0


def run_env_worker(settings: WorkerSettings, inbox: Any, requests: Any, replies: Any, events: Any) -> None:
    try:
        _EnvWorker(settings, inbox, requests, replies, events).run()
    except RoboscaleError as exc:
        events.put(messages.Failed(settings.name, to_record(exc)))
    except Exception as exc:  # reported, never a silent death the engine must time out on
        events.put(messages.Failed(settings.name,
                                   to_record(WorkerError(f"env worker failed: {type(exc).__name__}: {exc}"))))


class _EnvWorker:
    def __init__(self, settings: WorkerSettings, inbox: Any, requests: Any, replies: Any, events: Any):
        from roboscale.sim.env import env_spec

        self.s = settings
        self.inbox, self.requests, self.replies, self.events = inbox, requests, replies, events
        self.spec = env_spec(settings.env)
        self.slots = [_Slot(i, ActionQueue(settings.n_action_steps)) for i in range(settings.envs)]
        # predicting in this process, a group waits for nothing another could step through: one batch of all
        groups = 1 if settings.local else min(settings.sub_batches, settings.envs)
        self.groups = [self.slots[g::groups] for g in range(groups)]
        self.waiting: list[set[int]] = [set() for _ in self.groups]
        self.jobs: deque[tuple[EpisodeJob, int]] = deque()
        self.producing = 0
        """The groups with episodes the server was last told of."""
        self.spare: list[Any] = []
        """Built environments no slot uses, oldest first (``_park``)."""
        self.stopping = False
        self.local = settings.local.build() if settings.local else None
        # totals so far, but for the timings of the environments still open (``_totals`` adds those)
        self.stats: dict[str, float] = {"env_steps": 0, "sim_s": 0.0, "render_s": 0.0, "inference_s": 0.0,
                                        "inference_calls": 0, "observations": 0, "envs_made": 0, "env_make_s": 0.0,
                                        "worker_wait_s": 0.0}
        self.cpu_start = time.process_time()
        self.reported = dict.fromkeys(STATS, 0)  # the totals at the last Report
        self.last_heartbeat = time.monotonic()

    # --- the loop ------------------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            self._read_inbox(block=False)
            self._assign()
            self._announce()
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
        while self.spare:
            self._close(self.spare.pop())
        if self.local is not None:  # a remote server's connections (every Predictor has close)
            self.local.close()

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

    def _announce(self) -> None:
        """Before the requests of groups that just got episodes, and once groups have run out of them: the
        server's batch need not wait for a request that cannot come (the last episodes of a run)."""
        if not self.s.announce_groups:
            return
        producing = sum(any(slot.job is not None for slot in group) for group in self.groups)
        if producing != self.producing:
            self.producing = producing
            self.requests.put(messages.Producing(self.s.index, producing))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self.last_heartbeat >= self.s.heartbeat_s:
            self.events.put(messages.Alive(self.s.name))
            self.last_heartbeat = now

    # --- jobs ----------------------------------------------------------------------------------------------
    def _read_inbox(self, block: bool) -> None:
        while True:
            try:
                message = self.inbox.get(timeout=self.s.heartbeat_s) if block else self.inbox.get_nowait()
            except queue.Empty:
                if block:
                    self.events.put(messages.Alive(self.s.name))
                return
            block = False
            match message:
                case messages.Job(job, attempt):
                    self.jobs.append((job, attempt))
                case messages.LoadWeights(data, version):
                    self.local.load_state(decode_state(data), version)
                    self.events.put(messages.WeightsLoaded(self.s.name, version))
                case messages.Report():
                    totals = self._totals()
                    self.events.put(messages.Stats(self.s.name, {k: totals[k] - self.reported[k] for k in STATS}))
                    self.reported = totals
                case messages.Stop():
                    self.stopping = True

    def _totals(self) -> dict[str, float]:
        """Everything so far, the environments still open included."""
        totals = dict(self.stats, worker_cpu_s=time.process_time() - self.cpu_start)
        for env in [slot.env for slot in self.slots if slot.env is not None] + self.spare:
            timings = getattr(env, "timings", {})
            totals["sim_s"] += timings.get("sim_s", 0.0)
            totals["render_s"] += timings.get("render_s", 0.0)
        return totals

    def _assign(self) -> None:
        """Each free environment takes the first job of its own task, or else the first job (``rollout.engine``:
        an environment kept on its task is not rebuilt)."""
        for slot in self.slots:
            if slot.job is None and self.jobs:
                task = slot.env.task if slot.env is not None else None
                mine = next((i for i, (job, _) in enumerate(self.jobs) if job.task == task), 0)
                job, attempt = self.jobs[mine]
                del self.jobs[mine]
                self._begin(slot, job, attempt)

    def _begin(self, slot: _Slot, job: EpisodeJob, attempt: int) -> None:
        self.events.put(messages.Started(self.s.name, job.key, attempt))
        slot.job, slot.attempt = job, attempt
        slot.queue.reset()
        slot.chunk_index, slot.steps, slot.rewards, slot.frames = 0, 0, [], []
        slot.recorder = TrajectoryRecorder() if job.record_trajectory else None
        slot.started = time.perf_counter()
        try:
            if slot.env is None or slot.env.task != job.task:
                spare = self._spare_for(job.task)  # before parking this one: the parking may close the oldest
                self._park(slot)
                slot.env = spare or self._make(job.task)
            slot.instruction = job.instruction or slot.env.instruction
            slot.observation = slot.env.reset(job.seed, job.start_scene)
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
        if slot.recorder is not None:
            slot.recorder.step(step.reward)
        slot.observation = step.observation
        if slot.job.record_video:
            slot.frames.append(step.observation["images"][self.s.video_camera])
        if step.success or step.done:  # success at any step ends it (MetaWorld can leave a success state)
            cut = not step.success and slot.steps >= slot.env.max_steps
            self._finish(slot, bool(step.success), terminated=not cut)

    def _finish(self, slot: _Slot, success: bool, terminated: bool) -> None:
        job = slot.job
        video = None
        if job.record_video:
            from roboscale.rollout.video import write_video

            task = job.task.replace("/", "--")  # LIBERO-Pro's tasks are <suite>/<name>: one file, not a folder
            name = f"{task}_ep{job.episode:03d}_{'success' if success else 'fail'}.mp4"
            write_video(Path(self.s.video_dir) / name, np.stack(slot.frames))
            video = name
        result = EpisodeResult(job.task, job.episode, job.seed, success, slot.steps, float(np.sum(slot.rewards)),
                               float(np.max(slot.rewards)), video, attempts=slot.attempt,
                               wall_s=time.perf_counter() - slot.started)
        trajectory = None
        if slot.recorder is not None:
            trajectory = slot.recorder.finish(job.task, job.episode, job.seed, job.draws_from, success, terminated)
        self.events.put(messages.Result(self.s.name, result.to_dict(), trajectory))
        slot.job, slot.frames, slot.recorder = None, [], None

    def _fail(self, slot: _Slot, exc: Exception) -> None:
        """The simulator raised: drop the environment (it may be broken) and let the engine retry the episode."""
        self.events.put(messages.EpisodeFailed(self.s.name, slot.job.key, f"{type(exc).__name__}: {exc}"))
        self._close_env(slot, broken=True)
        slot.job, slot.frames, slot.recorder = None, [], None

    # --- environments: built once per task, kept while they may be needed again ---------------------------------
    def _make(self, task: str) -> Any:
        start = time.perf_counter()
        env = self.spec.make(task, self.s.env_request)
        self.stats["env_make_s"] += time.perf_counter() - start
        self.stats["envs_made"] += 1
        return env

    def _park(self, slot: _Slot) -> None:
        """The slot moves to another task: keep its environment as a spare (the oldest spare beyond
        ``spare_envs`` is closed). A MetaWorld environment costs ~0.8 s of CPU to build (three quarters of it the
        renderer's GL context), as much as ~70 of its steps with a batched demo-size policy, and a generator that
        runs the same tasks step after step would otherwise rebuild every environment every step."""
        if slot.env is None:
            return
        self.spare.append(slot.env)
        slot.env = None
        while len(self.spare) > self.s.spare_envs:
            self._close(self.spare.pop(0))

    def _spare_for(self, task: str) -> Any:
        """A spare environment of ``task`` (the most recently parked), taken out of the spares; None: none."""
        for i in range(len(self.spare) - 1, -1, -1):
            if self.spare[i].task == task:
                return self.spare.pop(i)
        return None

    def _close_env(self, slot: _Slot, broken: bool = False) -> None:
        if slot.env is not None:
            env, slot.env = slot.env, None
            self._close(env, broken)

    def _close(self, env: Any, broken: bool = False) -> None:
        timings = getattr(env, "timings", {})
        self.stats["sim_s"] += timings.get("sim_s", 0.0)
        self.stats["render_s"] += timings.get("render_s", 0.0)
        try:
            env.close()
        except Exception:
            if not broken:
                raise

    # --- actions -------------------------------------------------------------------------------------------
    def _request(self, g: int, slots: list[_Slot]) -> None:
        items = [PredictItem(slot.index, slot.job.draws_from, slot.chunk_index, slot.instruction,
                             slot.observation["state"], slot.observation["images"]) for slot in slots]
        for slot, item in zip(slots, items, strict=True):
            slot.chunk_index += 1
            slot.asked = item
        if self.local is not None:
            start = time.perf_counter()
            size = self.s.max_batch_size or len(items)
            predictions = [p for i in range(0, len(items), size) for p in self.local.predict(items[i:i + size])]
            self.stats["inference_s"] += time.perf_counter() - start
            self.stats["inference_calls"] += -(-len(items) // size)
            self.stats["observations"] += len(items)
            for slot, prediction in zip(slots, predictions, strict=True):
                self._fill(slot, prediction)
            return
        self.waiting[g] = {slot.index for slot in slots}
        self.requests.put(messages.Predict(self.s.index, self.s.generation, items))

    def _fill(self, slot: _Slot, prediction: Prediction) -> None:
        slot.queue.fill(prediction.chunk)
        if slot.recorder is not None:
            item = slot.asked
            slot.recorder.chunk(item.state, item.images, item.instruction, prediction)

    def _read_replies(self, block: bool) -> None:
        if self.local is not None:
            return
        while True:
            start = time.perf_counter()
            try:
                message = self.replies.get(timeout=self.s.heartbeat_s) if block else self.replies.get_nowait()
            except queue.Empty:
                return
            finally:
                if block:  # nothing to step until an answer comes
                    self.stats["worker_wait_s"] += time.perf_counter() - start
            block = False
            match message:
                case messages.Actions(generation, answers) if generation == self.s.generation:
                    for slot_index, chunk_index, prediction in answers:
                        slot = self.slots[slot_index]
                        if slot.job is not None and chunk_index == slot.chunk_index - 1:
                            self._fill(slot, prediction)
                        for waiting in self.waiting:
                            waiting.discard(slot_index)
