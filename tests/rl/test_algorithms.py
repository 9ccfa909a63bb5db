"""The RL algorithm seam (``roboscale.rl.algorithms``, registered in ``roboscale.configs.rl.ALGORITHMS``): every
registered algorithm is chosen by name with its own options, computes one advantage per episode (or per chunk)
of a group, and says whether it needs a critic; RLOO, the third, was added as one module and one registry line."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from roboscale.config import choices, parse
from roboscale.configs.rl import ALGORITHMS, Algorithm, RLConfig
from roboscale.errors import ConfigError
from roboscale.rl.algorithms.rloo import leave_one_out


@dataclass
class _Chunk:
    rewards: np.ndarray
    value: float


@dataclass
class _Trajectory:
    chunks: list[_Chunk]
    success: bool


def _group() -> tuple[np.ndarray, list[_Trajectory]]:
    trajectories = [_Trajectory([_Chunk(np.zeros(2), 0.1 * i) for i in range(3)], success=bool(e % 2))
                    for e in range(4)]
    return np.array([float(t.success) for t in trajectories], np.float32), trajectories


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_registered_algorithm_is_chosen_by_name_and_scores_a_group(name: str) -> None:
    cfg = parse(RLConfig, [f"--rl.algorithm={name}"])
    algorithm = cfg.rl.algorithm
    assert isinstance(algorithm, Algorithm) and algorithm.type == name and type(algorithm) is choices(Algorithm)[name]
    returns, trajectories = _group()
    advantages, targets = algorithm.advantages(returns, trajectories, "success")
    assert len(advantages) == len(trajectories)
    for advantage, trajectory in zip(advantages, trajectories, strict=True):
        assert np.ndim(advantage) == 0 or len(advantage) == len(trajectory.chunks)
    assert (targets is not None) == algorithm.critic
    assert (algorithm.value_head_dim > 0) == algorithm.critic  # a critic says its width


def test_rloo_is_each_return_against_the_mean_of_the_others() -> None:
    returns = [1.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(leave_one_out(returns), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)
    # n / (n - 1) times the deviation from the group mean; zero when every episode did alike
    rng = np.random.default_rng(0)
    r = rng.normal(size=8)
    np.testing.assert_allclose(leave_one_out(r), 8 / 7 * (r - r.mean()), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(leave_one_out([1.0, 1.0, 1.0]), 0.0)
    with pytest.raises(ConfigError, match="--rl.group_size must be at least 2 for rloo"):
        parse(RLConfig, ["--rl.algorithm=rloo", "--rl.group_size=1"])


def test_an_algorithms_options_exist_only_when_it_is_chosen() -> None:
    assert parse(RLConfig, ["--rl.algorithm=ppo", "--rl.algorithm.gamma=0.9"]).rl.algorithm.gamma == 0.9
    for argv in (["--rl.algorithm.gamma=0.9"], ["--rl.algorithm=rloo", "--rl.algorithm.value_coef=1"]):
        with pytest.raises(ConfigError, match=r"rl.algorithm: unknown option\(s\)"):
            parse(RLConfig, argv)


def test_an_rl_state_saved_before_algorithms_had_options_still_reads() -> None:
    from roboscale.config import to_dict
    from roboscale.rl.run import upgraded

    old = to_dict(RLConfig())
    old["rl"].update(algorithm="ppo", gamma=0.9, gae_lambda=0.8, value_coef=0.25, value_head_dim=32)
    from roboscale.config import from_dict

    algorithm = from_dict(RLConfig, upgraded(old)).rl.algorithm
    assert (algorithm.type, algorithm.gamma, algorithm.gae_lambda, algorithm.value_head_dim) == ("ppo", 0.9, 0.8, 32)
    old["rl"].update(algorithm="grpo", gamma=0.9)
    assert from_dict(RLConfig, upgraded(old)).rl.algorithm.type == "grpo"


@pytest.mark.slow
def test_rloo_post_trains_end_to_end(sft, tmp_path) -> None:
    import json

    from tests.rl.test_rl import _rl

    out = tmp_path / "rloo"
    _rl(sft, out, "--steps=2", "--rollout.workers=1", "--rl.algorithm=rloo")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("value_loss" not in m for m in metrics)
    config = json.loads((out / "checkpoints" / "last" / "pretrained_model" / "config.json").read_text())
    assert config["value_head_dim"] == 0  # no critic
