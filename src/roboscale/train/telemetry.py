"""Training telemetry: loss, throughput, MFU, padding, data wait, memory, stragglers; to ``metrics.jsonl``,
TensorBoard, the log (and W&B when asked).

``<output_dir>/metrics.jsonl`` has one JSON object per logged step (rank 0 writes it): window means of the
step's metrics and

- ``samples_per_s`` (global batch samples over all ranks), ``tokens_per_s`` (positions that carry data: real image,
  prompt and action tokens) and ``padding`` = 1 - tokens / computed_tokens (compute spent on nothing; LeRobot's
  pi0.5 layout ~40%, packed 0);
- ``mfu``: analytical training FLOPs per sample (the policy's registry entry, at its nominal size, scaled by the
  tokens the samples really had over the nominal count: prompts are shorter than the longest allowed, cameras may
  be missing) x samples/s over the ranks' summed peak (``peak_source`` says whether the peak is a datasheet figure
  or a measured CPU GEMM rate);
- ``data_wait``: the fraction of wall time the loop spent blocked on the loader (0: it keeps up; near 1: the
  accelerator starves), measured around ``next(loader)`` in the training process;
- ``checkpoint_s``: seconds in the window that training stood still for checkpoint saves (the gather of the
  consolidated weights and the save; with ``--checkpoint.async_save`` the save part is only the staging copy);
- ``step_time`` and ``step_time_spread`` ((slowest - fastest rank) / this rank's mean step time: stragglers);
- ``memory/state_bytes`` (this rank's parameters + gradients + optimizer state: what sharding divides),
  ``memory/peak``; ``skipped_steps`` (NaN/Inf updates skipped so far); ``distinct_episodes`` (mean distinct
  episodes in this rank's share of a batch, since the start: how independent the batches are).

Evaluations during training (``train/evaluation.py``) add lines ``{"step", "eval/success", "eval/success/<task>",
"eval/ci_low", "eval/ci_high"}`` at their checkpoint's step when they end, later than the lines of the steps
trained meanwhile.

A resumed run first drops the lines after its checkpoint's step, so the file reads as one run.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from collections.abc import Collection
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

COUNTS = ("tokens", "computed_tokens")  # per-step counts: summed over the window, not averaged
LAST = ("lr", "skipped_steps")  # the value at the logged step, not a window mean
METRICS_FILE = "metrics.jsonl"
EVAL_KEY = "eval/success"  # marks the lines of finished evaluations (write_eval)


class Telemetry:
    def __init__(self, output_dir: Path, batch_size: int, *, write: bool = True, flops_per_sample: Any = None,
                 peak: tuple[float, str] | None = None, ranks: int = 1, wandb: bool = False, config: Any = None):
        self.output_dir = Path(output_dir)
        self.batch_size = batch_size
        self.flops_per_sample = flops_per_sample
        self.peak = peak
        self.ranks = ranks
        self.writer = None
        self.wandb = None
        if write:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))
            if wandb:
                self.wandb = _start_wandb(config, self.output_dir)
        self.path = self.output_dir / METRICS_FILE
        self._sums: dict[str, float | torch.Tensor] = defaultdict(float)
        self._last: dict[str, Any] = {}
        self._count = 0
        self._blocked: dict[str, float] = defaultdict(float)
        self._window_start = time.perf_counter()

    @contextmanager
    def blocked(self, on: str):
        """Time the loop stands still ``on`` something other than computing: ``data`` (the loader; logged as the
        ``data_wait`` fraction) or ``checkpoint`` (a save, gather included; logged as ``checkpoint_s``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._blocked[on] += time.perf_counter() - start

    def step(self, step: int, metrics: dict[str, Any], log_now: bool) -> dict[str, float] | None:
        """Accumulate one step; on ``log_now`` return the window's summary (on every rank) and start a new one."""
        for k, v in metrics.items():  # tensors stay on their device until the window is logged
            if k in LAST:
                self._last[k] = v
            else:
                self._sums[k] = self._sums[k] + (v.detach() if isinstance(v, torch.Tensor) else v)
        self._count += 1
        if not log_now:
            return None
        sums = {k: float(v) for k, v in self._sums.items()}
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        counts = {k: sums.pop(k) for k in COUNTS if k in sums}
        summary = {k: v / self._count for k, v in sums.items()}
        summary.update({k: float(v) for k, v in self._last.items()})
        summary["step_time"] = elapsed / self._count
        summary["samples_per_s"] = self._count * self.batch_size / elapsed
        if counts.get("tokens"):
            summary["tokens_per_s"] = counts["tokens"] / elapsed
            if counts.get("computed_tokens"):
                summary["padding"] = 1.0 - counts["tokens"] / counts["computed_tokens"]
        if self.flops_per_sample is not None and self.peak:
            flops = float(self.flops_per_sample)
            nominal = getattr(self.flops_per_sample, "tokens", 0)
            if nominal and counts.get("tokens"):
                flops *= min(1.0, counts["tokens"] / (self._count * self.batch_size) / nominal)
            summary["mfu"] = flops * summary["samples_per_s"] / (self.peak[0] * self.ranks)
        summary["data_wait"] = self._blocked["data"] / elapsed
        summary["checkpoint_s"] = self._blocked["checkpoint"]
        self._sums.clear()
        self._count = 0
        self._blocked.clear()
        self._window_start = time.perf_counter()
        return summary

    def write(self, step: int, summary: dict[str, float], loader_stats: dict[str, float] | None = None) -> None:
        """Rank 0: one line of metrics.jsonl, TensorBoard scalars, a log line."""
        if self.writer is None:
            return
        record = {"step": step, **summary}
        if "mfu" in summary:
            record["peak_source"] = self.peak[1]
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in summary.items():
            self.writer.add_scalar(k if "/" in k else f"train/{k}", v, step)
        for k, v in (loader_stats or {}).items():
            self.writer.add_scalar(f"loader/{k}", v, step)
        if self.wandb is not None:
            self.wandb.log(summary, step=step)
        log.info("step %d %s", step, " ".join(f"{k}={v:.4g}" for k, v in summary.items()))

    def write_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0: a finished evaluation of the checkpoint of ``step`` (``eval/success``, ``eval/success/<task>``,
        ``eval/ci_low``, ``eval/ci_high``): one line of metrics.jsonl and TensorBoard scalars at that step, however
        much later the evaluation ended (so its line may follow lines of later steps)."""
        if self.writer is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # evaluations are rare and slow: show them now, not at the writer's next flush
        if self.wandb is not None:
            # W&B refuses steps older than its last one; its own x-axis keeps the checkpoint's step
            self.wandb.log({**metrics, "eval/step": step})

    def truncate_after(self, step: int, evaluated: Collection[int] | None = None) -> None:
        """Drop the lines a killed run logged after the checkpoint this run resumes from, and, given the steps
        whose evaluations are on record (``evaluated``), the eval lines of the others (their evaluation is
        redone)."""
        if self.writer is None or not self.path.exists():
            return

        def keep(record: dict[str, Any]) -> bool:
            if record.get("step", 0) > step:
                return False
            return evaluated is None or EVAL_KEY not in record or record["step"] in evaluated

        kept = [line for line in self.path.read_text().splitlines() if line.strip() and keep(json.loads(line))]
        from roboscale.utils.io import atomic_path

        with atomic_path(self.path) as tmp:
            Path(tmp).write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


WANDB_RUN_ID = "wandb_run_id"
"""Beside metrics.jsonl: the W&B run a resumed training continues."""


def _start_wandb(config: Any, output_dir: Path):
    """A W&B run when the package is installed; otherwise say so once and go on without it. A resumed training
    continues the W&B run its output directory started (W&B keeps the first logging of any step a killed run
    repeats, as it refuses steps older than its last; metrics.jsonl and TensorBoard hold the resumed run's)."""
    try:
        import wandb
    except ImportError:
        log.warning("--wandb=true but the wandb package is not installed; logging to TensorBoard and "
                    "metrics.jsonl only")
        return None
    from roboscale.config import to_dict
    from roboscale.utils.io import atomic_write_bytes

    id_file = output_dir / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    run = wandb.init(dir=str(output_dir), id=run_id, resume="allow" if run_id else None,
                     config=to_dict(config) if config is not None else None)
    if run_id is None:
        atomic_write_bytes(id_file, run.id.encode())
    return run
