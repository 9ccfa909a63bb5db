"""Training micro-batches from episode groups: one group's episodes (one initial state's, whose advantages compare
them) scored by ``--rl.algorithm`` and cut into micro-batches of at most ``max_chunks`` chunks (see rl.objective for
their fields). The observations go through ``rollout.observation.observation_batch``, the function the inference
runner built the acting policy's input with."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from roboscale.configs.rl import RLOptions
from roboscale.rl.advantages import episode_return
from roboscale.rollout.observation import observation_batch


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
    observation = observation_batch(chunks, state_key, image_keys)
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
