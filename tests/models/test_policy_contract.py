"""The Policy contract every registered policy keeps (design.md): select_action pops an action queue and predicts
a new chunk only when the queue is empty; reset() drops what is queued."""

import pytest

from tests.models.helpers import batch, tiny_policy
from tests.models.test_groot import tiny_groot

POLICIES = {"pi05": tiny_policy, "groot": tiny_groot}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_select_action_pops_a_queue_and_predicts_once_per_chunk(name, monkeypatch):
    policy = POLICIES[name]().eval()
    assert policy.config.n_action_steps == 3  # both tiny configs: steps 0, 3, 6 predict
    calls = []
    original = policy.predict_action_chunk

    def counting(obs):
        calls.append(1)
        return original(obs)

    monkeypatch.setattr(policy, "predict_action_chunk", counting)
    obs = batch(b=1)
    actions = [policy.select_action(obs) for _ in range(7)]
    assert len(calls) == 3
    assert all(a.shape == (1, 4) for a in actions)
    policy.reset()
    policy.select_action(obs)
    assert len(calls) == 4
