"""Every option a command's ``--help`` lists changes something or is refused: run as a user runs it, each
command reads every one of its options (a field of its config that nothing reads is an option that is given and
then ignored), except the few that only a choice of another option makes matter, each listed below with that
choice. A second copy of an option (``--rl.noise_level`` beside ``--rollout.noise_level``, with the loss reading
one and the sampler the other) is what this catches: the copy nobody reads fails here.

How: every config dataclass records the fields read from it by roboscale's code (``__getattribute__``, in this
process: the commands build what their processes run from their config here; reads that only copy a config, as
``to_dict`` does for the checkpoint's record, do not count) while ``train``, ``eval``, ``rl`` and ``serve`` run
end to end on the tiny policy; then each leaf option of the parsed config (``--section.name``) must have been read,
or be in ``ONLY_WITH`` (why it was not: the choice that makes it matter), and nothing may be in ``ONLY_WITH`` that
the config lacks (a stale entry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.entry_points import TINY_PI05

pytestmark = pytest.mark.slow

ROLLOUT_ONLY_WITH = {
    "rollout.servers": "--rollout.inference=server (auto on a GPU)", "rollout.max_retries": "a simulator that crashes",
    "rollout.server_api_key_file": "--rollout.server (refused without it)",
    "rollout.runner.batch_timeout_ms": "--rollout.inference=server",
}
TRAINER_ONLY_WITH = {
    "eval.*": "--eval.every > 0", "max_nonfinite_steps": "a NaN/Inf step",
    "parallel.dp_shard": "--parallel.strategy=fsdp|hsdp", "parallel.dp_replicate": "--parallel.strategy=hsdp",
}
ONLY_WITH: dict[str, dict[str, str]] = {
    "train": {**TRAINER_ONLY_WITH, "ray.*": "--launcher=ray"},
    "rl": {**TRAINER_ONLY_WITH, **ROLLOUT_ONLY_WITH, "rl.max_staleness": "--rl.mode=async",
           "rl.schedule": "--rl.mode=async",
           # read where the policy predicts: on the CPU the env workers, other processes than this one
           "rollout.sampler.sde_steps": "(read in the env workers)"},
    "eval": dict(ROLLOUT_ONLY_WITH),
    "serve": {},
    "data tasks": {}, "data validate": {}, "model info": {}, "export": {"onnx.*": "--format=onnx"}, "report": {}, "eval compare": {},
    "plan": {"fp8_speedup": "--precision=fp8"}, "lake build": {}, "data convert": {},
}
"""Per command, the options a default run does not read, with the choice that makes them matter."""


def _config_classes() -> set[type]:
    """Every dataclass of ``roboscale.configs`` and the registered sections' classes (policies, algorithms,
    samplers)."""
    import importlib
    import pkgutil

    from roboscale import configs
    from roboscale.config import _CHOICES, choices

    classes: set[type] = set()
    for info in pkgutil.iter_modules(configs.__path__):
        module = importlib.import_module(f"roboscale.configs.{info.name}")
        classes |= {v for v in vars(module).values() if isinstance(v, type) and dataclasses.is_dataclass(v)}
    for base in list(_CHOICES):
        classes |= {base, *choices(base).values()}
    return {c for c in classes if c.__module__.startswith("roboscale.")}


SOURCE = Path(__file__).parents[1] / "src" / "roboscale"
COPIES = {SOURCE / "config.py"}
"""Code that reads every field to copy or print a config (``to_dict``, ``save_yaml``, a resume's comparison):
reading there is not using."""


def _caller(frame: Any) -> Any:
    """The code that read: ``dataclasses.asdict``'s caller for a config passed whole as a function's keywords
    (`data convert`'s options), else the frame's own."""
    while frame.f_back is not None and frame.f_code.co_name in ("asdict", "_asdict_inner") \
            and frame.f_code.co_filename == dataclasses.__file__:
        frame = frame.f_back
    return frame.f_code


def _used_by_the_command(code: Any) -> bool:
    """Whether a read from ``code`` uses the value: roboscale's code, but not a config checking its own values
    (``__post_init__``: a value it accepts may still be ignored) or copying itself."""
    path = Path(code.co_filename)
    return path.is_relative_to(SOURCE) and path not in COPIES and code.co_name != "__post_init__"


@contextlib.contextmanager
def recorded_reads() -> Iterator[set[tuple[type, str]]]:
    """(class, field) of every config field read inside the block (in this process)."""
    reads: set[tuple[type, str]] = set()
    patched = []
    for cls in _config_classes():
        names = {f.name for f in dataclasses.fields(cls)}

        def recorder(self: Any, name: str, _names: set[str] = names) -> Any:
            if name in _names and _used_by_the_command(_caller(sys._getframe(1))):
                reads.add((type(self), name))
            return object.__getattribute__(self, name)

        patched.append((cls, "__getattribute__" in cls.__dict__, cls.__dict__.get("__getattribute__")))
        cls.__getattribute__ = recorder
    try:
        yield reads
    finally:
        for cls, had, original in patched:
            if had:
                cls.__getattribute__ = original
            else:
                del cls.__getattribute__


def leaf_options(cfg: Any, prefix: str = "") -> dict[str, tuple[type, str]]:
    """``section.name`` -> (the class holding it, its field) for every leaf option of ``cfg``."""
    out: dict[str, tuple[type, str]] = {}
    for f in dataclasses.fields(cfg):
        value = object.__getattribute__(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaf_options(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (type(cfg), f.name)
    return out


def unread(command: str, cfg: Any, reads: set[tuple[type, str]]) -> list[str]:
    """The leaf options of ``cfg`` that were not read and that ``ONLY_WITH[command]`` does not excuse; an entry of
    ``ONLY_WITH`` that names no option, or only options that were read, fails (the list stays true)."""
    allowed = ONLY_WITH[command]
    leaves = leaf_options(cfg)

    def covered(option: str, entry: str) -> bool:
        return option == entry or (entry.endswith(".*") and option.startswith(entry[:-1]))

    stale = [e for e in allowed if all(leaves[o] in reads for o in leaves if covered(o, e))]
    assert not stale, f"{command}: ONLY_WITH names options that do not exist or were read: {stale}"
    return sorted(o for o, key in leaves.items() if key not in reads and not any(covered(o, e) for e in allowed)
                  and not o.startswith("policy."))  # the policy's own options: its model tests read them


def _reads_of(command: str, config: type, argv: list[str], positional: tuple[str, ...] = (),
              parser: Any = None) -> list[str]:
    """The options of ``roboscale COMMAND argv`` (``command``: its words, "data validate") that it did not read
    (and ONLY_WITH does not excuse). ``parser``: the command's own (argv -> config), where it has one."""
    from roboscale.cli import main
    from roboscale.config import parse

    cfg = parser(argv) if parser is not None else parse(config, argv, positional=positional)
    with recorded_reads() as reads:
        assert main([*command.split(), *argv]) == 0
    return unread(command, cfg, reads)


def test_train_reads_every_option_it_lists(tiny_dataset: Path, tmp_path: Path) -> None:
    from roboscale.configs.train import TrainConfig

    argv = [f"--dataset.root={tiny_dataset}", f"--output_dir={tmp_path / 'run'}", "--steps=2", "--batch_size=4",
            "--save_freq=2", "--optimizer.warmup_steps=1", *TINY_PI05]  # past the warmup: the decay's options
    assert _reads_of("train", TrainConfig, argv) == []


@pytest.fixture(scope="module")
def sft(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from roboscale.cli import main

    run = tmp_path_factory.mktemp("options") / "sft"
    assert main(["train", f"--dataset.root={tiny_dataset}", f"--output_dir={run}", "--steps=1", "--batch_size=4",
                 *TINY_PI05]) == 0
    return run


def test_eval_reads_every_option_it_lists(sft: Path, tmp_path: Path) -> None:
    from roboscale.configs.eval import EvalConfig

    argv = [f"--checkpoint={sft}", "--tasks=[reach]", "--episodes=1", "--max_steps=8", "--videos_per_task=1",
            f"--output_dir={tmp_path / 'eval'}", "--rollout.workers=1", "--rollout.envs_per_worker=1"]
    assert _reads_of("eval", EvalConfig, argv) == []


def test_rl_reads_every_option_it_lists(sft: Path, tmp_path: Path) -> None:
    from roboscale.configs.rl import RLConfig

    argv = [f"--policy_path={sft}", f"--output_dir={tmp_path / 'rl'}", "--tasks=[reach]", "--steps=1",
            "--rl.group_size=2", "--rl.max_steps=8", "--rollout.workers=1", "--rollout.envs_per_worker=2"]
    assert _reads_of("rl", RLConfig, argv) == []


def test_serve_reads_every_option_it_lists(tmp_path: Path) -> None:
    """The server as `roboscale serve` builds it, answering one observation, then shut down."""
    from roboscale.config import parse
    from roboscale.configs.serve import ServeConfig
    from roboscale.serve.command import build_server
    from tests.models.helpers import tiny_policy
    from tests.serve.conftest import observation, running
    from tests.serve.test_server import ask, client

    tiny_policy().save_pretrained(tmp_path / "pretrained_model")  # statistics the served observation fits
    argv = [f"--checkpoint={tmp_path / 'pretrained_model'}", "--port=0", "--runner.threads=1"]
    cfg = parse(ServeConfig, argv)
    with recorded_reads() as reads, running(build_server(parse(ServeConfig, argv))) as (_, url):
        ws, _ = client(url)
        try:
            assert "actions" in ask(ws, observation(size=(16, 16)))
        finally:
            ws.close()
    assert unread("serve", cfg, reads) == []


def test_the_other_commands_read_every_option_they_list(sft: Path, tiny_dataset: Path, tmp_path: Path) -> None:
    """The data, model, export, report, compare, plan and lake commands (not `data generate`, whose workers read
    its options in their own processes, nor `demo`, which is generate, train and eval in a row)."""
    from roboscale.configs.data import TasksConfig, ValidateConfig
    from roboscale.configs.eval import EvalConfig
    from roboscale.configs.lake import LakeConfig
    from roboscale.configs.model import ExportConfig, ModelInfoConfig
    from roboscale.configs.plan import PlanConfig
    from roboscale.configs.report import CompareConfig, ReportConfig

    assert _reads_of("data tasks", TasksConfig, ["--env=metaworld"]) == []
    assert _reads_of("data validate", ValidateConfig, [str(tiny_dataset)], ("root",)) == []
    assert _reads_of("model info", ModelInfoConfig, ["--policy=pi05", "--preset=tiny"]) == []
    assert _reads_of("export", ExportConfig, [str(sft), f"--output={tmp_path / 'exported'}"], ("checkpoint",)) == []
    assert _reads_of("report", ReportConfig, [str(sft), f"--output={tmp_path / 'report.html'}"], ("run_dir",)) == []
    runs = []
    for seed in (1000, 2000):
        runs.append(str(tmp_path / f"eval{seed}"))
        assert _reads_of("eval", EvalConfig, [f"--checkpoint={sft}", "--tasks=[reach]", "--episodes=1",
                                              "--max_steps=4", "--videos_per_task=0", f"--seed={seed}",
                                              f"--output_dir={runs[-1]}", "--rollout.workers=1",
                                              "--rollout.envs_per_worker=1"]) == []
    assert _reads_of("eval compare", CompareConfig, [*runs, f"--output_dir={tmp_path / 'compare'}"], ("runs",)) == []
    from roboscale.configs.plan import parse_plan_args

    assert _reads_of("plan", PlanConfig, ["--policy.type=pi05", "--gpus=[1,8]"], parser=parse_plan_args) == []
    from roboscale.configs.data import ConvertConfig
    from tests.data.lerobot.v21_factory import write_v21_dataset

    v21 = write_v21_dataset(tmp_path / "v21")
    assert _reads_of("data convert", ConvertConfig, [str(v21), str(tmp_path / "v30")], ("src", "dst")) == []
    assert _reads_of("lake build", LakeConfig, [str(tiny_dataset), f"--output={tmp_path / 'lake'}"], ("sources",)) == []
