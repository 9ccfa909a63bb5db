"""The policy's observation batch from environment observations: one function for the two that build it, the
inference runner (``PolicyRunner.batch``, from ``PredictItem``s) and RL's trainer (``rl.batching``, from the
``ChunkRecord``s of what the policy saw), so that the trainer recomputes log-probabilities on exactly the input the
acting policy was given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class Observed(Protocol):
    """One environment's observation: ``PredictItem`` and ``ChunkRecord`` both are."""

    state: np.ndarray
    images: dict[str, np.ndarray]
    """Camera name (the feature's last part) -> H x W x 3 uint8."""
    instruction: str


def observation_batch(items: Sequence[Observed], state_key: str, image_keys: Sequence[str]) -> dict[str, Any]:
    """The policy's observation batch, in the dataset's feature names: the stacked states, the instructions as
    ``task`` and each camera's uint8 CHW images, on the CPU (the policy's own transform collates it and moves it to
    its device)."""
    import torch

    batch: dict[str, Any] = {state_key: torch.from_numpy(np.stack([item.state for item in items])),
                             "task": [item.instruction for item in items]}
    for key in image_keys:
        name = key.removeprefix("observation.images.")
        images = np.stack([item.images[name] for item in items]).transpose(0, 3, 1, 2)
        batch[key] = torch.from_numpy(np.ascontiguousarray(images))
    return batch
