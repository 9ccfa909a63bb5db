"""RL's environments are named to the rollout workers as the user named them: an adapter given as
``module:SPEC`` whose own ``name`` is short must still resolve in every worker."""

from __future__ import annotations

from pathlib import Path

from roboscale.configs.rl import RLConfig
from roboscale.rl.job import rl_env_setup
from roboscale.sim.env import env_spec
from tests.models.helpers import tiny_policy

FAKE = "tests.rollout.fake_envs:SPEC"


def test_a_module_attr_env_reaches_the_workers_by_the_name_the_user_gave(tmp_path: Path) -> None:
    policy = tiny_policy()
    checkpoint = policy.save_pretrained(tmp_path / "pretrained_model")
    assert env_spec(FAKE).name == "fake-point"  # a name the workers could not resolve
    setup = rl_env_setup(RLConfig(env=FAKE), checkpoint, ["reach"], policy.config)
    assert setup.env == FAKE
    assert env_spec(setup.env) is env_spec(FAKE)
