"""GRPO's group-relative advantages and PPO's GAE on hand-made returns."""

from __future__ import annotations

import numpy as np

from roboscale.rl.advantages import gae, group_advantages


def test_group_advantages_compare_each_episode_with_its_own_group() -> None:
    returns = [1, 0, 0, 1, 1, 1, 0, 0]
    groups = [0, 0, 0, 0, 1, 1, 2, 2]
    adv = group_advantages(returns, groups)
    np.testing.assert_allclose(adv[:4], [1, -1, -1, 1], atol=1e-5)  # mean 0.5, std 0.5
    np.testing.assert_array_equal(adv[4:], 0)  # all succeeded / all failed: no signal
    assert adv.dtype == np.float32


def test_gae_by_hand() -> None:
    rewards, values, gamma, lam = [0.0, 0.0, 1.0], [0.5, 0.6, 0.8], 0.9, 0.5
    adv, target = gae(rewards, values, gamma, lam)
    d2 = 1.0 - 0.8  # last chunk: nothing after it
    d1 = 0.0 + 0.9 * 0.8 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.9 * 0.5 * a2
    a0 = d0 + 0.9 * 0.5 * a1
    np.testing.assert_allclose(adv, [a0, a1, a2], rtol=1e-6)
    np.testing.assert_allclose(target, np.array([a0, a1, a2]) + values, rtol=1e-6)


def test_gae_with_lambda_one_and_no_critic_is_the_discounted_return() -> None:
    adv, _ = gae([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], 0.5, 1.0)
    np.testing.assert_allclose(adv, [1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3], rtol=1e-6)
