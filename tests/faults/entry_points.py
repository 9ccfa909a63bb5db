"""Every way in to a dataset, run the way a user runs it, reduced to an ``Outcome`` the fault tests can judge.

Command-line entry points run ``roboscale.cli.main`` in this process (the same code path as the console script,
without paying for a fresh interpreter per case) and report its exit code and what it printed.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from roboscale.cli import main
from roboscale.errors import RoboscaleError, one_line
from tests.conftest import tiny_policy_args

# A policy small enough that one training step is a fraction of a second.
TINY_PI05 = tiny_policy_args("pi05", chunk_size=4, n_action_steps=2)


@dataclass
class Outcome:
    kind: str
    """ok | error | skip (ran, and skipped the episodes it could not read)."""
    message: str = ""
    """An error's text (the CLI's stderr, or the exception's message)."""
    exit_code: int = 0
    frames: dict[int, list[int]] = field(default_factory=dict)
    """Loaders: the frames one epoch yielded, per episode (each listed as often as it came)."""
    skipped: int = 0


def run_cli(*args: str) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _quiet():
        code = main(list(args))
    if code == 0:
        return Outcome("ok", out.getvalue())
    return Outcome("error", err.getvalue(), exit_code=code)


@contextlib.contextmanager
def _quiet():
    """The CLI's log lines go to stderr through the root logger; keep them out of the error text we judge."""
    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        root.setLevel(saved)


def run_python(fn: Callable[[], Outcome]) -> Outcome:
    try:
        return fn()
    except RoboscaleError as e:
        return Outcome("error", one_line(e))


# --------------------------------------------------------------------------------------------------- entry points


def data_info(root: Path, work: Path) -> Outcome:
    return run_cli("data", "info", str(root))


def data_validate(root: Path, work: Path) -> Outcome:
    return run_cli("data", "validate", str(root))


def lerobot_dataset(root: Path, work: Path) -> Outcome:
    from roboscale.data import LeRobotDataset

    def read_all() -> Outcome:
        ds = LeRobotDataset(root=root, delta_timestamps={"action": [0.0, 0.1]})
        for i in range(len(ds)):
            ds[i]
        return Outcome("ok")

    return run_python(read_all)


def _epoch(root: Path, skip: bool) -> Outcome:
    from roboscale.data.loading.loader import build_loader

    loader = build_loader(root, batch_size=1, num_workers=0, skip_bad_episodes=skip, seed=0)
    try:
        seen = Counter()
        for batch in loader.take(loader.batches_per_epoch):
            seen[(int(batch["episode_index"][0]), int(batch["frame_index"][0]))] += 1
        stats = loader.stats()
    finally:
        loader.close()
    frames: dict[int, list[int]] = {}
    for (ep, frame), count in sorted(seen.items()):
        frames.setdefault(ep, []).extend([frame] * count)
    skipped = int(stats["skipped_episodes"])
    return Outcome("skip" if skipped else "ok", frames=frames, skipped=skipped)


def loader(root: Path, work: Path) -> Outcome:
    return run_python(lambda: _epoch(root, skip=False))


def loader_skipping(root: Path, work: Path) -> Outcome:
    return run_python(lambda: _epoch(root, skip=True))


def train_args(root: Path, work: Path, *extra: str) -> list[str]:
    return ["train", f"--dataset.root={root}", f"--output_dir={work / 'run'}", "--steps=1", "--batch_size=4",
            "--log_freq=1", *TINY_PI05, *extra]


def train(root: Path, work: Path) -> Outcome:
    return run_cli(*train_args(root, work))


def train_skipping(root: Path, work: Path) -> Outcome:
    return run_cli(*train_args(root, work, "--skip-bad-episodes"))


def lake_build(root: Path, work: Path) -> Outcome:
    return run_cli("lake", "build", str(root), f"--output={work / 'lake'}", "--image-size=0", "--num-cpus=2")


ENTRY_POINTS: dict[str, Callable[[Path, Path], Outcome]] = {
    "data info": data_info,
    "data validate": data_validate,
    "LeRobotDataset": lerobot_dataset,
    "build_loader": loader,
    "build_loader skipping": loader_skipping,
    "train": train,
    "train --skip-bad-episodes": train_skipping,
    "lake build": lake_build,
}
