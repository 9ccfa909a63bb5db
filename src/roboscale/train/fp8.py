"""FP8 training of a policy's large Linear layers (torchao float8, tensorwise dynamic scaling).

Which layers convert is the policy's choice, stated in its registry entry (``PolicySpec.fp8_filter``); both
policies use ``roboscale.models.layers.fp8_eligible``. The filter converts the ``nn.Linear`` layers of the
transformer blocks (ViT, language model, action expert / VL self-attention / DiT) and leaves in full precision:

- layers narrower than ``FP8_MIN_FEATURES`` (1024) or with a dimension that is not a multiple of 16: the FP8 GEMM
  needs 16-aligned shapes, and below ~1k features the casts (an amax and a scaled copy of each input, weight and
  gradient) cost more than the faster GEMM saves (torchao's microbenchmarks: 0.8x at 1024x2048x1024, 1.4x at
  4096x8192x16384). At the full presets this keeps e.g. pi0.5's multi-query k/v projections (256 wide) in bf16;
- the vision stem (patch embedding) and the projector into the language model: the stem reads raw pixels, so its
  rounding error reaches every later layer, and both are a sliver of the FLOPs;
- the first and last layers of the flow, i.e. the action in/out projections, the state projection, the time MLP,
  GR00T's per-embodiment encoders/decoder and the DiT's output projections: their error reaches the predicted
  velocity without a later layer to average it out, and they are small (tokens x 32 actions);
- the adaLN / adaRMSNorm modulations: one row per sample (nothing to gain) whose error scales every token of a
  block.

Call ``apply_fp8`` on the plain policy before activation checkpointing, ``torch.compile`` and FSDP wrap it (the
swap replaces Linear children in place; parameter names, hence checkpoints, are unchanged). With FSDP, torchao's
float8 all-gather sends the converted weights in FP8 (half the bytes), and the trainer calls
``fp8_after_optimizer_step(policy)`` after every ``optimizer.step()``: it computes the next step's weight scales
with one all-reduce for all layers instead of one per layer during forward.

On CPU torchao's emulation runs the same casts with fp32 matmuls (tests); real FP8 GEMMs need compute capability
8.9+ (Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from roboscale.errors import ConfigError
from roboscale.utils.imports import load

log = logging.getLogger(__name__)


def check_fp8_device(device: torch.device) -> None:
    """Refuse a CUDA device without FP8 tensor cores (a user's choice of --fp8 on the wrong GPU)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"--fp8: {name} (compute capability {major}.{minor}) has no FP8 matmul; FP8 needs "
                              "sm89+ (Ada, Hopper, Blackwell): train without --fp8")
    elif device.type != "cpu":
        raise ConfigError(f"--fp8: FP8 training runs on CUDA (sm89+) or, emulated, on CPU; not on {device.type}")


def fp8_filter_of(policy: nn.Module, min_features: int | None = None):
    """The policy's registered filter as ``(name, module) -> bool``, with ``min_features`` threaded through."""
    from roboscale.models.registry import get_spec

    spec = get_spec(policy.name)
    if spec.fp8_filter is None:
        raise ConfigError(f"--fp8: policy {policy.name!r} states no FP8 filter in its registry entry")
    function = load(spec.fp8_filter)
    return function if min_features is None else partial(function, min_features=min_features)


def apply_fp8(policy: nn.Module, *, device: torch.device, fsdp: bool, min_features: int | None = None) -> list[str]:
    """Convert the Linear layers the policy's FP8 filter picks to torchao ``Float8Linear`` (in place) and return
    their names. ``fsdp``: send converted weights in FP8 in FSDP2's all-gathers (then call
    ``fp8_after_optimizer_step`` after each optimizer step). ``min_features`` lowers the width floor (tests)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    device = torch.device(device)
    check_fp8_device(device)
    chosen = fp8_filter_of(policy, min_features)
    names = [name for name, module in policy.named_modules() if chosen(name, module)]
    if not names:
        log.warning("fp8: no Linear layer of %s passes its FP8 filter; nothing converted", policy.name)
        return []
    config = Float8LinearConfig(emulate=device.type == "cpu", enable_fsdp_float8_all_gather=fsdp)
    wanted = set(names)
    convert_to_float8_training(policy, module_filter_fn=lambda module, fqn: fqn in wanted, config=config)
    return names


def fp8_after_optimizer_step(policy: nn.Module) -> None:
    """Per-step FP8 hook for FSDP: the next forward's scales of every FP8-gathered weight, in one all-reduce.
    Call after ``optimizer.step()`` on every rank; a no-op without FSDP's float8 all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(policy)


def converted_layers(policy: nn.Module) -> list[str]:
    """Names of the layers running in FP8 (for logs and tests)."""
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, module in policy.named_modules() if isinstance(module, Float8Linear)]
