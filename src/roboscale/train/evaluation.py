"""Evaluation during training: each due checkpoint is scored by a separate ``roboscale eval`` process while
training goes on, and ``checkpoints/best`` follows the highest success.

Rank 0 owns one ``EvaluationScheduler``. ``submit(step)``, after that step's checkpoint is saved, starts its
evaluation, or queues it while another one runs: at most one evaluation is in flight (it shares the CPUs with
training), and a newer checkpoint replaces a queued one that has not started (the newest checkpoint is the one
worth knowing about). ``poll()``, once per step, only asks the OS whether the process has ended
(``Popen.poll``), so training never waits for an evaluation. ``finish()`` at the end of training waits for the
running evaluation and runs the queued one (the final checkpoint's), so that ``best`` is final. ``close()`` kills
the evaluation's process group on every way out of training (an error, Ctrl-C); a trainer killed outright takes
its evaluation with it too (a supervisor process that watches the trainer: ``roboscale.utils.lifetime``).

Step N is evaluated by ``python -m roboscale eval --checkpoint=<output_dir>/checkpoints/<N> --output_dir=
<output_dir>/eval/step_<N> ...`` (its output goes to ``eval.log`` there). When it ends:

1. its numbers go to the telemetry at step N (``eval/success``, ``eval/success/<task>``, ``eval/ci_low``,
   ``eval/ci_high``: metrics.jsonl and TensorBoard);
2. a line goes to ``<output_dir>/evals.jsonl`` (one ``write`` of the whole line; readers skip a torn last
   line): step, checkpoint, report_dir (relative to output_dir), success_rate, ci_low, ci_high, episodes,
   per_task, wall_s. A failed evaluation (non-zero exit, no readable report) gets a line with ``error`` instead
   of the numbers and a warning in the log; training goes on;
3. ``checkpoints/best`` points to the checkpoint with the highest success_rate (a tie keeps the earlier one).

evals.jsonl is the record of what was evaluated. A resumed run drops its lines after the step it resumes from
(those checkpoints are about to be written again), points ``best`` by the rest and does not redo them; an
evaluation that was cut short left no line, so the newest such checkpoint is evaluated again, in the same
report directory (where ``roboscale eval`` reuses the episodes it had finished). The telemetry line is written
before the evals.jsonl line, and a resume drops the telemetry's eval lines that have no record
(``Telemetry.truncate_after``), so each evaluation shows up there exactly once.

Intervals are Wilson 95% intervals: the report's own, or computed (``utils.stats``) from successes and episodes
when the report has none.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roboscale.configs.train import EvalDuringTrainingConfig
from roboscale.train.checkpoint import point_best, step_directories, step_name
from roboscale.utils.io import append_json_line, atomic_path, fsync_dir, load_json, read_json_lines
from roboscale.utils.stats import wilson_interval

log = logging.getLogger(__name__)

EVALS_FILE = "evals.jsonl"
REPORT_FILE = "report.json"
LOG_FILE = "eval.log"
KILL_GRACE_S = 10.0
"""How long a stopped evaluation may take to exit on SIGTERM before its process group gets SIGKILL."""

Command = Callable[[Path, Path], list[str]]
"""(checkpoint step directory, report directory) -> the argv that evaluates it and writes report.json there."""
Report = Callable[[int, dict[str, float]], None]
"""(step, {"eval/success": ..., ...}): where finished evaluations' numbers go (the trainer's telemetry)."""


def report_dir(step: int) -> str:
    """An evaluation's report directory, relative to the training's output_dir."""
    return f"eval/step_{step_name(step)}"


def eval_command(cfg: EvalDuringTrainingConfig) -> Command:
    """``roboscale eval`` with the options of ``--eval.*``, run by this Python."""

    def command(checkpoint: Path, out: Path) -> list[str]:
        return [sys.executable, "-m", "roboscale", "eval", f"--checkpoint={checkpoint}", f"--output_dir={out}",
                *cfg.protocol_options(), f"--rollout.workers={cfg.workers}"]

    return command


@dataclass
class _Evaluation:
    step: int
    checkpoint: Path
    out: Path
    process: subprocess.Popen
    started: float


class EvaluationScheduler:
    """The evaluations of one training run (rank 0): at most one running, at most one queued."""

    def __init__(self, output_dir: Path, cfg: EvalDuringTrainingConfig, *, command: Command | None = None,
                 report: Report | None = None):
        self.output_dir = Path(output_dir)
        self.cfg = cfg
        self.command = command or eval_command(cfg)
        self.report = report or (lambda step, metrics: None)
        self.path = self.output_dir / EVALS_FILE
        self.checkpoints = self.output_dir / "checkpoints"
        self.records: dict[int, dict[str, Any]] = {r["step"]: r for r in read_evals(self.path, repair=True)}
        self.running: _Evaluation | None = None
        self.queued: int | None = None
        self.best: tuple[int, float] | None = None  # (step, success_rate)

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def resume(self, step: int) -> set[int]:
        """Continue a run from its checkpoint at ``step`` (0: a new run): forget the evaluations of later
        checkpoints, point ``best`` by the others, evaluate the newest due checkpoint that has no record; returns
        the evaluated steps."""
        later = [s for s in self.records if s > step]
        for s in later:
            del self.records[s]
        if later:
            with atomic_path(self.path) as tmp:
                tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records.values()))
        self._point_best_by_records()
        due = [int(p.name) for p in step_directories(self.checkpoints)
               if int(p.name) <= step and int(p.name) % self.cfg.every == 0 and int(p.name) not in self.records]
        if due:
            log.info("evaluating the checkpoint of step %d, whose evaluation was cut short", max(due))
            self.submit(max(due))
        return set(self.records)

    def _point_best_by_records(self) -> None:
        self.best = None
        for step in sorted(self.records):
            record = self.records[step]
            if "error" in record or not (self.checkpoints / step_name(step)).is_dir():
                continue
            if self.best is None or record["success_rate"] > self.best[1]:
                self.best = (step, record["success_rate"])
        best = self.checkpoints / "best"
        if self.best is not None:
            if not best.is_symlink() or os.readlink(best) != step_name(self.best[0]):
                point_best(self.checkpoints, step_name(self.best[0]))
        elif best.is_symlink():  # it pointed to a checkpoint this run is about to write again
            best.unlink()
            fsync_dir(self.checkpoints)

    def pending(self) -> list[str]:
        """Step directories an evaluation is reading or waiting to read: retention must keep them."""
        steps = ([self.running.step] if self.running is not None else []) + \
            ([self.queued] if self.queued is not None else [])
        return [step_name(s) for s in steps]

    # --- the process ----------------------------------------------------------------------------------------
    def submit(self, step: int) -> None:
        """Evaluate the checkpoint of ``step`` now, or after the running evaluation (replacing a queued one)."""
        if step in self.records or self.queued == step or (self.running is not None and self.running.step == step):
            return
        if self.running is None:
            self._start(step)
            return
        if self.queued is not None:
            log.info("the checkpoint of step %d will not be evaluated: step %d replaces it in the queue",
                     self.queued, step)
        self.queued = step

    def poll(self) -> None:
        """Without waiting: record the running evaluation if it has ended, and start the queued one."""
        if self.running is None or self.running.process.poll() is None:
            return
        ended, self.running = self.running, None
        self._record(ended)
        if self.queued is not None:
            step, self.queued = self.queued, None
            self._start(step)

    def finish(self, final_step: int | None = None) -> None:
        """End of training: evaluate ``final_step``'s checkpoint too (unless it was), wait for everything."""
        if final_step is not None:
            self.submit(final_step)
        while self.running is not None:
            ev = self.running
            then = f", then step {self.queued}'s" if self.queued is not None else ""
            log.info("training done; waiting for the evaluation of step %d (running for %.0f s%s) so that "
                     "checkpoints/best is final; its log: %s", ev.step, time.monotonic() - ev.started, then,
                     ev.out / LOG_FILE)
            ev.process.wait()
            self.poll()
        if self.best is not None:
            log.info("best checkpoint: step %d, success %.1f%% (checkpoints/best)", self.best[0], 100 * self.best[1])

    def close(self) -> None:
        """Stop the running evaluation and its own worker processes (training ended before it did)."""
        ev, self.running, self.queued = self.running, None, None
        if ev is None or ev.process.poll() is not None:
            return
        log.warning("stopping the evaluation of step %d: training ended first", ev.step)
        kill_group(ev.process)

    def _start(self, step: int) -> None:
        out = (self.output_dir / report_dir(step)).absolute()
        checkpoint = (self.checkpoints / step_name(step)).absolute()
        # the trainer shares the cores: one OpenMP thread per evaluation process, and no busy-waiting
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
        started = time.monotonic()
        try:
            # A cut-short evaluation of this step left its finished episodes, which `roboscale eval` reuses only
            # for the same checkpoint (by its sha256) and protocol; an old report must not pass for this one's.
            out.mkdir(parents=True, exist_ok=True)
            (out / REPORT_FILE).unlink(missing_ok=True)
            with open(out / LOG_FILE, "ab") as log_file:
                # a session of its own: the terminal's Ctrl-C reaches the trainer only (which then stops the
                # evaluation in close()), and killpg reaches the evaluation's own worker processes too
                process = subprocess.Popen(_dies_with_this_process(self.command(checkpoint, out)), env=env,
                                           stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        except OSError as exc:
            self._failed(step, checkpoint, f"could not start ({exc.strerror or exc})", 0.0, out / LOG_FILE)
            return
        self.running = _Evaluation(step, checkpoint, out, process, started)
        log.info("evaluating the checkpoint of step %d in the background; its log: %s", step, out / LOG_FILE)

    def _record(self, ev: _Evaluation) -> None:
        wall_s = round(time.monotonic() - ev.started, 3)
        code = ev.process.returncode
        if code != 0:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            self._failed(ev.step, ev.checkpoint, f"{how}: {last_line(ev.out / LOG_FILE)}", wall_s, ev.out / LOG_FILE)
            return
        try:
            result = read_report(ev.out / REPORT_FILE)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self._failed(ev.step, ev.checkpoint, f"{REPORT_FILE} unreadable ({type(exc).__name__}: {exc})", wall_s,
                         ev.out / LOG_FILE)
            return
        metrics = {"eval/success": result["success_rate"],
                   **{f"eval/success/{task}": t["success_rate"] for task, t in result["per_task"].items()},
                   "eval/ci_low": result["ci_low"], "eval/ci_high": result["ci_high"]}
        self.report(ev.step, metrics)  # before the record: see the module docstring
        self._append({"step": ev.step, "checkpoint": str(ev.checkpoint), "report_dir": report_dir(ev.step),
                      **result, "wall_s": wall_s})
        if self.best is None or result["success_rate"] > self.best[1]:
            self.best = (ev.step, result["success_rate"])
            point_best(self.checkpoints, step_name(ev.step))
        log.info("step %d: success %.1f%% [%.1f%%, %.1f%%] over %d episodes (evaluated in %.0f s); best: step %d",
                 ev.step, 100 * result["success_rate"], 100 * result["ci_low"], 100 * result["ci_high"],
                 result["episodes"], wall_s, self.best[0])

    def _failed(self, step: int, checkpoint: Path, error: str, wall_s: float, log_path: Path) -> None:
        log.warning("the evaluation of step %d failed (%s); training goes on. Its log: %s", step, error, log_path)
        self._append({"step": step, "checkpoint": str(checkpoint), "report_dir": report_dir(step), "error": error,
                      "wall_s": wall_s})

    def _append(self, record: dict[str, Any]) -> None:
        append_json_line(self.path, record)
        self.records[record["step"]] = record


def read_evals(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The records of evals.jsonl, in file order; a line that is not a JSON record (a torn last write) is skipped
    (``repair``: and cut off the file)."""
    return [r for r in read_json_lines(path, repair)[0] if isinstance(r.get("step"), int)]


def read_report(path: Path) -> dict[str, Any]:
    """success_rate, ci_low, ci_high, episodes and per_task {task: success_rate, ci_low, ci_high} of an
    evaluation's report.json; intervals the report lacks are computed (Wilson 95%)."""
    report = load_json(Path(path).read_text())
    overall, tasks = report["overall"], report["per_task"]
    episodes = int(overall["episodes"])
    per_task, successes = {}, 0
    for task, t in tasks.items():
        n = int(t.get("episodes", episodes // max(1, len(tasks))))
        rate = float(t["success_rate"])
        wins = int(t.get("successes", round(rate * n)))
        successes += wins
        per_task[task] = {"success_rate": rate, **_interval(t, wins, n)}
    successes = int(overall.get("successes", successes))
    return {"success_rate": float(overall["success_rate"]), **_interval(overall, successes, episodes),
            "episodes": episodes, "per_task": per_task}


def _interval(summary: dict[str, Any], successes: int, n: int) -> dict[str, float]:
    if "ci_low" in summary and "ci_high" in summary:
        return {"ci_low": float(summary["ci_low"]), "ci_high": float(summary["ci_high"])}
    low, high = wilson_interval(successes, n)
    return {"ci_low": low, "ci_high": high}


def last_line(path: Path) -> str:
    """The last non-blank line of a log (progress bars end their lines with carriage returns)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else "(empty log)"


def kill_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group, SIGKILL to whatever is left after KILL_GRACE_S; reaps the process."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:  # also the group's members that outlived its leader (the evaluation's own workers)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


# A trainer killed outright (SIGKILL, or SIGTERM outside the command line) must not leave its evaluation behind,
# with worker or server processes of its own: the evaluation runs under a supervisor that kills its whole process
# group when the trainer ends (roboscale.utils.lifetime.supervise). The same SIGTERM from close() does the same.
def _dies_with_this_process(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "roboscale.utils.lifetime", str(os.getpid()), *argv]
