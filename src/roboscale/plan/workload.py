"""What a policy config implies for the scaling model: FLOPs per sample, weights moved per step, data per sample.

The policy is built on the meta device (no memory, about a second at full size) to count its parameters, the
trainable ones, the FP8-converted ones and its parallel units. Loader costs come from ``benchmarks/loader.py``
as recorded in docs/benchmarks.md (2 cameras at 224², 2026-11-29/30, 2-core machine):

    lake shards  0.51-0.56 ms CPU per sample -> LAKE_MS_PER_FRAME = 0.27 ms per camera frame
    raw v3 (AV1) 1.47-1.62 ms CPU per sample -> RAW_MS_PER_FRAME  = 0.78 ms per camera frame

scaled by cameras and by pixels (image_size / 224)^2 (the benchmark's 480² run cost 4.6x its 224² one, the pixel
ratio). Raw decoding really scales with the source video's size, which the config does not know: give
``ms_per_frame`` for other sources.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from roboscale.errors import ConfigError
from roboscale.models.config import PolicyConfig
from roboscale.plan.model import Workload

LAKE_MS_PER_FRAME = 0.27
RAW_MS_PER_FRAME = 0.78
BENCH_IMAGE_SIZE = 224
SOURCES = {"lake": LAKE_MS_PER_FRAME, "raw": RAW_MS_PER_FRAME}

# Fields a build fills from the dataset, for presets that leave them to it: a MetaWorld-shaped dataset.
DATASET_DEFAULTS = dict(image_keys=["observation.images.corner2", "observation.images.wrist"], state_dim=4,
                        action_dim=4, vocab_size=512)

GATHER_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2}
"""Bytes per weight in FSDP's all-gather (the trainer's MixedPrecisionPolicy param_dtype; FP8-converted weights
take 1 byte with torchao's float8 all-gather, counted apart)."""
REDUCE_BYTES = 4
"""Gradients are reduced in fp32 (the trainer's reduce_dtype)."""


@dataclass(frozen=True)
class DataCost:
    source: str = "lake"
    ms_per_frame: float = 0.0
    """CPU ms per camera frame at the policy's image size (0: the benchmark figure of ``source``)."""


def filled(config: PolicyConfig) -> PolicyConfig:
    """A copy of ``config`` with the dataset-derived fields a preset leaves empty filled (MetaWorld's)."""
    config = copy.deepcopy(config)
    for name, value in DATASET_DEFAULTS.items():
        if hasattr(config, name) and not getattr(config, name):
            setattr(config, name, value)
    return config


def workload_of(config: PolicyConfig, *, precision: str = "bf16", data: DataCost = DataCost(),
                shard_frozen: bool = True) -> Workload:
    """The Workload of training ``config``'s policy at ``precision`` (fp32 | bf16 | fp8) from ``data.source``.
    ``shard_frozen``: frozen weights are sharded and gathered like the rest (false: replicated, never moved)."""
    import torch

    from roboscale.models.registry import get_spec
    from roboscale.train.flops import flops_per_sample
    from roboscale.train.fp8 import fp8_filter_of

    if precision not in GATHER_BYTES:
        raise ConfigError(f"--precision must be one of {', '.join(GATHER_BYTES)}, got {precision!r}")
    if data.source not in SOURCES:
        raise ConfigError(f"--data.source must be one of {', '.join(SOURCES)}, got {data.source!r}")
    config = filled(config)
    spec = get_spec(type(config).type)
    flops = flops_per_sample(config)
    with torch.device("meta"):
        policy = spec.policy_class()(config)
    converted = set()
    if precision == "fp8":
        chosen = fp8_filter_of(policy)
        converted = {f"{name}.weight" for name, module in policy.named_modules() if chosen(name, module)}
    params = trainable = gather = frozen_gather = 0
    for name, param in policy.named_parameters():
        n = param.numel()
        params += n
        size = n * (1 if name in converted else GATHER_BYTES[precision])
        if param.requires_grad:
            trainable += n
            gather += size
        elif shard_frozen:
            frozen_gather += size
    # frozen weights are gathered again for backward only if gradients flow through them to something that trains
    frozen_backward = any(c.backprop and not c.trains for c in flops.components)
    cams = len(config.image_keys)
    frame_bytes = 3 * config.image_size**2  # uint8 frames at the policy's size (a lake stores them so)
    numbers = 4 * (config.state_dim + config.chunk_size * config.action_dim)
    tokens = 4 * getattr(config, "max_language_tokens", 0)
    ms = data.ms_per_frame or SOURCES[data.source] * (config.image_size / BENCH_IMAGE_SIZE) ** 2
    return Workload(
        name=type(config).type,
        flops_per_sample=float(flops),
        params=params,
        trainable_params=trainable,
        gather_bytes=gather + frozen_gather,
        backward_gather_bytes=gather + (frozen_gather if frozen_backward else 0),
        grad_bytes=REDUCE_BYTES * trainable,
        units=len(policy.parallel_units()) + 1,
        bytes_per_sample=cams * frame_bytes + numbers + tokens,
        core_s_per_sample=cams * ms / 1e3,
    )
