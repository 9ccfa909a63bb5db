"""Depth-map video features (LeRobot 0.6): 12-bit log-quantized depth in a ``gray12le`` HEVC stream.

Facts from LeRobot 0.6.1 (``configs/video.py``, ``datasets/depth_utils.py``, ``datasets/video_utils.py``,
``datasets/dataset_metadata.py``, ``datasets/compute_stats.py``):

- a video feature is a depth map when its ``info`` has ``is_depth_map: true`` (0.4.4 wrote ``video.is_depth_map``;
  some converters a separate ``video_info`` block). The encoder is HEVC, ``gray12le``, ``x265-params lossless=1``,
  and info records ``video.depth_min`` / ``video.depth_max`` / ``video.shift`` (metres; defaults 0.01, 10, 3.5),
  ``video.use_log`` (default true) and ``depth_unit`` ("mm" when the recorded frames were integers, "m" for floats);
- quantization maps depth ``d`` (in the recorded unit, the metre parameters converted to it) to a code in
  ``0..4095``: ``rint(4095 * (log(d + shift) - log(min + shift)) / (log(max + shift) - log(min + shift)))``
  (linear in ``d`` when ``use_log`` is false), clipped;
- reading decodes the codes (``gray12le``), maps them back through the inverse, clips to ``[min, max]`` metres and
  returns float32 ``[1, H, W]`` in millimetres (rounded to whole mm; LeRobot's default) or metres;
- stats of a depth feature stay in the recorded unit (not divided by 255) and are converted to the output unit
  when read (``rescale_depth_stats``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

DEPTH_QMAX = 4095  # 12-bit codes
DEPTH_PIX_FMT = "gray12le"
METRE, MILLIMETRE = "m", "mm"
DEPTH_UNITS = (METRE, MILLIMETRE)
MM_PER_METRE = 1000.0


def is_depth_map(feature: Mapping[str, Any]) -> bool:
    """The feature is a depth map, by any marker LeRobot wrote or reads (``is_depth_map`` in ``info``, the 0.4.x
    ``video.is_depth_map``, or a ``video_info`` block's)."""
    info = feature.get("info") or {}
    video_info = feature.get("video_info") or {}
    return bool(info.get("is_depth_map") or info.get("video.is_depth_map") or video_info.get("video.is_depth_map"))


@dataclass(frozen=True)
class DepthQuantization:
    """How a depth feature's codes map to distance (``depth_min``/``depth_max``/``shift`` in metres)."""

    depth_min: float = 0.01
    depth_max: float = 10.0
    shift: float = 3.5
    use_log: bool = True
    unit: str | None = None  # the recorded unit (info's ``depth_unit``): what its stats are in

    @classmethod
    def of(cls, feature: Mapping[str, Any]) -> DepthQuantization:
        """From a feature's info (missing keys take LeRobot's defaults); ValueError naming the bad key."""
        info = {**(feature.get("video_info") or {}), **(feature.get("info") or {})}
        values: dict[str, Any] = {}
        for name in ("depth_min", "depth_max", "shift"):
            value = info.get(f"video.{name}")
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"'video.{name}' must be a number, got {value!r}")
                values[name] = float(value)
        if info.get("video.use_log") is not None:
            if not isinstance(info["video.use_log"], bool):
                raise ValueError(f"'video.use_log' must be true or false, got {info['video.use_log']!r}")
            values["use_log"] = info["video.use_log"]
        unit = info.get("depth_unit")
        if unit is not None and unit not in DEPTH_UNITS:
            raise ValueError(f"'depth_unit' must be one of {list(DEPTH_UNITS)}, got {unit!r}")
        q = cls(**values, unit=unit)
        if not q.depth_min < q.depth_max:
            raise ValueError(f"'video.depth_min' ({q.depth_min}) must be below 'video.depth_max' ({q.depth_max})")
        if q.use_log and q.depth_min + q.shift <= 0:
            raise ValueError(f"'video.depth_min' + 'video.shift' = {q.depth_min + q.shift} must be positive for "
                             "log quantization")
        return q

    def _scale_offset(self) -> tuple[float, float]:
        if self.use_log:
            lo, hi = math.log(self.depth_min + self.shift), math.log(self.depth_max + self.shift)
        else:
            lo, hi = self.depth_min, self.depth_max
        return (hi - lo) / DEPTH_QMAX, lo

    def dequantize(self, codes: np.ndarray, unit: str = MILLIMETRE) -> np.ndarray:
        """float32 depth in ``unit`` from 12-bit codes (any shape); millimetres are rounded to whole mm."""
        if unit not in DEPTH_UNITS:
            raise ValueError(f"depth unit must be one of {list(DEPTH_UNITS)}, got {unit!r}")
        scale, offset = self._scale_offset()
        metres = np.asarray(codes, dtype=np.float64) * scale + offset
        if self.use_log:
            metres = np.exp(metres) - self.shift
        metres = np.clip(metres, self.depth_min, self.depth_max)
        if unit == METRE:
            return metres.astype(np.float32)
        return np.rint(metres * MM_PER_METRE).astype(np.float32)

    def quantize(self, depth: np.ndarray, unit: str) -> np.ndarray:
        """uint16 codes in 0..4095 of ``depth`` given in ``unit`` (what LeRobot's recorder stores)."""
        if unit not in DEPTH_UNITS:
            raise ValueError(f"depth unit must be one of {list(DEPTH_UNITS)}, got {unit!r}")
        metres = np.asarray(depth, dtype=np.float64) / (MM_PER_METRE if unit == MILLIMETRE else 1.0)
        scale, offset = self._scale_offset()
        values = np.log(np.maximum(metres + self.shift, 1e-12)) if self.use_log else metres
        return np.clip(np.rint((values - offset) / scale), 0, DEPTH_QMAX).astype(np.uint16)


def rescale_depth_stats(stats: Mapping[str, np.ndarray], stored: str | None, unit: str) -> dict[str, np.ndarray]:
    """A depth feature's stats converted from the recorded unit to ``unit`` (``count`` untouched); unchanged when
    the recorded unit is unknown (LeRobot then warns and returns frames and stats as they are)."""
    if stored is None or stored == unit:
        return dict(stats)
    factor = MM_PER_METRE if stored == METRE else 1.0 / MM_PER_METRE
    return {name: value if name == "count" else np.asarray(value, dtype=np.float64) * factor
            for name, value in stats.items()}
