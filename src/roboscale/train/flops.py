"""FLOPs per training sample and the device's peak rate: the two numbers MFU divides.

- ``flops_per_sample(config)``: the policy's analytical count (its registry entry, ``roboscale.models.flops`` has
  the rules), from the config alone at its nominal token counts;
- ``peak_flops(device, precision)``: datasheet dense tensor-core figures for known GPUs; otherwise (CPU, an
  unknown GPU) a measured GEMM rate, timed once per process and cached. The second value says which it is, so a
  logged MFU always carries its denominator's source.

MFU = flops_per_sample x samples/s / (peak x ranks).
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from roboscale.errors import ConfigError
from roboscale.models.config import PolicyConfig
from roboscale.models.flops import SampleFlops

PRECISIONS = ("fp32", "tf32", "bf16", "fp8")


def flops_per_sample(config: PolicyConfig, frozen: Iterable[str] = ()) -> SampleFlops:
    """FLOPs of one training sample of ``config``'s policy by component ("vision", "language", "action");
    ``frozen`` names components to count as frozen on top of what the config freezes."""
    from roboscale.models.registry import get_spec

    function = get_spec(type(config).type).flops_function()
    if function is None:
        raise ConfigError(f"policy {type(config).type!r} states no FLOPs function in its registry entry")
    flops = function(config)
    return flops.frozen(frozen) if frozen else flops


@dataclass(frozen=True)
class GpuSpec:
    """Dense (no 2:4 sparsity) tensor-core peaks from NVIDIA's datasheets, in FLOP/s per GPU."""

    key: str
    """The name ``roboscale plan --gpu`` takes."""
    pattern: str
    """Regular expression matched against ``torch.cuda.get_device_name()``."""
    bf16: float
    fp8: float | None
    tf32: float
    fp32: float
    nvlink_GBps: float
    """GPU-to-GPU bandwidth inside a node, both directions together: NVLink, or PCIe for PCIe cards."""

    def peak(self, precision: str) -> float | None:
        return getattr(self, precision)


T = 1e12
# Most specific first: "H100 NVL" before "H100". SXM parts unless named otherwise.
GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("gb200", r"\bGB200\b", 2500 * T, 5000 * T, 1250 * T, 80 * T, 1800),
    GpuSpec("b200", r"\bB200\b", 2250 * T, 4500 * T, 1125 * T, 75 * T, 1800),
    GpuSpec("h200-nvl", r"\bH200 NVL\b", 835.5 * T, 1670.5 * T, 417.5 * T, 60 * T, 900),
    GpuSpec("h200", r"\bH200\b", 989.5 * T, 1979 * T, 494.5 * T, 67 * T, 900),
    GpuSpec("h100-nvl", r"\bH100 NVL\b", 835.5 * T, 1670.5 * T, 417.5 * T, 60 * T, 600),
    GpuSpec("h100-pcie", r"\bH100 PCIe\b", 756 * T, 1513 * T, 378 * T, 51 * T, 128),
    GpuSpec("h100", r"\bH100\b", 989.5 * T, 1979 * T, 494.5 * T, 67 * T, 900),
    GpuSpec("h800", r"\bH800\b", 989.5 * T, 1979 * T, 494.5 * T, 67 * T, 400),
    GpuSpec("h20", r"\bH20\b", 148 * T, 296 * T, 74 * T, 44 * T, 900),
    GpuSpec("a100", r"\bA100\b", 312 * T, None, 156 * T, 19.5 * T, 600),
    GpuSpec("a800", r"\bA800\b", 312 * T, None, 156 * T, 19.5 * T, 400),
    GpuSpec("l40s", r"\bL40S\b", 362 * T, 733 * T, 183 * T, 91.6 * T, 64),
    GpuSpec("l4", r"\bL4\b", 121 * T, 242.5 * T, 60 * T, 30.3 * T, 64),
)


def gpu_spec(key: str) -> GpuSpec:
    """The datasheet entry ``roboscale plan --gpu=KEY`` names."""
    for spec in GPUS:
        if spec.key == key.lower():
            return spec
    raise ConfigError(f"--gpu: unknown GPU {key!r}; known: {', '.join(s.key for s in GPUS)}")


def gpu_of(device_name: str) -> GpuSpec | None:
    return next((spec for spec in GPUS if re.search(spec.pattern, device_name)), None)


def peak_flops(device: torch.device | str, precision: str) -> tuple[float, str]:
    """Peak FLOP/s of one ``device`` at ``precision`` (fp32 | tf32 | bf16 | fp8) and where the figure comes from.

    CUDA: the datasheet's dense figure for a known GPU (fp32 counts as tf32 when torch allows TF32 matmuls, as the
    GEMMs then run on tensor cores); an unknown GPU is measured. CPU: a measured GEMM rate (fp32; bf16 measured in
    bf16; fp8 is emulated in fp32 by torchao there, so it is the fp32 rate)."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if precision == "fp32" and torch.get_float32_matmul_precision() != "highest":
            precision = "tf32"
        spec = gpu_of(name)
        if spec is not None:
            value = spec.peak(precision)
            if value is None:
                raise ConfigError(f"--fp8: {name} has no FP8 tensor cores (datasheet)")
            return value, f"datasheet: {name} dense {precision}"
        dtype = torch.bfloat16 if precision in ("bf16", "fp8") else torch.float32
        rate = measured_gemm_flops(str(device), dtype)
        return rate, f"measured: {name} {_dtype_name(dtype)} GEMM (not in the datasheet table)"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    rate = measured_gemm_flops(str(device), dtype, torch.get_num_threads())
    emulated = "FP8 emulated: " if precision == "fp8" else ""
    return rate, (f"measured: {emulated}{_dtype_name(dtype)} {_CPU_N}^3 GEMM on {torch.get_num_threads()} CPU "
                  f"thread(s), {rate / 1e9:.1f} GFLOP/s")


_CPU_N, _GPU_N = 1024, 8192


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


@functools.cache
def measured_gemm_flops(device: str, dtype: torch.dtype = torch.float32, threads: int = 0) -> float:
    """The best of a few square GEMMs on ``device``, in FLOP/s; timed once per (device, dtype, threads) and cached
    (a CPU rate depends on the thread count, so it is part of the key). About 0.2 s on two CPU cores."""
    del threads  # only part of the cache key
    dev = torch.device(device)
    n = _GPU_N if dev.type == "cuda" else _CPU_N
    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=generator)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: kernel selection, first-touch of the pages
    sync()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def mfu(flops_per_sample: float, samples_per_s: float, peak: float, ranks: int = 1) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the ranks' summed peak."""
    return flops_per_sample * samples_per_s / (peak * ranks)
