"""The Policy contract every registered policy keeps (roboscale.models.policy), run over each of them."""

import pickle

import pytest
import torch

from roboscale.eval.rollout import ActionQueue
from roboscale.models.flow_matching import flow_matching_loss
from roboscale.models.registry import SPECS
from tests.models.helpers import batch, tiny_policy
from tests.models.test_groot import tiny_groot

POLICIES = {"pi05": tiny_policy, "groot": tiny_groot}


def test_every_registered_policy_is_covered():
    assert sorted(POLICIES) == sorted(SPECS)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_action_queue_predicts_once_per_chunk_and_reset_drops_what_it_holds(name, monkeypatch):
    policy = POLICIES[name]().eval()
    assert policy.config.n_action_steps == 3  # both tiny configs: steps 0, 3, 6 predict
    calls = []
    obs = batch(b=1)

    def predict():
        calls.append(1)
        return policy.predict_action_chunk(obs)[0]

    queue = ActionQueue(policy.config.n_action_steps)
    actions = [queue.pop(predict) for _ in range(7)]
    assert len(calls) == 3 and all(a.shape == (4,) for a in actions)
    queue.reset()
    queue.pop(predict)
    assert len(calls) == 4


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_contract(name):
    policy = POLICIES[name]()
    transform, collate = policy.data_transforms()
    pickle.dumps((transform, collate))  # they run in loader workers
    encoded = policy.encode(batch(b=3))
    assert encoded.batch_size == 3 and encoded.actions is not None and encoded.tokens <= encoded.computed_tokens
    t = torch.full((3,), 0.5)
    x = torch.randn_like(encoded.actions)
    assert policy.velocity(encoded, x, t).shape == encoded.actions.shape
    loss, metrics = flow_matching_loss(policy, batch(b=3))
    assert torch.isfinite(loss) and float(metrics["loss_weight"]) > 0
    units = policy.parallel_units()
    assert units and all(isinstance(u, torch.nn.Module) for u in units)
    unit_params = sum(p.numel() for u in units for p in u.parameters())
    assert unit_params > 0.5 * sum(p.numel() for p in policy.parameters())  # the bulk of the model is in units
