"""The Trainer's data source in RL: each global step's batch is rolled out with the weights being trained.

Synchronous (RL part 1): ``next()`` runs the step's episodes on the rollout engine (env workers, inference servers
with the stochastic sampler, the current weights and their version), turns their trajectories into chunks with
advantages, and returns them as micro-batches; the optimizer step follows, then the new weights are published
(``WeightPublisher``, a step hook) before the next rollout. Nothing is in flight between steps, so a checkpoint
needs only the step (``state_dict``): a resumed run rolls out the same episodes again.

With ``--rl.epochs=E`` each rollout serves E optimizer steps (the same chunks each time; their recorded
log-probabilities are the acting weights', so the later epochs' ratios measure how far the updates went).

Which episodes a rollout runs depends on its number alone: for each task, ``states_per_task`` initial states
(``episode_seed(rl.seed, task, rollout * states_per_task + s)``) and ``group_size`` episodes from each, whose
noise comes from their own ``noise_seed``. Groups are dealt to ranks by index (group g to rank g mod ranks) and each
rank rolls out its own on its own engine, so a step's global batch, its advantages (a group never straddles
ranks) and its losses do not depend on the number of ranks or env workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from roboscale.configs.rl import RLOptions
from roboscale.rl.advantages import gae, group_advantages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """The episodes of one initial state in one step."""

    index: int
    task: str
    seed: int
    instruction: str = ""


def step_groups(options: RLOptions, tasks: list[str], step: int) -> list[Group]:
    from roboscale.sim.experts import episode_seed

    groups = []
    for task in tasks:
        for s in range(options.states_per_task):
            groups.append(Group(len(groups), task, episode_seed(options.seed, task, step * options.states_per_task + s)))
    return groups


def noise_seed(options: RLOptions, step: int, group: Group, member: int) -> int:
    """Distinct per (step, group, member): the episodes of a group differ only by their noise."""
    return int(np.random.SeedSequence([options.seed, step, group.index, member]).generate_state(1, np.uint64)[0] >> 1)


def episode_jobs(options: RLOptions, groups: list[Group], step: int) -> list[Any]:
    from roboscale.rollout.episode import EpisodeJob

    return [EpisodeJob(group.task, group.index * options.group_size + member, group.seed, group.instruction,
                       noise_seed=noise_seed(options, step, group, member), record_trajectory=True)
            for group in groups for member in range(options.group_size)]


def episode_return(trajectory: Any, reward: str) -> float:
    """Sparse: 1 if the episode succeeded; shaped: the sum of the simulator's rewards."""
    if reward == "success":
        return float(trajectory.success)
    return float(sum(float(np.sum(c.rewards)) for c in trajectory.chunks))


def chunk_rewards(trajectory: Any, reward: str) -> np.ndarray:
    """Each chunk's reward: sparse, 1 for the chunk in which the episode succeeded; shaped, the sum of the
    simulator's rewards after its executed actions."""
    if reward == "success":
        out = np.zeros(len(trajectory.chunks), np.float32)
        out[-1] = float(trajectory.success)  # success ends the episode: its last chunk reached it
        return out
    return np.array([float(np.sum(c.rewards)) for c in trajectory.chunks], np.float32)


def chunk_batches(results: list[Any], advantages: np.ndarray, returns: np.ndarray, *, image_keys: list[str],
                  state_key: str, action_dim: int, max_chunks: int) -> list[dict[str, Any]]:
    """The chunks of ``results`` (episodes with trajectories) as training micro-batches of at most ``max_chunks``
    chunks, in episode order (see rl.objective for the fields)."""
    rows = []
    for result, advantage, ret in zip(results, advantages, returns, strict=True):
        chunks = result.trajectory.chunks
        for chunk in chunks:
            rows.append((chunk, float(advantage), 1.0 / len(chunks), float(result.success), float(ret),
                         float(result.steps)))
    return [_collate(rows[i:i + max_chunks], image_keys, state_key, action_dim)
            for i in range(0, len(rows), max_chunks)]


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
    advantage, weight, success, ret, steps = (torch.tensor(col, dtype=torch.float32) for col in columns)
    return {"observation": observation, "chain": chain, "stochastic": stochastic, "mask": mask,
            "old_log_prob": old_log_prob, "advantage": advantage, "weight": weight,
            "success": success, "return": ret, "steps": steps, "action_dims": data_dims}


class RolloutSource:
    """A ``DataSource`` of the Trainer (train.components): ``next()`` is one step's rolled-out chunks on this
    rank. ``engine``: a started ``RolloutEngine`` whose sampler is the stochastic one."""

    def __init__(self, options: RLOptions, tasks: list[str], engine: Any, policy_config: Any, *, rank: int = 0,
                 world_size: int = 1, max_chunks: int = 64, before_rollout: Callable[[], None] | None = None,
                 value_fn: Callable[[list[dict[str, Any]]], list[torch.Tensor]] | None = None):
        self.options, self.tasks, self.engine = options, tasks, engine
        self.before_rollout = before_rollout  # the servers get the current weights (WeightPublisher)
        self.value_fn = value_fn  # PPO: the critic's values of a step's chunk batches
        self.image_keys = list(policy_config.image_keys)
        self.state_key = policy_config.state_key
        self.action_dim = policy_config.action_dim
        self.rank, self.world_size, self.max_chunks = rank, world_size, max_chunks
        self.step = 0
        """Batches handed out (the trainer's optimizer steps); rollout r serves steps r * epochs ... + epochs - 1."""
        self._batches: list[dict[str, Any]] | None = None
        self.episodes = 0
        self.failed_episodes = 0
        self.env_steps = 0
        self.rollout_s = 0.0

    @property
    def rolls_out_next(self) -> bool:
        """Whether the next ``next()`` rolls out (with the weights then published) rather than training again on
        the last rollout (``--rl.epochs``)."""
        return self.step % self.options.epochs == 0

    def __next__(self) -> list[dict[str, Any]]:
        if not self.rolls_out_next and self._batches is not None:  # another epoch on the same rollout
            self.step += 1
            return self._batches
        self._batches = self._roll_out(self.step // self.options.epochs)
        self.step += 1
        return self._batches

    def _roll_out(self, rollout: int) -> list[dict[str, Any]]:
        """Rollout number ``rollout``'s chunks on this rank, with their advantages."""
        groups = [g for g in step_groups(self.options, self.tasks, rollout) if g.index % self.world_size == self.rank]
        jobs = episode_jobs(self.options, groups, rollout)
        if self.before_rollout is not None:
            self.before_rollout()
        results, stats = self.engine.run(jobs)
        self.rollout_s += stats.wall_s
        self.env_steps += stats.env_steps
        usable = [r for r in results if r.trajectory is not None and r.trajectory.chunks]
        self.failed_episodes += len(results) - len(usable)  # a simulator that kept failing: counted, not used
        self.episodes += len(usable)
        returns = np.array([episode_return(r.trajectory, self.options.reward) for r in usable], dtype=np.float32)
        if self.options.algorithm == "grpo":
            members = np.array([r.episode // self.options.group_size for r in usable])
            return chunk_batches(usable, group_advantages(returns, members), returns, image_keys=self.image_keys,
                                 state_key=self.state_key, action_dim=self.action_dim, max_chunks=self.max_chunks)
        batches = chunk_batches(usable, np.zeros(len(usable), np.float32), returns, image_keys=self.image_keys,
                                state_key=self.state_key, action_dim=self.action_dim, max_chunks=self.max_chunks)
        return self._with_gae(usable, batches)

    def _with_gae(self, results: list[Any], batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """PPO: each chunk's GAE advantage and value target, from the critic's values of every chunk."""
        values = np.concatenate([v.numpy() for v in self.value_fn(batches)])
        advantages, targets, at = [], [], 0
        for result in results:
            chunks = result.trajectory.chunks
            adv, target = gae(chunk_rewards(result.trajectory, self.options.reward), values[at:at + len(chunks)],
                              self.options.gamma, self.options.gae_lambda)
            advantages.append(adv)
            targets.append(target)
            at += len(chunks)
        advantages, targets, at = np.concatenate(advantages), np.concatenate(targets), 0
        for batch in batches:
            n = len(batch["weight"])
            batch["advantage"] = torch.from_numpy(advantages[at:at + n])
            batch["value_target"] = torch.from_numpy(targets[at:at + n])
            at += n
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "episodes": self.episodes, "failed_episodes": self.failed_episodes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        if self.step % self.options.epochs:  # RLConfig keeps checkpoints between rollouts
            raise ValueError(f"step {self.step} is inside a rollout of {self.options.epochs} epochs")
        self.episodes = int(state.get("episodes", 0))
        self.failed_episodes = int(state.get("failed_episodes", 0))

    def stats(self) -> dict[str, float]:
        return {"episodes": float(self.episodes), "failed_episodes": float(self.failed_episodes),
                "env_steps": float(self.env_steps), "rollout_s": self.rollout_s}

    def close(self) -> None:
        self.engine.close()
