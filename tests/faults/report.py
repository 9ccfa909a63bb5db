"""Print the fault matrix of docs/reliability.md: every damage against every entry point, run now.

    .venv/bin/python -m tests.faults.report > /tmp/matrix.md

The tests (test_dataset_faults.py, test_checkpoint_faults.py) assert what each cell must be; this prints what
each cell was, with the error a user sees, so the page shows real output rather than a claim.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from tests.data.conftest import write_small_dataset

from .damages import DAMAGES
from .entry_points import ENTRY_POINTS, TINY_PI05, Outcome, run_cli
from .test_checkpoint_faults import DAMAGES as CHECKPOINT_DAMAGES
from .test_checkpoint_faults import ENTRY_POINTS as CHECKPOINT_ENTRY_POINTS
from .test_checkpoint_faults import STEP


def _cell(outcome: Outcome) -> str:
    if outcome.kind == "error":
        return f"error (exit {outcome.exit_code})" if outcome.exit_code else "error"
    if outcome.kind == "skip":
        return f"skips {outcome.skipped}"
    return "ok"


def _line(outcome: Outcome, *paths: Path) -> str:
    text = outcome.message.strip().replace("\r", "\n").splitlines()[-1] if outcome.message.strip() else ""
    for path, name in paths:
        text = text.replace(str(path), name)
    return text.removeprefix("error: ")


def _matrix(work: Path, damages: list, entry_points: dict, make_case, header: str, quoted: str,
            placeholder: str) -> list[str]:
    """Rows of damage x entry point outcomes, then what ``quoted`` said for each damage. ``make_case(dir, damage)``
    returns the damaged copy to hand to the entry points."""
    entries = list(entry_points)
    rows = [f"| {header} | " + " | ".join(entries) + " |", "|---|" + "---|" * len(entries)]
    messages = []
    for damage in damages:
        cells = []
        for entry in entries:
            case = work / f"{damage.name}-{len(cells)}"
            target = make_case(case, damage)
            outcome = entry_points[entry](target, case)
            cells.append(_cell(outcome))
            if entry == quoted and outcome.kind == "error":
                messages.append(f"- **{damage.name}**: `{_line(outcome, (target, placeholder))}`")
            shutil.rmtree(case)
        rows.append(f"| **{damage.name}**: {damage.what} | " + " | ".join(cells) + " |")
    return [*rows, "", f"What `roboscale {quoted}` says for each (the path shown as {placeholder}):", "", *messages]


def dataset_matrix(work: Path) -> list[str]:
    pristine = write_small_dataset(work / "pristine")

    def make_case(case: Path, damage) -> Path:
        shutil.copytree(pristine, case / "dataset")
        damage.apply(case / "dataset")
        return case / "dataset"

    return _matrix(work, DAMAGES, ENTRY_POINTS, make_case, "damage", "train", "DATASET")


def checkpoint_matrix(work: Path) -> list[str]:
    from tests.conftest import write_tiny_dataset

    data = write_tiny_dataset(work / "tiny")
    run = work / "trained"
    outcome = run_cli("train", f"--dataset.root={data}", f"--output_dir={run}", "--steps=2", "--save_freq=1",
                      "--batch_size=4", *TINY_PI05)
    assert outcome.kind == "ok", outcome.message

    def make_case(case: Path, damage) -> Path:
        shutil.copytree(run, case / "run", symlinks=True)
        damage.apply(case / "run" / "checkpoints" / STEP)
        return case / "run"

    return _matrix(work, CHECKPOINT_DAMAGES, CHECKPOINT_ENTRY_POINTS, make_case, f"damage (to checkpoint {STEP})",
                   "train --resume", "RUN")


def main() -> None:
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("\n".join(["### Datasets", "", *dataset_matrix(work), "", "### Checkpoints", "",
                         *checkpoint_matrix(work)]))


if __name__ == "__main__":
    main()
