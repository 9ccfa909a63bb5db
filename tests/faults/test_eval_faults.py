"""Evaluation faults a probe found (issue 18): two evaluations into one directory, damaged files of an evaluation
directory or a training run (protocol.json, episodes.jsonl, report.json, evals.jsonl), what "the same episodes
whatever the batching" holds to, and the demo's evaluation on the training run's page.

Command-line entry points run in this process (``run_cli``); the evaluations use the toy env adapter
(tests/rollout/fake_envs.py) unless the claim is about MetaWorld."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable
from html import escape
from pathlib import Path

import numpy as np
import pytest

from roboscale.configs.eval import EvalConfig
from roboscale.configs.rollout import RolloutConfig, RunnerConfig
from roboscale.eval.closed_loop import evaluate
from roboscale.eval.episode_log import EpisodeLog
from tests.eval.test_report import make_report
from tests.eval.test_run_report import make_training_run
from tests.models.helpers import tiny_policy

from .entry_points import TINY_PI05, run_cli

FAKE = "tests.rollout.fake_envs:SPEC"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    tiny_policy().save_pretrained(path / "pretrained_model")
    return path


def eval_args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", f"--checkpoint={checkpoint}", f"--env={FAKE}", "--tasks=[reach]", "--episodes=3",
            "--max_steps=6", "--videos_per_task=0", "--rollout.workers=1", "--rollout.envs_per_worker=1",
            f"--output_dir={out}", *extra]


@pytest.fixture(scope="module")
def evaluated(checkpoint, tmp_path_factory) -> Path:
    """A finished evaluation directory (protocol.json, episodes.jsonl, report.json), copied by each test."""
    out = tmp_path_factory.mktemp("evaluated") / "eval"
    assert run_cli(*eval_args(checkpoint, out)).kind == "ok"
    return out


def episode_keys(out: Path) -> list[tuple[str, int]]:
    return [(r["task"], r["episode"]) for r in map(json.loads, (out / "episodes.jsonl").read_text().splitlines())]


# --------------------------------------------------------------------------------- two evaluations, one directory


def test_a_second_evaluation_into_the_same_directory_is_refused_naming_the_first(checkpoint, tmp_path,
                                                                                 monkeypatch):
    """The second `roboscale eval` starts once the first has finished an episode (from the first one's own
    result callback, so no timing is involved; flock locks an open file, so this process's second open is
    refused as another process's would be): refused in one line, and each episode is run and recorded once."""
    out = tmp_path / "eval"
    args = eval_args(checkpoint, out)
    second = []
    append = EpisodeLog.append

    def append_then_start_another(self, result):
        append(self, result)
        if not second:
            second.append(None)
            second[0] = run_cli(*args)

    monkeypatch.setattr(EpisodeLog, "append", append_then_start_another)
    assert run_cli(*args).kind == "ok"
    (refused,) = second
    assert (refused.exit_code, refused.message) == (2, f"error: {out}: another evaluation (pid {os.getpid()} on "
                                                       f"{socket.gethostname()}) is writing there; wait for it to "
                                                       "end, or use another --output_dir\n")
    assert episode_keys(out) == [("reach", 0), ("reach", 1), ("reach", 2)]  # in finishing order: one env, in turn


# ------------------------------------------------------------------------- damaged files of an evaluation directory


def _edit_line(name: str, number: int, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """Replace line ``number`` (1-based) of ``name`` by ``edit(record)`` (as JSON; a str is written as is)."""

    def damage(out: Path) -> None:
        lines = (out / name).read_text().splitlines()
        new = edit(json.loads(lines[number - 1]))
        lines[number - 1] = new if isinstance(new, str) else json.dumps(new)
        (out / name).write_text("\n".join(lines) + "\n")

    return damage


def _cut(name: str) -> Callable[[Path], None]:
    def damage(out: Path) -> None:
        data = (out / name).read_bytes()
        (out / name).write_bytes(data[: len(data) // 2])

    return damage


def _overwrite(name: str, text: str) -> Callable[[Path], None]:
    return lambda out: (out / name).write_text(text)


RESUME_DAMAGES = {
    "protocol-truncated": (_cut("protocol.json"), "protocol.json: not valid JSON ("),
    "protocol-a-list": (_overwrite("protocol.json", '["reach"]\n'),
                        'protocol.json: must hold a JSON object, got ["reach"]'),
    "episode-field-missing": (_edit_line("episodes.jsonl", 2, lambda r: {k: v for k, v in r.items()
                                                                        if k != "success"}),
                              "episodes.jsonl: line 2: field 'success' is missing"),
    "episode-steps-a-string": (_edit_line("episodes.jsonl", 1, lambda r: {**r, "steps": "six"}),
                               "episodes.jsonl: line 1: field 'steps' must be an integer, got \"six\""),
    "episode-success-a-number": (_edit_line("episodes.jsonl", 3, lambda r: {**r, "success": 0}),
                                 "episodes.jsonl: line 3: field 'success' must be true or false, got 0"),
    "episode-a-list": (_edit_line("episodes.jsonl", 2, lambda r: list(r.values())[:2]),
                       'episodes.jsonl: line 2: must be a JSON object, got ["reach", 1]'),
    "episode-line-garbled": (_edit_line("episodes.jsonl", 1, lambda r: json.dumps(r)[:30]),
                             "episodes.jsonl: line 1: not valid JSON ("),
}


@pytest.mark.parametrize("damage", list(RESUME_DAMAGES))
def test_resuming_into_a_damaged_evaluation_directory_is_a_one_line_error(evaluated, checkpoint, tmp_path, damage):
    out = tmp_path / "eval"
    shutil.copytree(evaluated, out)
    apply, expected = RESUME_DAMAGES[damage]
    apply(out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    outcome = run_cli(*eval_args(checkpoint, out))
    assert outcome.exit_code == 1 and outcome.message.count("\n") == 1
    assert outcome.message.startswith(f"error: {out / expected}")
    assert outcome.message.endswith("; delete it, or --resume=false to start over\n" if damage.startswith("protocol")
                                    else "; fix or delete that line (its episode is then run again), or "
                                         "--resume=false to start over\n")
    assert before == {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}  # nothing rewritten


def test_a_damaged_evaluation_directory_starts_over_with_resume_false(evaluated, checkpoint, tmp_path):
    out = tmp_path / "eval"
    shutil.copytree(evaluated, out)
    RESUME_DAMAGES["episode-field-missing"][0](out)
    RESUME_DAMAGES["protocol-truncated"][0](out)
    assert run_cli(*eval_args(checkpoint, out, "--resume=false")).kind == "ok"
    assert _episodes(out) == _episodes(evaluated)


def _episodes(out: Path) -> list[dict]:
    """report.json's episodes but for their wall times."""
    return [{k: v for k, v in e.items() if k != "wall_s"} for e in json.loads((out / "report.json").read_text())
            ["episodes"]]


# ------------------------------------------------------ damaged reports and evals.jsonl: eval compare, report


def _report_json(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(report_dir: Path) -> None:
        path = report_dir / "report.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))

    return damage


def _first_task(report: dict, **changes) -> dict:
    task = next(iter(report["per_task"]))
    return {**report, "per_task": {**report["per_task"], task: {**report["per_task"][task], **changes}}}


REPORT_DAMAGES = {
    "report-truncated": (_cut("report.json"), "report.json: not valid JSON ("),
    "report-a-list": (_overwrite("report.json", "[]"), "report.json: must hold a JSON object, got []"),
    "report-overall-missing": (_report_json(lambda r: {k: v for k, v in r.items() if k != "overall"}),
                               "report.json: field 'overall' is missing"),
    "report-task-a-string": (_report_json(lambda r: {**r, "per_task": {"drawer-open-v3": "90%"}}),
                             'report.json: per_task.drawer-open-v3 must be a JSON object, got "90%"'),
    "report-rate-a-string": (_report_json(lambda r: _first_task(r, success_rate="high")),
                             "report.json: field 'per_task.drawer-open-v3.success_rate' must be a number, got "
                             '"high"'),
    "report-episode-without-steps": (_report_json(lambda r: {**r, "episodes": [{k: v for k, v in e.items()
                                                                                if k != "steps"}
                                                                               for e in r["episodes"]]}),
                                     "report.json: field 'episodes[0].steps' is missing"),
}


@pytest.mark.parametrize("damage", list(REPORT_DAMAGES))
def test_eval_compare_of_a_damaged_report_is_a_one_line_error(tmp_path, damage):
    """Both ways a report reaches the comparison: a training run's best evaluation, and its directory."""
    apply, expected = REPORT_DAMAGES[damage]
    base = tmp_path / "base"
    make_report(base, {"drawer-open-v3": (3, 20)}, label="base")
    run = make_training_run(tmp_path)
    best = run / "eval" / "000200"
    apply(best)
    outcome = run_cli("eval", "compare", str(base), str(run), f"--output_dir={tmp_path}")
    assert outcome.exit_code == 1 and outcome.message.startswith(f"error: {best / expected}")
    apply(base)
    outcome = run_cli("eval", "compare", str(base), str(best), f"--output_dir={tmp_path}")
    assert outcome.exit_code == 1 and outcome.message.startswith(f"error: {base / expected}")
    assert outcome.message.count("\n") == 1


@pytest.mark.parametrize("damage", ["report-a-list", "report-rate-a-string", "report-episode-without-steps"])
def test_the_run_page_says_what_is_wrong_with_the_best_checkpoints_report(tmp_path, damage):
    """The page is still written (curves, success vs step come from other files); the best checkpoint's section
    names the file and the field."""
    apply, expected = REPORT_DAMAGES[damage]
    run = make_training_run(tmp_path)
    apply(run / "eval" / "000200")
    assert run_cli("report", str(run)).kind == "ok"
    html = (run / "report.html").read_text()
    assert f"its report cannot be read: {escape(str(run / 'eval' / '000200' / expected))}.</p>" in html
    assert "best: step 200" in html  # success vs step, from evals.jsonl


def _evals_line(number: int, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    return _edit_line("evals.jsonl", number, edit)


EVALS_DAMAGES = {
    "evals-per-task-a-list": (_evals_line(1, lambda r: {**r, "per_task": list(r["per_task"])}),
                              "line 1: field 'per_task' must be an object, got [\"drawer-open-v3\", "
                              "\"faucet-open-v3\"]"),
    "evals-rate-a-string": (_evals_line(2, lambda r: {**r, "success_rate": "0.35"}),
                            "line 2: field 'success_rate' must be a number, got \"0.35\""),
    "evals-task-rate-missing": (_evals_line(3, lambda r: {**r, "per_task": {"drawer-open-v3": {}}}),
                                "line 3: field 'per_task.drawer-open-v3.success_rate' is missing"),
    "evals-step-missing": (_evals_line(3, lambda r: {k: v for k, v in r.items() if k != "step"}),
                           "line 3: field 'step' is missing"),
    "evals-neither-rate-nor-error": (_evals_line(4, lambda r: {k: v for k, v in r.items() if k != "error"}),
                                     "line 4: neither 'success_rate' nor 'error'"),
    "evals-line-garbled": (_evals_line(2, lambda r: json.dumps(r)[:20]),
                           "line 2: not valid JSON (Unterminated string starting at)"),
}


@pytest.mark.parametrize("damage", list(EVALS_DAMAGES))
def test_a_damaged_evals_jsonl_line_is_a_one_line_error_of_report_and_compare(tmp_path, damage):
    apply, expected = EVALS_DAMAGES[damage]
    run = make_training_run(tmp_path)
    apply(run)
    for args in (["report", str(run)], ["eval", "compare", str(run), str(run), f"--output_dir={tmp_path}"]):
        outcome = run_cli(*args)
        assert (outcome.exit_code, outcome.message) == (
            1, f"error: {run / 'evals.jsonl'}: {expected}; fix or delete that line\n"), args


def test_a_torn_last_evals_line_is_one_being_written_and_skipped(tmp_path):
    """The trainer may be appending right now: only a line with its newline is complete."""
    run = make_training_run(tmp_path)
    with open(run / "evals.jsonl", "a") as f:
        f.write('{"step": 500, "success_rate": "0.')
    assert run_cli("report", str(run)).kind == "ok"
    assert run_cli("eval", "compare", str(run), str(run), f"--output_dir={tmp_path}").kind == "ok"


# ------------------------------------------------------------------- batching: what is identical, what is not


def test_a_batched_prediction_equals_predicting_alone_up_to_float32_rounding(checkpoint):
    """Batching changes nothing in an episode's inputs (its scene, its noise) and its actions only by float32
    rounding: a matrix product of another shape sums in another order (MKL here, cuBLAS on GPUs; even a batch of
    one row takes another kernel), about 1e-7 of the actions' scale."""
    from roboscale.rollout.inference import PolicyRunner, PredictItem

    runner = PolicyRunner(str(checkpoint / "pretrained_model"), "cpu", threads=1)
    rng = np.random.default_rng(0)
    prompts = ["Open a drawer", "Rotate the faucet clockwise", "Go"]
    items = [PredictItem(i, 1000 + i, i % 3, prompts[i % 3], rng.standard_normal(4).astype(np.float32),
                         {c: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for c in ("corner2", "wrist")})
             for i in range(6)]
    alone = np.stack([runner.predict([item])[0] for item in items])
    for order in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [1, 2, 3]):
        np.testing.assert_allclose(runner.predict([items[i] for i in order]), alone[order], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_one_observation_per_policy_call_gives_identical_episodes_whatever_the_workers(checkpoint, tmp_path):
    """README's exact claim: --rollout.runner.max_batch_size=1 and --rollout.runner.threads=1 make every policy call
    the same computation, so the episodes are the same bit for bit (sum_reward included) in MetaWorld, for any
    number of env workers and environments per worker."""
    layouts = [(1, 1), (1, 2), (2, 1)]  # (workers, envs_per_worker)
    for workers, envs in layouts:
        cfg = EvalConfig(checkpoint=str(checkpoint), tasks=["reach"], episodes=3, max_steps=12, videos_per_task=0,
                         output_dir=str(tmp_path / f"{workers}x{envs}"),
                         rollout=RolloutConfig(workers=workers, envs_per_worker=envs, runner=RunnerConfig(max_batch_size=1,
                                                                                     threads=1)))
        evaluate(cfg, progress=False)
    runs = [tmp_path / f"{workers}x{envs}" for workers, envs in layouts]
    assert _episodes(runs[0]) == _episodes(runs[1]) == _episodes(runs[2])
    # recorded in the report: together with the batch, the threads decide how the matrix products round
    assert {json.loads((run / "report.json").read_text())["timing"]["runner.threads"] for run in runs} == {1}


# ------------------------------------------------------------------------ the demo's evaluation on the run's page


@pytest.mark.slow
def test_the_demos_evaluation_of_its_trained_policy_is_on_the_training_runs_page(tiny_dataset, tmp_path):
    """A tiny `roboscale demo` (the tiny dataset reused, 1 training step, 1 episode): the run evaluates its final
    checkpoint as evaluations during training do, so `roboscale report` of the run shows it, and a re-run of
    the demo reuses it (or refuses another protocol)."""
    out = tmp_path / "demo"
    shutil.copytree(tiny_dataset, out / "data")
    args = ["demo", f"--output_dir={out}", "--data.tasks=[reach]", "--evaluate_untrained=false",
            "--language_check=false", "--train.steps=1", "--train.batch_size=4",
            *(a.replace("--policy.", "--train.policy.") for a in TINY_PI05), "--eval.episodes=1",
            "--eval.max_steps=5", "--eval.videos_per_task=0", "--eval.rollout.workers=1",
            "--eval.rollout.envs_per_worker=1"]
    demo = run_cli(*args)
    assert demo.kind == "ok", demo.message
    run = out / "train"
    assert f"report:     {run / 'eval' / 'step_000001'}/report.md" in demo.message  # the demo's stdout
    (record,) = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["episodes"] == 1 and "error" not in record
    assert os.readlink(run / "checkpoints" / "best") == "000001"
    assert run_cli("report", str(run)).kind == "ok"
    html = (run / "report.html").read_text()
    assert "No evaluations yet" not in html and "Step <b>1</b>, chosen by checkpoints/best (step 1)" in html
    assert run_cli(*args).kind == "ok"  # a re-run: the recorded evaluation, not a second one
    assert len((run / "evals.jsonl").read_text().splitlines()) == 1
    again = run_cli(*args, "--eval.episodes=2")
    assert again.exit_code == 2 and "evaluated the trained policy with another protocol (differs in: " \
                                   "episodes_per_task)" in again.message
