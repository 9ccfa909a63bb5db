"""The policy on the rollout side: observations of many environments in, one action chunk per observation out.

A request item is one environment's observation with what makes its prediction reproducible: the episode's seed
and the index of the chunk within the episode (the noise is drawn from those two alone, ``rollout.noise``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from roboscale.rollout.noise import chunk_noise


@dataclass
class PredictItem:
    slot: int
    """The environment within its worker."""
    seed: int
    chunk_index: int
    instruction: str
    state: np.ndarray
    images: dict[str, np.ndarray]
    """{camera feature name: H x W x 3 uint8}."""


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def inference_threads(requested: int, processes_sharing: int) -> int:
    return requested or max(1, (os.cpu_count() or 1) // max(1, processes_sharing))


class PolicyRunner:
    """A policy loaded for inference (eval mode, fp32 on CPU) and the batching of observations into its input."""

    def __init__(self, checkpoint: str, device: str = "auto", threads: int = 1):
        import torch

        from roboscale.models.policy import Policy

        torch.set_num_threads(threads)
        self.device = torch.device(resolve_device(device))
        self.policy = Policy.from_pretrained(checkpoint).to(self.device).eval()
        config = self.policy.config
        self.image_keys: list[str] = list(config.image_keys)
        self.state_key: str = config.state_key
        self.noise_shape = (config.chunk_size, config.action_dim)

    def batch(self, items: list[PredictItem]) -> dict[str, Any]:
        """The policy's observation batch, in the dataset's feature names (uint8 CHW images)."""
        import torch

        batch: dict[str, Any] = {
            self.state_key: torch.from_numpy(np.stack([item.state for item in items])),
            "task": [item.instruction for item in items],
        }
        for key in self.image_keys:
            name = key.removeprefix("observation.images.")
            images = np.stack([item.images[name] for item in items]).transpose(0, 3, 1, 2)
            batch[key] = torch.from_numpy(np.ascontiguousarray(images))
        return batch  # on the CPU: the policy's own transform collates it and moves it to its device

    def predict(self, items: list[PredictItem]) -> np.ndarray:
        """Action chunks [len(items), T, A] in the dataset's units."""
        import torch

        noise = torch.from_numpy(np.stack([chunk_noise(it.seed, it.chunk_index, self.noise_shape) for it in items]))
        observation = self.batch(items)
        chunks = self.policy.predict_action_chunk(observation, noise=noise)
        return chunks.float().cpu().numpy()
