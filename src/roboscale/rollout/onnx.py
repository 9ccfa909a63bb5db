"""An exported policy (``roboscale export --format=onnx``) as a ``Predictor``: what the env workers, the inference
servers and `roboscale serve` drive when the backend is onnx (``RunnerSettings.backend``).

The same items give the same chunks as ``PolicyRunner``'s to rounding: the noise comes from each item's episode
seed and chunk index (``rollout.noise``), items with committed actions are guided together (real-time chunking) and
the others predicted apart, so an unguided item's chunk never depends on who shares its batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.config import from_dict
from roboscale.configs.rollout import ODESampler, Sampler
from roboscale.errors import CheckpointError, ConfigError, WorkerError
from roboscale.models.config import PolicyConfig
from roboscale.rollout.inference import Prediction, PredictItem, by_guidance, committed_actions
from roboscale.rollout.noise import chunk_noise

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
             "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]}


@dataclass
class ExportedPolicy:
    """An exported directory as evaluation and serving see a policy: its name, config, statistics and weights."""

    name: str
    config: PolicyConfig
    """The exported policy's own config (what evaluation and a served policy's metadata read)."""
    state_normalizer: Any
    action_normalizer: Any
    """``deploy.runtime.Normalization``s."""
    weights_sha256: str
    """The sha256 of the checkpoint's model.safetensors it was exported from: a report names the same weights
    whichever backend ran them."""


def exported_policy(directory: str | Path) -> ExportedPolicy:
    """The exported policy in ``directory``, its files checked (``deploy.format``): a CheckpointError naming the file
    otherwise."""
    import roboscale.models.registry  # noqa: F401  (every policy's config type, for from_dict)
    from roboscale.deploy.format import ExportedConfig, ExportedDirectoryError
    from roboscale.deploy.runtime import OnnxPolicy

    try:
        config = ExportedConfig.read(Path(directory))
        normalization = OnnxPolicy.read_normalization(Path(directory))
    except ExportedDirectoryError as exc:
        raise CheckpointError(directory, str(exc)) from None
    where = str(Path(directory) / "config.json")
    try:
        policy_config = from_dict(PolicyConfig, dict(config.source["policy_config"]), where=f"{where}: source")
    except (KeyError, TypeError, ConfigError) as exc:
        raise CheckpointError(where, f"source.policy_config: not a policy config ({exc})") from None
    return ExportedPolicy(config.policy, policy_config, normalization["state"], normalization["action"],
                          str(config.source.get("weights_sha256", "")))


class OnnxPredictor:
    """A ``Predictor`` over ``deploy.runtime.OnnxPolicy``. ``device``: cpu, cuda or tensorrt (onnxruntime's
    execution providers; auto: cpu), ``threads``: onnxruntime's intra-op threads."""

    def __init__(self, directory: str, device: str = "auto", threads: int = 0, sampler: Sampler | None = None,
                 rtc_schedule: str = "exp", rtc_max_guidance: float = 5.0, graph: str = "auto"):
        from roboscale.deploy.format import ExportedDirectoryError
        from roboscale.deploy.runtime import SCHEDULES, OnnxPolicy

        if sampler is not None and not isinstance(sampler, ODESampler):
            raise ConfigError(f"--rollout.sampler={sampler.type}: an exported policy runs the ode sampler only (RL's "
                              "stochastic sampler needs the PyTorch policy)")
        if rtc_schedule not in SCHEDULES:
            raise ValueError(f"rtc_schedule must be one of {list(SCHEDULES)}, got {rtc_schedule!r}")
        device = "cpu" if device == "auto" else device.partition(":")[0]
        if device not in PROVIDERS:
            raise ConfigError(f"device {device!r}: an exported policy runs on {sorted(PROVIDERS)}")
        try:
            self.model = OnnxPolicy(directory, PROVIDERS[device], threads, graph)
        except ExportedDirectoryError as exc:
            raise CheckpointError(directory, str(exc)) from None
        self.policy = exported_policy(directory)
        self.device = device
        self.version = 0
        cfg = self.model.config
        self.noise_shape = (cfg.chunk_size, cfg.action_dim)
        self.action_width = cfg.dataset_action_dim
        self.rtc_schedule, self.rtc_max_guidance = rtc_schedule, rtc_max_guidance

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        raise WorkerError("an exported (ONNX) policy cannot take new weights: export the new checkpoint, or run the "
                          "PyTorch backend")

    def close(self) -> None:
        """Nothing beyond memory: the sessions are freed with the predictor."""

    def predict(self, items: list[PredictItem]) -> list[Prediction]:
        return [Prediction(chunk, None, self.version) for chunk in by_guidance(items, self._guide, self._predict)]

    def _guide(self, items: list[PredictItem]):
        from roboscale.deploy.runtime import Guide

        actions, counts, delays = committed_actions(items, self.noise_shape[0], self.action_width)
        return Guide(actions, counts, delays, self.rtc_schedule, self.rtc_max_guidance)

    def _predict(self, items: list[PredictItem], guide) -> np.ndarray:
        cfg = self.model.config
        images = {key: np.stack([item.images[key.removeprefix("observation.images.")] for item in items])
                  for key in cfg.image_keys}
        state = np.stack([np.asarray(item.state, dtype=np.float32) for item in items])
        noise = np.stack([chunk_noise(it.noise_seed, it.chunk_index, self.noise_shape) for it in items])
        return self.model.predict(images, state, [item.instruction for item in items], noise, guide)
