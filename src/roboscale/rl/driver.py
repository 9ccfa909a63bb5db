"""The rollout driver: a thread that runs this rank's rollouts on its engine, one ``RolloutEngine.stream`` for the
whole training, and the schedule that says when each rollout may start and which weights it acts with
(``rl.rollouts`` describes the modes and schedules; ``RolloutSource`` hands what arrives to the trainer).

The stream's feed (``RolloutDriver._feed``, asked between the engine's events) releases rollout after rollout as the
``WeightSchedule`` permits: a released rollout's episode jobs go to the engine, its episodes overlap the previous
rollout's (no environment waits for a rollout's slowest episode), and each group (one initial state's episodes)
becomes micro-batches (``rl.batching``) the moment its last episode ends.

Weights reach the generators by one path, the engine's ``WeightChannel`` (``rollout.weights``), which the RL job
creates and gives to the engine; the trainer's ``WeightPublisher`` hands each rollout's weights to the schedule
(``WeightSchedule.publish``), which puts them on the channel:

- sync and bounded: at once, on the trainer's thread (publishing never waits for the generators); the engine takes
  the latest between its events and deals no job until every process that predicts has loaded it. A rollout is
  released once the channel's latest weights are the ones it may act with; its jobs are dealt with those (or,
  bounded, newer ones as they come).
- exact: the schedule keeps them by version, and the feed, before it releases rollout r, puts exactly
  ``acting_version(r)`` on the channel, once published, and only when no episode in flight acts with the version
  there (the engine predicts with one version at a time): consecutive rollouts overlap while they act with the
  same weights, and every chunk of rollout r acts with ``acting_version(r)``. The versions the next rollouts act
  with are kept in the checkpoint (``tensor_state``), so a resume acts as the uninterrupted run did.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from roboscale.configs.rl import RLOptions
from roboscale.rl.batching import group_micro_batches
from roboscale.rollout.engine import Cancelled
from roboscale.rollout.weights import WeightChannel


# --- which episodes a rollout runs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """The episodes of one initial state in one step."""

    index: int
    task: str
    seed: int
    scene: int
    """The initial state's number among the run's attempts at ``task`` (what ``episode_seed`` hashes)."""
    instruction: str = ""


def step_groups(options: RLOptions, tasks: list[str], step: int) -> list[Group]:
    from roboscale.sim.env import episode_seed

    groups = []
    for task in tasks:
        for s in range(options.states_per_task):
            scene = step * options.states_per_task + s
            groups.append(Group(len(groups), task, episode_seed(options.seed, task, scene), scene))
    return groups


def noise_seed(options: RLOptions, step: int, group: Group, member: int) -> int:
    """Distinct per (step, group, member): the episodes of a group differ only by their noise."""
    return int(np.random.SeedSequence([options.seed, step, group.index, member]).generate_state(1, np.uint64)[0] >> 1)


def episode_jobs(options: RLOptions, groups: list[Group], step: int, first_episode: int = 0) -> list[Any]:
    """The episodes of ``groups``: group g's member m is episode ``first_episode + g * group_size + m`` (a run's
    rollouts number theirs apart: ``first_episode`` = rollout x its episodes)."""
    from roboscale.rollout.episode import EpisodeJob

    return [EpisodeJob(group.task, first_episode + group.index * options.group_size + member, group.seed,
                       group.instruction, noise_seed=noise_seed(options, step, group, member), record_trajectory=True,
                       scene=group.scene)
            for group in groups for member in range(options.group_size)]


# --- which weights it acts with ---------------------------------------------------------------------------------
class WeightSchedule:
    """When rollout r may start and which weights it acts with (``--rl.mode``, ``--rl.schedule``; see the module
    docstring): the trainer's weights in (``publish``), the engine's ``WeightChannel`` out. ``rollouts``: how many
    the run trains on."""

    def __init__(self, options: RLOptions, rollouts: int, channel: WeightChannel):
        self.options, self.rollouts, self.channel = options, rollouts, channel
        self._lock = threading.Lock()
        # the exact schedule's: published weights by version, kept while a rollout not yet trained on acts with them
        self._published: dict[int, Mapping[str, torch.Tensor]] = {}

    @property
    def exact(self) -> bool:
        """Rollout k acts with exactly ``acting_version(k)`` (``--rl.schedule=exact``; sync is exact by nature)."""
        return self.options.mode == "async" and self.options.schedule == "exact"

    def acting_version(self, rollout: int) -> int:
        """The exact schedule's: the weights (a trainer step) rollout ``rollout`` acts with, those trained on
        max(0, rollout - max_staleness) rollouts."""
        return max(0, rollout - self.options.max_staleness) * self.options.epochs

    def acting_versions(self, rollout: int) -> set[int]:
        """The exact schedule's: the weights rollout ``rollout`` and those that may be in flight beside it (up to
        max_staleness ahead, within the run) act with."""
        last = min(rollout + self.options.max_staleness + 1, self.rollouts)
        return {self.acting_version(r) for r in range(rollout, max(last, rollout + 1))}

    # --- the trainer's thread -------------------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights for the rollouts that start from now on (``version``: the trainer's step, which is also the
        number of batches it has taken); returns at once. Sync and bounded: on the channel now; exact: kept for
        the feed to put there when their rollouts come."""
        if not self.exact:
            self.channel.publish(state, version)
            return
        with self._lock:
            self._published[version] = state
            oldest = self.acting_version(version // self.options.epochs)  # no rollout from here on acts older
            for old in [v for v in self._published if v < oldest]:
                del self._published[old]

    # --- the driver's thread --------------------------------------------------------------------------------
    def hand_over(self, rollout: int, running: bool) -> None:
        """Exact, before ``rollout`` is released: the weights it acts with onto the channel, once published, unless
        the channel holds them already or an episode in flight (``running``: a rollout not yet whole) acts with
        the ones it holds. Never newer than the rollout's. (Sync and bounded: the trainer put them there.)"""
        if not self.exact or rollout >= self.rollouts:
            return
        held, wanted = self.channel.version, self.acting_version(rollout)
        with self._lock:
            state = self._published.get(wanted)
        if wanted == held or state is None or (held is not None and running):
            return
        self.channel.publish(state, wanted)

    def permits(self, rollout: int, requested: int) -> int | None:
        """The version on the channel if ``rollout`` may start with it, else None: sync, once the trainer asks for
        it (``requested``: the rollouts it has asked for); exact, once the channel holds exactly the weights it
        acts with; bounded, once the channel's have trained on at least ``rollout - max_staleness`` rollouts (0:
        the weights a sync run acts with). None before any weights are published."""
        version = self.channel.version
        if version is None:
            return None
        if self.options.mode == "sync":
            permitted = requested > rollout
        elif self.exact:
            permitted = version == self.acting_version(rollout)
        else:
            permitted = version // self.options.epochs >= rollout - self.options.max_staleness
        return version if permitted else None

    # --- checkpoints ----------------------------------------------------------------------------------------
    def tensor_state(self, step: int) -> dict[str, torch.Tensor]:
        """The exact schedule's: the weights older than the trainer's (at ``step``) that the rollouts not yet
        trained on act with, as ``<version>/<name>``."""
        if not self.exact:
            return {}
        needed = self.acting_versions(step // self.options.epochs)
        with self._lock:
            kept = {v: self._published[v] for v in sorted(needed) if v < step and v in self._published}
        return {f"{version}/{name}": value for version, state in kept.items() for name, value in state.items()}

    def load_tensor_state(self, tensors: dict[str, torch.Tensor], step: int) -> None:
        published: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            version, _, name = key.partition("/")
            published.setdefault(int(version), {})[name] = value
        missing = sorted(self.acting_versions(step // self.options.epochs) - set(published) - {step})
        if self.exact and missing:
            raise ValueError(f"the checkpoint lacks the weights of steps {missing}, which the rollouts after step "
                             f"{step} act with under --rl.schedule=exact (saved with --rl.schedule=bounded?)")
        with self._lock:
            self._published.update(published)


# --- the driver -------------------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """A released rollout while its groups' episodes end (the driver thread's), and at its end what it did."""

    groups: dict[int, list[Any]]
    version: int
    """The weights version on the channel when it was released (later chunks may act with newer ones)."""
    started: float
    held_s: float
    """How long the simulators had no rollout to run before it was released."""
    episodes: int = 0
    failed: int = 0
    successes: int = 0
    env_steps: int = 0
    left: int = -1
    ended: float = 0.0

    def __post_init__(self) -> None:
        self.left = len(self.groups)


@dataclass
class Arrival:
    rollout: int
    batches: list[dict[str, Any]] | None = None
    """One group's micro-batches (None: the rollout's end, ``done`` says what it did)."""
    group: int = -1
    error: BaseException | None = None
    """What ended the driver (then ``rollout`` is -1)."""
    done: Rollout | None = None


class RolloutDriver:
    """The thread that runs this rank's rollouts on ``engine`` (a started ``RolloutEngine`` whose channel
    ``schedule`` feeds, with the stochastic sampler): ``start(first)``, then ``request`` rollouts (sync releases
    them only then); ``arrivals`` gets each group's micro-batches as it finishes and each rollout's end, or the
    error that ended the driver. ``collate``: ``rl.batching``'s micro-batch options. The rollouts are the groups
    of ``step_groups`` dealt to ranks by index (group g to rank g mod ``world_size``)."""

    def __init__(self, options: RLOptions, tasks: list[str], engine: Any, schedule: WeightSchedule, *,
                 rank: int = 0, world_size: int = 1, collate: dict[str, Any], cores: set[int] | None = None):
        self.options, self.tasks, self.engine, self.schedule = options, tasks, engine, schedule
        self.rank, self.world_size, self.collate = rank, world_size, collate
        self.cores = cores  # --rl.placement=disaggregated on the CPU: pools it restarts stay there
        self.arrivals: queue.Queue[Arrival] = queue.Queue()
        self.wait_s = 0.0
        """Time the simulators had no rollout to run: none running, the next held back for its turn (sync) or for
        fresh enough weights (async)."""
        # shared with the trainer's thread, under _lock
        self._lock = threading.Lock()
        self._requested = 0  # rollouts the trainer has asked for
        self._started: dict[int, int] = {}  # rollout -> its episodes on this rank, while in flight
        self._closed = False
        # the driver thread's
        self._running: dict[int, Rollout] = {}
        self._released = 0  # the next rollout to release
        self._idle_since: float | None = None  # no rollout running, none released
        self._thread: threading.Thread | None = None

    # --- the trainer's side ---------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, first: int) -> None:
        """Run rollouts from ``first`` on (the run trains on ``schedule.rollouts``: none is started beyond)."""
        self._thread = threading.Thread(target=self._drive, args=(first,), name="rollout-driver", daemon=True)
        self._thread.start()

    def request(self, rollouts: int) -> None:
        """The trainer has asked for ``rollouts`` rollouts (the first ``rollouts``, counted from the run's start)."""
        with self._lock:
            self._requested = rollouts

    def finished(self, rollout: int) -> None:
        """The trainer has taken ``rollout`` whole: it is no longer in flight."""
        with self._lock:
            self._started.pop(rollout, None)

    def in_flight(self, since: int) -> int:
        """Episodes on this rank of the rollouts from ``since`` on that were released and not taken whole."""
        with self._lock:
            return sum(n for r, n in self._started.items() if r >= since)

    def close(self) -> None:
        """Stop the thread (a rollout in flight is abandoned: its processes are killed) and the engine."""
        with self._lock:
            self._closed = True
        try:
            if self._thread is not None:
                self._thread.join(timeout=60.0)
        finally:
            self.engine.close()

    # --- the driver thread ----------------------------------------------------------------------------------
    def _drive(self, first: int) -> None:
        """One engine stream for the whole training; its feed releases the rollouts (``_feed``)."""
        try:
            if self.cores:
                os.sched_setaffinity(0, self.cores)
            self._released, self._idle_since = first, time.perf_counter()
            self.engine.stream(self._feed, self._on_result, should_stop=lambda: self._closed)
        except Cancelled:  # closed while rollouts ran (the run ended or failed): they are abandoned
            return
        except BaseException as exc:  # the trainer raises it at its next arrival
            self.arrivals.put(Arrival(-1, error=exc))

    def _feed(self) -> list[Any] | None:
        """Between the engine's events: the next rollout's jobs once the schedule permits it (else []; exact: its
        weights are put on the channel first, when they may be), None once the run's last was released. The
        engine takes the channel's weights after this, before it deals the jobs."""
        rollout = self._released
        if rollout >= self.schedule.rollouts:
            return None
        self.schedule.hand_over(rollout, running=bool(self._running))
        now = time.perf_counter()
        with self._lock:
            requested = self._requested
        version = self.schedule.permits(rollout, requested)
        if version is None:
            if self._idle_since is None and not self._running:
                self._idle_since = now  # the simulators have nothing to do until the trainer lets them
            return []
        held = 0.0 if self._idle_since is None else now - self._idle_since
        self.wait_s += held
        self._idle_since = None
        self._released += 1
        return self._release(rollout, version, held)

    def _release(self, rollout: int, version: int, held_s: float) -> list[Any]:
        """Rollout ``rollout``'s episode jobs on this rank, and what will follow its groups."""
        options = self.options
        groups = [g for g in step_groups(options, self.tasks, rollout) if g.index % self.world_size == self.rank]
        jobs = episode_jobs(options, groups, rollout, first_episode=rollout * self._episodes_per_rollout())
        with self._lock:
            self._started[rollout] = len(jobs)
        self._running[rollout] = Rollout({g.index: [] for g in groups}, version, time.time(), held_s)
        return jobs

    def _on_result(self, result: Any) -> None:
        """An episode ended: its group's micro-batches go to the trainer once the group is whole, the rollout's
        end once all its groups are."""
        options = self.options
        rollout = result.episode // self._episodes_per_rollout()
        running = self._running[rollout]
        index = (result.episode - rollout * self._episodes_per_rollout()) // options.group_size
        group = running.groups[index]
        group.append(result)
        usable = result.trajectory is not None and bool(result.trajectory.chunks)
        running.episodes += usable
        running.failed += not usable
        running.successes += bool(usable and result.success)
        running.env_steps += result.steps
        if len(group) < options.group_size:
            return
        group.sort(key=lambda r: r.episode)
        running.left -= 1
        self.arrivals.put(Arrival(rollout, group_micro_batches(options, group, version=rollout * options.epochs,
                                                               **self.collate), group=index))
        running.groups[index] = []  # the trajectories are the trainer's now
        if running.left:
            return
        del self._running[rollout]
        running.ended = time.time()
        self.arrivals.put(Arrival(rollout, None, done=running))

    def _episodes_per_rollout(self) -> int:
        """Episodes of a rollout on all ranks: rollout r's are numbered from r x this."""
        return len(self.tasks) * self.options.states_per_task * self.options.group_size
