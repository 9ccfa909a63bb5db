import numpy as np
import pytest

from roboscale.configs.data import GenerateConfig
from roboscale.data import LeRobotDataset
from roboscale.errors import ConfigError, RoboscaleError
from roboscale.sim.experts import generate_dataset
from roboscale.sim.metaworld import MetaWorldEnv, RenderConfig, resolve_tasks


def test_task_names_and_suites_resolve():
    assert resolve_tasks(["drawer-open", "reach-v3"]) == ["drawer-open-v3", "reach-v3"]
    assert len(resolve_tasks(["mt10"])) == 10 and len(resolve_tasks("mt50")) == 50
    with pytest.raises(ValueError, match="unknown MetaWorld task 'draw-open'"):
        resolve_tasks(["draw-open"])


def test_reset_with_a_seed_reproduces_the_scene():
    cams = {"corner2": "corner2"}
    with MetaWorldEnv("drawer-open", RenderConfig(32, 32, cams)) as a, MetaWorldEnv("drawer-open", RenderConfig(32, 32, cams)) as b:
        first, again, other = a.reset(5), b.reset(5), b.reset(6)
    np.testing.assert_array_equal(first["full_state"], again["full_state"])
    np.testing.assert_array_equal(first["images"]["corner2"], again["images"]["corner2"])
    assert not np.array_equal(first["full_state"], other["full_state"])
    assert first["images"]["corner2"].shape == (32, 32, 3) and first["images"]["corner2"].std() > 5  # not black


def test_generating_one_expert_episode_writes_a_readable_dataset(tmp_path, caplog):
    cfg = GenerateConfig(tasks=["button-press-topdown"], episodes_per_task=1, out=str(tmp_path / "ds"), image_size=32,
                         workers=1, steps_after_success=2)
    with caplog.at_level("INFO", logger="roboscale.sim.experts"):
        generate_dataset(cfg)
    assert "button-press-topdown-v3: 1/1 (100%)" in caplog.text  # the expert's success per task
    with pytest.raises(ConfigError, match="--episodes_per_task must be a positive integer, got 0"):
        GenerateConfig(episodes_per_task=0)
    ds = LeRobotDataset(root=tmp_path / "ds")
    assert ds.num_episodes == 1 and ds.meta.fps == 80
    assert ds.meta.task_list == ["Press a button from the top"]
    table = ds.read_episode(0)
    assert bool(table["next.success"][-1])  # only successful demonstrations are kept
    assert not bool(table["next.success"][0])
    np.testing.assert_allclose(table["observation.state"], table["observation.environment_state"][:, :4])
    item = ds[len(ds) - 1]
    assert item["observation.images.corner2"].shape == (3, 32, 32)
    assert item["observation.images.wrist"].shape == (3, 32, 32)
    assert item["task"] == "Press a button from the top"
    assert set(ds.meta.stats) >= {"observation.state", "action", "observation.images.corner2"}


FAKE = "tests.rollout.fake_envs:SPEC"


def test_a_task_the_expert_cannot_do_stops_generation_unless_partial_tasks(tmp_path, caplog):
    """One task's expert never succeeds: by default nothing is written; with partial_tasks the other tasks' demos
    are, and the summary names the short task."""
    cfg = GenerateConfig(env=FAKE, tasks=["reach", "out-of-reach"], episodes_per_task=2, max_attempts=3,
                         out=str(tmp_path / "all"), image_size=8, workers=2, action_noise=0.0, steps_after_success=0)
    with pytest.raises(RoboscaleError, match="out-of-reach: the expert succeeded only 0 times in 3 attempts"):
        generate_dataset(cfg)
    assert not [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]  # no dataset, no staging left

    cfg.out, cfg.partial_tasks = str(tmp_path / "partial"), True
    with caplog.at_level("INFO", logger="roboscale.sim.experts"):
        generate_dataset(cfg)
    assert "reach: 2/2 (100%)" in caplog.text and "out-of-reach: 0/3 (0%), short of 2" in caplog.text
    assert "1 of 2 tasks have fewer than 2 demos (--partial_tasks): out-of-reach 0" in caplog.text
    ds = LeRobotDataset(root=tmp_path / "partial")
    assert ds.num_episodes == 2 and ds.meta.task_list == ["Reach the goal"]

    cfg.out, cfg.tasks = str(tmp_path / "none"), ["out-of-reach"]
    with pytest.raises(RoboscaleError, match="the experts succeeded in none of 3 attempts"):
        generate_dataset(cfg)
    assert not (tmp_path / "none").exists()
