"""The policy on the rollout side: observations of many environments in, one action chunk per observation out.

A request item is one environment's observation with what makes its prediction reproducible: the episode's noise
seed and the index of the chunk within the episode (the noise is drawn from those two alone, ``rollout.noise``).
Two samplers: ``ode``, the policy's deterministic Euler steps from that noise (``predict_action_chunk``, what
evaluation uses), and ``sde``, the stochastic sampler of RL post-training (``sample_action_chain``), whose step
noise is drawn from the same two (``step_noise``) and which returns the whole denoising chain as well. Each
prediction carries the version of the weights that made it (0: the checkpoint's; ``load_state`` sets others).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from roboscale.configs.rollout import SAMPLERS
from roboscale.errors import CheckpointError
from roboscale.rollout.noise import chunk_noise, step_noise, stochastic_steps

if TYPE_CHECKING:
    import torch


@dataclass
class PredictItem:
    slot: int
    """The environment within its worker."""
    noise_seed: int
    """The seed the episode's noise is drawn from (``EpisodeJob.draws_from``)."""
    chunk_index: int
    instruction: str
    state: np.ndarray
    images: dict[str, np.ndarray]
    """{camera feature name: H x W x 3 uint8}."""


@dataclass
class Prediction:
    """One item's prediction."""

    chunk: np.ndarray
    """[T, A_data]: the action chunk in the dataset's units."""
    chain: np.ndarray | None
    """[K + 1, T, A] float32: the denoising chain, normalized (``sde``; None for ``ode``); its last entry is the
    normalized chunk."""
    version: int
    """The version of the weights that predicted it."""
    stochastic: np.ndarray | None = None
    """[K] bool: the denoising steps that drew noise (``sde``; None for ``ode``)."""
    log_density: np.ndarray | None = None
    """[T, A] float32: each entry's log-density under the weights that sampled it, over its stochastic steps
    (``sde``; ``FlowMatching.sampled_log_density``): the chunk's log-probability once the executed entries are
    known."""
    value: float | None = None
    """The value head's estimate of the observation's return (``sde`` with weights that carry a critic: PPO)."""

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """Where an array is expected, a prediction is its chunk (callers that only compare actions)."""
        return self.chunk if dtype is None else self.chunk.astype(dtype)


@dataclass(frozen=True)
class RunnerSettings:
    """What a process that predicts builds its ``PolicyRunner`` from."""

    checkpoint: str
    device: str = "auto"
    threads: int = 1
    sampler: str = "ode"
    noise_level: float = 0.5
    sde_steps: int = 0

    def build(self) -> PolicyRunner:
        return PolicyRunner(self.checkpoint, self.device, self.threads, self.sampler, self.noise_level,
                            self.sde_steps)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def inference_threads(requested: int, processes_sharing: int) -> int:
    return requested or max(1, (os.cpu_count() or 1) // max(1, processes_sharing))


class PolicyRunner:
    """A policy loaded for inference (eval mode, fp32 on CPU) and the batching of observations into its input."""

    def __init__(self, checkpoint: str, device: str = "auto", threads: int = 1, sampler: str = "ode",
                 noise_level: float = 0.5, sde_steps: int = 0):
        import torch

        from roboscale.models.policy import Policy

        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {list(SAMPLERS)}, got {sampler!r}")
        self.sampler, self.noise_level, self.sde_steps = sampler, noise_level, sde_steps
        self.version = 0
        torch.set_num_threads(threads)
        self.device = torch.device(resolve_device(device))
        self.policy = Policy.from_pretrained(checkpoint).to(self.device).eval()
        config = self.policy.config
        self.image_keys: list[str] = list(config.image_keys)
        self.state_key: str = config.state_key
        self.noise_shape = (config.chunk_size, config.action_dim)
        self.steps = config.num_inference_steps

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """New weights (strict: every tensor of the policy, of its shape, and nothing else) and their version.
        Weights that carry a critic (PPO's value head) give the policy one, of their shape, if it has none, and
        from then on each ``sde`` prediction its value; weights without one leave it out of the comparison.
        Checked before anything is copied, so a refused state leaves the weights and version as they were."""
        from roboscale.models.value import CRITIC, ValueHead, acting_weights

        state = dict(state)
        where = f"published weights (version {version})"
        critic = {k.removeprefix(CRITIC): v for k, v in state.items() if k.startswith(CRITIC)}
        head = self.policy.value_head
        if critic and head is None:
            try:
                head = ValueHead(critic["hidden.weight"].shape[1], critic["hidden.weight"].shape[0])
            except KeyError:
                raise CheckpointError(where, f"its critic lacks {CRITIC}hidden.weight") from None
        own = self.policy.state_dict() if head is self.policy.value_head else {
            **self.policy.state_dict(), **{CRITIC + k: v for k, v in head.state_dict().items()}}
        if not critic:
            own, state = acting_weights(own), acting_weights(state)
        missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        reshaped = sorted(k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape))
        for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", reshaped)):
            if names:
                raise CheckpointError(where, f"{len(names)} tensors {what} for this policy (first: {names[0]!r})")
        if head is not self.policy.value_head:
            self.policy.value_head = head.to(self.device).eval()
            self.policy.config.value_head_dim = head.hidden.out_features
        self.policy.load_state_dict(state, strict=False)  # complete (the critic aside when it has none): checked
        self.version = version

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

    def predict(self, items: list[PredictItem]) -> list[Prediction]:
        """One prediction per item, in order: its chunk [T, A_data] in the dataset's units (and, ``sde``, its
        chain), by the current weights."""
        import torch

        from roboscale.models.flow_matching import sampled_log_density

        noise = torch.from_numpy(np.stack([chunk_noise(it.noise_seed, it.chunk_index, self.noise_shape)
                                           for it in items]))
        observation = self.batch(items)
        if self.sampler == "ode":
            chunks = self.policy.predict_action_chunk(observation, noise=noise).float().cpu().numpy()
            return [Prediction(chunk, None, self.version) for chunk in chunks]
        draws = torch.from_numpy(np.stack([step_noise(it.noise_seed, it.chunk_index, self.steps, self.noise_shape)
                                           for it in items]))
        stochastic = np.stack([stochastic_steps(it.noise_seed, it.chunk_index, self.steps, self.sde_steps)
                               for it in items])
        stochastic = torch.from_numpy(stochastic)
        actions, chains, values = self.policy.sample_action_chain(observation, noise, draws, self.noise_level,
                                                                  stochastic)
        densities = sampled_log_density(draws, stochastic, self.steps, self.noise_level).numpy()
        values = [None] * len(items) if values is None else values.float().cpu().tolist()
        return [Prediction(chunk, chain, self.version, steps.numpy(), density, value)
                for chunk, chain, steps, density, value in zip(actions.float().cpu().numpy(),
                                                               chains.float().cpu().numpy(), stochastic, densities,
                                                               values, strict=True)]
