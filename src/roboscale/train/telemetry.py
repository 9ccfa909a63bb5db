"""Training telemetry: loss, samples/s, tokens/s, padding, data-wait fraction; to TensorBoard and the log.

A policy's ``forward`` may report ``tokens`` (positions that carry data: real image, prompt and action tokens)
and ``computed_tokens`` (positions it computed over, padding included) per step. They are summed, not averaged:
``tokens_per_s`` is the throughput that packing is measured by, and ``padding`` = 1 - tokens / computed_tokens is
the compute spent on nothing (LeRobot's pi0.5 layout: ~40%; packed: 0).

``data_wait`` is the fraction of wall time the loop spent blocked on the loader (0: the loader keeps up; near 1:
the accelerator starves). It is measured around ``next(loader)`` in the training process, so it counts only waiting,
not the workers' decode time running in parallel (the loader's own ``decode_s`` figure).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

COUNTS = ("tokens", "computed_tokens")  # per-step counts: summed over the window, not averaged


class Telemetry:
    def __init__(self, log_dir: Path, batch_size: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        self.batch_size = batch_size
        self._sums: dict[str, float | torch.Tensor] = defaultdict(float)
        self._count = 0
        self._wait = 0.0
        self._window_start = time.perf_counter()

    @contextmanager
    def data_wait(self):
        start = time.perf_counter()
        yield
        self._wait += time.perf_counter() - start

    def step(self, step: int, metrics: dict[str, float | torch.Tensor], log_now: bool,
             loader_stats: dict[str, float] | None = None) -> dict[str, float] | None:
        """Accumulate one step; on ``log_now`` write window means (and the loader's counters) and return them."""
        for k, v in metrics.items():  # tensors stay on their device until the window is logged
            self._sums[k] = self._sums[k] + (v.detach() if isinstance(v, torch.Tensor) else v)
        self._count += 1
        if not log_now:
            return None
        self._sums = defaultdict(float, {k: float(v) for k, v in self._sums.items()})
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        counts = {k: self._sums.pop(k) for k in COUNTS if k in self._sums}
        summary = {k: v / self._count for k, v in self._sums.items()}
        summary["samples_per_s"] = self._count * self.batch_size / elapsed
        if "tokens" in counts:
            summary["tokens_per_s"] = counts["tokens"] / elapsed
            if counts.get("computed_tokens"):
                summary["padding"] = 1.0 - counts["tokens"] / counts["computed_tokens"]
        summary["data_wait"] = self._wait / elapsed
        for k, v in summary.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        for k, v in (loader_stats or {}).items():
            self.writer.add_scalar(f"loader/{k}", v, step)
        log.info("step %d %s", step, " ".join(f"{k}={v:.4g}" for k, v in summary.items()))
        self._sums.clear()
        self._count = 0
        self._wait = 0.0
        self._window_start = time.perf_counter()
        return summary

    def close(self) -> None:
        self.writer.close()
