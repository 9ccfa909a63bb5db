"""The Policy contract every policy implements, and checkpoint save/load.

A policy is a plain ``nn.Module`` that the engines drive from outside:

- **Build.** ``Policy(config, tokenizer)`` builds every module; its parameters are initialised as they are
  created. On the meta device nothing is allocated or drawn: ``to_empty(device=...)`` then ``init_weights()``
  materialises a policy too large to build whole on one device, after sharding (torchtitan's order).
  ``set_normalization(stats)`` fills the state/action statistics.
- **Data.** ``delta_indices()`` (the frames it reads per feature), ``data_transforms()`` (the picklable
  per-sample transform and per-batch collate the loader's workers run, or ``(None, None)``).
- **Compute.** ``encode(batch)`` turns a batch or an observation into an ``Encoded`` (the observation ready for
  the action model, and for training batches the normalized actions); ``velocity(encoded, x_t, t)`` predicts the
  flow velocity of noisy actions in the policy's ``flow_matching`` convention. The training objective
  (``roboscale.models.objective.flow_matching_loss``) and inference (``predict_action_chunk``) are built on
  these two calls, so another objective can drive the same model.
- **Parallelism.** ``parallel_units()`` lists the blocks that FSDP, activation checkpointing and
  ``torch.compile`` wrap; each unit's ``forward`` is where its work happens, so one all-gather serves it.

A checkpoint directory holds ``config.json`` (the policy config, with ``"type"``), ``model.safetensors`` (weights
and normalization statistics, as buffers) and, for language-conditioned policies, ``tokenizer.json``. Nothing
is pickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from roboscale.config import from_dict, to_dict
from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.config import PolicyConfig
from roboscale.models.flow_matching import FlowMatching
from roboscale.models.normalize import Normalizer
from roboscale.models.rtc import ChunkGuide, Guide, prefix_weights
from roboscale.models.tokenizer import TaskTokenizer
from roboscale.utils.io import atomic_path, atomic_write_json, load_json

CONFIG_NAME = "config.json"
PRETRAINED = "pretrained_model"
"""A checkpoint step directory's consolidated policy (what eval, serve, export and fine-tuning read)."""
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_NAME = "tokenizer.json"


@dataclass
class Encoded:
    """What ``Policy.encode`` returns; policies extend it with what their ``velocity`` needs."""

    batch_size: int
    actions: torch.Tensor | None
    """float [B, T, A]: the normalized action chunk of a training batch (None for an observation)."""
    action_mask: torch.Tensor | None
    """bool [B, T]: the action steps the loss counts (None: all of them)."""
    tokens: int
    """Positions that carry data (images, prompt, actions): what tokens/s counts."""
    computed_tokens: int
    """Positions computed over, padding included."""


class Policy(nn.Module):
    """See the module docstring for the contract."""

    name: ClassVar[str]
    config: PolicyConfig
    state_normalizer: Normalizer
    action_normalizer: Normalizer
    tokenizer: TaskTokenizer | None

    def __init__(self, config: PolicyConfig, tokenizer: TaskTokenizer | None = None):
        super().__init__()
        unfilled = [name for name in ("image_keys", "state_dim", "action_dim", "vocab_size")
                    if hasattr(config, name) and not getattr(config, name)]
        if unfilled:
            raise ValueError(f"{type(config).__name__} needs {', '.join(unfilled)}; build it with "
                             "roboscale.models.registry.build_policy(config, dataset_meta) to fill them from a dataset")
        self.config = config
        self.tokenizer = tokenizer

    # --- build ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer as a fresh policy (after ``to_empty``): each module's own
        ``reset_parameters``, children before their parent, so a parent's own rule (a zeroed modulation) wins."""
        for module in _children_first(self):
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def set_normalization(self, stats: Mapping[str, Mapping[str, Any]]) -> None:
        """State/action statistics from a LeRobot-style stats dict ({feature: {"mean": ..., "q01": ...}})."""
        for normalizer, key in ((self.state_normalizer, self.config.state_key),
                                (self.action_normalizer, self.config.action_key)):
            if key not in stats:
                raise ConfigError(f"no normalization statistics for {key!r} (stats has {sorted(stats)})")
            normalizer.set_stats(stats[key], key)

    # --- data -----------------------------------------------------------------------------------------------
    def delta_indices(self) -> dict[str, list[int]]:
        """Frame offsets the policy needs per feature (LeRobot's delta_timestamps, in frames)."""
        return {self.config.action_key: list(range(self.config.chunk_size))}

    def data_transforms(self) -> tuple[Any, Any]:
        """``(transform, collate)`` the loader's workers run (picklable), or ``(None, None)``."""
        return None, None

    # --- compute --------------------------------------------------------------------------------------------
    @property
    def flow_matching(self) -> FlowMatching:
        raise NotImplementedError

    def encode(self, batch: Any, *, cache: bool = False) -> Encoded:
        """A batch (training) or an observation (inference) ready for ``velocity``. ``cache``: keep what every
        Euler step of one observation shares (pi0.5's prefix keys/values)."""
        raise NotImplementedError

    def velocity(self, encoded: Encoded, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predicted dx/dt [B, T, A] of noisy normalized actions x_t at times t [B]."""
        raise NotImplementedError

    def parallel_units(self) -> list[nn.Module]:
        """The blocks FSDP / activation checkpointing / torch.compile wrap, in execution order."""
        raise NotImplementedError

    # --- the critic (PPO) -----------------------------------------------------------------------------------
    def add_value_head(self, feature_dim: int) -> None:
        """A policy's ``__init__`` ends with this: a value head on ``features`` when ``config.value_head_dim``."""
        from roboscale.models.value import ValueHead

        dim = getattr(self.config, "value_head_dim", 0)
        self.value_head = ValueHead(feature_dim, dim) if dim else None

    def features(self, encoded: Encoded) -> torch.Tensor:
        """float [B, D]: what the value head reads, from an ``encode``d observation."""
        raise NotImplementedError

    def value(self, encoded: Encoded) -> torch.Tensor:
        """float [B]: the value head's estimate of the return from this observation."""
        if self.value_head is None:
            raise ConfigError(f"this {self.name} policy has no value head (policy.value_head_dim is 0)")
        return self.value_head(self.features(encoded))

    # --- description ----------------------------------------------------------------------------------------
    @staticmethod
    def component_of(parameter_name: str) -> str:
        """The component a parameter belongs to, in the names users know (``roboscale model info``)."""
        return parameter_name.split(".")[0]

    flops_components: ClassVar[dict[str, str]] = {}
    """Parameter-name prefix -> the component of the policy's analytical FLOPs (its registry's
    ``flops_per_sample``: vision, language, action) that counts the parameter's compute; the longest prefix wins."""

    def flops_component_of(self, parameter_name: str) -> str:
        """The FLOPs component a parameter's compute is counted in (a frozen component trains no backward)."""
        matches = [p for p in self.flops_components if parameter_name == p or parameter_name.startswith(p + ".")]
        if not matches:
            raise KeyError(f"{type(self).__name__}.flops_components does not place the parameter {parameter_name!r}")
        return self.flops_components[max(matches, key=len)]

    def parameter_note(self, total: int) -> str:
        """How this count relates to the reference implementation's (what we leave out, and why)."""
        return ""

    @torch.no_grad()
    def predict_action_chunk(self, observation: Any, noise: torch.Tensor | None = None,
                             guide: ChunkGuide | None = None) -> torch.Tensor:
        """Actions [B, chunk_size, dataset_action_dim or action_dim] in the dataset's units (the dataset's width: a
        fine-tuned policy's padded dimensions are cropped), from noise by the policy's Euler steps. ``noise``
        [B, chunk_size, action_dim]: the starting point of each sample's flow (the rollout engine draws it per
        episode so that an episode's actions do not depend on the batch it was predicted in); default N(0, 1)
        from torch's generator.

        ``guide``: real-time chunking (``roboscale.models.rtc``): the actions each sample's robot has committed to,
        which its chunk is guided to agree with, at the cost of a backward pass through the action model per step
        (gradients reach the noisy actions only, never a parameter's ``.grad``; freezing the parameters,
        ``requires_grad_(False)``, also spares autograd what their gradients would need). A sample with no
        committed actions gets exactly its unguided chunk, and a batch with none takes the unguided sampler."""
        encoded = self.encode(observation, cache=True)
        device = next(self.parameters()).device
        shape = (encoded.batch_size, self.config.chunk_size, self.config.action_dim)
        if noise is None:
            noise = torch.randn(shape, device=device)
        elif tuple(noise.shape) != shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {shape}")
        noise = noise.to(device)
        actions = self.flow_matching.sample(lambda x, t: self.velocity(encoded, x, t), noise,
                                            self.config.num_inference_steps,
                                            None if guide is None else self._sampler_guide(guide, shape, device))
        return self.action_normalizer.unnormalize(actions)

    def _sampler_guide(self, guide: ChunkGuide, shape: tuple[int, int, int], device: torch.device) -> Guide | None:
        """``guide`` as the sampler takes it: normalized, at the model's width (a fine-tuned policy's padded
        dimensions, which the dataset has no values for, left unguided), with each sample's weights; None when no
        sample has committed actions."""
        b, t, width = shape
        data_width = self.action_normalizer.data_dim or width
        if tuple(guide.actions.shape) != (b, t, data_width):
            raise ValueError(f"guide.actions (the committed actions) has shape {tuple(guide.actions.shape)}, "
                             f"expected {(b, t, data_width)}")
        counts, delays = guide.count.tolist(), guide.delay.tolist()
        if len(counts) != b or len(delays) != b:
            raise ValueError(f"guide.count and guide.delay need one entry per sample ({b}), got {len(counts)} and "
                             f"{len(delays)}")
        if not any(counts):
            return None
        weights = torch.stack([prefix_weights(d, n, t, guide.schedule) for n, d in zip(counts, delays, strict=True)])
        dims = (torch.arange(width) < data_width).float()
        target = self.action_normalizer.normalize(guide.actions.to(device, torch.float32))
        return Guide(target, (weights[..., None] * dims).to(device), guide.max_guidance)

    @torch.no_grad()
    def sample_action_chain(self, observation: Any, noise: torch.Tensor, step_noise: torch.Tensor,
                            noise_level: float, stochastic: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``predict_action_chunk`` with the stochastic sampler (Flow-SDE, ``FlowMatching.sample_chain``): the
        actions in the dataset's units, the whole denoising chain [B, K + 1, T, action_dim] (normalized), from
        which the chunk's log-probability is recomputed in training, and the value head's estimate [B] of each
        observation (None without a value head: PPO's GAE takes the values of the weights that acted, as RLinf's
        rollouts record them). ``step_noise`` [B, K, T, action_dim]; ``stochastic`` [B, K] bool: the steps that
        draw noise (None: all)."""
        encoded = self.encode(observation, cache=True)
        device = next(self.parameters()).device
        chain = self.flow_matching.sample_chain(lambda x, t: self.velocity(encoded, x, t), noise.to(device),
                                                step_noise.to(device), self.config.num_inference_steps, noise_level,
                                                None if stochastic is None else stochastic.to(device))
        values = self.value(encoded) if self.value_head is not None else None
        return self.action_normalizer.unnormalize(chain[:, -1]), chain, values

    # --- persistence ----------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> Path:
        """Write config.json + model.safetensors (+ tokenizer.json) into ``directory``, each file atomically.
        ``state_dict``: the weights to write instead of this module's own (gathered from sharded ranks, or an
        average of weights)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_json(directory / CONFIG_NAME, to_dict(self.config))
        state = {k: v.detach().contiguous().cpu()
                 for k, v in (self.state_dict() if state_dict is None else state_dict).items()}
        with atomic_path(directory / WEIGHTS_NAME) as tmp:
            # one metadata key, as LeRobot writes: safetensors writes the map in hash order, so with two keys the
            # same weights saved twice differ byte for byte (and in the sha256 that eval and serve identify them by)
            save_file(state, str(tmp), metadata={"format": "pt"})
        if self.tokenizer is not None:
            self.tokenizer.save(directory / TOKENIZER_NAME)
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides: Any) -> Policy:
        """Load a policy from a checkpoint directory (``.../pretrained_model``), ours or (where the registry has
        an adapter) another framework's."""
        from roboscale.models.registry import spec_of_checkpoint

        directory = Path(directory)
        config_dict = read_policy_config(directory)
        spec = spec_of_checkpoint(config_dict, directory / CONFIG_NAME)
        if spec.foreign is not None and spec.foreign.detect(config_dict):
            return spec.foreign.loader()(directory, **overrides)  # e.g. a LeRobot pi0.5 checkpoint
        expected = getattr(cls, "name", None)
        if expected is not None and spec.name != expected:
            raise CheckpointError(directory / CONFIG_NAME, f"this checkpoint is a {spec.name!r} policy, not "
                                                           f"{expected!r}")
        config_dict.update(overrides)
        try:
            config = from_dict(PolicyConfig, config_dict, where=str(directory / CONFIG_NAME))
        except ConfigError as exc:
            raise CheckpointError(directory / CONFIG_NAME, str(exc)) from None
        tokenizer = TaskTokenizer.from_file(directory / TOKENIZER_NAME) if spec.uses_tokenizer else None
        policy = spec.policy_class()(config, tokenizer)
        # a value head added by an override (RL's PPO on a supervised checkpoint) starts fresh
        added = frozenset(name for name in policy.state_dict() if name.startswith("value_head.")) \
            if overrides.get("value_head_dim") and not read_policy_config(directory).get("value_head_dim") \
            else frozenset()
        policy.load_weights(directory / WEIGHTS_NAME, optional=added)
        return policy

    def load_weights(self, path: Path, optional: frozenset[str] = frozenset()) -> None:
        """Strict load: every tensor present with the shape the config implies, or one error listing the misfits
        (and, where the policy knows them, the config fields that set those shapes)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not path.is_file():
            raise CheckpointError(path, "weights file not found")
        try:
            state = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(path, f"not a readable safetensors file ({exc})") from None
        state = self.upgrade_state_dict(state)
        self.check_state_dict(state, path, optional)
        self.load_state_dict(state, strict=not optional)

    def check_state_dict(self, state: Mapping[str, torch.Tensor], path: Path, optional: frozenset[str] = frozenset()
                         ) -> None:
        """Every tensor present with the shape the config implies (``optional`` ones may be absent), or one
        CheckpointError listing the misfits and, where the policy knows them, the config fields that set those
        shapes."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state) - optional)
        unexpected = sorted(set(state) - set(own))
        misfits = [k for k in own if k in state and state[k].shape != own[k].shape]
        if not (missing or unexpected or misfits):
            return
        parts = []
        if misfits:
            parts.append("shape mismatch: " + "; ".join(
                f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(own[k].shape)}" for k in misfits[:5]))
        if missing:
            parts.append(f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        fields = self.shape_fields(misfits)
        hint = (f" The fields of config.json that set those shapes are {fields}; restore the values the "
                "checkpoint was trained with." if fields else " Was config.json edited?")
        raise CheckpointError(path, "weights do not match config.json (" + "; ".join(parts) + ")." + hint)

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensor names of older checkpoints -> today's (normalizer statistics were saved as ``a``/``b``)."""
        state = dict(state)
        for name, module in self.named_modules():
            if isinstance(module, Normalizer):
                module.upgrade_keys(f"{name}.", state)
        return state

    def shape_fields(self, tensor_names: list[str]) -> list[str]:
        """Config fields that set the shapes of these tensors (for load errors); [] when the policy does not say."""
        return []


def _children_first(module: nn.Module):
    for child in module.children():
        yield from _children_first(child)
    yield module


def resolve_checkpoint(path: str | Path) -> Path:
    """The ``pretrained_model`` directory a user means by ``path``: itself, a step directory's (checkpoints/<step>),
    or a training output directory's last checkpoint's (checkpoints/last). A ``pretrained_model`` directory is the
    checkpoint even when damaged: loading it names the missing file."""
    path = Path(path)
    for candidate in (path, path / PRETRAINED, path / "checkpoints" / "last" / PRETRAINED):
        if (candidate / CONFIG_NAME).is_file() or (candidate.name == PRETRAINED and candidate.is_dir()):
            return candidate.resolve()
    last = path / "checkpoints" / "last"
    if last.is_symlink() and not last.exists():
        raise CheckpointError(last, f"points to {os.readlink(last)}, which does not exist; pass a checkpoint "
                                    "directory (checkpoints/<step>) instead")
    if (path / "checkpoints").is_dir():
        raise CheckpointError(path / "checkpoints", "has no complete checkpoint (no `last`)")
    raise CheckpointError(path, "no policy checkpoint here (expected config.json + model.safetensors, a "
                                "checkpoints/<step> directory, or a training output directory)")


def read_policy_config(directory: Path) -> dict:
    path = directory / CONFIG_NAME
    if not directory.is_dir():
        raise CheckpointError(directory, "checkpoint directory not found")
    if not path.is_file():
        raise CheckpointError(path, "missing; a policy checkpoint needs config.json and model.safetensors")
    try:
        data = load_json(path.read_text())
    except ValueError as exc:  # JSON or UTF-8 decoding
        raise CheckpointError(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "type" not in data:
        raise CheckpointError(path, "has no 'type' field naming the policy (e.g. \"type\": \"pi05\")")
    if not isinstance(data["type"], str):
        raise CheckpointError(path, f"'type' must be a string naming the policy (e.g. \"pi05\"), got "
                                    f"{json.dumps(data['type'])}")
    return data
