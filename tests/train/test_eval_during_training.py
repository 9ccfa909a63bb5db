"""Evaluation during training (train/evaluation.py): a separate process per due checkpoint, training that never
waits for it, ``checkpoints/best``, retention that keeps what evaluations read, failures recorded, resume.

Most tests run a fake evaluation (a few lines of Python that write report.json with a chosen success rate) in
place of ``roboscale eval``, so that best, queueing and replacement are tested with known numbers and without
MetaWorld; FIFOs, not sleeps, hold it back or tell when it is gone. One test runs the real ``roboscale eval``.
"""

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from roboscale.configs.train import EvalDuringTrainingConfig
from roboscale.train.checkpoint import point_best, prune_checkpoints, step_directories
from roboscale.train.evaluation import EvaluationScheduler, eval_command, read_evals, read_report
from roboscale.train.supervised import SupervisedJob
from roboscale.train.telemetry import Telemetry
from roboscale.train.trainer import Trainer
from tests.train.test_trainer import tiny_train_config

# argv: checkpoint, report dir, control dir. The control dir holds rates.json ({step: success rate, or null for
# a crash}) and optionally FIFOs: "gate" (wait until the test opens and closes it), "alive" (held open for
# writing by this process and a child of its own until they are killed: the test reads EOF then).
FAKE_EVAL = r"""
import json, os, signal, subprocess, sys
from pathlib import Path

checkpoint, out, control = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
step = int(checkpoint.name)
(control / f"started_{step}").write_text(json.dumps({k: v for k, v in os.environ.items() if k.startswith("OMP_")}))
if (control / "gate").exists():
    (control / "gate").read_bytes()
if (control / "alive").exists():
    fd = os.open(control / "alive", os.O_WRONLY)
    subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"], pass_fds=(fd,))
    signal.pause()
if not checkpoint.is_dir():
    sys.exit(f"error: {checkpoint} was deleted before it was evaluated")
rate = json.loads((control / "rates.json").read_text()).get(str(step), 0.0)
if rate is None:
    print("evaluating:  50%", end="\r", flush=True)
    sys.exit("error: the simulator crashed")
report = {"overall": {"success_rate": rate, "episodes": 4},
          "per_task": {"reach-v3": {"success_rate": rate, "episodes": 4}}}
(out / "report.json").write_text(json.dumps(report))
"""


def supervised_trainer(cfg, **options):
    """The Trainer of `roboscale train` (its supervised job), with ``options`` (an evaluation command of its own)."""
    return Trainer(cfg, SupervisedJob(cfg), **options)


def fake_eval(control: Path):
    return lambda checkpoint, out: [sys.executable, "-c", FAKE_EVAL, str(checkpoint), str(out), str(control)]


def control_dir(tmp_path: Path, rates: dict[int, float | None], *fifos: str) -> Path:
    control = tmp_path / "control"
    control.mkdir()
    (control / "rates.json").write_text(json.dumps({str(k): v for k, v in rates.items()}))
    for name in fifos:
        os.mkfifo(control / name)
    return control


def release(control: Path) -> None:
    """Let the evaluation waiting at the gate go on (opening blocks until it is there), and later ones pass."""
    with open(control / "gate", "wb"):
        pass
    (control / "gate").unlink()


def started(control: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in control.glob("started_*"))


def wait_for_eof(fd: int) -> bytes:
    """What the "alive" FIFO gives once every writer is gone (the deadline only bounds a failing test)."""
    readable, _, _ = select.select([fd], [], [], 120)
    assert readable, "the evaluation outlived the trainer"
    return os.read(fd, 1)


def make_checkpoints(out: Path, *steps: int) -> Path:
    for step in steps:
        (out / "checkpoints" / f"{step:06d}").mkdir(parents=True)
    return out / "checkpoints"


def eval_lines(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if "eval/success" in line]


def scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


# --- the scheduler's bookkeeping --------------------------------------------------------------------------------
def test_best_follows_the_highest_success_a_tie_keeps_the_earlier_and_each_result_is_recorded(tmp_path):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {2: 0.5, 4: 0.5, 6: 0.25, 8: 0.75})
    reported = []
    scheduler = EvaluationScheduler(out, EvalDuringTrainingConfig(every=2), command=fake_eval(control),
                                    report=lambda step, metrics: reported.append((step, metrics)))
    bests = []
    for step in (2, 4, 6, 8):
        checkpoints = make_checkpoints(out, step)
        scheduler.submit(step)
        scheduler.finish()
        bests.append(os.readlink(checkpoints / "best"))  # relative, like `last`
    assert bests == ["000002", "000002", "000002", "000008"]
    records = read_evals(out / "evals.jsonl")
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    first = records[0]
    low, high = pytest.approx(0.1500, abs=1e-4), pytest.approx(0.8500, abs=1e-4)  # Wilson 95%, 2 of 4
    assert first == {"step": 2, "checkpoint": str(checkpoints.absolute() / "000002"), "report_dir": "eval/step_000002",
                     "success_rate": 0.5, "ci_low": low, "ci_high": high, "episodes": 4,
                     "per_task": {"reach-v3": {"success_rate": 0.5, "ci_low": low, "ci_high": high}},
                     "wall_s": first["wall_s"]}
    assert first["wall_s"] > 0 and (out / "eval" / "step_000002" / "eval.log").is_file()
    assert reported[0] == (2, {"eval/success": 0.5, "eval/success/reach-v3": 0.5, "eval/ci_low": low,
                               "eval/ci_high": high})
    # the evaluation leaves the cores to training: one OpenMP thread, no spinning
    assert json.loads((control / "started_2").read_text()) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}


def test_one_evaluation_at_a_time_and_a_newer_checkpoint_replaces_the_queued_one(tmp_path):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {2: 0.25, 6: 0.5}, "gate")
    make_checkpoints(out, 2, 4, 6)
    scheduler = EvaluationScheduler(out, EvalDuringTrainingConfig(every=2), command=fake_eval(control))
    for step in (2, 4, 6):
        scheduler.submit(step)
    scheduler.poll()  # the evaluation of step 2 waits at the gate: nothing to record yet
    assert (scheduler.running.step, scheduler.queued) == (2, 6)
    assert scheduler.pending() == ["000002", "000006"]
    release(control)
    scheduler.finish()
    assert started(control) == [2, 6]
    assert [(r["step"], r["success_rate"]) for r in read_evals(out / "evals.jsonl")] == [(2, 0.25), (6, 0.5)]
    assert os.readlink(out / "checkpoints" / "best") == "000006" and scheduler.pending() == []


def test_a_resume_keeps_the_record_and_best_and_redoes_only_the_evaluation_that_was_cut_short(tmp_path):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {8: 0.25})
    checkpoints = make_checkpoints(out, 2, 4, 6, 8)
    point_best(checkpoints, "000006")
    done = [{"step": 2, "success_rate": 0.5}, {"step": 4, "error": "exit code 1: boom"},
            {"step": 6, "success_rate": 0.75}]
    # the run was killed while step 8 was evaluated, and while an append was under way
    (out / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in done) + '{"step": 8, "succ')
    scheduler = EvaluationScheduler(out, EvalDuringTrainingConfig(every=2), command=fake_eval(control))
    assert scheduler.resume(8) == {2, 4, 6}
    assert scheduler.running.step == 8 and os.readlink(checkpoints / "best") == "000006"
    scheduler.finish(8)  # already running: not evaluated twice
    assert started(control) == [8]
    assert [r["step"] for r in read_evals(out / "evals.jsonl")] == [2, 4, 6, 8]
    assert (out / "evals.jsonl").read_text().endswith("}\n")  # the torn line is gone, not glued to the next
    assert os.readlink(checkpoints / "best") == "000006"
    # a resume from an earlier checkpoint: the later ones will be written again, their evaluations go
    rolled_back = EvaluationScheduler(out, EvalDuringTrainingConfig(every=2), command=fake_eval(control))
    assert rolled_back.resume(4) == {2, 4} and rolled_back.running is None
    assert os.readlink(checkpoints / "best") == "000002"
    assert [r["step"] for r in read_evals(out / "evals.jsonl")] == [2, 4]


def test_a_resume_keeps_the_eval_lines_of_recorded_evaluations_only_once(tmp_path):
    telemetry = Telemetry(tmp_path, batch_size=1)
    telemetry.write(5, {"loss": 1.0})
    telemetry.write_eval(2, {"eval/success": 0.5, "eval/success/reach-v3": 0.5})
    telemetry.write(10, {"loss": 0.5})
    telemetry.write_eval(8, {"eval/success": 0.25})  # killed before its evals.jsonl line: it is evaluated again
    telemetry.write(15, {"loss": 0.25})
    telemetry.write_eval(12, {"eval/success": 1.0})  # after the checkpoint resumed from
    telemetry.close()
    assert scalars(tmp_path, "eval/success") == [(2, 0.5), (8, 0.25), (12, 1.0)]
    Telemetry(tmp_path, batch_size=1).truncate_after(10, evaluated={2})
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], "eval/success" in line) for line in lines] == [(5, False), (2, True), (10, False)]


def test_retention_keeps_best_last_and_the_checkpoints_evaluations_read(tmp_path):
    checkpoints = make_checkpoints(tmp_path, 1, 2, 3, 4, 5, 6)
    point_best(checkpoints, "000001")
    deleted = prune_checkpoints(tmp_path, keep_last=1, keep=["000003", "000004"])  # running, queued
    assert [p.name for p in deleted] == ["000002", "000005"]
    assert [p.name for p in step_directories(checkpoints)] == ["000001", "000003", "000004", "000006"]


def test_the_reports_own_intervals_are_used_and_missing_ones_computed(tmp_path):
    report = {"overall": {"success_rate": 0.75, "episodes": 8, "ci_low": 0.4, "ci_high": 0.9},
              "per_task": {"a-v3": {"success_rate": 1.0, "episodes": 4, "ci_low": 0.5, "ci_high": 1.0},
                           "b-v3": {"success_rate": 0.5, "episodes": 4}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    result = read_report(tmp_path / "report.json")
    assert (result["ci_low"], result["ci_high"], result["episodes"]) == (0.4, 0.9, 8)
    assert result["per_task"]["a-v3"] == {"success_rate": 1.0, "ci_low": 0.5, "ci_high": 1.0}
    assert result["per_task"]["b-v3"]["ci_low"] == pytest.approx(0.15, abs=1e-4)


def test_the_evaluation_command_is_roboscale_eval_with_the_eval_options(tmp_path):
    from roboscale.config import parse
    from roboscale.configs.eval import EvalConfig

    cfg = EvalDuringTrainingConfig(every=5, env="tests.rollout.fake_envs:SPEC", tasks=["reach", "push"], episodes=3,
                                   seed=7, max_steps=20, workers=2, videos_per_task=0)
    argv = eval_command(cfg)(tmp_path / "checkpoints" / "000005", tmp_path / "eval" / "step_000005")
    assert argv[:4] == [sys.executable, "-m", "roboscale", "eval"]
    parsed = parse(EvalConfig, argv[4:])  # every option is one `roboscale eval` knows
    assert (parsed.checkpoint, parsed.output_dir) == (str(tmp_path / "checkpoints" / "000005"),
                                                     str(tmp_path / "eval" / "step_000005"))
    assert (parsed.env, parsed.tasks, parsed.episodes, parsed.seed, parsed.max_steps, parsed.rollout.workers,
            parsed.videos_per_task) == ("tests.rollout.fake_envs:SPEC", ["reach", "push"], 3, 7, 20, 2, 0)


def test_eval_options_parse_are_checked_and_may_change_on_resume(capsys):
    from roboscale.cli import main
    from roboscale.configs.train import TrainConfig
    from roboscale.train.resume import parse_train_args, resume_conflicts

    cfg = parse_train_args(["--eval.every=200", "--eval.tasks=reach,push", "--eval.episodes=5"])
    assert (cfg.eval.every, cfg.eval.tasks, cfg.eval.episodes) == (200, ["reach", "push"], 5)
    assert resume_conflicts(TrainConfig(), cfg) == []
    assert main(["train", "--eval.every=-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--eval.every must be >= 0, got -1" in err


def test_a_trainer_killed_outright_takes_its_evaluation_with_it(tmp_path):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {}, "alive")
    make_checkpoints(out, 1)
    trainer = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom pathlib import Path\nfrom roboscale.configs.train import EvalDuringTrainingConfig\n"
        "from roboscale.train.evaluation import EvaluationScheduler\nfrom tests.train.test_eval_during_training "
        "import fake_eval\nscheduler = EvaluationScheduler(Path(sys.argv[1]), EvalDuringTrainingConfig(every=1), "
        "command=fake_eval(Path(sys.argv[2])))\nscheduler.submit(1)\nsys.stdin.read()\n"), str(out), str(control)],
        stdin=subprocess.PIPE, cwd=Path(__file__).parents[2])
    fd = os.open(control / "alive", os.O_RDONLY)  # returns once the evaluation is running
    try:
        trainer.kill()  # SIGKILL: no finally, no handler runs in the trainer
        trainer.wait()
        assert wait_for_eof(fd) == b""  # the evaluation and its own child are gone
    finally:
        os.close(fd)


# --- in the trainer ---------------------------------------------------------------------------------------------
def eval_config(tiny_dataset, out, steps, **kw):
    cfg = tiny_train_config(tiny_dataset, out, steps=steps, **kw)
    cfg.eval = EvalDuringTrainingConfig(every=2, tasks=["reach"], episodes=1, max_steps=5, workers=1,
                                        videos_per_task=0)
    return cfg


def test_an_unknown_eval_task_is_refused_before_training_starts(tiny_dataset, tmp_path):
    from roboscale.errors import ConfigError

    out = tmp_path / "run"
    cfg = eval_config(tiny_dataset, out, steps=2)
    cfg.eval.tasks = ["reach", "reachh"]
    with pytest.raises(ConfigError, match="--eval.tasks: unknown MetaWorld task 'reachh'"):
        supervised_trainer(cfg, progress=False).fit()
    cfg.eval.tasks, cfg.eval.env_options = ["reach"], {"settle_steps": 3}
    with pytest.raises(ConfigError, match=r"--eval.env_options: the metaworld environment takes no options"):
        supervised_trainer(cfg, progress=False).fit()
    assert not (out / "checkpoints").exists()


def test_training_goes_on_while_a_checkpoint_is_evaluated(tiny_dataset, tmp_path, monkeypatch):
    """Step 2's evaluation is held at the gate until step 6: training reaches step 6 meanwhile, step 4 waits in
    the queue and step 6 replaces it; retention (keep_last=1) keeps what is evaluated or queued."""
    out = tmp_path / "run"
    control = control_dir(tmp_path, {2: 0.75, 6: 0.25}, "gate")
    cfg = eval_config(tiny_dataset, out, steps=6, save_freq=1)
    cfg.checkpoint.keep_last = 1
    seen = {}
    checkpoint = Trainer.checkpoint

    def spy(self):
        saved = checkpoint(self)
        ev = self.evaluations
        seen[self.step] = (ev.running and ev.running.step, ev.queued,
                           [p.name for p in step_directories(out / "checkpoints")])
        if self.step == 6:
            release(control)
        return saved

    monkeypatch.setattr(Trainer, "checkpoint", spy)
    final = supervised_trainer(cfg, progress=False, eval_command=fake_eval(control)).fit()
    assert final.parent.name == "000006"
    assert seen[3] == (2, None, ["000002", "000003"])
    assert seen[4] == (2, 4, ["000002", "000004"])
    assert seen[5] == (2, 4, ["000002", "000004", "000005"])  # the queued checkpoint is kept
    assert seen[6] == (2, 6, ["000002", "000006"])  # step 6 replaced step 4, which retention then deleted
    assert started(control) == [2, 6]  # the final checkpoint is evaluated after training, before fit returns
    assert [(r["step"], r["success_rate"]) for r in read_evals(out / "evals.jsonl")] == [(2, 0.75), (6, 0.25)]
    assert os.readlink(out / "checkpoints" / "best") == "000002"
    assert scalars(out, "eval/success") == [(2, 0.75), (6, 0.25)]
    assert scalars(out, "eval/success/reach-v3") == [(2, 0.75), (6, 0.25)]
    lines = eval_lines(out)
    assert [(line["step"], line["eval/success"], line["eval/success/reach-v3"]) for line in lines] == \
        [(2, 0.75, 0.75), (6, 0.25, 0.25)]
    assert all(0 <= line["eval/ci_low"] <= line["eval/success"] <= line["eval/ci_high"] <= 1 for line in lines)


def test_a_failed_evaluation_is_recorded_and_training_ends_normally(tiny_dataset, tmp_path, caplog):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {2: None, 4: 0.5})
    with caplog.at_level("WARNING", logger="roboscale.train.evaluation"):
        final = supervised_trainer(eval_config(tiny_dataset, out, steps=4), progress=False, eval_command=fake_eval(control)).fit()
    assert final.parent.name == "000004"
    failed, passed = read_evals(out / "evals.jsonl")
    assert failed["step"] == 2 and failed["error"] == "exit code 1: error: the simulator crashed"
    assert "success_rate" not in failed and failed["report_dir"] == "eval/step_000002"
    assert "the evaluation of step 2 failed (exit code 1: error: the simulator crashed)" in caplog.text
    assert passed["step"] == 4 and passed["success_rate"] == 0.5
    assert os.readlink(out / "checkpoints" / "best") == "000004"
    assert [line["step"] for line in eval_lines(out)] == [4]


def test_a_resumed_run_does_not_redo_evaluations_and_keeps_best(tiny_dataset, tmp_path):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {2: 0.5, 4: 0.25, 6: 0.5})
    supervised_trainer(eval_config(tiny_dataset, out, steps=4), progress=False, eval_command=fake_eval(control)).fit()
    for done in control.glob("started_*"):
        done.unlink()
    resumed = eval_config(tiny_dataset, out, steps=6, resume=True)
    resumed.eval.episodes = 2  # evaluation options may change on resume
    supervised_trainer(resumed, progress=False, eval_command=fake_eval(control)).fit()
    assert started(control) == [6]
    assert [r["step"] for r in read_evals(out / "evals.jsonl")] == [2, 4, 6]
    assert os.readlink(out / "checkpoints" / "best") == "000002"  # step 6 only ties it
    assert [line["step"] for line in eval_lines(out)] == [2, 4, 6]  # each once, across the resume

def test_ctrl_c_during_training_stops_the_evaluation_and_its_processes(tiny_dataset, tmp_path, monkeypatch):
    out = tmp_path / "run"
    control = control_dir(tmp_path, {}, "alive")
    checkpoint = Trainer.checkpoint
    alive = []

    def spy(self):
        saved = checkpoint(self)
        if self.step == 3:
            alive.append(os.open(control / "alive", os.O_RDONLY))  # returns once step 2's evaluation runs
            raise KeyboardInterrupt
        return saved

    monkeypatch.setattr(Trainer, "checkpoint", spy)
    with pytest.raises(KeyboardInterrupt):
        supervised_trainer(eval_config(tiny_dataset, out, steps=6), progress=False, eval_command=fake_eval(control)).fit()
    try:
        assert wait_for_eof(alive[0]) == b""
    finally:
        os.close(alive[0])
    assert not (out / "evals.jsonl").exists()  # cut short: nothing recorded, a resume evaluates it again


def test_roboscale_eval_scores_checkpoints_during_training(tiny_dataset, tmp_path):
    """The real thing: `roboscale eval` processes on MetaWorld's reach, an untrained tiny policy (0% success)."""
    from roboscale.train.supervised import train

    out = tmp_path / "run"
    train(eval_config(tiny_dataset, out, steps=4), progress=False)
    records = read_evals(out / "evals.jsonl")
    assert [r["step"] for r in records] == [2, 4] and all("error" not in r for r in records)
    assert all(r["success_rate"] == 0.0 and r["episodes"] == 1 and list(r["per_task"]) == ["reach-v3"]
               for r in records)
    assert 0.0 == records[0]["ci_low"] < records[0]["ci_high"] < 1.0
    assert (out / "eval" / "step_000002" / "report.json").is_file()
    assert os.readlink(out / "checkpoints" / "best") == "000002"  # a tie keeps the earlier checkpoint
    assert scalars(out, "eval/success") == [(2, 0.0), (4, 0.0)]
    assert [line["step"] for line in eval_lines(out)] == [2, 4]

