"""The Trainer's seams (train/components.py): a job of its own data, objective, hooks and checkpointed state
(tests/train/toy_job.py) trains, logs its metrics reduced by name, runs its hook after applied steps only and
resumes exactly; the reduction by name on its own, on 1 process and on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roboscale.errors import CheckpointError, TrainingError
from roboscale.train.checkpoint import check_state_names
from roboscale.train.components import DataSource, TrainingComponents
from roboscale.train.reduction import StepMetrics
from roboscale.train.supervised import train
from roboscale.train.trainer import Trainer

from .toy_job import BATCH, Publisher, ToyJob, toy_config

ROOT = Path(__file__).parents[2]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _state(out: Path, step: str, name: str) -> dict:
    return json.loads((out / "checkpoints" / step / "training_state" / f"{name}_state.json").read_text())


def _cut_back(out: Path, to: str) -> None:
    """A run killed after checkpoint ``to``: later checkpoints gone, ``last`` at it."""
    checkpoints = out / "checkpoints"
    for later in [p for p in checkpoints.iterdir() if p.name.isdigit() and p.name > to]:
        shutil.rmtree(later)
    (checkpoints / "last").unlink()
    (checkpoints / "last").symlink_to(to)


def test_the_streaming_loader_is_a_data_source(tiny_dataset: Path) -> None:
    from roboscale.data.loading.loader import build_loader

    loader = build_loader(tiny_dataset, batch_size=2, num_workers=0, keys=["action"], seed=0)
    try:
        assert isinstance(loader, DataSource)
    finally:
        loader.close()


def test_a_jobs_metrics_are_reduced_by_name_and_its_hook_runs_after_applied_steps(tiny_dataset: Path,
                                                                                 tmp_path: Path) -> None:
    job = ToyJob(tiny_dataset, nan_at=frozenset({3}))
    cfg = toy_config(tiny_dataset, tmp_path / "run", steps=5, ema_decay=0.9)
    trainer = Trainer(cfg, job, progress=False)
    trainer.fit()
    assert trainer.loader is job.data and job.data.closed
    assert trainer.hooks[-1] is job.publisher and len(trainer.hooks) == 2  # the EMA update, then the job's
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        calls = [c for c in job.calls if c["step"] == row["step"]]
        assert len(calls) == 2 and calls[0]["loss_weight"] != calls[1]["loss_weight"]  # 3 and 5 samples
        weight = sum(c["loss_weight"] for c in calls)
        assert row["loss_weight"] == weight
        assert row["samples"] == BATCH  # summed: the objective lists it in objective.summed
        assert row["ratio"] == pytest.approx(sum(c["ratio"] * c["loss_weight"] for c in calls) / weight, rel=1e-12)
        assert row["ratio"] != pytest.approx(sum(c["ratio"] for c in calls) / 2)  # weighted, not a plain mean
        if row["step"] != 3:
            assert row["loss"] == pytest.approx(sum(c["loss"] * c["loss_weight"] for c in calls) / weight, rel=1e-6)
        tokens = sum(c["tokens"] for c in calls)  # a count: telemetry turns it into tokens/s and padding
        assert row["padding"] == pytest.approx(1 - tokens / sum(c["computed_tokens"] for c in calls))
    assert rows[2]["skipped_steps"] == 1 and rows[2]["loss"] != rows[2]["loss"]  # NaN: skipped
    assert job.publisher.called_at == [1, 2, 4, 5]  # once per applied step, never after the skipped one
    assert _state(tmp_path / "run", "000005", "publisher") == {"published": 4, "last_step": 5}


def test_resume_restores_the_jobs_state_and_continues_with_the_same_losses(tiny_dataset: Path,
                                                                          tmp_path: Path) -> None:
    train(toy_config(tiny_dataset, tmp_path / "straight", steps=6), progress=False, job=ToyJob(tiny_dataset))
    train(toy_config(tiny_dataset, tmp_path / "cut", steps=6, save_freq=3), progress=False,
          job=ToyJob(tiny_dataset))
    _cut_back(tmp_path / "cut", "000003")
    job = ToyJob(tiny_dataset)
    train(toy_config(tiny_dataset, tmp_path / "cut", steps=6, save_freq=3, resume=True), progress=False, job=job)
    assert job.publisher.restored == [{"published": 3, "last_step": 3}]
    assert job.publisher.called_at == [4, 5, 6]
    assert _state(tmp_path / "cut", "000006", "publisher") == _state(tmp_path / "straight", "000006", "publisher")
    assert _state(tmp_path / "cut", "000006", "loader") == {"position": 6}
    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "cut")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["ratio"] for r in resumed] == [r["ratio"] for r in straight]


def test_a_checkpoint_without_an_entry_the_job_needs_is_an_error_naming_its_file(tiny_dataset: Path,
                                                                                tmp_path: Path) -> None:
    out = tmp_path / "run"
    train(toy_config(tiny_dataset, out, steps=2, save_freq=1), progress=False, job=ToyJob(tiny_dataset))
    missing = out / "checkpoints" / "000002" / "training_state" / "publisher_state.json"
    missing.unlink()
    with pytest.raises(CheckpointError, match=rf"^{missing}: missing; cannot resume from it \(to resume from the "
                                              r"previous checkpoint: ln -sfn 000001 "):
        train(toy_config(tiny_dataset, out, steps=3, resume=True), progress=False, job=ToyJob(tiny_dataset))
    _cut_back(out, "000001")
    (out / "checkpoints" / "000001" / "training_state" / "publisher_state.json").write_text('{"published": 1}')
    with pytest.raises(CheckpointError, match=r"000001/training_state/publisher_state.json: does not fit this run's "
                                              r"'publisher' state \(KeyError: 'last_step'\); cannot resume"):
        train(toy_config(tiny_dataset, out, steps=3, resume=True), progress=False, job=ToyJob(tiny_dataset))


def test_a_jobs_state_takes_names_of_its_own() -> None:
    check_state_names({"publisher": Publisher(), "replay.v2": Publisher()})
    for name in ("trainer", "loader", "../escape", ""):
        with pytest.raises(TrainingError, match="the names \\['trainer', 'loader'\\] are the trainer's"):
            check_state_names({name: Publisher()})
    with pytest.raises(TrainingError, match="'counter': int is not Stateful"):
        check_state_names({"counter": 3})
    assert TrainingComponents(data=None, objective=len).hooks == []  # defaults: no hooks, no extra state


def _metrics(**values: float) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value) for name, value in values.items()}


def test_metrics_are_summed_or_weighted_by_name_on_one_process() -> None:
    step = StepMetrics(frozenset({"loss_weight", "tokens", "episodes"}), torch.device("cpu"))
    step.add(_metrics(loss=1.0, loss_weight=1.0, tokens=10, episodes=2, ratio=0.5), torch.tensor(1.0))
    step.add(_metrics(loss=4.0, loss_weight=3.0, tokens=20, episodes=1, ratio=0.1), torch.tensor(3.0))
    reduced = {name: float(value) for name, value in step.reduce(distributed=False).items()}
    assert reduced == pytest.approx({"loss": (1 + 12) / 4, "loss_weight": 4, "tokens": 30, "episodes": 3,
                                     "ratio": (0.5 + 0.3) / 4})


def test_maxed_metrics_take_their_largest_value() -> None:
    step = StepMetrics(frozenset({"loss_weight"}), torch.device("cpu"), maxed=frozenset({"staleness_max"}))
    step.add(_metrics(loss=1.0, loss_weight=1.0, staleness_max=2.0), torch.tensor(1.0))
    step.add(_metrics(loss=1.0, loss_weight=3.0, staleness_max=1.0), torch.tensor(3.0))
    assert float(step.reduce(distributed=False)["staleness_max"]) == 2.0  # not the weighted mean, 1.25


def test_an_objective_whose_metrics_change_names_or_lack_the_weight_is_a_clear_error() -> None:
    from roboscale.train.reduction import loss_weight

    step = StepMetrics(frozenset({"loss_weight"}), torch.device("cpu"))
    step.add(_metrics(loss=1.0, loss_weight=1.0), torch.tensor(1.0))
    with pytest.raises(TrainingError, match=r"metrics \['loss', 'loss_weight', 'ratio'\] for a micro-batch and "
                                            r"\['loss', 'loss_weight'\] for an earlier one"):
        step.add(_metrics(loss=1.0, loss_weight=1.0, ratio=2.0), torch.tensor(1.0))
    later = StepMetrics(frozenset({"loss_weight"}), torch.device("cpu"), agreed=step.names)  # the next step
    with pytest.raises(TrainingError, match=r"metrics \['loss_weight', 'ratio'\], and \['loss', 'loss_weight'\] at "
                                            r"the run's earlier steps; it must return the same names at every step"):
        later.add(_metrics(loss_weight=1.0, ratio=2.0), torch.tensor(1.0))
    with pytest.raises(TrainingError, match=r"metrics \['loss'\] without 'loss_weight'"):
        loss_weight(_metrics(loss=1.0))
    with pytest.raises(TrainingError, match=r"\['lr'\] take names the trainer logs itself"):
        StepMetrics(frozenset(), torch.device("cpu")).add(_metrics(loss_weight=1.0, lr=0.1), torch.tensor(1.0))
    with pytest.raises(TrainingError, match=r"metric 'ratio' has shape \[2\]; metrics are scalars"):
        StepMetrics(frozenset(), torch.device("cpu")).add(
            {"loss_weight": torch.tensor(1.0), "ratio": torch.ones(2)}, torch.tensor(1.0))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING"}


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "tests.train.toy_job", *args]
    return subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.slow
def test_two_gloo_ranks_reduce_a_jobs_metrics_to_the_one_process_values(tiny_dataset: Path, tmp_path: Path) -> None:
    train(toy_config(tiny_dataset, tmp_path / "one", steps=3), progress=False, job=ToyJob(tiny_dataset))
    done = _torchrun(str(tiny_dataset), str(tmp_path / "two"), "3")
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        # each rank cuts its 4 samples 1 + 3 (one process: 3 + 5), yet the global values are the same
        assert (b["loss_weight"], b["samples"], b["padding"]) == (a["loss_weight"], a["samples"], a["padding"])
        assert b["ratio"] == pytest.approx(a["ratio"], rel=1e-12)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert _state(tmp_path / "two", "000003", "publisher") == {"published": 3, "last_step": 3}


@pytest.mark.slow
def test_ranks_whose_objectives_name_other_metrics_stop_with_one_clear_error() -> None:
    done = _torchrun("names")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r}: the objective's metrics differ between ranks: rank 0 has ['loss', 'loss_weight', "
                     "'rank0_only'], rank 1 has ['loss', 'loss_weight', 'rank1_only']" for r in (0, 1)]
