"""The Trainer's data source in RL: the rollouts, run by a driver thread on this rank's rollout engine.

Three levels (RL-VLA3's): the simulators (env workers, stepping their environments' sub-batches), the generators
(inference with dynamic batching: servers, or the workers themselves on the CPU) and the trainer. The driver runs
rollout after rollout on the engine; each group of episodes (one initial state's) is turned into micro-batches
with advantages as soon as its last episode ends, and handed to the trainer. Weights move at rollout boundaries
only: the trainer publishes them after a rollout's last optimizer step (``WeightPublisher``), and the driver hands
the latest to the engine before it starts a rollout, whose chunks record the version that acted.

- ``--rl.mode=sync``: the driver starts a rollout when the trainer asks for it, and the trainer takes it whole,
  in group order: roll out everything, then train (the baseline).
- ``--rl.mode=async``: the driver starts rollout r while the trainer trains on earlier ones (simulators and
  generators keep working), and the trainer computes each group's gradients as it arrives
  (``Trainer.accumulate_stream``); its optimizer step still waits for the whole rollout, the global batch. Which
  weights rollout r acts with (``--rl.schedule``):
  - ``exact`` (default): exactly those trained on max(0, r - ``max_staleness``) rollouts (``acting_version``), every
    chunk of it. The driver hands the engine exactly those, once published, and only when no episode in flight acts
    with the ones it holds (the engine predicts with one version at a time), so consecutive rollouts overlap while
    they act with the same weights. A run is reproducible, and a resume acts as the uninterrupted run did: the
    checkpoint keeps the older weights the next rollouts act with (``tensor_state``).
  - ``bounded``: as soon as the published weights have trained on r - ``max_staleness`` rollouts, taking newer
    ones mid-rollout as they come (RL-VLA3's bound; timing decides which).
  At staleness 0 both act with the weights a sync run's do: the same losses step by step, the gain only from the
  overlap.

With ``--rl.epochs=E`` each rollout serves E optimizer steps (the same chunks each time; their recorded
log-probabilities are the acting weights', so the later epochs' ratios measure how far the updates went).

Which episodes a rollout runs depends on its number alone: for each task, ``states_per_task`` initial states
(``episode_seed(rl.seed, task, rollout * states_per_task + s)``) and ``group_size`` episodes from each, whose
noise comes from their own ``noise_seed``. Groups are dealt to ranks by index (group g to rank g mod ranks) and each
rank rolls out its own on its own engine, so a step's global batch, its advantages (a group never straddles
ranks) and its losses do not depend on the number of ranks or env workers. A checkpoint keeps the step; rollouts
in flight are not kept (a resume rolls them out again, counted as ``dropped_episodes``, and cuts ``rollouts.jsonl``
back to the rollouts before them).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roboscale.configs.rl import RLOptions
from roboscale.rl.advantages import episode_return
from roboscale.rollout.engine import Cancelled, Feed

log = logging.getLogger(__name__)


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


def chunk_batches(results: list[Any], advantages: Any, returns: np.ndarray, *, image_keys: list[str],
                  state_key: str, action_dim: int, max_chunks: int, value_targets: list[np.ndarray] | None = None,
                  version: int = 0, epochs: int = 1) -> list[dict[str, Any]]:
    """The chunks of ``results`` (episodes with trajectories) as training micro-batches of at most ``max_chunks``
    chunks, in episode order (see rl.objective for the fields). ``advantages[i]``: episode i's advantage (GRPO) or
    one per chunk (PPO, with ``value_targets``). ``version``: the trainer's weights when the rollout's first
    step trains on it; a chunk's staleness is how many rollouts' updates those are ahead of the ones that acted
    (``epochs`` optimizer steps each)."""
    rows = []
    for i, (result, ret) in enumerate(zip(results, returns, strict=True)):
        chunks = result.trajectory.chunks
        advantage = np.broadcast_to(np.asarray(advantages[i], np.float32), (len(chunks),))
        target = np.zeros(len(chunks), np.float32) if value_targets is None else value_targets[i]
        for c, chunk in enumerate(chunks):
            rows.append((chunk, float(advantage[c]), 1.0 / len(chunks), float(result.success), float(ret),
                         float(result.steps), float(target[c]), float((version - chunk.version) // epochs)))
    batches = [_collate(rows[i:i + max_chunks], image_keys, state_key, action_dim)
               for i in range(0, len(rows), max_chunks)]
    if value_targets is None:
        for batch in batches:
            del batch["value_target"]
    return batches


def _collate(rows: list[tuple], image_keys: list[str], state_key: str, action_dim: int) -> dict[str, Any]:
    chunks = [row[0] for row in rows]
    observation: dict[str, Any] = {state_key: torch.from_numpy(np.stack([c.state for c in chunks])),
                                   "task": [c.instruction for c in chunks]}
    for key in image_keys:
        name = key.removeprefix("observation.images.")
        images = np.stack([c.images[name] for c in chunks]).transpose(0, 3, 1, 2)
        observation[key] = torch.from_numpy(np.ascontiguousarray(images))
    chain = torch.from_numpy(np.stack([c.chain for c in chunks]))
    stochastic = torch.from_numpy(np.stack([c.stochastic for c in chunks]))
    data_dims = chunks[0].chunk.shape[-1]
    mask = torch.zeros(chain.shape[0], chain.shape[2], chain.shape[3])
    for i, c in enumerate(chunks):
        mask[i, :c.executed, :data_dims] = 1.0
    # the acting weights' log-probability of each chunk, as sampled: the importance ratio's denominator
    old_log_prob = (torch.from_numpy(np.stack([c.log_density for c in chunks])) * mask).flatten(1).sum(1)
    columns = list(zip(*[row[1:] for row in rows], strict=True))
    advantage, weight, success, ret, steps, target, staleness = (torch.tensor(col, dtype=torch.float32)
                                                                  for col in columns)
    return {"observation": observation, "chain": chain, "stochastic": stochastic, "mask": mask,
            "old_log_prob": old_log_prob, "advantage": advantage, "weight": weight,
            "success": success, "return": ret, "steps": steps, "value_target": target, "staleness": staleness,
            "action_dims": data_dims}


def group_micro_batches(options: RLOptions, results: list[Any], *, version: int, **collate: Any
                        ) -> list[dict[str, Any]]:
    """One group's episodes (all of them: their advantages compare them) as micro-batches with the advantages of
    ``options.algorithm`` (``roboscale.rl.algorithms``)."""
    usable = [r for r in results if r.trajectory is not None and r.trajectory.chunks]
    if not usable:
        return []
    returns = np.array([episode_return(r.trajectory, options.reward) for r in usable], dtype=np.float32)
    advantages, targets = options.algorithm.advantages(returns, [r.trajectory for r in usable], options.reward)
    return chunk_batches(usable, advantages, returns, value_targets=targets, version=version, epochs=options.epochs,
                         **collate)


@dataclass
class _Running:
    """A released rollout's groups while their episodes end (the driver thread's)."""

    groups: dict[int, list[Any]]
    version: int
    """The weights version handed to the engine when it was released (later chunks may act with newer ones)."""
    started: float
    held_s: float
    episodes: int = 0
    failed: int = 0
    successes: int = 0
    env_steps: int = 0
    left: int = -1

    def __post_init__(self) -> None:
        self.left = len(self.groups)


@dataclass
class _Arrival:
    rollout: int
    batches: list[dict[str, Any]] | None = None
    """One group's micro-batches (None: the rollout's end, with its counts)."""
    group: int = -1
    error: BaseException | None = None
    record: dict[str, Any] | None = None
    """At the rollout's end: what ``rollouts.jsonl`` says of it (see ``RolloutSource``)."""


class RolloutSource:
    """A ``DataSource`` of the Trainer (train.components): ``next()`` is one step's rolled-out chunks on this rank.
    ``engine``: a started ``RolloutEngine`` whose sampler is the stochastic one; ``rollouts``: how many the run
    trains on (the driver starts none beyond). ``before_first`` runs on the trainer's thread before the first
    rollout (the first weights are published); ``publish`` (``WeightPublisher``) hands the driver each rollout's
    weights."""

    def __init__(self, options: RLOptions, tasks: list[str], engine: Any, policy_config: Any, *, rollouts: int,
                 rank: int = 0, world_size: int = 1, max_chunks: int = 64,
                 before_first: Callable[[], None] | None = None, driver_cores: set[int] | None = None,
                 log_path: Path | None = None):
        self.options, self.tasks, self.engine, self.rollouts = options, tasks, engine, rollouts
        self.driver_cores = driver_cores  # --rl.placement=disaggregated on the CPU: pools it restarts stay there
        self.log_path = log_path
        self._trainer_wait = 0.0
        self.before_first = before_first
        self.collate = {"image_keys": list(policy_config.image_keys), "state_key": policy_config.state_key,
                        "action_dim": policy_config.action_dim, "max_chunks": max_chunks}
        self.rank, self.world_size = rank, world_size
        self.step = 0
        """Batches handed out (the trainer's optimizer steps); rollout r serves steps r * epochs ... + epochs - 1."""
        self._batches: list[dict[str, Any]] | None = None
        self.episodes = 0
        self.failed_episodes = 0
        self.dropped_episodes = 0
        """Episodes of rollouts in flight when a run stopped, that its resume rolled out again."""
        self.env_steps = 0
        self.rollout_s = 0.0
        self.driver_wait_s = 0.0
        """Time the simulators had no rollout to run: none running, the next held back for its turn (sync) or for
        fresh enough weights (async)."""
        # shared with the driver thread (which polls them from its engine run), under _lock
        self._lock = threading.Lock()
        self._weights: tuple[dict[str, torch.Tensor], int] | None = None  # the latest published, and its version
        # the exact schedule's: published weights by version, kept while a rollout not yet trained on acts with them
        self._published: dict[int, dict[str, torch.Tensor]] = {}
        self._requested = 0  # rollouts the trainer has asked for
        self._started: dict[int, int] = {}  # rollout -> its episodes on this rank, while in flight
        self._closed = False
        self._arrivals: queue.Queue[_Arrival] = queue.Queue()
        self._early: dict[int, list[_Arrival]] = {}  # the trainer's: groups of rollouts after the one it takes
        self._running: dict[int, _Running] = {}  # the driver's
        self._driver: threading.Thread | None = None

    # --- the trainer's side ---------------------------------------------------------------------------------
    @property
    def rolls_out_next(self) -> bool:
        """Whether the next ``next()`` starts a rollout's first epoch (the weights then published are the ones
        it is trained against) rather than training again on the last rollout (``--rl.epochs``)."""
        return self.step % self.options.epochs == 0

    @property
    def exact(self) -> bool:
        """Rollout k acts with exactly ``acting_version(k)`` (``--rl.schedule=exact``; sync is exact by nature)."""
        return self.options.mode == "async" and self.options.schedule == "exact"

    def acting_version(self, rollout: int) -> int:
        """The exact schedule's: the weights (a trainer step) rollout ``rollout`` acts with, those trained on
        max(0, rollout - max_staleness) rollouts."""
        return max(0, rollout - self.options.max_staleness) * self.options.epochs

    def _acting_versions(self, rollout: int) -> set[int]:
        """The exact schedule's: the weights rollout ``rollout`` and those that may be in flight beside it (up to
        max_staleness ahead, within the run) act with."""
        last = min(rollout + self.options.max_staleness + 1, self.rollouts)
        return {self.acting_version(r) for r in range(rollout, max(last, rollout + 1))}

    def publish(self, state: dict[str, torch.Tensor], version: int) -> None:
        """New weights for the rollouts that start from now on (``version``: the trainer's step)."""
        with self._lock:
            self._weights = (state, version)
            if self.exact:
                self._published[version] = state
                oldest = self.acting_version(self.step // self.options.epochs)  # no rollout from here on acts older
                for old in [v for v in self._published if v < oldest]:
                    del self._published[old]

    def __next__(self) -> Any:
        if not self.rolls_out_next and self._batches is not None:  # another epoch on the same rollout
            self.step += 1
            return list(self._batches)
        rollout = self.step // self.options.epochs
        if self._driver is None:
            if self.before_first is not None:
                self.before_first()
            self._driver = threading.Thread(target=self._drive, args=(rollout,), name="rollout-driver", daemon=True)
            self._driver.start()
        with self._lock:
            self._requested = rollout + 1
        self.step += 1
        self._batches = []
        if self.options.mode == "sync":  # the whole rollout, then the step: in group order
            arrived = sorted(self._arrivals_of(rollout), key=lambda a: a.group)
            self._batches = [b for a in arrived for b in a.batches]
            return list(self._batches)
        return self._stream(rollout)

    def _stream(self, rollout: int) -> Iterator[dict[str, Any]]:
        """The rollout's micro-batches as its groups finish (the trainer computes their gradients meanwhile)."""
        for arrival in self._arrivals_of(rollout):
            for batch in arrival.batches:
                self._batches.append(batch)
                yield batch

    def _arrivals_of(self, rollout: int) -> Iterator[_Arrival]:
        """The groups of ``rollout`` as they arrive, up to its end (whose counts are added); the driver's error
        raised here. Groups of later rollouts that arrive meanwhile are kept for their turn."""
        self._trainer_wait = 0.0
        while True:
            early = self._early.get(rollout)
            if early:
                arrival = early.pop(0)
            else:
                waited = time.perf_counter()
                try:
                    arrival = self._arrivals.get(timeout=1.0)
                except queue.Empty:
                    self._trainer_wait += time.perf_counter() - waited
                    if self._driver is not None and not self._driver.is_alive():
                        raise RuntimeError(f"the rollout driver ended without finishing rollout {rollout}") from None
                    continue
                self._trainer_wait += time.perf_counter() - waited
                if arrival.error is not None:
                    raise arrival.error
                if arrival.rollout != rollout:
                    if arrival.rollout < rollout:
                        raise RuntimeError(f"rollout {arrival.rollout} arrived after rollout {rollout} was asked for")
                    self._early.setdefault(arrival.rollout, []).append(arrival)
                    continue
            if arrival.batches is None:
                with self._lock:
                    self._started.pop(rollout, None)
                record = arrival.record
                self.episodes += record["episodes"]
                self.failed_episodes += record["failed_episodes"]
                self.env_steps += record["env_steps"]
                self.rollout_s += record["rollout_s"]
                self._record({**record, "trainer_wait_s": self._trainer_wait})
                if record["episodes"] == 0:
                    raise RuntimeError(f"rollout {rollout}: every episode on rank {self.rank} failed in the "
                                       "simulator (see the warnings above)")
                return
            yield arrival

    def _record(self, record: dict[str, Any]) -> None:
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- the driver thread ----------------------------------------------------------------------------------
    def _may_start(self, rollout: int, version: int | None) -> bool:
        """Under _lock: sync, once the trainer asks for it; exact, once the engine holds exactly the weights it acts
        with; bounded, once the weights handed to the engine (``version``) have trained on at least ``rollout -
        max_staleness`` rollouts (0: the weights a sync run acts with)."""
        if version is None:
            return False
        if self.options.mode == "sync":
            return self._requested > rollout
        if self.exact:
            return version == self.acting_version(rollout)
        return version // self.options.epochs >= rollout - self.options.max_staleness

    def _exact_weights(self, rollout: int, pushed: int | None) -> tuple[dict[str, torch.Tensor], int] | None:
        """Under _lock: the weights to hand the engine before ``rollout`` is released (None: not now). The engine
        predicts with one version at a time, so they change only once no episode acts with the ones it holds (the
        rollouts in flight are done), and never to weights newer than the rollout's."""
        if rollout >= self.rollouts:
            return None
        wanted = self.acting_version(rollout)
        if wanted == pushed or wanted not in self._published or (pushed is not None and self._running):
            return None
        return self._published[wanted], wanted

    def _drive(self, first: int) -> None:
        """One engine run for the whole training: rollouts released as ``_may_start`` allows, episodes of
        consecutive rollouts overlapping (no environment waits for a rollout's slowest episode), new weights
        handed over as they are published."""
        try:
            if self.driver_cores:
                os.sched_setaffinity(0, self.driver_cores)
            pushed: int | None = None
            released = first
            idle_since: float | None = time.perf_counter()  # no rollout running, none released

            def weights() -> tuple[dict[str, torch.Tensor], int] | None:
                nonlocal pushed
                with self._lock:
                    latest = self._exact_weights(released, pushed) if self.exact else self._weights
                if latest is None or latest[1] == pushed:
                    return None
                pushed = latest[1]
                return latest

            def jobs() -> list[Any] | None:
                nonlocal released, idle_since
                if released >= self.rollouts:
                    return None
                now = time.perf_counter()
                with self._lock:
                    permitted = self._may_start(released, pushed)
                if not permitted:
                    if idle_since is None and not self._running:
                        idle_since = now  # the simulators have nothing to do until the trainer lets them
                    return []
                held = 0.0 if idle_since is None else now - idle_since
                self.driver_wait_s += held
                idle_since = None
                started = self._release(released, pushed, held)
                released += 1
                return started

            self.engine.run([], on_result=self._on_result, should_stop=lambda: self._closed, feed=Feed(jobs, weights))
        except Cancelled:  # closed while rollouts ran (the run ended or failed): they are abandoned
            return
        except BaseException as exc:  # the trainer raises it at its next arrival
            self._arrivals.put(_Arrival(-1, error=exc))

    def _release(self, rollout: int, version: int, held_s: float) -> list[Any]:
        """Rollout ``rollout``'s episode jobs on this rank, and what will follow its groups."""
        options = self.options
        groups = [g for g in step_groups(options, self.tasks, rollout) if g.index % self.world_size == self.rank]
        jobs = episode_jobs(options, groups, rollout, first_episode=rollout * self._episodes_per_rollout())
        with self._lock:
            self._started[rollout] = len(jobs)
        self._running[rollout] = _Running({g.index: [] for g in groups}, version, time.time(), held_s)
        return jobs

    def _on_result(self, result: Any) -> None:
        """An episode ended: its group's micro-batches go to the trainer once the group is whole, the rollout's
        record once all its groups are."""
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
        self._arrivals.put(_Arrival(rollout, group_micro_batches(options, group, version=rollout * options.epochs,
                                                                 **self.collate), group=index))
        running.groups[index] = []  # the trajectories are the trainer's now
        if running.left:
            return
        del self._running[rollout]
        ended = time.time()
        self._arrivals.put(_Arrival(rollout, None, record={
            "rollout": rollout, "version": running.version,
            "staleness": (rollout * options.epochs - running.version) // options.epochs,
            "episodes": running.episodes, "failed_episodes": running.failed, "success": running.successes,
            "env_steps": running.env_steps, "started": running.started, "ended": ended,
            "rollout_s": ended - running.started, "driver_wait_s": running.held_s}))

    def _episodes_per_rollout(self) -> int:
        """Episodes of a rollout on all ranks: rollout r's are numbered from r x this."""
        return len(self.tasks) * self.options.states_per_task * self.options.group_size

    # --- checkpoint, telemetry, end -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._lock:  # rollouts started beyond the one being trained: a resume from here rolls them out again
            in_flight = sum(n for r, n in self._started.items() if r >= self.step // self.options.epochs)
        return {"step": self.step, "episodes": self.episodes, "failed_episodes": self.failed_episodes,
                "dropped_episodes": self.dropped_episodes, "in_flight_episodes": in_flight}

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """The exact schedule's: the weights older than the trainer's that the rollouts not yet trained on act with
        (a resume acts with them again: ``load_tensor_state``), as ``<version>/<name>``."""
        if not self.exact:
            return {}
        needed = self._acting_versions(self.step // self.options.epochs)
        with self._lock:
            kept = {v: self._published[v] for v in sorted(needed) if v < self.step and v in self._published}
        return {f"{version}/{name}": value for version, state in kept.items() for name, value in state.items()}

    def load_tensor_state(self, tensors: dict[str, torch.Tensor]) -> None:
        published: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            version, _, name = key.partition("/")
            published.setdefault(int(version), {})[name] = value
        missing = sorted(self._acting_versions(self.step // self.options.epochs) - set(published) - {self.step})
        if self.exact and missing:
            raise ValueError(f"the checkpoint lacks the weights of steps {missing}, which the rollouts after step "
                             f"{self.step} act with under --rl.schedule=exact (saved with --rl.schedule=bounded?)")
        with self._lock:
            self._published.update(published)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        if self.step % self.options.epochs:  # RLConfig keeps checkpoints between rollouts
            raise ValueError(f"step {self.step} is inside a rollout of {self.options.epochs} epochs")
        self._cut_log(self.step // self.options.epochs)
        self.episodes = int(state.get("episodes", 0))
        self.failed_episodes = int(state.get("failed_episodes", 0))
        in_flight = int(state.get("in_flight_episodes", 0))
        self.dropped_episodes = int(state.get("dropped_episodes", 0)) + in_flight
        if in_flight:
            log.warning("resuming at step %d: %d episodes that were rolling out when the checkpoint was saved are "
                        "rolled out again", self.step, in_flight)

    def _cut_log(self, rollouts: int) -> None:
        """A resume rolls out again from rollout ``rollouts``: the log keeps only the rollouts before it (as
        metrics.jsonl keeps only the steps before the resumed one)."""
        if self.log_path is None or not self.log_path.is_file():
            return
        from roboscale.utils.io import atomic_write_bytes, read_json_lines

        records, _ = read_json_lines(self.log_path, repair=True)
        kept = [r for r in records if isinstance(r.get("rollout"), int) and r["rollout"] < rollouts]
        atomic_write_bytes(self.log_path, "".join(json.dumps(r) + "\n" for r in kept).encode())

    def stats(self) -> dict[str, float]:
        return {"episodes": float(self.episodes), "failed_episodes": float(self.failed_episodes),
                "dropped_episodes": float(self.dropped_episodes), "env_steps": float(self.env_steps),
                "rollout_s": self.rollout_s, "driver_wait_s": self.driver_wait_s}

    def close(self) -> None:
        """Stop the driver (a rollout in flight is abandoned: its processes are killed) and the engine."""
        with self._lock:
            self._closed = True
        try:
            if self._driver is not None:
                self._driver.join(timeout=60.0)
        finally:
            self.engine.close()
