"""The Trainer's data source in RL: the rollouts of this rank, as its driver thread runs them on its rollout engine.

Three levels (RL-VLA3's): the simulators (env workers, stepping their environments' sub-batches), the generators
(inference with dynamic batching: servers, or the workers themselves on the CPU) and the trainer. The driver
(``rl.driver``) runs rollout after rollout on the engine; each group of episodes (one initial state's) is turned into
micro-batches with advantages (``rl.batching``) as soon as its last episode ends, and handed to the trainer here.
Weights move at rollout boundaries only: the trainer publishes them after a rollout's last optimizer step
(``WeightPublisher``, to the driver's ``WeightSchedule``), and they reach the generators through the engine's one
``WeightChannel`` before the rollouts that act with them start; each chunk records the version that acted.

- ``--rl.mode=sync``: the driver starts a rollout when the trainer asks for it, and the trainer takes it whole,
  in group order: roll out everything, then train (the baseline).
- ``--rl.mode=async``: the driver starts rollout r while the trainer trains on earlier ones (simulators and
  generators keep working), and the trainer computes each group's gradients as it arrives
  (``Trainer.accumulate_stream``); its optimizer step still waits for the whole rollout, the global batch. Which
  weights rollout r acts with (``--rl.schedule``):
  - ``exact`` (default): exactly those trained on max(0, r - ``max_staleness``) rollouts
    (``WeightSchedule.acting_version``), every chunk of it. The driver puts exactly those on the engine's channel,
    once published, and only when no episode in flight acts with the ones there (the engine predicts with one
    version at a time), so consecutive rollouts overlap while they act with the same weights. A run is
    reproducible, and a resume acts as the uninterrupted run did: the checkpoint keeps the older weights the next
    rollouts act with (``tensor_state``).
  - ``bounded``: as soon as the published weights have trained on r - ``max_staleness`` rollouts, taking newer
    ones mid-rollout as they come (RL-VLA3's bound; timing decides which).
  At staleness 0 both act with the weights a sync run's do: the same losses step by step, the gain only from the
  overlap.

With ``--rl.epochs=E`` each rollout serves E optimizer steps (the same chunks each time; their recorded
log-probabilities are the acting weights', so the later epochs' ratios measure how far the updates went).

Which episodes a rollout runs depends on its number alone: for each task, ``states_per_task`` initial states
(``episode_seed(rl.seed, task, rollout * states_per_task + s)``) and ``group_size`` episodes from each, whose
noise comes from their own ``noise_seed`` (``rl.driver.episode_jobs``). Groups are dealt to ranks by index (group g
to rank g mod ranks) and each rank rolls out its own on its own engine, so a step's global batch, its advantages (a
group never straddles ranks) and its losses do not depend on the number of ranks or env workers. A checkpoint
keeps the step; rollouts in flight are not kept (a resume rolls them out again, counted as ``dropped_episodes``, and
cuts ``rollouts.jsonl`` back to the rollouts before them).
"""

from __future__ import annotations

import json
import logging
import queue
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from roboscale.configs.rl import RLOptions
from roboscale.rl.driver import Arrival, Rollout, RolloutDriver, WeightSchedule

log = logging.getLogger(__name__)


class RolloutSource:
    """A ``DataSource`` of the Trainer (train.components): ``next()`` is one step's rolled-out chunks on this rank.
    ``engine``: a started ``RolloutEngine`` whose sampler is the stochastic one and whose ``WeightChannel``
    ``schedule`` feeds; ``schedule.rollouts``: how many the run trains on (the driver starts none beyond).
    ``before_first`` runs on the trainer's thread before the first rollout (the first weights are published, to
    ``schedule``). ``log_path``: where each rollout's record goes (``rollouts.jsonl``: its weights version and
    staleness, episodes, successes, env steps, when it ran, how long the driver held it back and the trainer
    waited for it)."""

    def __init__(self, options: RLOptions, tasks: list[str], engine: Any, schedule: WeightSchedule,
                 policy_config: Any, *, rank: int = 0, world_size: int = 1, max_chunks: int = 64,
                 before_first: Callable[[], None] | None = None, driver_cores: set[int] | None = None,
                 log_path: Path | None = None):
        self.options, self.schedule, self.rank = options, schedule, rank
        self.log_path = log_path
        self.before_first = before_first
        collate = {"image_keys": list(policy_config.image_keys), "state_key": policy_config.state_key,
                   "action_dim": policy_config.action_dim, "max_chunks": max_chunks}
        self.driver = RolloutDriver(options, tasks, engine, schedule, rank=rank, world_size=world_size,
                                    collate=collate, cores=driver_cores)
        self.step = 0
        """Batches handed out (the trainer's optimizer steps); rollout r serves steps r * epochs ... + epochs - 1."""
        self._batches: list[dict[str, Any]] | None = None
        self.episodes = 0
        self.failed_episodes = 0
        self.dropped_episodes = 0
        """Episodes of rollouts in flight when a run stopped, that its resume rolled out again."""
        self.env_steps = 0
        self.rollout_s = 0.0
        self._trainer_wait = 0.0
        self._early: dict[int, list[Arrival]] = {}  # groups of rollouts after the one the trainer takes

    @property
    def rolls_out_next(self) -> bool:
        """Whether the next ``next()`` starts a rollout's first epoch (the weights then published are the ones
        it is trained against) rather than training again on the last rollout (``--rl.epochs``)."""
        return self.step % self.options.epochs == 0

    def __next__(self) -> Any:
        if not self.rolls_out_next and self._batches is not None:  # another epoch on the same rollout
            self.step += 1
            return list(self._batches)
        rollout = self.step // self.options.epochs
        if not self.driver.started:
            if self.before_first is not None:
                self.before_first()
            self.driver.start(rollout)
        self.driver.request(rollout + 1)
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

    def _arrivals_of(self, rollout: int) -> Iterator[Arrival]:
        """The groups of ``rollout`` as they arrive, up to its end (whose counts are added and recorded); the
        driver's error raised here. Groups of later rollouts that arrive meanwhile are kept for their turn."""
        self._trainer_wait = 0.0
        while True:
            early = self._early.get(rollout)
            if early:
                arrival = early.pop(0)
            else:
                waited = time.perf_counter()
                try:
                    arrival = self.driver.arrivals.get(timeout=1.0)
                except queue.Empty:
                    self._trainer_wait += time.perf_counter() - waited
                    if self.driver.started and not self.driver.alive:
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
                self.driver.finished(rollout)
                self._ended(rollout, arrival.done)
                return
            yield arrival

    def _ended(self, rollout: int, done: Rollout) -> None:
        """The rollout's counts added, and its record written."""
        epochs = self.options.epochs
        self.episodes += done.episodes
        self.failed_episodes += done.failed
        self.env_steps += done.env_steps
        self.rollout_s += done.ended - done.started
        self._record({
            "rollout": rollout, "version": done.version, "staleness": (rollout * epochs - done.version) // epochs,
            "episodes": done.episodes, "failed_episodes": done.failed, "success": done.successes,
            "env_steps": done.env_steps, "started": done.started, "ended": done.ended,
            "rollout_s": done.ended - done.started, "driver_wait_s": done.held_s,
            "trainer_wait_s": self._trainer_wait})
        if done.episodes == 0:
            raise RuntimeError(f"rollout {rollout}: every episode on rank {self.rank} failed in the simulator (see "
                               "the warnings above)")

    def _record(self, record: dict[str, Any]) -> None:
        if self.log_path is not None:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    # --- checkpoint, telemetry, end -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # rollouts started beyond the one being trained: a resume from here rolls them out again
        in_flight = self.driver.in_flight(self.step // self.options.epochs)
        return {"step": self.step, "episodes": self.episodes, "failed_episodes": self.failed_episodes,
                "dropped_episodes": self.dropped_episodes, "in_flight_episodes": in_flight}

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """The exact schedule's: the weights older than the trainer's that the rollouts not yet trained on act with
        (a resume acts with them again: ``load_tensor_state``), as ``<version>/<name>``."""
        return self.schedule.tensor_state(self.step)

    def load_tensor_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.schedule.load_tensor_state(tensors, self.step)

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
                "rollout_s": self.rollout_s, "driver_wait_s": self.driver.wait_s}

    def close(self) -> None:
        """Stop the driver (a rollout in flight is abandoned: its processes are killed) and the engine."""
        self.driver.close()
