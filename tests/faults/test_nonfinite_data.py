"""Non-finite and degenerate data (issue 18): NaN/Inf values and a q01 = q99 normalization range trained silently.

- NaN or Inf in a float column (state, action) is a problem of that episode and field in `data validate` (full and
  quick), refused by the trainer's gate like any unreadable episode, skipped with `--skip-bad-episodes`
  (``nan-action`` and ``inf-state`` in ``damages.DAMAGES``, which test_dataset_faults.py runs against every entry
  point).
- Data the gate did not see (a source whose up-front check does not read values): a skipped step names the
  episodes of its batch, gathered over ranks, and so does the ``--max_nonfinite_steps`` stop.
- A degenerate q01..q99 band (LeRobot's fixture: one action dimension has q01 = q99 while it spans 0..3) is
  normalized with min/max: training on the fixture has a sane loss; a checkpoint written before still normalizes
  as it was trained.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from roboscale.data.lerobot.validate import bad_episodes, validate
from tests.conftest import tiny_policy_args

from .damages import inf_in_state, nan_in_actions, set_values
from .entry_points import TINY_PI05, run_cli, train_args

FIXTURE = Path(__file__).parents[1] / "fixtures" / "lerobot-v3.0-mini"

# --------------------------------------------------------------------------------------------------- NaN / Inf


@pytest.mark.parametrize("full", [True, False], ids=["full", "quick"])
def test_nonfinite_values_are_problems_of_their_episode_and_field(small_copy: Path, full: bool) -> None:
    nan_in_actions(small_copy)
    inf_in_state(small_copy)
    found = {(p.episode, p.field): str(p) for p in validate(small_copy, full=full).problems}
    assert set(found) == {(1, "action"), (3, "observation.state")}, found
    assert re.search(r"episode 1: field 'action': 3 non-finite values \(NaN\) in 3 of 11 frames \(first at frame 2\), "
                     r"dims \[2\]$", found[1, "action"])
    assert re.search(r"episode 3: field 'observation.state': 1 non-finite value \(Inf\) in 1 of 9 frames \(first at "
                     r"frame 4\), dims \[3\]$", found[3, "observation.state"])


def test_the_quick_cli_check_reports_them(small_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from roboscale.cli import main

    nan_in_actions(small_copy)
    assert main(["data", "validate", str(small_copy), "--quick"]) == 1  # it said "no problems", exit 0
    assert "episode 1: field 'action': 3 non-finite values (NaN)" in capsys.readouterr().out


def test_the_gate_names_episode_and_field(small_copy: Path, tmp_path: Path) -> None:
    nan_in_actions(small_copy)
    assert list(bad_episodes(small_copy)) == [1]
    outcome = run_cli(*train_args(small_copy, tmp_path))
    assert outcome.kind == "error" and outcome.exit_code == 1
    assert re.search(r"1 of 5 episodes cannot be read \(first: \S+\.parquet: episode 1: field 'action': 3 non-finite "
                     r"values \(NaN\)", outcome.message), outcome.message


# --------------------------------------------------------------------------------------------------- skipped steps

POLICIES = {
    "pi05": TINY_PI05,
    "pi05-packed": [*TINY_PI05, "--policy.packing=true", "--policy.pack_token_budget=120"],
    "groot": tiny_policy_args("groot", chunk_size=4, n_action_steps=2),
}


def _unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training on data no up-front check read the values of (a FrameSource's ``unreadable_episodes`` is its own)."""
    import roboscale.data.loading.loader as loader

    monkeypatch.setattr(loader, "check_sources", lambda sources, names, *, skip_bad_episodes: [])


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_skipped_step_names_the_episodes_of_its_batch(policy: str, small_copy: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    set_values(small_copy, 1, "action", slice(None), float("nan"))  # the whole episode
    _unchecked(monkeypatch)
    args = [a for a in train_args(small_copy, tmp_path, "--steps=6") if not a.startswith("--policy.")]
    with caplog.at_level(logging.WARNING, logger="roboscale.train.trainer"):
        outcome = run_cli(*args, *POLICIES[policy], "--max_nonfinite_steps=100")
    assert outcome.kind == "ok", outcome.message
    skipped = [r.getMessage() for r in caplog.records if "the update was skipped" in r.getMessage()]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and skipped and len(skipped) == rows[-1]["skipped_steps"]
    for message in skipped:  # episode 1 is NaN in every frame: every batch that skipped held it
        episodes = re.search(r"its batch: episodes? ([\d, ]+)\)$", message)
        assert episodes and 1 in {int(e) for e in episodes.group(1).split(", ")}, message


def test_the_nonfinite_stop_names_the_episodes(small_copy: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    set_values(small_copy, 1, "action", slice(None), float("nan"))
    _unchecked(monkeypatch)
    outcome = run_cli(*train_args(small_copy, tmp_path, "--steps=6", "--max_nonfinite_steps=1"))
    assert outcome.kind == "error" and outcome.exit_code == 1
    line = outcome.message.strip().splitlines()[-1]
    found = re.search(r"^error: step \d+: loss or gradient norm not finite in 1 steps in a row "
                      r"\(--max_nonfinite_steps\), the last one's batch: episodes? ([\d, ]+); the last", line)
    assert found and 1 in {int(e) for e in found.group(1).split(", ")}, line


def _gather_on_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from roboscale.train.trainer import batch_episodes

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mine = [{"episode_index": torch.tensor([10 * rank, 5])}, {"episode_index": torch.tensor([-1])}]
        Path(out, f"rank{rank}").write_text(batch_episodes(mine, distributed=True))
    finally:
        dist.destroy_process_group()


def test_the_episodes_of_a_skipped_step_are_gathered_from_every_rank(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_gather_on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    assert {Path(tmp_path, f"rank{r}").read_text() for r in (0, 1)} == {"episodes 0, 5, 10"}


# --------------------------------------------------------------------------------------------------- normalization


def _fixture_stats() -> dict:
    return json.loads((FIXTURE / "meta" / "stats.json").read_text())


def _fixture_actions() -> torch.Tensor:
    import pyarrow.parquet as pq

    tables = [pq.read_table(p, columns=["action"]) for p in sorted((FIXTURE / "data").glob("**/*.parquet"))]
    return torch.tensor(np.concatenate([np.stack(t["action"].to_numpy(zero_copy_only=False)) for t in tables]))


def test_a_degenerate_quantile_range_is_normalized_with_min_max(caplog: pytest.LogCaptureFixture) -> None:
    from roboscale.models.normalize import Normalizer

    stats = _fixture_stats()["action"]
    assert stats["q01"][2] == pytest.approx(stats["q99"][2]) and (stats["min"][2], stats["max"][2]) == (0.0, 3.0)
    normalizer = Normalizer(6, "quantiles", data_dim=4)  # padded, as a policy wider than the data
    with caplog.at_level(logging.WARNING, logger="roboscale.models.normalize"):
        normalizer.set_stats(stats, "action")
    warnings = [r.getMessage() for r in caplog.records if r.name == "roboscale.models.normalize"]
    assert len(warnings) == 1 and re.match(r"action: the q01\.\.q99 range of dims \[2\] is under ", warnings[0])
    assert normalizer.q01[:4].tolist() == pytest.approx([stats["q01"][0], stats["q01"][1], 0.0, stats["q01"][3]])
    assert normalizer.q99[:4].tolist() == pytest.approx([stats["q99"][0], stats["q99"][1], 3.0, stats["q99"][3]])
    normalized = normalizer.normalize(_fixture_actions())
    assert normalized[:, 2].abs().max() <= 1.0  # was ~1e6
    assert torch.allclose(normalizer.unnormalize(normalized), _fixture_actions(), atol=1e-5)  # cropped back


@pytest.mark.parametrize("policy", [TINY_PI05, [*tiny_policy_args("groot", chunk_size=4, n_action_steps=2),
                                                "--policy.state_norm=quantiles", "--policy.action_norm=quantiles"]],
                         ids=["pi05", "groot-quantiles"])
def test_training_on_the_lerobot_fixture_has_a_sane_loss(policy: list[str], tmp_path: Path) -> None:
    args = [a for a in train_args(FIXTURE, tmp_path, "--steps=3") if not a.startswith("--policy.")]
    outcome = run_cli(*args, *policy)
    assert outcome.kind == "ok", outcome.message
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and max(losses) < 10, losses  # was ~1e11-1e12


def test_a_checkpoint_written_before_the_repair_normalizes_as_it_was_trained(tmp_path: Path) -> None:
    """The repair happens when stats are set from a dataset; a checkpoint's buffers are what its policy trained
    with, degenerate or not, and must come back as they were."""
    from roboscale.data.loading.meta import source_meta
    from roboscale.data.loading.raw_source import RawSource
    from roboscale.models.policy import Policy
    from roboscale.models.registry import build_policy, preset_config

    policy = build_policy(preset_config("pi05", "tiny"), source_meta([RawSource(FIXTURE)], [str(FIXTURE)]))
    stats = _fixture_stats()["action"]
    old = policy.action_normalizer  # as the code before the repair set them: stats.json's q01/q99 as they are
    old.q01[:4], old.q99[:4] = torch.tensor(stats["q01"]), torch.tensor(stats["q99"])
    trained = old.normalize(_fixture_actions())
    loaded = Policy.from_pretrained(policy.save_pretrained(tmp_path / "old"))
    assert torch.equal(loaded.action_normalizer.q01, old.q01) and torch.equal(loaded.action_normalizer.q99, old.q99)
    assert torch.equal(loaded.action_normalizer.normalize(_fixture_actions()), trained)
