"""The policy on the rollout side: observations of many environments in, one action chunk per observation out.

A request item is one environment's observation with what makes its prediction reproducible: the episode's noise
seed and the index of the chunk within the episode (the noise is drawn from those two alone, ``rollout.noise``).
Two samplers: ``ode``, the policy's deterministic Euler steps from that noise (``predict_action_chunk``, what
evaluation uses), and ``sde``, the stochastic sampler of RL post-training (``sample_action_chain``), whose step
noise is drawn from the same two (``step_noise``) and which returns the whole denoising chain as well. An ``ode``
item may carry the actions its robot has committed to (real-time chunking, ``roboscale.models.rtc``): those items
are sampled guided to agree with them, in a batch of their own. Each prediction carries the version of the
weights that made it (0: the checkpoint's; ``load_state`` sets others).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from roboscale.configs.rollout import ODESampler, Sampler, SDESampler
from roboscale.errors import CheckpointError, ConfigError
from roboscale.rollout.noise import chunk_noise, step_noise, stochastic_steps

if TYPE_CHECKING:
    import torch

    from roboscale.models.rtc import ChunkGuide


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
    committed: np.ndarray | None = None
    """Real-time chunking (``roboscale serve --rtc``): the previous chunk's actions the robot had not executed yet
    when this observation was taken, [n, A_data] in the dataset's units; the new chunk is guided to agree with them
    (None: unguided, the ``ode`` sampler's chunk)."""
    delay: int = 0
    """Of ``committed``, how many the robot executes before this chunk arrives (the inference delay, in action
    steps): those are frozen (weight 1), the rest of ``committed`` guided with decaying weights."""


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


BACKENDS = {"torch": "roboscale.rollout.inference:PolicyRunner", "onnx": "roboscale.rollout.onnx:OnnxPredictor"}
"""What runs a policy, by name: each a ``Predictor`` built as ``(checkpoint, device, threads, sampler, rtc_schedule,
rtc_max_guidance)``."""


@dataclass(frozen=True)
class RunnerSettings:
    """What a process that predicts builds its ``PolicyRunner`` from."""

    checkpoint: str
    device: str = "auto"
    threads: int = 1
    sampler: Sampler = field(default_factory=ODESampler)
    rtc_schedule: str = "exp"
    """Real-time chunking: how the guidance weights of ``committed`` actions after the delay decay."""
    rtc_max_guidance: float = 5.0
    """Real-time chunking: the largest guidance weight (beta of the paper)."""
    backend: str = "torch"
    """What runs the policy: torch (``checkpoint`` is a policy checkpoint, ``PolicyRunner``) or onnx (``checkpoint``
    is an exported directory, ``rollout.onnx.OnnxPredictor``)."""

    def build(self) -> Any:
        """The backend's ``rollout.predictor.Predictor`` (which imports this module: named, not imported, here)."""
        from roboscale.utils.imports import load

        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of {sorted(BACKENDS)}")
        return load(BACKENDS[self.backend])(self.checkpoint, self.device, self.threads, self.sampler,
                                            self.rtc_schedule, self.rtc_max_guidance)


def resolve_device(device: str, option: str = "--runner.device") -> str:
    """``auto`` as cuda where there is one, else cpu; a CUDA device this machine does not have is a ConfigError
    naming the option (torch's own failure is an AssertionError deep in the first ``.to``)."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        index = device.partition(":")[2]
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (index.isdigit() and int(index) >= count):
            raise ConfigError(f"{option}={device}: this machine has {count} CUDA devices (torch {torch.__version__}); "
                              f"use {option}=cpu, or auto")
    return device


def inference_threads(requested: int, processes_sharing: int) -> int:
    return requested or max(1, (os.cpu_count() or 1) // max(1, processes_sharing))


class PolicyRunner:
    """A policy loaded for inference (eval mode, fp32 on CPU) and the batching of observations into its input."""

    def __init__(self, checkpoint: str, device: str = "auto", threads: int = 1, sampler: Sampler | None = None,
                 rtc_schedule: str = "exp", rtc_max_guidance: float = 5.0):
        import torch

        from roboscale.models.policy import Policy
        from roboscale.models.rtc import SCHEDULES

        if rtc_schedule not in SCHEDULES:
            raise ValueError(f"rtc_schedule must be one of {list(SCHEDULES)}, got {rtc_schedule!r}")
        self.sampler = sampler if sampler is not None else ODESampler()
        self.rtc_schedule, self.rtc_max_guidance = rtc_schedule, rtc_max_guidance
        self.version = 0
        torch.set_num_threads(threads)
        self.device = torch.device(resolve_device(device))
        # inference only: real-time chunking differentiates the noisy actions, never the weights
        self.policy = Policy.from_pretrained(checkpoint).to(self.device).eval().requires_grad_(False)
        config = self.policy.config
        self.image_keys: list[str] = list(config.image_keys)
        self.state_key: str = config.state_key
        self.noise_shape = (config.chunk_size, config.action_dim)
        self.action_width = self.policy.action_normalizer.data_dim or config.action_dim
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

    def close(self) -> None:
        """Nothing to release: the policy is this process's memory, freed with the runner (``Predictor.close``
        is for what outlives it, a remote predictor's connections)."""

    def batch(self, items: list[PredictItem]) -> dict[str, Any]:
        """The policy's observation batch, in the dataset's feature names (uint8 CHW images; the one RL's trainer
        builds from the chunks it trains on: ``rollout.observation``)."""
        from roboscale.rollout.observation import observation_batch

        return observation_batch(items, self.state_key, self.image_keys)

    def predict(self, items: list[PredictItem]) -> list[Prediction]:
        """One prediction per item, in order: its chunk [T, A_data] in the dataset's units (and, ``sde``, its
        chain), by the current weights."""
        import torch

        from roboscale.models.flow_matching import sampled_log_density

        sampler = self.sampler
        if not isinstance(sampler, SDESampler):
            return self._predict_ode(items)
        if any(it.committed is not None for it in items):
            raise ValueError("committed: real-time chunking is not supported by the sde sampler (use sampler=ode)")
        noise = self._noise(items)
        observation = self.batch(items)
        draws = torch.from_numpy(np.stack([step_noise(it.noise_seed, it.chunk_index, self.steps, self.noise_shape)
                                           for it in items]))
        stochastic = np.stack([stochastic_steps(it.noise_seed, it.chunk_index, self.steps, sampler.sde_steps)
                               for it in items])
        stochastic = torch.from_numpy(stochastic)
        actions, chains, values = self.policy.sample_action_chain(observation, noise, draws, sampler.noise_level,
                                                                  stochastic)
        densities = sampled_log_density(draws, stochastic, self.steps, sampler.noise_level).numpy()
        values = [None] * len(items) if values is None else values.float().cpu().tolist()
        return [Prediction(chunk, chain, self.version, steps.numpy(), density, value)
                for chunk, chain, steps, density, value in zip(actions.float().cpu().numpy(),
                                                               chains.float().cpu().numpy(), stochastic, densities,
                                                               values, strict=True)]

    def _noise(self, items: list[PredictItem]) -> torch.Tensor:
        import torch

        return torch.from_numpy(np.stack([chunk_noise(it.noise_seed, it.chunk_index, self.noise_shape)
                                          for it in items]))

    def _predict_ode(self, items: list[PredictItem]) -> list[Prediction]:
        """The ``ode`` sampler's predictions, in order: the items with ``committed`` actions guided together (real-time
        chunking), the others by the plain sampler, each group in one batch (so an unguided item's chunk is the one it
        gets where nobody asks for guidance, and the others pay for no backward passes)."""
        def predict(group: list[PredictItem], guide: ChunkGuide | None) -> np.ndarray:
            out = self.policy.predict_action_chunk(self.batch(group), noise=self._noise(group), guide=guide)
            return out.float().cpu().numpy()

        return [Prediction(chunk, None, self.version) for chunk in by_guidance(items, self._chunk_guide, predict)]

    def _chunk_guide(self, items: list[PredictItem]) -> ChunkGuide | None:
        """The committed actions of ``items`` as the policy takes them (``committed_actions`` checks them); None for
        no items."""
        import torch

        from roboscale.models.rtc import ChunkGuide

        if not items:
            return None
        actions, counts, delays = committed_actions(items, self.noise_shape[0], self.action_width)
        return ChunkGuide(torch.from_numpy(actions), torch.from_numpy(counts), torch.from_numpy(delays),
                          self.rtc_schedule, self.rtc_max_guidance)


def by_guidance(items: list[PredictItem], guide_of: Callable[[list[PredictItem]], Any],
                predict: Callable[[list[PredictItem], Any], np.ndarray]) -> list[np.ndarray]:
    """Each item's chunk, in order: the items with ``committed`` actions predicted together with ``guide_of`` them
    (real-time chunking), the others together unguided (``predict(group, None)``), so an unguided item's chunk is
    the one it gets where nobody asks for guidance. ``guide_of`` runs first: a bad request fails before anything is
    computed."""
    plain = [i for i, it in enumerate(items) if it.committed is None]
    guided = [i for i, it in enumerate(items) if it.committed is not None]
    guide = guide_of([items[i] for i in guided]) if guided else None
    chunks: dict[int, np.ndarray] = {}
    for indices, group_guide in ((plain, None), (guided, guide)):
        if indices:
            chunks.update(zip(indices, predict([items[i] for i in indices], group_guide), strict=True))
    return [chunks[i] for i in range(len(items))]


def committed_actions(items: list[PredictItem], horizon: int, action_width: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Real-time chunking's request of each item, checked (a bad request names its field): the committed actions
    zero-padded to the chunk [N, horizon, action_width], their counts [N] and delays [N]."""
    actions = np.zeros((len(items), horizon, action_width), dtype=np.float32)
    counts = []
    for row, item in zip(actions, items, strict=True):
        committed = np.asarray(item.committed, dtype=np.float32)
        if committed.ndim != 2 or committed.shape[0] > horizon or committed.shape[1] != action_width:
            raise ValueError(f"committed has shape {list(committed.shape)}; expected [n, {action_width}] "
                             f"with n <= {horizon} (the chunk size)")
        if not np.isfinite(committed).all():
            raise ValueError("committed has non-finite values")
        if not 0 <= item.delay <= len(committed):
            raise ValueError(f"delay must be in [0, {len(committed)}] (the number of committed actions), "
                             f"got {item.delay}")
        row[:len(committed)] = committed
        counts.append(len(committed))
    return actions, np.asarray(counts, dtype=np.int64), np.asarray([it.delay for it in items], dtype=np.int64)
