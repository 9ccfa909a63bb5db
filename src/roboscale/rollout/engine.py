"""The rollout engine: runs episode jobs on env workers and inference servers, retries what crashed, and keeps
going until every episode has a result.

Lifetime: ``RolloutEngine(cfg, setup).run(jobs)`` starts a pool of processes for that call and stops it after
(``roboscale eval``). Started (``start()`` ... ``close()``, or ``with RolloutEngine(...) as engine:``), the engine
keeps its pool across calls, so the servers load the policy once. Between calls the processes wait idle; at the
end of each call each reports what it did since the last (``RolloutStats``). Two calls:

- ``run(jobs)``: every job's result, in job order, and the stats.
- ``stream(jobs, on_result)``: a run that goes on (RL's rollouts): ``jobs()`` is asked between events for more
  jobs (a list, maybe empty) or None once no more will come; each result goes to ``on_result`` as it comes, and
  the stats are returned once the last job has its result.

Weights: given a ``WeightChannel`` (``rollout.weights``: ``RolloutEngine(cfg, setup, weights=channel)``), the engine
predicts with the channel's latest weights (none published: the checkpoint's, version 0). A run takes the latest
when it starts (every episode of it acts with them); a stream takes newer ones between its events too, and the
jobs it has not dealt yet wait until every process that predicts has loaded them (the episodes in flight go on
with them: each chunk records the version that predicted it). A pool started, or restarted after a crash, loads
the weights the engine holds before it gets a job. Once every process that predicts has loaded a version, the
engine acknowledges it on the channel; weights the policy refuses end the call with its error (a
``CheckpointError`` naming the tensor) and leave the last acknowledged ones published.

Scheduling: each worker holds at most ``2 x envs_per_worker`` jobs (its environments' plus one queued each, so an
environment that finishes starts the next episode at once); a result frees a place and the next job goes there,
one job to each worker in turn. Jobs are dealt in turns over their tasks (the first job of each task, then the
second of each...; each task's in the order given), and a worker's free environment takes a job of its own task
when it holds one: each environment then keeps to few tasks, where dealt in the order given (usually task after
task) every environment would run every task and be rebuilt for each (a MetaWorld environment costs ~0.8 s of CPU
to build: in a 40-episode, 4-task evaluation on 8 environments that was a third of all the CPU time). The results
are the same whatever the order, the number of workers or environments: what an episode does depends only on its
job (seed, task, instruction) and the policy (``rollout.noise``); ``run`` returns them in job order.

Faults: a worker that dies, raises in its simulator, or is silent for ``watchdog_s`` (a simulator hang: workers
report ``alive`` while they wait for a server too) costs the episodes it had started one attempt (all of them: a
process of several environments does not say which one crashed it); each is retried
up to ``max_retries`` times and then reported as a failed episode with the reason. A dead or hung worker is
killed and the whole pool restarted: the channels it shared with the others may be left locked by a process
killed mid-write, and a restart is cheap next to a hang. Episodes other workers had in progress start again
(their outcome is the same). An inference server that dies or hangs is replaced the same way (the new pool loads
the engine's weights; no episode is charged an attempt, and after ``max_retries`` lost servers in one run
the run fails). A process that reports it cannot work (a bad checkpoint or env adapter, a failed prediction) ends
the run with that error.
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
from roboscale.errors import CheckpointError, WorkerError, from_record
from roboscale.rollout import messages
from roboscale.rollout.batcher import BatcherStats
from roboscale.rollout.episode import EpisodeJob, EpisodeResult
from roboscale.rollout.launch import Channel, Handle, Launcher, launcher_for
from roboscale.rollout.server import ServerSettings, run_server
from roboscale.rollout.weights import Published, WeightChannel
from roboscale.rollout.worker import WorkerSettings, run_env_worker
from roboscale.sim.env import EnvRequest

log = logging.getLogger(__name__)

STARTUP_S = 300.0


@dataclass
class EnvSetup:
    """What every worker builds its environments with, and what the policy needs from them."""

    env: str
    checkpoint: str
    n_action_steps: int
    request: EnvRequest = field(default_factory=EnvRequest)
    """How each environment is built (``EnvSpec.make(task, request)``)."""
    video_camera: str = ""
    video_dir: str = ""
    backend: str = "torch"
    """What runs the policy in the processes that predict (``RunnerSettings.backend``): torch, or onnx
    (``checkpoint`` is then an exported directory)."""


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
    envs_made: int = 0
    """Environments the env workers built (one per slot and task, unless a spare of that task was kept)."""
    env_make_s: float = 0.0
    """Wall time env workers spent building environments (a new task on a slot: ~0.8 s for MetaWorld)."""
    worker_cpu_s: float = 0.0
    """CPU time of the env worker processes (every thread: simulation, rendering, messages)."""
    worker_wait_s: float = 0.0
    """Wall time env workers had nothing to step and waited for actions."""
    server_cpu_s: float = 0.0
    """CPU time of the inference servers (every thread: the policy, reading requests, sending answers)."""
    batching: BatcherStats = field(default_factory=BatcherStats)
    """The inference servers' dynamic batching, their reports added up (``rollout.batcher``): the sizes of their
    policy calls, why each batch went (full, all_waiting, timeout), the time they had no request (``idle_s``)
    and held requests back to fill a batch (``fill_s``)."""
    restarts: int = 0
    retries: list[Retry] = field(default_factory=list)
    inference: str = ""
    """Who predicted: ``server`` or ``worker`` (``--rollout.inference=auto`` resolved)."""

    @property
    def mean_batch_size(self) -> float:
        return self.observations / self.inference_calls if self.inference_calls else 0.0


def uses_servers(cfg: RolloutConfig, device: str) -> bool:
    """Whether inference servers predict (``--rollout.inference``, ``auto`` resolved for the device the policy runs
    on: servers for a GPU, the workers themselves on the CPU); never with a remote server (``--rollout.server``),
    which the workers ask themselves."""
    if cfg.server:
        return False
    if cfg.inference == "auto":
        return not device.startswith("cpu")
    return cfg.inference == "server"


def task_turns(jobs: list[EpisodeJob]) -> list[EpisodeJob]:
    """The jobs in turns over their tasks (in the order each task first appears), each task's in the given order."""
    by_task: dict[str, deque[EpisodeJob]] = {}
    for job in jobs:
        by_task.setdefault(job.task, deque()).append(job)
    turns = []
    while by_task:
        for task in list(by_task):
            turns.append(by_task[task].popleft())
            if not by_task[task]:
                del by_task[task]
    return turns


class Cancelled(Exception):
    """``should_stop`` said so: the call was abandoned (its pool killed; ``start`` again to reuse the engine)."""


class _Restart(Exception):
    """The pool must be restarted (a worker or server died or hung)."""

    def __init__(self, message: str, server: bool = False):
        super().__init__(message)
        self.server = server
        """A server was lost: no episode is to blame (each starts again, no attempt charged)."""


class RolloutEngine:
    """See the module docstring: one-shot ``run``, or ``start`` / ``run`` or ``stream`` ... / ``close``."""

    def __init__(self, cfg: RolloutConfig, setup: EnvSetup, weights: WeightChannel | None = None):
        self.cfg = cfg
        self.setup = setup
        self.weights = weights if weights is not None else WeightChannel()
        """Where the engine's weights come from (see the module docstring): nothing published, the checkpoint's."""
        self._launcher: Launcher | None = None
        self._pool: _Pool | None = None
        self._generation = 0
        self._held: Published | None = None  # the weights taken from the channel (None: the checkpoint's, version 0)
        self._busy = ""  # the call in progress: run and stream do not nest

    @property
    def version(self) -> int:
        """The version of the weights the engine predicts with, or does once its processes have loaded them (0:
        the checkpoint's)."""
        return self._held.version if self._held is not None else 0

    # --- lifetime -------------------------------------------------------------------------------------------
    def start(self) -> RolloutEngine:
        """Start the processes now (the servers load the policy, and the channel's latest weights); ``run`` and
        ``stream`` reuse them until ``close``."""
        self._open()
        if self._pool is None:
            self._held = self.weights.latest()
            self._pool = self._new_pool()
        return self

    def close(self) -> None:
        """Stop the processes (kill those that do not stop) and release the channels; ``start`` may follow."""
        try:
            if self._pool is not None:
                self._pool.shutdown()
        finally:
            self._pool = None
            if self._launcher is not None:
                self._launcher.close()
                self._launcher = None

    def __enter__(self) -> RolloutEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- work -----------------------------------------------------------------------------------------------
    def run(self, jobs: list[EpisodeJob], on_result: Callable[[EpisodeResult], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> tuple[list[EpisodeResult], RolloutStats]:
        """Every job's result (in job order) and where the time went, by the channel's latest weights when the run
        starts. Not started: a pool for this call only. ``on_result``: each result as it comes, too;
        ``should_stop``: asked about once a second and after each event; True abandons the run (``Cancelled``)."""
        return self._call("run", jobs, None, on_result, should_stop)

    def stream(self, jobs: Callable[[], list[EpisodeJob] | None], on_result: Callable[[EpisodeResult], None],
               should_stop: Callable[[], bool] | None = None) -> RolloutStats:
        """Run the jobs ``jobs()`` hands out (asked between events: a list, maybe empty, or None once no more will
        come; a job's key once in a stream) until it said None and every job has a result; each result goes to
        ``on_result`` as it comes (none is kept). Newer weights on the channel are taken between events, after
        ``jobs()``: a job handed out is dealt only once every process that predicts has loaded the channel's latest
        weights as of then. ``should_stop`` as for ``run``. Returns where the time went."""
        return self._call("stream", [], jobs, on_result, should_stop)[1]

    # --- inside ---------------------------------------------------------------------------------------------
    def _call(self, call: str, jobs: list[EpisodeJob], feed: Callable[[], list[EpisodeJob] | None] | None,
              on_result: Callable[[EpisodeResult], None] | None, should_stop: Callable[[], bool] | None
              ) -> tuple[list[EpisodeResult], RolloutStats]:
        if self._busy:
            raise RuntimeError(f"RolloutEngine.{call} called during {self._busy} (call it between runs)")
        one_shot = self._launcher is None
        self._open()
        self._busy = call
        try:
            return self._run(jobs, feed, on_result, should_stop or (lambda: False))
        except BaseException as exc:  # an error, or Ctrl-C: nothing of this pool is worth waiting for
            self._refused(exc, self._pool)
            self._discard_pool()
            raise
        finally:
            self._busy = ""
            if one_shot:
                self.close()

    def _open(self) -> None:
        if self._launcher is None:
            self._launcher = launcher_for(self.cfg.ray_address, self.cfg.ray_resources)

    def _new_pool(self) -> _Pool:
        """A pool with the weights the engine holds, loaded by every process that predicts."""
        pool = _Pool(self.cfg, self.setup, self._launcher, self._generation, acknowledge=self.weights.acknowledge)
        self._generation += 1  # replies of an earlier pool are told apart and dropped
        if self._held is not None:
            try:
                pool.load_weights(self._held)
            except BaseException as exc:
                self._refused(exc, pool)
                pool.kill()
                raise
        return pool

    def _refused(self, exc: BaseException, pool: _Pool | None) -> None:
        """A process's CheckpointError while ``pool`` loads weights: the policy refused them. The channel's last
        acknowledged weights are published again, and the engine's."""
        if isinstance(exc, CheckpointError) and pool is not None and pool.awaiting and pool.weights is not None:
            self.weights.refuse(pool.weights, exc)
            self._held = self.weights.latest()

    def _send_weights(self) -> None:
        """The weights the engine holds, to the processes of its pool that lack them (without waiting: no job is
        dealt until each has loaded them)."""
        if self._held is not None and self._pool.weights is not self._held:
            self._pool.send_weights(self._held)

    def _discard_pool(self) -> None:
        if self._pool is not None:
            self._pool.kill()
            self._pool = None

    def _run(self, jobs: list[EpisodeJob], feed: Callable[[], list[EpisodeJob] | None] | None,
             on_result: Callable[[EpisodeResult], None] | None, should_stop: Callable[[], bool]
             ) -> tuple[list[EpisodeResult], RolloutStats]:
        stats = RolloutStats()
        results: dict[tuple[str, int], EpisodeResult] | None = {} if feed is None else None
        attempts: dict[tuple[str, int], int] = {job.key: 0 for job in jobs}
        pending: deque[EpisodeJob] = deque(task_turns(jobs))
        start = time.perf_counter()
        lost_servers = 0
        feeding = feed is not None

        def between() -> bool:
            """A stream's, between events: the feed's new jobs, then the channel's newer weights (sent before any
            of those jobs is dealt); whether more jobs may come."""
            nonlocal feeding
            if feeding:
                feeding = self._take_jobs(feed, pending, attempts)
            self._held = self.weights.latest()
            self._send_weights()
            return feeding

        self._held = self.weights.latest()
        while pending or feeding:
            try:
                if self._pool is None:
                    self._pool = self._new_pool()
                self._pool.resume()
                self._send_weights()
                self._pool.drive(pending, attempts, results, on_result, stats, should_stop,
                                 None if feed is None else between)
            except _Restart as restart:
                self._discard_pool()
                stats.restarts += 1
                log.warning("restarting the rollout workers: %s", restart)
                lost_servers += restart.server
                if lost_servers > self.cfg.max_retries:
                    raise WorkerError(f"the inference servers keep failing ({restart}); gave up after {lost_servers} "
                                      "restarts") from None
                if stats.restarts > self.cfg.max_retries * max(1, len(jobs)) + self.cfg.max_retries:
                    raise WorkerError(f"rollout workers keep failing ({restart}); gave up after "
                                      f"{stats.restarts} restarts") from None
        if self._pool is not None:
            self._pool.report(stats)
            stats.inference = "server" if self._pool.servers else "worker"
        stats.wall_s = time.perf_counter() - start
        return ([] if results is None else [results[job.key] for job in jobs]), stats

    @staticmethod
    def _take_jobs(feed: Callable[[], list[EpisodeJob] | None], pending: deque[EpisodeJob], attempts: dict) -> bool:
        """The feed's new jobs, queued; whether more may come."""
        jobs = feed()
        if jobs is None:
            return False
        for job in jobs:
            if job.key in attempts:
                raise ValueError(f"the feed gave the job {job.key} twice (episode numbers must be unique in a run)")
            attempts[job.key] = 0
        pending.extend(task_turns(jobs))
        return True


class _Pool:
    """One generation of servers and workers."""

    def __init__(self, cfg: RolloutConfig, setup: EnvSetup, launcher: Launcher, generation: int,
                 acknowledge: Callable[[Published], None] | None = None):
        from roboscale.rollout.inference import RunnerSettings, inference_threads
        from roboscale.rollout.remote import RemoteSettings
        from roboscale.transport.websocket import read_key

        self.cfg, self.setup, self.generation = cfg, setup, generation
        self.events = launcher.channel()
        self.requests = launcher.channel()
        self.replies = [launcher.channel() for _ in range(cfg.workers)]
        self.inboxes = [launcher.channel() for _ in range(cfg.workers)]
        device = launcher.device(cfg.runner.device)
        serving = uses_servers(cfg, device)
        gpus = 1.0 if device.startswith("cuda") else 0.0  # what each process that predicts reserves (Ray)
        # a server shares the cores with the env workers (which render on the CPU): more threads than its share
        # only make them wait for each other
        threads = inference_threads(cfg.runner.threads, cfg.servers + cfg.workers if serving else cfg.workers)
        runner = RunnerSettings(setup.checkpoint, device, threads, cfg.sampler, backend=setup.backend)
        predictor = (RemoteSettings(cfg.server, read_key(cfg.server_api_key_file, "--rollout.server_api_key_file"))
                     if cfg.server else runner)
        self.servers: dict[str, Handle] = {}
        self.controls: dict[str, Channel] = {}
        """Each process's own channel from the engine: a server's control channel, a worker's inbox."""
        if serving:
            for i in range(cfg.servers):
                name = f"server{i}"
                self.controls[name] = launcher.channel()
                settings = ServerSettings(name, runner, cfg.runner.max_batch_size, cfg.runner.batch_timeout_ms)
                self.servers[name] = launcher.start(
                    run_server, (settings, self.requests, self.controls[name], self.replies, self.events),
                    name=f"rollout-{name}", cpus=1.0, gpus=gpus)
        self.workers: dict[str, Handle] = {}
        self.index: dict[str, int] = {}
        for i in range(cfg.workers):
            name = f"worker{i}"
            settings = WorkerSettings(
                name, i, generation, setup.env, setup.request, cfg.envs_per_worker, cfg.sub_batches,
                setup.n_action_steps, setup.video_camera, setup.video_dir, spare_envs=cfg.spare_envs,
                announce_groups=serving and cfg.servers == 1,
                render_every_step=cfg.render == "every_step", local=None if serving else predictor,
                max_batch_size=cfg.runner.max_batch_size)
            self.workers[name] = launcher.start(
                run_env_worker, (settings, self.inboxes[i], self.requests, self.replies[i], self.events),
                name=f"rollout-{name}", cpus=cfg.worker_cpus, gpus=0.0 if serving else gpus / cfg.workers)
            self.index[name] = i
            self.controls[name] = self.inboxes[i]
        self.predicting = list(self.servers) if serving else list(self.workers)
        self.started_at = time.monotonic()
        self.last_seen: dict[str, float] = {}
        self.assigned: dict[str, dict[tuple[str, int], EpisodeJob]] = {name: {} for name in self.workers}
        self.started: dict[str, set[tuple[str, int]]] = {name: set() for name in self.workers}
        self.weights: Published | None = None
        """The weights sent to the processes that predict (None: the checkpoint's)."""
        self.awaiting: set[str] = set()
        """Processes that have not acknowledged ``weights`` yet (no job is dealt meanwhile)."""
        self.acknowledge = acknowledge or (lambda published: None)
        """Called once every process that predicts has loaded ``weights``."""

    @property
    def handles(self) -> dict[str, Handle]:
        return {**self.workers, **self.servers}

    # --- events ---------------------------------------------------------------------------------------------
    def _next_event(self, timeout: float | None) -> Any:
        """The next event (None: none came; ``timeout=None``: only one already there), its sender marked as
        seen; a process's report that it cannot work is raised."""
        try:
            message = self.events.get_nowait() if timeout is None else self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        self.last_seen[message.name] = time.monotonic()
        if isinstance(message, messages.Failed):
            raise from_record(message.record)
        return message

    def resume(self) -> None:
        """Before a run: read what the processes said while the pool was idle (heartbeats; a failure raises), so
        that they are not taken for silent."""
        while self._next_event(None) is not None:
            pass

    # --- the loop ------------------------------------------------------------------------------------------
    def drive(self, pending: deque[EpisodeJob], attempts: dict, results: dict | None,
              on_result: Callable[[EpisodeResult], None] | None, stats: RolloutStats,
              should_stop: Callable[[], bool], between: Callable[[], bool] | None = None) -> None:
        """Until every job has a result (and, streaming, no more will come: ``between`` runs between events,
        queues new jobs, may send new weights, and says whether more jobs may come); ``results``: None keeps none
        (they go to ``on_result``)."""
        while True:
            if should_stop():
                raise Cancelled
            more = between() if between is not None else False
            if not (pending or any(self.assigned.values()) or more):
                return
            if not self.awaiting:
                self._deal(pending, attempts)
            match self._next_event(timeout=1.0 if between is None else 0.05):
                case messages.WeightsLoaded(name, version) if self.weights is not None and \
                        version == self.weights.version:
                    self._loaded(name)
                case messages.Started(name, key, _):
                    self.started[name].add(tuple(key))
                case messages.Result(name, record, trajectory):
                    result = EpisodeResult.from_dict(record)
                    result.trajectory = trajectory
                    key = (result.task, result.episode)
                    self.assigned[name].pop(key, None)
                    self.started[name].discard(key)
                    attempts[key] += 1
                    if results is not None:
                        results[key] = result
                    if on_result is not None:
                        on_result(result)
                case messages.EpisodeFailed(name, key, reason):
                    key = tuple(key)
                    job = self.assigned[name].pop(key)
                    self.started[name].discard(key)
                    self._failed_attempt(job, reason, pending, attempts, results, on_result, stats)
            self._check_liveness(pending, attempts, results, on_result, stats)

    def _deal(self, pending: deque[EpisodeJob], attempts: dict) -> None:
        """Pending jobs to workers with credit, one each in turn: a run of fewer jobs than all the credits still
        spreads them over every worker's environments (worker by worker, the first would take them all and
        leave the others idle)."""
        credit = 2 * self.cfg.envs_per_worker
        while pending:
            open_ = [name for name, jobs in self.assigned.items() if len(jobs) < credit]
            if not open_:
                return
            for name in open_[:len(pending)]:
                job = pending.popleft()
                self.assigned[name][job.key] = job
                self.inboxes[self.index[name]].put(messages.Job(job, attempts[job.key] + 1))

    def _failed_attempt(self, job: EpisodeJob, reason: str, pending: deque, attempts: dict, results: dict,
                        on_result: Callable[[EpisodeResult], None] | None, stats: RolloutStats) -> None:
        attempts[job.key] += 1
        stats.retries.append(Retry(job.task, job.episode, attempts[job.key], reason))
        if attempts[job.key] <= self.cfg.max_retries:
            log.warning("%s episode %d: %s; retrying (attempt %d of %d)", job.task, job.episode, reason,
                        attempts[job.key] + 1, self.cfg.max_retries + 1)
            pending.appendleft(job)
            return
        log.warning("%s episode %d failed %d times (%s); counted as a failure", job.task, job.episode,
                    attempts[job.key], reason)
        result = EpisodeResult(job.task, job.episode, job.seed, False, 0, 0.0, 0.0, attempts=attempts[job.key],
                               error=reason)
        if results is not None:
            results[job.key] = result
        if on_result is not None:
            on_result(result)

    def _silent(self, name: str, now: float) -> bool:
        """Silent for longer than the watchdog allows; before its first message a process may take
        ``STARTUP_S`` (imports, loading the policy, a Ray task waiting for resources)."""
        if name in self.last_seen:
            return now - self.last_seen[name] > self.cfg.watchdog_s
        return now - self.started_at > max(STARTUP_S, self.cfg.watchdog_s)

    def _lost(self) -> tuple[str, str] | None:
        """(name, why) of a process that died or hung (one that said why it cannot work: its error, raised)."""
        now = time.monotonic()
        for kind, handles in (("inference server", self.servers), ("env worker", self.workers)):
            for name, handle in handles.items():
                if not handle.alive():
                    self._drain_errors()
                    return name, f"the {kind} died ({handle.exit_reason()})"
                if self._silent(name, now):
                    hang = " (a simulator hang)" if name in self.workers else ""
                    return name, f"the {kind} was silent for {self.cfg.watchdog_s:.0f} s{hang}"
        return None

    def _check_liveness(self, pending: deque, attempts: dict, results: dict,
                        on_result: Callable[[EpisodeResult], None] | None, stats: RolloutStats) -> None:
        """A lost env worker costs the episodes it had started an attempt (its simulator may be to blame); a lost
        server, none (every episode starts again on the new pool's server, with the published weights)."""
        lost = self._lost()
        if lost is None:
            return
        name, reason = lost
        for key in sorted(self.started.get(name, ())):
            job = self.assigned[name].pop(key)
            self._failed_attempt(job, reason, pending, attempts, results, on_result, stats)
        self._requeue_all(pending)
        raise _Restart(f"{name}: {reason}", server=name in self.servers)

    def _drain_errors(self) -> None:
        """A process that died after reporting why: raise what it reported (a bad checkpoint, not a crash)."""
        while self._next_event(None) is not None:
            pass

    def _requeue_all(self, pending: deque) -> None:
        """Everything not finished goes back to the front, in job order (a restart starts it again)."""
        left = [job for jobs in self.assigned.values() for job in jobs.values()]
        for jobs in self.assigned.values():
            jobs.clear()
        for job in sorted(left, key=lambda j: j.key, reverse=True):
            pending.appendleft(job)

    # --- weights -------------------------------------------------------------------------------------------
    def send_weights(self, weights: Published) -> None:
        """Every process that predicts is sent ``weights``; ``drive`` deals no job until each has acknowledged
        them (so a job dealt from now on is predicted by them from its first chunk)."""
        message = messages.LoadWeights(weights.data(), weights.version)
        for name in self.predicting:
            self.controls[name].put(message)
        self.weights, self.awaiting = weights, set(self.predicting)

    def _loaded(self, name: str) -> None:
        if name in self.awaiting:
            self.awaiting.discard(name)
            if not self.awaiting:
                self.acknowledge(self.weights)

    def load_weights(self, weights: Published) -> None:
        """A new pool's: every process that predicts loads ``weights``; returns once each has said so (a process
        that dies meanwhile: ``_Restart``; one that refuses them: its error)."""
        self.send_weights(weights)
        while self.awaiting:
            match self._next_event(timeout=1.0):
                case messages.WeightsLoaded(name, version) if version == weights.version:
                    self._loaded(name)
            lost = self._lost()
            if lost is not None:
                raise _Restart(f"{lost[0]}: {lost[1]}", server=lost[0] in self.servers)

    # --- after a call --------------------------------------------------------------------------------------
    def report(self, stats: RolloutStats, timeout_s: float = 30.0) -> None:
        """Add what each process did since its last report to ``stats`` (one that does not answer: lost)."""
        waiting = {name for name, handle in self.handles.items() if handle.alive()}
        for name in waiting:
            self.controls[name].put(messages.Report())
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            match self._next_event(timeout=0.5):
                case messages.Stats(name, part):
                    for key, value in part.items():
                        if isinstance(value, BatcherStats):
                            stats.batching.add(value)
                        else:
                            setattr(stats, key, getattr(stats, key) + value)
                    waiting.discard(name)
                case None:
                    waiting = {name for name in waiting if self.handles[name].alive()}

    # --- the end -------------------------------------------------------------------------------------------
    def kill(self) -> None:
        """A restart: nothing of this pool is worth waiting for."""
        for handle in self.handles.values():
            handle.kill()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop every process; kill what has not exited by ``timeout_s``."""
        for name, handle in self.handles.items():
            if handle.alive():
                self.controls[name].put(messages.Stop())
        deadline = time.monotonic() + timeout_s
        while any(handle.alive() for handle in self.handles.values()) and time.monotonic() < deadline:
            try:  # read what they still send: a process whose channel's pipe is full cannot exit
                self.events.get(timeout=0.2)
            except queue.Empty:
                pass
        for handle in self.handles.values():
            handle.join(timeout=1.0)
            if handle.alive():
                handle.kill()
