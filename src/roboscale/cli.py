"""The `roboscale` command line: one ``Command`` per verb (``COMMANDS``: data, model, lake, train, rl, export,
eval, serve, report, plan, demo), each parsing its typed config (``roboscale.configs``) and calling one library
function. Errors a user can act on (``RoboscaleError``) are one line and an exit code (2: a bad option, 1: the
data or a run failed); Ctrl-C and SIGTERM end every process a command started. Every option a command lists in
``--help`` is read by it or refused (``tests/test_options.py`` runs each command but `data generate`, whose
workers read its options in their own processes, and `demo`, which is generate, train and eval)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from roboscale.errors import ConfigError, RoboscaleError, one_line
from roboscale.utils.lifetime import restore_sigterm, terminate_like_interrupt


@dataclass(frozen=True)
class Command:
    summary: str
    run: Callable[[list[str]], object]


def _generate(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.data import GenerateConfig
    from roboscale.sim.experts import generate_dataset

    cfg = parse(GenerateConfig, argv, prog="roboscale data generate")
    print(f"dataset written to {generate_dataset(cfg)}")


def _tasks(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.data import TasksConfig
    from roboscale.sim.env import env_spec

    spec = env_spec(parse(TasksConfig, argv, prog="roboscale data tasks").env)
    if spec.catalog is None:
        raise ConfigError(f"--env: the {spec.name} environment does not list its tasks")
    tasks, suites = spec.catalog()
    for task, text in sorted(tasks.items()):
        print(f"{task:30s} {text}")
    if spec.suite_groups is None:
        print("\nsuites: " + ", ".join(f"{k} ({len(v)} tasks)" for k, v in suites.items()))
        return
    print("\nsuites:")
    for title, names in spec.suite_groups().items():
        print(f"  {title}\n    " + ", ".join(f"{name} ({len(suites[name])} tasks)" for name in names))


def _info(argv: list[str]) -> None:
    from roboscale.data.lerobot.summary import summarize

    if len(argv) != 1 or argv[0].startswith("-"):
        raise ConfigError("usage: roboscale data info DATASET_DIR")
    print("\n".join(summarize(argv[0]).lines()))  # metadata and file sizes only: instant on any dataset size


def _validate(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.data import ValidateConfig
    from roboscale.data.lerobot.validate import validate
    from roboscale.errors import DatasetError

    cfg = parse(ValidateConfig, argv, prog="roboscale data validate", positional=("root",))
    if not cfg.root:
        raise ConfigError("usage: roboscale data validate ROOT [--quick] [--tolerance-s S]")
    report = validate(cfg.root, full=not cfg.quick, tolerance_s=cfg.tolerance_s)
    if len(report.problems) == 1 and report.episodes == 0:  # e.g. no meta/info.json: nothing else was checked
        only = report.problems[0]
        raise DatasetError(only.path, only.message, field=only.field, episode=only.episode)
    for problem in report.problems:
        print(problem)
    checked = f"{report.episodes} episodes, {report.frames} frames, {report.files_checked} files"
    if report.problems:
        bad = len(report.bad_episodes())
        raise DatasetError(cfg.root, f"{len(report.problems)} problems ({bad} episodes affected) in {checked}")
    print(f"{cfg.root}: no problems ({checked} checked{', quick' if cfg.quick else ''})")


def _convert(argv: list[str]) -> None:
    import dataclasses

    from roboscale.config import parse
    from roboscale.configs.data import ConvertConfig
    from roboscale.data.lerobot.convert import convert_v21_to_v30

    cfg = parse(ConvertConfig, argv, prog="roboscale data convert", positional=("src", "dst"))
    if not cfg.src or not cfg.dst:
        raise ConfigError("usage: roboscale data convert SRC DST [--reencode] [--video-codec C] (see --help)")
    options = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("src", "dst")}
    dst = convert_v21_to_v30(cfg.src, cfg.dst, progress=sys.stderr.isatty(), **options)
    print(f"converted to {dst}")


def _lake_build(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.lake import LakeConfig
    from roboscale.data.lake.build import build_lake

    cfg = parse(LakeConfig, argv, prog="roboscale lake build", positional=("sources",))
    tokenize, vocab_size = None, None
    if cfg.tokenizer is not None:  # the lake stores token ids, never the models' tokenizer
        from roboscale.models.tokenizer import TaskTokenizer

        tokenizer = TaskTokenizer.from_file(cfg.tokenizer)
        tokenize, vocab_size = partial(_encode_all, tokenizer), tokenizer.vocab_size
    report = build_lake(cfg, tokenize=tokenize, vocab_size=vocab_size)
    print(f"lake {report.output}: {report.episodes} episodes, {report.frames} frames, {len(report.built)} built, "
          f"{len(report.skipped)} reused shards, {report.seconds:.1f} s")


def _encode_all(tokenizer: Any, tasks: Sequence[str]) -> list[list[int]]:
    return [tokenizer.encode(task) for task in tasks]


def _lake_verify(argv: list[str]) -> None:
    from roboscale.data.lake.source import LakeSource

    if len(argv) != 1 or argv[0].startswith("-"):
        raise ConfigError("usage: roboscale lake verify LAKE_DIR")
    src = LakeSource(argv[0], verify=True)
    print(f"{argv[0]}: ok ({len(src.episode_ids)} episodes, {len(src)} frames, every shard checksum matches, "
          "no NaN or Inf)")


def _train(argv: list[str]) -> None:
    from roboscale.train.resume import parse_train_args
    from roboscale.train.supervised import train

    # `--skip-bad-episodes`: the spelling users know from dataset tools, for --dataset.skip_bad_episodes=true
    argv = ["--dataset.skip_bad_episodes=true" if a == "--skip-bad-episodes" else a for a in argv]
    cfg = parse_train_args(argv)
    if cfg.launcher == "ray":
        from roboscale.train.ray_launcher import train_on_ray

        final = train_on_ray(cfg)
    else:
        final = train(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one line, not one per rank
        print(f"final checkpoint: {final}")


def _rl(argv: list[str]) -> None:
    from roboscale.rl.run import parse_rl_args, run_rl

    final = run_rl(parse_rl_args(argv))
    if os.environ.get("RANK", "0") == "0":
        print(f"final checkpoint: {final}")


def _eval(argv: list[str]) -> None:
    if argv and argv[0] == "compare":  # `roboscale eval compare RUN...`; anything else evaluates a checkpoint
        _compare(argv[1:])
        return
    from roboscale.config import parse
    from roboscale.configs.eval import EvalConfig
    from roboscale.eval.closed_loop import evaluate
    from roboscale.eval.report import success_table

    cfg = parse(EvalConfig, argv, prog="roboscale eval")
    summary = evaluate(cfg)
    print(success_table({"success": summary}, list(summary["per_task"])))
    print(f"report: {summary['report_dir']}/report.md")


def _serve(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.serve import ServeConfig
    from roboscale.serve.command import serve_policy

    serve_policy(parse(ServeConfig, argv, prog="roboscale serve"))


def _compare(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.report import CompareConfig
    from roboscale.eval.compare import write_comparison

    cfg = parse(CompareConfig, argv, prog="roboscale eval compare", positional=("runs",))
    if len(cfg.runs) < 2:
        raise ConfigError("usage: roboscale eval compare RUN_A RUN_B [...] [--output_dir DIR]")
    markdown, md_path, html_path = write_comparison(cfg.runs, cfg.output_dir)
    print(markdown)
    print(f"\nwritten: {md_path}, {html_path}", file=sys.stderr)  # stdout stays pure Markdown


def _report(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.report import ReportConfig
    from roboscale.eval.run_report import write_run_report

    cfg = parse(ReportConfig, argv, prog="roboscale report", positional=("run_dir",))
    if not cfg.run_dir:
        raise ConfigError("usage: roboscale report RUN_DIR [--output FILE]")
    print(f"report written to {write_run_report(Path(cfg.run_dir), Path(cfg.output) if cfg.output else None)}")


def _model_info(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.model import ModelInfoConfig
    from roboscale.models.info import model_info

    if argv and not argv[0].startswith("-"):  # `roboscale model info pi05`
        argv = [f"--policy={argv[0]}", *argv[1:]]
    cfg = parse(ModelInfoConfig, argv, prog="roboscale model info")
    print(model_info(cfg.policy, cfg.preset, cfg.overrides))


def _export(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.model import ExportConfig
    from roboscale.train.export import export_checkpoint

    cfg = parse(ExportConfig, argv, prog="roboscale export", positional=("checkpoint",))
    if not cfg.checkpoint or not cfg.output:
        raise ConfigError("usage: roboscale export CHECKPOINT --output DIR [--format=roboscale|onnx|lerobot]")
    print(f"exported to {export_checkpoint(cfg.checkpoint, cfg.output, cfg.format, cfg.onnx)}")


def _plan(argv: list[str]) -> None:
    from roboscale.configs.plan import parse_plan_args
    from roboscale.plan.report import render
    from roboscale.plan.run import make_plan

    print(render(make_plan(parse_plan_args(argv))))


def _demo(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.configs.demo import DemoConfig
    from roboscale.demo import run_demo

    run_demo(parse(DemoConfig, argv, prog="roboscale demo"))


COMMANDS: dict[str, Command | dict[str, Command]] = {
    "data": {
        "generate": Command("run MetaWorld scripted experts and write a LeRobot v3.0 dataset", _generate),
        "info": Command("print a dataset's schema, episodes, tasks, sizes on disk and codecs", _info),
        "validate": Command("check every file of a dataset and list every problem (exit 1 if any)", _validate),
        "convert": Command("convert a LeRobot v2.0/v2.1 dataset to v3.0: convert SRC DST", _convert),
        "tasks": Command("list a simulator's tasks and suites (--env=metaworld|libero)", _tasks),
    },
    "model": {
        "info": Command("parameter count of a policy by component (meta-device build): model info pi05", _model_info),
    },
    "lake": {
        "build": Command("compile datasets into training-ready shards with Ray Data (resumable)", _lake_build),
        "verify": Command("check a lake's manifest and every shard checksum", _lake_verify),
    },
    "train": Command("train a policy on a LeRobot v3.0 dataset", _train),
    "rl": Command("RL post-training of a supervised checkpoint in the simulator (GRPO, PPO)", _rl),
    "export": Command("write a checkpoint's consolidated policy (pretrained_model, or ONNX graphs) to a directory",
                      _export),
    "eval": Command("evaluate a checkpoint in closed loop in simulation (eval compare RUN_A RUN_B: compare runs)",
                    _eval),
    "serve": Command("serve a checkpoint to robot clients over openpi's websocket protocol (127.0.0.1 by default)",
                     _serve),
    "report": Command("write an HTML page for a training run: curves, success vs step, best checkpoint", _report),
    "plan": Command("predict step time, communication, data rate and scaling of a policy over GPU counts", _plan),
    "demo": Command("generate demos, train, evaluate: the whole loop on the embedded default", _demo),
}


def _usage(table: dict, prefix: str) -> str:
    lines = [f"usage: {prefix} <command> [--help] [--option=value ...]", "", "commands:"]
    for name, cmd in table.items():
        if isinstance(cmd, dict):
            for sub, c in cmd.items():
                lines.append(f"  {name} {sub:10s} {c.summary}")
        else:
            lines.append(f"  {name:15s} {cmd.summary}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get("ROBOSCALE_LOG", "INFO"), format="%(asctime)s %(levelname)s %(message)s")
    os.environ.setdefault("MUJOCO_GL", "egl")
    table: dict = COMMANDS
    prefix = "roboscale"
    while True:
        if not argv or argv[0] in ("-h", "--help"):
            print(_usage(table, prefix))
            return 0 if argv else 2
        name = argv.pop(0)
        if name not in table:
            print(f"{prefix}: unknown command {name!r}\n\n{_usage(table, prefix)}", file=sys.stderr)
            return 2
        entry = table[name]
        prefix = f"{prefix} {name}"
        if isinstance(entry, dict):
            table = entry
            continue
        # SIGTERM (a scheduler's, a launcher's) ends a command as Ctrl-C does (roboscale.utils.lifetime)
        previous = terminate_like_interrupt()
        try:
            entry.run(argv)
        except RoboscaleError as exc:  # the one path every error a user can cause takes: one line, no traceback
            print(f"error: {one_line(exc)}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM as Terminated: what was cut short, what is intact
            print(one_line(exc) or "interrupted", file=sys.stderr)
            return getattr(exc, "exit_code", 130)
        except BrokenPipeError:  # `roboscale data info DIR | head`
            sys.stderr.close()
            return 0
        finally:  # called in-process (tests, notebooks): the caller's own SIGTERM handling again
            restore_sigterm(previous)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
