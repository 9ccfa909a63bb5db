"""The Policy contract every policy implements, and checkpoint save/load.

A checkpoint directory holds ``config.json`` (the policy config, with ``"type"``), ``model.safetensors`` (weights
and normalization statistics, as buffers) and, for language-conditioned policies, ``tokenizer.json``. Nothing
is pickled.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from roboscale.config import from_dict, to_dict
from roboscale.errors import CheckpointError, ConfigError
from roboscale.utils.io import atomic_path, atomic_write_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"


@dataclass
class PolicyConfig:
    """Options every policy has. Subclasses are registered with ``@register(PolicyConfig, "name")``."""

    image_keys: list[str] = field(default_factory=list)
    """Camera features the policy reads (empty: every camera of the training dataset)."""
    state_key: str = "observation.state"
    """Proprioceptive state feature."""
    action_key: str = "action"
    """Action feature."""
    state_dim: int = 0
    """State size (0: from the dataset)."""
    action_dim: int = 0
    """Action size (0: from the dataset)."""
    image_size: int = 64
    """Square input resolution; frames of another size are resized on the fly."""
    chunk_size: int = 16
    """Actions predicted per inference call."""
    n_action_steps: int = 4
    """Actions executed from each predicted chunk before predicting again (the action queue length). Re-planning
    every 4 of the 16 steps (50 ms at 80 Hz) corrects small contact errors; 8 cost ~10 points of success."""
    fps: float = 0.0
    """Dataset frame rate (0: from the dataset); with chunk_size it defines the action window."""


class Policy(nn.Module):
    """``forward(batch) -> (loss, metrics)``; ``predict_action_chunk(obs) -> [B, T, A]``; ``select_action`` queues."""

    config_class: ClassVar[type[PolicyConfig]]
    name: ClassVar[str]

    def __init__(self, config: PolicyConfig):
        super().__init__()
        self.config = config
        self._action_queue: deque[torch.Tensor] = deque()

    # --- contract -------------------------------------------------------------------------------------------
    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def predict_action_chunk(self, observation: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError

    def delta_indices(self) -> dict[str, list[int]]:
        """Frame offsets the policy needs per feature (LeRobot's delta_timestamps, in frames)."""
        return {self.config.action_key: list(range(self.config.chunk_size))}

    def reset(self) -> None:
        """Call at the start of every episode: drops queued actions."""
        self._action_queue.clear()

    @torch.no_grad()
    def select_action(self, observation: dict[str, Any]) -> torch.Tensor:
        """One action per env step [B, A]; a new chunk is predicted only when the queue is empty."""
        if not self._action_queue:
            chunk = self.predict_action_chunk(observation)[:, : self.config.n_action_steps]
            self._action_queue.extend(chunk.transpose(0, 1))
        return self._action_queue.popleft()

    # --- persistence ----------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write config.json + model.safetensors (+ extra files) into ``directory``, each file atomically."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(directory / CONFIG_NAME, to_dict(self.config))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        with atomic_path(directory / WEIGHTS_NAME) as tmp:
            save_file(state, str(tmp), metadata={"format": "pt", "type": self.name})
        self._save_extra(directory)
        return directory

    def _save_extra(self, directory: Path) -> None:
        """Hook for files beside the weights (the tokenizer)."""

    def _load_extra(self, directory: Path) -> None:
        """Hook: read what ``_save_extra`` wrote."""

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides: Any) -> Policy:
        """Load a policy from a checkpoint directory (``.../pretrained_model``)."""
        from roboscale.models.registry import POLICIES, get_policy_class

        directory = Path(directory)
        config_dict = read_policy_config(directory)
        policy_type = config_dict.get("type")
        spec = POLICIES.get(policy_type)
        if spec is not None and spec.foreign_loader is not None and spec.foreign_loader.detect(config_dict):
            return spec.foreign_loader.load(directory, **overrides)  # e.g. a LeRobot pi0.5 checkpoint
        expected = getattr(cls, "name", None)
        if expected is not None and policy_type != expected:
            raise CheckpointError(
                directory / CONFIG_NAME, f"this checkpoint is a {policy_type!r} policy, not {expected!r}"
            )
        policy_cls = get_policy_class(policy_type, directory / CONFIG_NAME)
        config_dict.update(overrides)
        try:
            config = from_dict(PolicyConfig, config_dict, where=str(directory / CONFIG_NAME))
        except ConfigError as exc:
            raise CheckpointError(directory / CONFIG_NAME, str(exc)) from None
        policy = policy_cls(config)
        policy._load_extra(directory)
        policy.load_weights(directory / WEIGHTS_NAME)
        return policy

    def load_weights(self, path: Path) -> None:
        """Strict load: every tensor present with the shape the config implies, or one error listing the misfits."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not path.is_file():
            raise CheckpointError(path, "weights file not found")
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(path, f"not a readable safetensors file ({exc})") from None
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        mismatched = [
            f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(own[k].shape)}"
            for k in own
            if k in state and state[k].shape != own[k].shape
        ]
        if missing or unexpected or mismatched:
            parts = []
            if mismatched:
                parts.append("shape mismatch: " + "; ".join(mismatched[:5]))
            if missing:
                parts.append(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            if unexpected:
                parts.append(f"unexpected tensors: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
            raise CheckpointError(
                path, "weights do not match config.json (" + "; ".join(parts) + "). Was config.json edited?"
            )
        self.load_state_dict(state, strict=True)


def read_policy_config(directory: Path) -> dict:
    path = directory / CONFIG_NAME
    if not directory.is_dir():
        raise CheckpointError(directory, "checkpoint directory not found")
    if not path.is_file():
        raise CheckpointError(path, "missing; a policy checkpoint needs config.json and model.safetensors")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # JSON or UTF-8 decoding
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "type" not in data:
        raise CheckpointError(path, "has no 'type' field naming the policy (e.g. \"type\": \"pi05\")")
    if not isinstance(data["type"], str):
        raise CheckpointError(path, f"'type' must be a string naming the policy (e.g. \"pi05\"), got "
                                    f"{json.dumps(data['type'])}")
    return data
