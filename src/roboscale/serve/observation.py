"""What a robot client sends, checked and turned into the rollout engine's ``PredictItem``.

A layout says which client key feeds which policy input: each camera the checkpoint reads, its state (one key, or
several joined in order, as openpi's DROID client sends joints and gripper apart) and the instruction. Presets:
the checkpoint's own feature names (LeRobot's), and openpi's LIBERO and DROID example clients, whose cameras map to
the checkpoint's in order; ``--key_map`` renames any of them. Every check names the client's key and what was
expected, so a robot integrator reads the fix in the error frame. Images of any size are fitted to the policy's
input as in training (``resize_with_pad``), here per image, so observations of clients with other cameras still
batch together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from roboscale.errors import ConfigError
from roboscale.rollout.inference import PredictItem
from roboscale.utils.images import resize_with_pad

PROMPT = "prompt"
"""The instruction's feature name in ``--key_map`` (and openpi's key for it)."""
MAX_SEED = 2 ** 63
MAX_IMAGE_SIDE = 8192

_PRESET_CAMERAS = {
    "openpi_libero": ("observation/image", "observation/wrist_image"),
    "openpi_droid": ("observation/exterior_image_1_left", "observation/wrist_image_left"),
}
_PRESET_STATE = {
    "openpi_libero": ("observation/state",),
    "openpi_droid": ("observation/joint_position", "observation/gripper_position"),
}


class ObservationError(ValueError):
    """An observation the policy cannot take (one line naming the key, for the client's error frame)."""


OUT_OF_RANGE = 10.0
"""A state value, or a committed action, this many normalized units beyond the checkpoint's statistics (the q01..q99
or min..max band of its training data is [-1, 1]; mean_std: standard deviations) is refused: far outside anything
the policy was trained on, it yields meaningless (at 3e38: NaN) actions."""


@dataclass(frozen=True)
class Bounds:
    """The values of one input the server accepts, per dimension, in the dataset's units."""

    low: np.ndarray
    high: np.ndarray

    @classmethod
    def of(cls, normalizer: Any) -> Bounds | None:
        """``OUT_OF_RANGE`` normalized units either side, in the data's width; None for an identity normalizer
        (no statistics to judge by: only finiteness is checked)."""
        if getattr(normalizer.mode, "value", normalizer.mode) == "identity":
            return None
        if isinstance(normalizer, torch.nn.Module):
            with torch.no_grad():
                low = normalizer.unnormalize(torch.full((normalizer.dim,), -OUT_OF_RANGE)).numpy()
                high = normalizer.unnormalize(torch.full((normalizer.dim,), OUT_OF_RANGE)).numpy()
        else:  # an exported policy's statistics (``deploy.runtime.Normalization``): the same map in numpy
            low = normalizer.unnormalize(np.full((normalizer.dim,), -OUT_OF_RANGE, np.float32))
            high = normalizer.unnormalize(np.full((normalizer.dim,), OUT_OF_RANGE, np.float32))
        return cls(np.minimum(low, high).astype(np.float32), np.maximum(low, high).astype(np.float32))

    def check(self, values: np.ndarray, key: str, what: str) -> None:
        outside = np.flatnonzero(((values < self.low) | (values > self.high)).reshape(-1, len(self.low)).any(0))
        if outside.size:
            i = int(outside[0])
            worst = values.reshape(-1, len(self.low))[:, i]
            value = float(worst[np.argmax(np.abs(worst - (self.low[i] + self.high[i]) / 2))])
            raise ObservationError(f"{key!r} dimension {i} is {value:.6g}, far outside the checkpoint's {what} "
                                   f"statistics (accepted: {self.low[i]:.6g} .. {self.high[i]:.6g}, "
                                   f"{OUT_OF_RANGE:g} normalized units either side of its training data)")

    def describe(self) -> dict[str, list[float]]:
        return {"low": self.low.tolist(), "high": self.high.tolist()}


@dataclass(frozen=True)
class ObservationLayout:
    cameras: dict[str, str]
    """The policy's camera name (``observation.images.<name>``) -> the client's key."""
    state: tuple[str, ...]
    """The client's keys joined, in order, into the state."""
    prompt: tuple[str, ...]
    """The client's keys the instruction may come under (the first present is taken)."""
    state_dim: int
    action_dim: int
    chunk_size: int
    image_size: int
    rtc: bool = False
    """Whether requests may carry ``committed`` and ``delay`` (real-time chunking)."""
    max_prompt_chars: int = 2000
    state_bounds: Bounds | None = None
    """The state values accepted (None: any finite value)."""
    action_bounds: Bounds | None = None
    """The committed actions accepted (None: any finite value)."""

    @classmethod
    def for_policy(cls, policy: Any, preset: str, key_map: dict[str, str], rtc: bool = False,
                   max_prompt_chars: int = 2000) -> ObservationLayout:
        """The layout of ``preset`` for this policy, ``key_map`` applied over it; ConfigError naming the option
        when a camera has no key or a ``key_map`` entry names no input of the policy. The accepted ranges of the
        state and of committed actions come from the policy's normalization statistics (``Bounds``)."""
        policy_cfg = policy.config
        names = [key.removeprefix("observation.images.") for key in policy_cfg.image_keys]
        if preset == "checkpoint":
            cameras = {name: f"observation.images.{name}" for name in names}
            state: tuple[str, ...] = (policy_cfg.state_key,)
            prompt: tuple[str, ...] = (PROMPT, "task")
        else:
            cameras = dict(zip(names, _PRESET_CAMERAS[preset], strict=False))
            state, prompt = _PRESET_STATE[preset], (PROMPT,)
        for feature, client_key in key_map.items():
            if feature.startswith("observation.images.") and feature.removeprefix("observation.images.") in names:
                cameras[feature.removeprefix("observation.images.")] = client_key
            elif feature == policy_cfg.state_key:
                state = tuple(client_key.split("+"))
            elif feature == PROMPT:
                prompt = (client_key,)
            else:
                inputs = [*policy_cfg.image_keys, policy_cfg.state_key, PROMPT]
                raise ConfigError(f"--key_map: {feature!r} is not an input of this policy (its inputs: {inputs})")
        unmapped = [name for name in names if name not in cameras]
        if unmapped:
            raise ConfigError(f"--keys={preset} names {len(_PRESET_CAMERAS.get(preset, ()))} cameras; this policy "
                              f"also reads {['observation.images.' + n for n in unmapped]}: give their keys with "
                              "--key_map")
        return cls(cameras, state, prompt, policy_cfg.dataset_state_dim or policy_cfg.state_dim,
                   policy_cfg.dataset_action_dim or policy_cfg.action_dim, policy_cfg.chunk_size,
                   policy_cfg.image_size, rtc, max_prompt_chars, Bounds.of(policy.state_normalizer),
                   Bounds.of(policy.action_normalizer))

    def describe(self) -> dict[str, Any]:
        """The layout for the server's metadata: what a client must send."""
        return {"images": dict(self.cameras), "state": list(self.state), "state_dim": self.state_dim,
                "prompt": list(self.prompt), "image_size": self.image_size, "action_dim": self.action_dim,
                "chunk_size": self.chunk_size, "optional": ["seed", "chunk_index"] + (
                    ["committed", "delay"] if self.rtc else []),
                "max_prompt_chars": self.max_prompt_chars,
                "accepted": {"state": None if self.state_bounds is None else self.state_bounds.describe(),
                             "committed": None if self.action_bounds is None else self.action_bounds.describe(),
                             "rule": f"values beyond {OUT_OF_RANGE:g} normalized units of the checkpoint's "
                                     "statistics are refused"}}

    def parse(self, observation: Any, default_seed: int) -> PredictItem:
        """A client's observation as a ``PredictItem`` (``default_seed``: the noise seed when it sends none)."""
        if not isinstance(observation, dict) or not all(isinstance(k, str) for k in observation):
            raise ObservationError("an observation must be a map of string keys to values")
        images = {name: _image(observation, key, self.image_size) for name, key in self.cameras.items()}
        state = np.concatenate([_numbers(observation, key) for key in self.state])
        if state.shape != (self.state_dim,):
            where = "+".join(self.state)
            raise ObservationError(f"{where!r} has {state.size} values; this policy reads a state of {self.state_dim}")
        if self.state_bounds is not None:
            self.state_bounds.check(state, "+".join(self.state), "state")
        seed = _integer(observation, "seed", default_seed, MAX_SEED)
        chunk_index = _integer(observation, "chunk_index", 0, MAX_SEED)
        committed, delay = self._committed(observation)
        return PredictItem(0, seed, chunk_index, self._instruction(observation), state, images, committed, delay)

    def _instruction(self, observation: dict) -> str:
        for key in self.prompt:
            if key in observation:
                value = observation[key]
                if isinstance(value, bytes):
                    value = value.decode("utf-8", errors="replace")
                if not isinstance(value, str):
                    raise ObservationError(f"{key!r} must be a string (the task instruction), got "
                                           f"{type(value).__name__}")
                if len(value) > self.max_prompt_chars:
                    raise ObservationError(f"{key!r} has {len(value)} characters; this server takes at most "
                                           f"{self.max_prompt_chars} (--max_prompt_chars)")
                return value
        raise ObservationError(f"missing key {self.prompt[0]!r} (the task instruction, a string)")

    def _committed(self, observation: dict) -> tuple[np.ndarray | None, int]:
        if "committed" not in observation:
            if "delay" in observation:
                raise ObservationError("'delay' was sent without 'committed'")
            return None, 0
        if not self.rtc:
            raise ObservationError("'committed' needs real-time chunking: start the server with --rtc")
        committed = _numbers(observation, "committed", ndim=2)
        if committed.shape[1] != self.action_dim or not 0 < committed.shape[0] <= self.chunk_size:
            raise ObservationError(f"'committed' has shape {list(committed.shape)}; expected [n, {self.action_dim}] "
                                   f"with 1 <= n <= {self.chunk_size} (the previous chunk's actions not yet executed)")
        if self.action_bounds is not None:
            self.action_bounds.check(committed, "committed", "action")
        delay = _integer(observation, "delay", 0, committed.shape[0] + 1)
        return committed, delay


def _image(observation: dict, key: str, size: int) -> np.ndarray:
    """The image under ``key`` as H x W x 3 uint8 at the policy's size (HWC or CHW; uint8, or float in [0, 1])."""
    if key not in observation:
        raise ObservationError(f"missing key {key!r} (a camera image: H x W x 3 uint8)")
    image = observation[key]
    if not isinstance(image, np.ndarray) or image.ndim != 3 or 3 not in (image.shape[0], image.shape[-1]):
        shape = list(image.shape) if isinstance(image, np.ndarray) else type(image).__name__
        raise ObservationError(f"{key!r} must be an image array of H x W x 3 (or 3 x H x W), got {shape}")
    chw = image if image.shape[-1] != 3 else image.transpose(2, 0, 1)
    if max(chw.shape[1:]) > MAX_IMAGE_SIDE or min(chw.shape[1:]) == 0:
        raise ObservationError(f"{key!r} has shape {list(image.shape)}; sides must be 1..{MAX_IMAGE_SIDE}")
    if image.dtype != np.uint8:
        if image.dtype.kind != "f":
            raise ObservationError(f"{key!r} must be uint8 (or float in [0, 1]), got {image.dtype}")
        if not np.isfinite(image).all():
            raise ObservationError(f"{key!r} has NaN or infinite values")
        chw = (np.clip(chw, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    fitted = resize_with_pad(torch.tensor(chw), size)  # a copy: a received array is read-only
    return fitted.numpy().transpose(1, 2, 0)


def _numbers(observation: dict, key: str, ndim: int = 1) -> np.ndarray:
    """A finite float32 array of ``ndim`` dimensions under ``key`` (a numpy array or a list of numbers)."""
    if key not in observation:
        raise ObservationError(f"missing key {key!r}")
    value = observation[key]
    if isinstance(value, list | tuple):
        try:
            value = np.asarray(value, dtype=np.float32)
        except (TypeError, ValueError):
            raise ObservationError(f"{key!r} must be numbers") from None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "biuf":
        raise ObservationError(f"{key!r} must be a numeric array, got {type(value).__name__}")
    value = value.astype(np.float32)
    if value.ndim == ndim + 1 and value.shape[0] == 1:  # a batch of one, as some clients send
        value = value[0]
    if value.ndim != ndim:
        raise ObservationError(f"{key!r} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape "
                               f"{list(value.shape)}")
    if not np.isfinite(value).all():
        raise ObservationError(f"{key!r} has NaN or infinite values")
    return value


def _integer(observation: dict, key: str, default: int, below: int) -> int:
    value = observation.get(key, default)
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < below:
        raise ObservationError(f"{key!r} must be an integer in [0, {below}), got {value!r}")
    return value
