"""The rollout engine: runs episode jobs on env workers and inference servers, retries what crashed, and keeps
going until every episode has a result.

Scheduling: each worker holds at most ``2 x envs_per_worker`` jobs (its environments' plus one queued each, so an
environment that finishes starts the next episode at once); a result frees a place and the next job goes there.
Jobs are dealt in the order given, so the results of a run are the same whatever the number of workers: what an
episode does depends only on its job (seed, task, instruction) and the policy (``rollout.noise``).

Faults: a worker that dies, raises in its simulator, or is silent for ``watchdog_s`` (a simulator hang: workers
report ``alive`` while they wait for a server too) costs the episodes it had started one attempt (all of them: a
process of several environments does not say which one crashed it); each is retried
up to ``max_retries`` times and then reported as a failed episode with the reason. A dead or hung worker is
killed and the whole pool restarted: the channels it shared with the others may be left locked by a process
killed mid-write, and a restart is cheap next to a hang. Episodes other workers had in progress start again
(their outcome is the same). A server that fails, or an error that is not a simulator's (a bad checkpoint or
env adapter), ends the run with that error.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from roboscale.configs.rollout import RolloutConfig
from roboscale.errors import WorkerError, from_record
from roboscale.rollout.episode import EpisodeJob, EpisodeResult
from roboscale.rollout.launch import Handle, Launcher, launcher_for
from roboscale.rollout.server import ServerSettings, run_server
from roboscale.rollout.worker import WorkerSettings, run_env_worker

log = logging.getLogger(__name__)

STARTUP_S = 300.0


@dataclass
class EnvSetup:
    """What every worker builds its environments with, and what the policy needs from them."""

    env: str
    checkpoint: str
    n_action_steps: int
    env_options: dict[str, Any] = field(default_factory=dict)
    video_camera: str = ""
    video_dir: str = ""


@dataclass
class Retry:
    task: str
    episode: int
    attempt: int
    """The attempt that failed (1: the first)."""
    reason: str


@dataclass
class RolloutStats:
    wall_s: float = 0.0
    env_steps: int = 0
    sim_s: float = 0.0
    render_s: float = 0.0
    inference_s: float = 0.0
    inference_calls: int = 0
    observations: int = 0
    restarts: int = 0
    retries: list[Retry] = field(default_factory=list)

    @property
    def mean_batch_size(self) -> float:
        return self.observations / self.inference_calls if self.inference_calls else 0.0


class _Restart(Exception):
    """The pool must be restarted (a worker died or hung)."""


class RolloutEngine:
    def __init__(self, cfg: RolloutConfig, setup: EnvSetup):
        self.cfg = cfg
        self.setup = setup

    def run(self, jobs: list[EpisodeJob], on_result: Callable[[EpisodeResult], None] | None = None
            ) -> tuple[list[EpisodeResult], RolloutStats]:
        """Every job's result (in job order) and where the time went."""
        stats = RolloutStats()
        results: dict[tuple[str, int], EpisodeResult] = {}
        attempts: dict[tuple[str, int], int] = {job.key: 0 for job in jobs}
        pending: deque[EpisodeJob] = deque(jobs)
        start = time.perf_counter()
        launcher = launcher_for(self.cfg.ray_address)
        generation = 0
        try:
            while pending:
                pool = _Pool(self.cfg, self.setup, launcher, generation, stats)
                try:
                    pool.drive(pending, attempts, results, on_result)
                except _Restart as restart:
                    pool.kill()
                    stats.restarts += 1
                    log.warning("restarting the rollout workers: %s", restart)
                    if stats.restarts > self.cfg.max_retries * max(1, len(jobs)) + self.cfg.max_retries:
                        raise WorkerError(f"rollout workers keep failing ({restart}); gave up after "
                                          f"{stats.restarts} restarts") from None
                except BaseException:  # an error, or Ctrl-C: nothing of this pool is worth waiting for
                    pool.kill()
                    raise
                finally:
                    pool.shutdown()
                generation += 1
        finally:
            launcher.close()
        stats.wall_s = time.perf_counter() - start
        return [results[job.key] for job in jobs], stats


class _Pool:
    """One generation of servers and workers."""

    def __init__(self, cfg: RolloutConfig, setup: EnvSetup, launcher: Launcher, generation: int,
                 stats: RolloutStats):
        from roboscale.rollout.inference import inference_threads

        self.cfg, self.setup, self.stats, self.generation = cfg, setup, stats, generation
        self.events = launcher.channel()
        self.requests = launcher.channel()
        self.replies = [launcher.channel() for _ in range(cfg.workers)]
        self.inboxes = [launcher.channel() for _ in range(cfg.workers)]
        device = launcher.device(cfg.device)
        serving = cfg.inference == "server"
        gpus = 1.0 if device.startswith("cuda") else 0.0  # what each process that predicts reserves (Ray)
        # a server shares the cores with the env workers (which render on the CPU): more threads than its share
        # only make them wait for each other
        threads = inference_threads(cfg.inference_threads, cfg.servers + cfg.workers if serving else cfg.workers)
        self.servers: dict[str, Handle] = {}
        if serving:
            for i in range(cfg.servers):
                name = f"server{i}"
                settings = ServerSettings(name, setup.checkpoint, device, threads, cfg.max_batch_size,
                                          cfg.batch_timeout_ms)
                self.servers[name] = launcher.start(run_server, (settings, self.requests, self.replies, self.events),
                                                    name=f"rollout-{name}", cpus=1.0, gpus=gpus)
        self.workers: dict[str, Handle] = {}
        self.index: dict[str, int] = {}
        for i in range(cfg.workers):
            name = f"worker{i}"
            settings = WorkerSettings(
                name, i, generation, setup.env, setup.env_options, cfg.envs_per_worker, cfg.sub_batches,
                setup.n_action_steps, setup.video_camera, setup.video_dir,
                render_every_step=cfg.render == "every_step", local_checkpoint="" if serving else setup.checkpoint,
                device=device, threads=threads)
            self.workers[name] = launcher.start(
                run_env_worker, (settings, self.inboxes[i], self.requests, self.replies[i], self.events),
                name=f"rollout-{name}", cpus=cfg.worker_cpus, gpus=0.0 if serving else gpus / cfg.workers)
            self.index[name] = i
        self.started_at = time.monotonic()
        self.last_seen: dict[str, float] = {}
        self.assigned: dict[str, dict[tuple[str, int], EpisodeJob]] = {name: {} for name in self.workers}
        self.started: dict[str, set[tuple[str, int]]] = {name: set() for name in self.workers}
        self.stopped: set[str] = set()

    # --- the loop ------------------------------------------------------------------------------------------
    def drive(self, pending: deque[EpisodeJob], attempts: dict, results: dict,
              on_result: Callable[[EpisodeResult], None] | None) -> None:
        credit = 2 * self.cfg.envs_per_worker
        while pending or any(self.assigned.values()):
            for name, jobs in self.assigned.items():
                while pending and len(jobs) < credit:
                    job = pending.popleft()
                    jobs[job.key] = job
                    self.inboxes[self.index[name]].put(("job", job, attempts[job.key] + 1))
            try:
                message = self.events.get(timeout=1.0)
            except queue.Empty:
                self._check_liveness(pending, attempts, results, on_result)
                continue
            kind, name = message[0], message[1]
            self.last_seen[name] = time.monotonic()
            if kind == "started":
                self.started[name].add(tuple(message[2]))
            elif kind == "result":
                result = EpisodeResult.from_dict(message[2])
                key = (result.task, result.episode)
                self.assigned[name].pop(key, None)
                self.started[name].discard(key)
                attempts[key] += 1
                results[key] = result
                if on_result is not None:
                    on_result(result)
            elif kind == "episode_error":
                key = tuple(message[2])
                job = self.assigned[name].pop(key)
                self.started[name].discard(key)
                self._failed_attempt(job, message[3], pending, attempts, results, on_result)
            elif kind == "error":
                raise from_record(message[2])
            elif kind == "stats":
                self._add_stats(message[2])
                self.stopped.add(name)
            self._check_liveness(pending, attempts, results, on_result)

    def _failed_attempt(self, job: EpisodeJob, reason: str, pending: deque, attempts: dict, results: dict,
                        on_result: Callable[[EpisodeResult], None] | None) -> None:
        attempts[job.key] += 1
        self.stats.retries.append(Retry(job.task, job.episode, attempts[job.key], reason))
        if attempts[job.key] <= self.cfg.max_retries:
            log.warning("%s episode %d: %s; retrying (attempt %d of %d)", job.task, job.episode, reason,
                        attempts[job.key] + 1, self.cfg.max_retries + 1)
            pending.appendleft(job)
            return
        log.warning("%s episode %d failed %d times (%s); counted as a failure", job.task, job.episode,
                    attempts[job.key], reason)
        result = EpisodeResult(job.task, job.episode, job.seed, False, 0, 0.0, 0.0, attempts=attempts[job.key],
                               error=reason)
        results[job.key] = result
        if on_result is not None:
            on_result(result)

    def _silent(self, name: str, now: float) -> bool:
        """Silent for longer than the watchdog allows; before its first message a process may take
        ``STARTUP_S`` (imports, loading the policy, a Ray task waiting for resources)."""
        if name in self.last_seen:
            return now - self.last_seen[name] > self.cfg.watchdog_s
        return now - self.started_at > max(STARTUP_S, self.cfg.watchdog_s)

    def _check_liveness(self, pending: deque, attempts: dict, results: dict,
                        on_result: Callable[[EpisodeResult], None] | None) -> None:
        now = time.monotonic()
        for name, handle in self.servers.items():
            if not handle.alive():
                self._drain_errors()
                raise WorkerError(f"the inference server {name} died ({handle.exit_reason()})")
            if self._silent(name, now):
                raise WorkerError(f"the inference server {name} did not answer for {self.cfg.watchdog_s:.0f} s")
        for name, handle in self.workers.items():
            if name in self.stopped:
                continue
            if not handle.alive():
                self._drain_errors()
                reason = f"the env worker died ({handle.exit_reason()})"
            elif self._silent(name, now):
                reason = f"the env worker was silent for {self.cfg.watchdog_s:.0f} s (a simulator hang)"
            else:
                continue
            for key in sorted(self.started[name]):
                job = self.assigned[name].pop(key)
                self._failed_attempt(job, reason, pending, attempts, results, on_result)
            self._requeue_all(pending)
            raise _Restart(f"{name}: {reason}")

    def _drain_errors(self) -> None:
        """A process that died after reporting why: raise what it reported (a bad checkpoint, not a crash)."""
        while True:
            try:
                message = self.events.get_nowait()
            except queue.Empty:
                return
            if message[0] == "error":
                raise from_record(message[2])

    def _requeue_all(self, pending: deque) -> None:
        """Everything not finished goes back to the front, in job order (a restart starts it again)."""
        left = [job for jobs in self.assigned.values() for job in jobs.values()]
        for jobs in self.assigned.values():
            jobs.clear()
        for job in sorted(left, key=lambda j: j.key, reverse=True):
            pending.appendleft(job)

    def _add_stats(self, part: dict) -> None:
        for key in ("env_steps", "sim_s", "render_s", "inference_s", "inference_calls", "observations"):
            setattr(self.stats, key, getattr(self.stats, key) + part.get(key, 0))

    # --- the end -------------------------------------------------------------------------------------------
    def kill(self) -> None:
        """A restart: nothing of this pool is worth waiting for."""
        for handle in [*self.workers.values(), *self.servers.values()]:
            handle.kill()

    def shutdown(self) -> None:
        """Stop workers, then servers, each collecting its stats; kill what does not stop."""
        for name, handle in self.workers.items():
            if handle.alive():
                self.inboxes[self.index[name]].put(("stop",))
        self._await_stats(self.workers, timeout_s=30.0)
        for _ in self.servers:
            self.requests.put(("stop",))
        self._await_stats(self.servers, timeout_s=30.0)
        for handle in [*self.workers.values(), *self.servers.values()]:
            handle.join(timeout=5.0)
            if handle.alive():
                handle.kill()

    def _await_stats(self, handles: dict[str, Handle], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = {name for name, handle in handles.items() if handle.alive() and name not in self.stopped}
        while waiting and time.monotonic() < deadline:
            try:
                message = self.events.get(timeout=0.5)
            except queue.Empty:
                waiting = {name for name in waiting if handles[name].alive()}
                continue
            if message[0] == "stats":
                self._add_stats(message[2])
                self.stopped.add(message[1])
                waiting.discard(message[1])
