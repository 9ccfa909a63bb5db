"""Normalization of state and actions, with the statistics stored as buffers so they travel with the weights.

The buffers are named after the statistics they hold (``mean``/``std``, ``min``/``max``, ``q01``/``q99``), as in
LeRobot's stats.json. Checkpoints written before that named them ``a``/``b``; ``upgrade_state_dict`` maps them.

A normalizer may be wider than its data (``data_dim`` < ``dim``): a policy fine-tuned from a checkpoint whose state
or action size is a padded maximum (pi0.5: 32, GR00T: 64/32). Then, as openpi and LeRobot do, inputs of the data's
width are zero-padded to ``dim`` (after normalization, a padded value stays 0), statistics of the data's width are
padded with the identity's, and ``unnormalize`` crops its output back to the data's width.

A degenerate q01..q99 band (``DEGENERATE_RANGE``: LeRobot's histogram quantiles can put q01 = q99 in a dimension
whose values span 0..3) would scale that dimension by ~1e6 and train at a loss of ~1e12; such dimensions are
normalized with min/max instead, said once in the log. The repair happens when statistics are set from a dataset
(``set_stats``), not in ``normalize``: the buffers hold what the policy was trained with, so a checkpoint written
before the repair still loads and behaves as it was trained.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

log = logging.getLogger(__name__)


class NormMode(str, Enum):
    IDENTITY = "identity"
    MEAN_STD = "mean_std"
    MIN_MAX = "min_max"  # [min, max] -> [-1, 1]
    QUANTILES = "quantiles"  # [q01, q99] -> [-1, 1], pi0.5's default


# The two statistics each mode reads, as keys of LeRobot's stats.json (and the names of the buffers).
STAT_KEYS = {
    NormMode.IDENTITY: (),
    NormMode.MEAN_STD: ("mean", "std"),
    NormMode.MIN_MAX: ("min", "max"),
    NormMode.QUANTILES: ("q01", "q99"),
}
_LEGACY = ("a", "b")  # the buffer names of older checkpoints, in STAT_KEYS order
# The statistics of padded dimensions: the identity map (0 -> 0, and back).
_IDENTITY = {NormMode.MEAN_STD: (0.0, 1.0), NormMode.MIN_MAX: (-1.0, 1.0), NormMode.QUANTILES: (-1.0, 1.0)}
DEGENERATE_RANGE = 1e-2
"""A dimension's q01..q99 band narrower than this fraction of its min..max range is degenerate: its extreme values
would normalize to ±200 or further (at q01 = q99, ±1e6 with the eps denominator) and dominate the loss."""


class Normalizer(nn.Module):
    """Maps one feature to a normalized space and back."""

    def __init__(self, dim: int, mode: NormMode | str, eps: float = 1e-6, data_dim: int = 0):
        super().__init__()
        self.mode = NormMode(mode)
        self.eps = eps
        self.dim = dim
        if not 0 <= data_dim <= dim:
            raise ValueError(f"data_dim {data_dim} must be in [0, dim={dim}]")
        # the data's width when narrower than ``dim`` (zero-padded on the way in, cropped on the way out); 0: dim
        self.data_dim = data_dim if data_dim != dim else 0
        for name in STAT_KEYS[self.mode]:
            self.register_buffer(name, torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """No statistics yet: the identity map's (centre 0 / low 0, spread 1 / high 1)."""
        for name, fill in zip(STAT_KEYS[self.mode], (0.0, 1.0), strict=False):
            getattr(self, name).fill_(fill)

    def set_stats(self, stats: Mapping, feature: str = "", *, repair: bool = True) -> None:
        """Fill from a LeRobot stats dict ({"mean": [...], "std": [...], "q01": ...}). ``repair``: min/max where a
        q01..q99 band is degenerate (a dataset's statistics); off for a checkpoint's own, used as they are."""
        keys = STAT_KEYS[self.mode]
        missing = [k for k in keys if k not in stats]
        if missing:
            raise ValueError(
                f"normalization mode {self.mode.value!r} of {feature!r} needs stats {missing}; "
                f"the dataset's stats.json has {sorted(stats)}"
            )
        values = {key: torch.as_tensor(stats[key], dtype=torch.float32).reshape(-1) for key in keys}
        if self.mode is NormMode.QUANTILES and repair:
            values = _min_max_where_degenerate(values, stats, feature)
        for key, fill in zip(keys, _IDENTITY.get(self.mode, ()), strict=True):
            value = values[key]
            if self.data_dim and value.numel() == self.data_dim:  # the padded dimensions map 0 to 0
                value = torch.cat([value, value.new_full((self.dim - self.data_dim,), fill)])
            if value.numel() != self.dim:
                raise ValueError(f"{feature!r}: {key} has {value.numel()} values, the policy expects "
                                 f"{self.data_dim or self.dim}")
            getattr(self, key).copy_(value)

    def stats(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, key) for key in STAT_KEYS[self.mode]}

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(self.mode, self.stats(), self.eps, _pad(x, self.dim, self.data_dim))

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return _crop(_unnormalize(self.mode, self.stats(), self.eps, x), self.data_dim)

    def snapshot(self) -> NormStats:
        """A plain, picklable CPU copy of the statistics (for data-loader workers)."""
        return NormStats(self.mode, {k: v.detach().cpu().clone() for k, v in self.stats().items()}, self.eps,
                         self.dim, self.data_dim)

    def upgrade_keys(self, prefix: str, state: dict[str, torch.Tensor]) -> None:
        """Rename this normalizer's tensors in an older checkpoint's ``state`` (``prefix.a``/``prefix.b``) in place;
        an identity normalizer's are dropped (it keeps no statistics)."""
        for legacy, key in zip(_LEGACY, STAT_KEYS[self.mode] or (None, None), strict=True):
            value = state.pop(f"{prefix}{legacy}", None)
            if value is not None and key is not None:
                state[f"{prefix}{key}"] = value


@dataclass
class NormStats:
    """The statistics of a ``Normalizer`` without the module: what data-loader workers normalize with."""

    mode: NormMode
    stats: dict[str, torch.Tensor]
    eps: float = 1e-6
    dim: int = 0
    data_dim: int = 0
    """As ``Normalizer.data_dim``: inputs this wide are zero-padded to ``dim``, outputs cropped back (0: no padding)."""

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return _normalize(self.mode, self.stats, self.eps, _pad(x, self.dim, self.data_dim))

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return _crop(_unnormalize(self.mode, self.stats, self.eps, x), self.data_dim)


def _min_max_where_degenerate(quantiles: dict[str, torch.Tensor], stats: Mapping, feature: str
                              ) -> dict[str, torch.Tensor]:
    """q01/q99 with min/max in the dimensions whose q01..q99 band is degenerate (``DEGENERATE_RANGE``); stats
    without min/max of the same size are left as they are (nothing to compare with)."""
    if "min" not in stats or "max" not in stats:
        return quantiles
    low, high = quantiles["q01"], quantiles["q99"]
    lo, hi = (torch.as_tensor(stats[k], dtype=torch.float32).reshape(-1) for k in ("min", "max"))
    if not low.shape == high.shape == lo.shape == hi.shape:
        return quantiles  # set_stats names the size that does not fit
    degenerate = (high - low).double() < DEGENERATE_RANGE * (hi - lo).double()
    if not degenerate.any():
        return quantiles
    dims = degenerate.nonzero().flatten().tolist()
    d = dims[0]
    log.warning("%s: the q01..q99 range of dims %s is under %g of their min..max range (dim %d: q01 %.6g, q99 %.6g, "
                "min %.6g, max %.6g); those dims are normalized with min/max instead", feature or "a feature",
                dims, DEGENERATE_RANGE, d, low[d], high[d], lo[d], hi[d])
    return {"q01": torch.where(degenerate, lo, low), "q99": torch.where(degenerate, hi, high)}


def _pad(x: torch.Tensor, dim: int, data_dim: int) -> torch.Tensor:
    """Zero-pad the last dimension of data-width ``x`` to the normalizer's ``dim`` (openpi's pad_to_dim)."""
    if data_dim and x.shape[-1] == data_dim:
        return torch.nn.functional.pad(x, (0, dim - data_dim))
    return x


def _crop(x: torch.Tensor, data_dim: int) -> torch.Tensor:
    return x[..., :data_dim] if data_dim else x


def _normalize(mode: NormMode, stats: Mapping[str, torch.Tensor], eps: float, x: torch.Tensor) -> torch.Tensor:
    if mode is NormMode.IDENTITY:
        return x
    if mode is NormMode.MEAN_STD:
        return (x - stats["mean"]) / (stats["std"] + eps)
    low, high = (stats[k] for k in STAT_KEYS[mode])
    return 2.0 * (x - low) / (high - low).clamp_min(eps) - 1.0


def _unnormalize(mode: NormMode, stats: Mapping[str, torch.Tensor], eps: float, x: torch.Tensor) -> torch.Tensor:
    if mode is NormMode.IDENTITY:
        return x
    if mode is NormMode.MEAN_STD:
        return x * (stats["std"] + eps) + stats["mean"]
    low, high = (stats[k] for k in STAT_KEYS[mode])
    return (x + 1.0) * 0.5 * (high - low).clamp_min(eps) + low
