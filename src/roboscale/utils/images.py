"""Fitting camera frames of any size into a policy's square input (pi0's ``resize_with_pad``).

Real datasets mix camera sizes (a 480x640 scene camera beside a 224x224 wrist camera), so every path that
batches cameras together (the policies' transforms, the lake's shards) fits each frame on its own first: the
longer side becomes ``size`` and the image is centred on black, so a policy never sees a squashed scene.
``stretch`` fills the square instead. Frames already at the target size are returned untouched (bit-exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RESIZE_MODES = ("pad", "stretch")


def fitted_size(height: int, width: int, size: int, mode: str = "pad") -> tuple[int, int]:
    """(height, width) of the image content inside the ``size`` square."""
    if mode not in RESIZE_MODES:
        raise ValueError(f"resize mode must be one of {RESIZE_MODES}, got {mode!r}")
    if mode == "stretch":
        return size, size
    scale = min(size / height, size / width)
    return max(1, round(height * scale)), max(1, round(width * scale))


def resize_with_pad(images: torch.Tensor, size: int, mode: str = "pad") -> torch.Tensor:
    """``[..., C, H, W]`` (uint8, or float in any range) -> ``[..., C, size, size]`` of the same dtype.

    Antialiased bilinear. uint8 frames on the CPU stay uint8 throughout: torch's uint8 kernel (the one
    torchvision's Resize uses) is ~25x faster than converting to float and within one level of it."""
    height, width = images.shape[-2:]
    if (height, width) == (size, size):
        return images
    content_h, content_w = fitted_size(height, width, size, mode)
    lead = images.shape[:-3]
    # a 4-D batch as it is: a channels-last view (frames decoded HWC) keeps torch's faster channels-last kernel
    flat = images if images.dim() == 4 else images.reshape(-1, *images.shape[-3:])
    native = images.dtype == torch.uint8 and images.device.type == "cpu"
    work = flat if native or images.is_floating_point() else flat.float()
    resized = work if (content_h, content_w) == (height, width) else F.interpolate(
        work, size=(content_h, content_w), mode="bilinear", antialias=True, align_corners=False)
    if resized.dtype != images.dtype:
        resized = resized.round().clamp(0, 255).to(images.dtype)
    if (content_h, content_w) != (size, size):
        top, left = (size - content_h) // 2, (size - content_w) // 2
        canvas = resized.new_zeros((*resized.shape[:-2], size, size))
        canvas[..., top:top + content_h, left:left + content_w] = resized
        resized = canvas
    return resized.reshape(*lead, *resized.shape[-3:])


def signed_unit_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (or [0, 1] float) ``[..., 3, H, W]`` -> float ``[..., 3, size, size]`` in [-1, 1] (SigLIP's input
    range), fitted by ``resize_with_pad``."""
    images = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    return resize_with_pad(images, size) * 2.0 - 1.0
