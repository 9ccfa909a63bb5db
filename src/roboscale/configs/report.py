"""The configs of the report commands: ``roboscale eval compare`` and ``roboscale report``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompareConfig:
    """`roboscale eval compare RUN_A RUN_B [...]`: success per task side by side, with Wilson 95% intervals and
    the differences to the first run that are significant (two-proportion z-test, p < 0.05)."""

    runs: list[str] = field(default_factory=list)
    """Evaluation report directories (with report.json) or training runs (their best checkpoint's evaluation,
    from evals.jsonl and checkpoints/best); the first is the baseline."""
    output_dir: str = "."
    """Where compare.md and compare.html are written."""


@dataclass
class ReportConfig:
    """`roboscale report RUN_DIR`: an HTML page for a training run (training curves, success vs step, the best
    checkpoint's per-task table and videos)."""

    run_dir: str = ""
    """The training run's output_dir (metrics.jsonl, evals.jsonl, checkpoints/)."""
    output: str = ""
    """The page to write (default: RUN_DIR/report.html)."""
