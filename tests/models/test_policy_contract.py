"""The Policy contract every registered policy keeps (roboscale.models.policy), run over each of them."""

import pickle

import pytest
import torch

from roboscale.models.objective import flow_matching_loss
from roboscale.models.registry import SPECS
from tests.models.helpers import batch, tiny_policy
from tests.models.test_groot import tiny_groot

POLICIES = {"pi05": tiny_policy, "groot": tiny_groot}


def test_every_registered_policy_is_covered():
    assert sorted(POLICIES) == sorted(SPECS)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_given_noise_a_prediction_does_not_depend_on_the_batch_it_is_in(name):
    """What lets the rollout engine batch observations of many episodes: each sample's actions come from its own
    noise and observation only (fp32), and the same noise gives the same actions."""
    policy = POLICIES[name]().eval()
    obs = batch(b=3)
    obs = {k: v for k, v in obs.items() if not k.startswith("action")}
    cfg = policy.config
    noise = torch.randn(3, cfg.chunk_size, cfg.action_dim)
    together = policy.predict_action_chunk(obs, noise=noise)
    alone = torch.cat([policy.predict_action_chunk({k: v[i:i + 1] for k, v in obs.items()}, noise=noise[i:i + 1])
                       for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
    assert torch.equal(together, policy.predict_action_chunk(obs, noise=noise))
    assert not torch.allclose(together, policy.predict_action_chunk(obs, noise=noise + 1))
    with pytest.raises(ValueError, match="noise has shape"):
        policy.predict_action_chunk(obs, noise=noise[:2])


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


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_parameter_is_counted_in_one_of_the_policys_flops_components(name):
    """MFU counts a frozen component without its backward: each parameter must map to a FLOPs component."""
    from roboscale.models.registry import get_spec

    policy = POLICIES[name]()
    components = {c.name for c in get_spec(name).flops_function()(policy.config).components}
    placed = {n: policy.flops_component_of(n) for n, _ in policy.named_parameters()}
    assert set(placed.values()) == components
    with pytest.raises(KeyError, match="does not place the parameter 'nonexistent.weight'"):
        policy.flops_component_of("nonexistent.weight")
