"""`roboscale demo` / `make demo`: the closed loop on one CPU.

MetaWorld expert demonstrations -> LeRobot v3.0 dataset -> pi0.5-style policy trained on the CPU -> evaluated in
closed loop, untrained and trained, with a per-task success table, report, videos and checkpoint. The trained
policy is evaluated by the training run itself, as evaluations during training are: its report is the run's
(train/eval/step_<N>/, train/evals.jsonl, train/checkpoints/best), so `roboscale report outputs/demo/train` shows it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch

from roboscale.config import save_yaml
from roboscale.configs.demo import DemoConfig
from roboscale.configs.eval import EvalConfig, EvalProtocol
from roboscale.configs.train import DatasetConfig, EvalDuringTrainingConfig
from roboscale.errors import ConfigError, WorkerError
from roboscale.eval.closed_loop import evaluate
from roboscale.eval.report import load_report, protocol_of, success_table
from roboscale.eval.run_report import eval_records
from roboscale.sim.experts import generate_dataset
from roboscale.train.supervised import SupervisedJob
from roboscale.train.trainer import Trainer

log = logging.getLogger(__name__)


def run_demo(cfg: DemoConfig) -> dict:
    from roboscale.data import LeRobotDataset
    from roboscale.models.registry import build_policy
    from roboscale.sim.env import env_spec

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    tasks = env_spec(cfg.data.env).tasks_or_default(cfg.data.tasks)

    data_dir = out / "data"
    cfg.data.out = str(data_dir)
    start = time.perf_counter()
    if cfg.reuse_data and (data_dir / "meta" / "info.json").is_file():
        log.info("reusing the dataset at %s", data_dir)
    else:
        log.info("1/5 generating %d expert demos for %s", cfg.data.episodes_per_task * len(tasks), ", ".join(tasks))
        generate_dataset(cfg.data)
    timings["generate_s"] = time.perf_counter() - start

    cfg.train.dataset = DatasetConfig(root=str(data_dir))
    cfg.train.output_dir = str(out / "train")
    cfg.eval.tasks = tasks

    # The untrained policy: same config and seed as the one we train, saved so the evaluator loads it the same way.
    start = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    untrained_dir = out / "untrained" / "pretrained_model"
    untrained = build_policy(cfg.train.policy, LeRobotDataset(root=str(data_dir)).meta)
    untrained.save_pretrained(untrained_dir)
    before = None
    if cfg.evaluate_untrained:
        log.info("2/5 evaluating the untrained policy")
        before = evaluate(_eval_cfg(cfg.eval, untrained_dir, out / "eval_untrained", videos=0), label="untrained")
        timings["eval_untrained_s"] = time.perf_counter() - start

    start = time.perf_counter()
    log.info("3/5 training for %d steps, then 4/5: the run evaluates its final checkpoint", cfg.train.steps)
    if (out / "train" / "checkpoints").exists():
        cfg.train.resume = True  # a re-run of the demo continues (or reuses) its own training
    checkpoint = Trainer(cfg.train, SupervisedJob(cfg.train),
                         eval_command=_evaluated_by_the_run(cfg, out / "eval_config.yaml")).fit()
    after = _final_evaluation(Path(cfg.train.output_dir), checkpoint, cfg.eval)
    timings["eval_trained_s"] = after["eval_seconds"]
    timings["train_s"] = max(0.0, time.perf_counter() - start - after["eval_seconds"])

    language = {}
    if cfg.language_check:
        start = time.perf_counter()
        language = _language_check(cfg.eval, checkpoint, out / "eval_swapped_instructions", tasks, after)
        timings["language_check_s"] = time.perf_counter() - start

    table = success_table({"untrained": before, "trained": after} if before else {"trained": after}, tasks)
    save_yaml(cfg, out / "demo_config.yaml")
    summary = {"table": table, "timings": timings, "checkpoint": str(checkpoint), "report": after["report_dir"],
               "language_check": language}
    print()
    print(table)
    print()
    for task, result in language.items():
        print(
            f"language check, {task}: {result['own']:.0%} success with its own instruction, "
            f"{result['swapped']:.0%} when told {result['told']!r}"
        )
    print("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()))
    print(f"dataset:    {data_dir}")
    print(f"checkpoint: {checkpoint}")
    print(f"report:     {after['report_dir']}/report.md (and report.html)")
    print(f"videos:     {after['report_dir']}/videos/")
    return summary


def _evaluated_by_the_run(cfg: DemoConfig, eval_yaml: Path) -> Callable[[Path, Path], list[str]]:
    """Make the training run evaluate its final checkpoint itself, as evaluations during training do
    (train.evaluation): the result lands in the run's eval/step_<N>/, evals.jsonl and checkpoints/best, where
    `roboscale report` and `eval compare` of the run look. Every evaluation of the run follows the demo's
    --eval.* options; the whole EvalConfig (rollout settings included) reaches `roboscale eval` as a YAML file."""
    protocol = {f.name: getattr(cfg.eval, f.name) for f in fields(EvalProtocol)}
    cfg.train.eval = EvalDuringTrainingConfig(**protocol, every=cfg.train.eval.every or cfg.train.steps,
                                              workers=cfg.eval.rollout.workers)
    save_yaml(cfg.eval, eval_yaml)
    return lambda checkpoint, report_dir: [sys.executable, "-m", "roboscale", "eval", f"--config={eval_yaml}",
                                           f"--checkpoint={checkpoint}", f"--output_dir={report_dir}"]


def _final_evaluation(run_dir: Path, checkpoint: Path, protocol: EvalProtocol) -> dict:
    """The run's evaluation of its final checkpoint (``checkpoint``: its pretrained_model): the summary of its
    report, where it is, and its wall time."""
    step = int(checkpoint.parent.name)
    record = next((r for r in reversed(eval_records(run_dir)) if r["step"] == step), None)
    if record is None or "error" in record:
        why = record["error"] if record else f"no line of step {step} in evals.jsonl"
        raise WorkerError(f"{run_dir}: the evaluation of the trained policy failed ({why})")
    report_dir = run_dir / record["report_dir"]
    report = load_report(report_dir / "report.json")
    # a re-run of the demo finds the evaluation an earlier one recorded: it must be of the protocol asked for now
    asked = {"tasks": protocol.tasks, "episodes_per_task": protocol.episodes, "seed": protocol.seed,
             "max_steps": protocol.max_steps}
    changed = [k for k, v in asked.items() if protocol_of(report).get(k) != v]
    if changed:
        raise ConfigError(f"{report_dir}: an earlier run of the demo evaluated the trained policy with another "
                          f"protocol (differs in: {', '.join(changed)}); use another --output_dir")
    return {"per_task": report["per_task"], "overall": report["overall"], "report_dir": str(report_dir),
            "eval_seconds": float(record.get("wall_s", 0.0))}


def _language_check(base: EvalConfig, checkpoint: Path, output_dir: Path, tasks: list[str], trained: dict) -> dict:
    """For each instruction-only pair in the task set, tell each task the other's instruction."""
    from dataclasses import replace

    from roboscale.sim.metaworld import INSTRUCTION_PAIRS, task_description

    swaps = {}
    for a, b in INSTRUCTION_PAIRS:
        if a in tasks and b in tasks:
            swaps[a], swaps[b] = task_description(b), task_description(a)
    if not swaps:
        return {}
    log.info("5/5 language check: %s with swapped instructions", ", ".join(swaps))
    episodes = max(1, base.episodes // 2)
    cfg = replace(_eval_cfg(base, checkpoint, output_dir, videos=1), tasks=list(swaps), instructions=swaps,
                  episodes=episodes)
    swapped = evaluate(cfg, label="swapped instructions")
    return {
        task: {
            "own": trained["per_task"][task]["success_rate"],
            "swapped": swapped["per_task"][task]["success_rate"],
            "told": told,
        }
        for task, told in swaps.items()
    }


def _eval_cfg(base: EvalConfig, checkpoint: Path, output_dir: Path, videos: int) -> EvalConfig:
    from dataclasses import replace

    return replace(base, checkpoint=str(checkpoint), output_dir=str(output_dir), videos_per_task=videos)
