"""Policy weights as they travel to the processes that predict: safetensors bytes, never a pickle (a pickled state
dict runs code when it is loaded; safetensors is tensors and a JSON header)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """The state's tensors (detached, contiguous, on the CPU) as one safetensors blob."""
    from safetensors.torch import save

    return save({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()})


def decode_state(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)
