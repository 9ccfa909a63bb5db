"""Dropout whose mask belongs to the sample, not to the process.

``nn.Dropout`` draws its mask from the process's RNG stream, so a sample's mask depends on which rank trains it
and what else is in its batch: a 2-rank run would not compute a 1-rank run's losses, and ranks seeded alike
would drop the same units of different samples. ``SampleDropout`` instead derives each element's keep/drop
decision from (the sample's seed, the module's site, the element's place within the sample) with a counter-based
hash, the loader's per-sample seed being a function of (seed, step, the sample's place in the global batch).
The same inputs give the same mask on any device and in any batch, and an activation-checkpointed block that is
recomputed during the backward pass redraws exactly the mask of its forward pass.

Without seeds (a batch that does not come from the loader) it is ``nn.Dropout``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_LOW32 = 0xFFFFFFFF

DropoutKeys = tuple[torch.Tensor, torch.Tensor] | None
"""(seeds, positions) of the tokens a ``SampleDropout`` sees (see ``keep_mask``); None: no per-sample seeds."""


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2**32 for x in [0, 2**32), in int64 without overflowing (two 16-bit halves)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _LOW32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: every input bit flips about half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def keep_mask(seeds: torch.Tensor, positions: torch.Tensor, site: int, width: int, p: float) -> torch.Tensor:
    """Bool [*S, width]: which elements to keep (probability 1 - p).

    ``seeds`` (int64) and ``positions`` (int64: the token's index within its sample) broadcast to the same shape
    ``S``, one entry per token; ``width`` is the feature size, ``site`` tells the dropout modules of a model apart.
    """
    seeds = seeds.to(torch.int64)
    key = _mix32((seeds & _LOW32) ^ _mix32(((seeds >> 32) & _LOW32) ^ _mix32(torch.tensor(site, device=seeds.device))))
    index = positions.to(torch.int64)[..., None] * width + torch.arange(width, device=positions.device)
    draws = _mix32(key[..., None] ^ _mix32(index & _LOW32))
    return draws >= int(p * 2**32)


class SampleDropout(nn.Module):
    """Dropout with per-sample masks (see the module's docstring). ``site`` is set by ``number_sites``."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} must be in [0, 1)")
        self.p = p
        self.site = 0

    def forward(self, x: torch.Tensor, keys: DropoutKeys = None) -> torch.Tensor:
        """x [..., D]; ``keys``: (seeds, positions), both broadcasting to x.shape[:-1] (see ``keep_mask``)."""
        if not self.training or self.p == 0.0:
            return x
        if keys is None:
            return F.dropout(x, self.p, training=True)
        seeds, positions = keys
        keep = keep_mask(seeds, positions, self.site, x.shape[-1], self.p)
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"


def number_sites(model: nn.Module) -> None:
    """Give each ``SampleDropout`` of ``model`` its own site, in module order (the same on every rank)."""
    for site, module in enumerate(m for m in model.modules() if isinstance(m, SampleDropout)):
        module.site = site
