"""`roboscale data|train|eval|demo`: parse a typed config, call one function."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from roboscale.errors import RoboscaleError


@dataclass(frozen=True)
class Command:
    summary: str
    run: Callable[[list[str]], object]


def _generate(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.sim.experts import GenerateConfig, generate_dataset

    cfg = parse(GenerateConfig, argv, prog="roboscale data generate")
    print(f"dataset written to {generate_dataset(cfg)}")


def _tasks(argv: list[str]) -> None:
    from roboscale.sim.metaworld import SUITES, TASK_DESCRIPTIONS

    for task, text in sorted(TASK_DESCRIPTIONS.items()):
        print(f"{task:30s} {text}")
    print("\nsuites: " + ", ".join(f"{k} ({len(v)} tasks)" for k, v in SUITES.items()))


def _info(argv: list[str]) -> None:
    from roboscale.data.validate import summarize

    if len(argv) != 1 or argv[0].startswith("-"):
        raise SystemExit("usage: roboscale data info DATASET_DIR")
    print("\n".join(summarize(argv[0]).lines()))  # metadata and file sizes only: instant on any dataset size


def _validate(argv: list[str]) -> None:
    import argparse

    from roboscale.data.validate import DEFAULT_TOLERANCE_S, validate
    from roboscale.errors import DatasetError

    parser = argparse.ArgumentParser(prog="roboscale data validate",
                                     description="check every file of a LeRobot v3.0 dataset; list every problem")
    parser.add_argument("root", metavar="DATASET_DIR")
    parser.add_argument("--quick", action="store_true",
                        help="index columns and one frame per episode and camera instead of decoding everything")
    parser.add_argument("--tolerance-s", type=float, default=DEFAULT_TOLERANCE_S,
                        help="allowed timestamp error in seconds (LeRobot's tolerance_s)")
    args = parser.parse_args(argv)
    report = validate(args.root, full=not args.quick, tolerance_s=args.tolerance_s)
    if len(report.problems) == 1 and report.episodes == 0:  # e.g. no meta/info.json: nothing else was checked
        only = report.problems[0]
        raise DatasetError(only.path, only.message, field=only.field, episode=only.episode)
    for problem in report.problems:
        print(problem)
    checked = f"{report.episodes} episodes, {report.frames} frames, {report.files_checked} files"
    if report.problems:
        bad = len(report.bad_episodes())
        raise DatasetError(args.root, f"{len(report.problems)} problems ({bad} episodes affected) in {checked}")
    print(f"{args.root}: no problems ({checked} checked{', quick' if args.quick else ''})")


def _convert(argv: list[str]) -> None:
    import argparse

    from roboscale.data.convert import convert_v21_to_v30
    from roboscale.data.lerobot_format import DEFAULT_DATA_FILE_SIZE_MB, DEFAULT_VIDEO_FILE_SIZE_MB

    parser = argparse.ArgumentParser(prog="roboscale data convert",
                                     description="convert a LeRobot v2.0/v2.1 dataset to v3.0 (SRC is not modified)")
    parser.add_argument("src", metavar="SRC")
    parser.add_argument("dst", metavar="DST")
    parser.add_argument("--reencode", action="store_true",
                        help="decode and re-encode videos instead of stream-copying them (slower, lossy)")
    parser.add_argument("--video-codec", default="libsvtav1", help="encoder for --reencode (libsvtav1, libx264)")
    parser.add_argument("--data-files-size-in-mb", type=float, default=DEFAULT_DATA_FILE_SIZE_MB)
    parser.add_argument("--video-files-size-in-mb", type=float, default=DEFAULT_VIDEO_FILE_SIZE_MB)
    parser.add_argument("--tolerance-s", type=float, default=1e-4,
                        help="allowed difference between a source timestamp and frame_index/fps")
    args = parser.parse_args(argv)
    dst = convert_v21_to_v30(args.src, args.dst, reencode=args.reencode, video_codec=args.video_codec,
                             data_files_size_in_mb=args.data_files_size_in_mb,
                             video_files_size_in_mb=args.video_files_size_in_mb, tolerance_s=args.tolerance_s,
                             progress=sys.stderr.isatty())
    print(f"converted to {dst}")


def _lake_build(argv: list[str]) -> None:
    import argparse

    from roboscale.data.lake import LakeConfig, build_lake

    parser = argparse.ArgumentParser(prog="roboscale lake build",
                                     description="compile LeRobot v3.0 datasets into training shards (Ray Data)")
    parser.add_argument("sources", nargs="+", metavar="SRC", help="dataset roots: paths or pyarrow URIs (s3://...)")
    parser.add_argument("--output", required=True, metavar="DIR")
    parser.add_argument("--image-size", type=int, default=224, help="square camera side; 0 keeps native sizes")
    parser.add_argument("--resize", choices=["pad", "stretch"], default="pad")
    parser.add_argument("--shard-frames", type=int, default=2048)
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--cpus-per-task", type=float, default=0.5)
    parser.add_argument("--stats-bins", type=int, default=4096, help="quantile error <= (max - min) / bins")
    parser.add_argument("--tokenizer", default=None, metavar="tokenizer.json", help="precompute task token ids")
    parser.add_argument("--no-validate", dest="validate", action="store_false")
    parser.add_argument("--repair", action="store_true", help="re-hash built shards, rebuild damaged ones")
    args = parser.parse_args(argv)
    report = build_lake(LakeConfig(**vars(args)))
    print(f"lake {report.output}: {report.episodes} episodes, {report.frames} frames, {len(report.built)} built, "
          f"{len(report.skipped)} reused shards, {report.seconds:.1f} s")


def _lake_verify(argv: list[str]) -> None:
    from roboscale.data.lake_source import LakeSource

    if len(argv) != 1 or argv[0].startswith("-"):
        raise SystemExit("usage: roboscale lake verify LAKE_DIR")
    src = LakeSource(argv[0], verify=True)
    print(f"{argv[0]}: ok ({len(src.episode_ids)} episodes, {len(src)} frames, every shard checksum matches)")


def _train(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.train.trainer import TrainConfig, train

    # `--skip-bad-episodes`: the spelling users know from dataset tools, for --dataset.skip_bad_episodes=true
    argv = ["--dataset.skip_bad_episodes=true" if a == "--skip-bad-episodes" else a for a in argv]
    cfg = parse(TrainConfig, argv, prog="roboscale train")
    print(f"final checkpoint: {train(cfg)}")


def _eval(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.eval.closed_loop import EvalConfig, evaluate
    from roboscale.eval.report import success_table

    cfg = parse(EvalConfig, argv, prog="roboscale eval")
    summary = evaluate(cfg)
    print(success_table({"success": summary}, list(summary["per_task"])))
    print(f"report: {summary['report_dir']}/report.md")


def _model_info(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.models.info import ModelInfoConfig, model_info

    if argv and not argv[0].startswith("-"):  # `roboscale model info pi05`
        argv = [f"--policy={argv[0]}", *argv[1:]]
    print(model_info(parse(ModelInfoConfig, argv, prog="roboscale model info")))


def _demo(argv: list[str]) -> None:
    from roboscale.config import parse
    from roboscale.demo import DemoConfig, run_demo

    run_demo(parse(DemoConfig, argv, prog="roboscale demo"))


COMMANDS: dict[str, Command | dict[str, Command]] = {
    "data": {
        "generate": Command("run MetaWorld scripted experts and write a LeRobot v3.0 dataset", _generate),
        "info": Command("print a dataset's schema, episodes, tasks, sizes on disk and codecs", _info),
        "validate": Command("check every file of a dataset and list every problem (exit 1 if any)", _validate),
        "convert": Command("convert a LeRobot v2.0/v2.1 dataset to v3.0: convert SRC DST", _convert),
        "tasks": Command("list the MetaWorld tasks and suites", _tasks),
    },
    "model": {
        "info": Command("parameter count of a policy by component (meta-device build): model info pi05", _model_info),
    },
    "lake": {
        "build": Command("compile datasets into training-ready shards with Ray Data (resumable)", _lake_build),
        "verify": Command("check a lake's manifest and every shard checksum", _lake_verify),
    },
    "train": Command("train a policy on a LeRobot v3.0 dataset", _train),
    "eval": Command("evaluate a checkpoint in closed loop in MetaWorld", _eval),
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
        try:
            entry.run(argv)
        except RoboscaleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `roboscale data info DIR | head`
            sys.stderr.close()
            return 0
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
