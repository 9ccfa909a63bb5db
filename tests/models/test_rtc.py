"""Real-time chunking: the guidance weights, the guided sampler in both time conventions, the policy's guided chunks
and the runner's mixed batches."""

import math

import numpy as np
import pytest
import torch

from roboscale.configs.rollout import SDESampler
from roboscale.models.flow_matching import FlowMatching
from roboscale.models.rtc import ChunkGuide, Guide, guidance_weight, prefix_weights
from roboscale.rollout.inference import PolicyRunner, PredictItem
from tests.models.helpers import CAMERAS, TASKS, batch, tiny_policy
from tests.models.test_groot import tiny_groot


def _exp(w: float) -> float:
    return w * math.expm1(w) / (math.e - 1)


@pytest.mark.parametrize("schedule, expected", [
    ("linear", [1, 1, 0.75, 0.5, 0.25, 0, 0, 0]),
    ("exp", [1, 1, _exp(0.75), _exp(0.5), _exp(0.25), 0, 0, 0]),
    ("ones", [1, 1, 1, 1, 1, 0, 0, 0]),
    ("zeros", [1, 1, 0, 0, 0, 0, 0, 0]),
])
def test_prefix_weights_freeze_the_delay_then_decay_over_the_committed_actions(schedule, expected):
    torch.testing.assert_close(prefix_weights(2, 5, 8, schedule), torch.tensor(expected, dtype=torch.float32))


def test_prefix_weights_at_the_edges_and_their_errors():
    assert prefix_weights(3, 3, 6, "linear").tolist() == [1, 1, 1, 0, 0, 0]  # all committed actions frozen
    assert prefix_weights(0, 0, 4, "exp").tolist() == [0, 0, 0, 0]  # nothing committed: unguided
    assert prefix_weights(0, 6, 6, "linear").tolist() == pytest.approx([6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7])
    with pytest.raises(ValueError, match="schedule"):
        prefix_weights(1, 2, 4, "cosine")
    with pytest.raises(ValueError, match="delay"):
        prefix_weights(3, 2, 4)


def test_guidance_weight_is_the_papers_in_the_middle_and_capped_at_both_ends():
    tau = torch.tensor([0.0, 0.5, 0.9, 1.0])
    weight = guidance_weight(tau, beta=5.0)
    # c(0.5) = (1 - 0.5) / 0.5 / r^2 with r^2 = 0.25 / 0.5: 2; c(0.9) = 0.82 / 0.09 > 5
    torch.testing.assert_close(weight, torch.tensor([5.0, 2.0, 5.0, 5.0]))


# --- the sampler --------------------------------------------------------------------------------------------------
def _paper_velocity(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """A nonlinear toy model in the paper's convention (tau: 0 noise -> 1 data, v = A - eps)."""
    mix = torch.linspace(-1, 1, x.shape[-1] ** 2).view(x.shape[-1], x.shape[-1])
    return torch.tanh(x @ mix) * 0.5 - x + tau.view(-1, 1, 1)


def _velocity_of(data_at: int):
    """The same toy model in a sampler's convention: pi0's runs the paper's time backwards, its velocity negated."""
    if data_at == 1:
        return _paper_velocity
    return lambda x, t: -_paper_velocity(x, 1.0 - t)


def _toy_guide(b=2, t=6, a=3, seed=0) -> Guide:
    g = torch.Generator().manual_seed(seed)
    weights = torch.stack([prefix_weights(2, 5, t, "exp"), prefix_weights(1, 4, t, "linear")])[:b]
    return Guide(torch.rand(b, t, a, generator=g) * 2 - 1, weights, beta=5.0)


@pytest.mark.parametrize("data_at", [0, 1])
def test_zero_weights_sample_exactly_as_the_unguided_sampler(data_at):
    flow, noise = FlowMatching(data_at), torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1))
    guide = _toy_guide()
    unguided = flow.sample(_velocity_of(data_at), noise, 5)
    zero = Guide(guide.target, torch.zeros_like(guide.weights), guide.beta)
    assert torch.equal(flow.sample(_velocity_of(data_at), noise, 5, guide=zero), unguided)


def test_both_conventions_guide_the_same_flow_to_the_same_chunk_towards_the_target():
    noise = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(1))
    guide = _toy_guide()
    pi0, groot = FlowMatching(0), FlowMatching(1)
    guided = {flow.data_at: flow.sample(_velocity_of(flow.data_at), noise, 5, guide=guide) for flow in (pi0, groot)}
    unguided = groot.sample(_paper_velocity, noise, 5)
    torch.testing.assert_close(pi0.sample(_velocity_of(0), noise, 5), unguided)  # the same flow either way
    torch.testing.assert_close(guided[0], guided[1], rtol=1e-5, atol=1e-6)  # the same guidance: signs are right
    frozen = guide.weights == 1
    near, far = ((chunk - guide.target).norm(dim=-1)[frozen].mean() for chunk in (guided[1], unguided))
    assert near < 0.5 * far


# --- the policies -------------------------------------------------------------------------------------------------
def _observation(b: int, seed: int = 0) -> dict:
    obs = batch(b=b, seed=seed)
    del obs["action"], obs["action_is_pad"]
    return obs


def _rows(obs: dict, rows: list[int]) -> dict:
    return {k: v[rows] if isinstance(v, torch.Tensor) else [v[i] for i in rows] for k, v in obs.items()}


def _committed(policy, b: int, counts: list[int], delays: list[int], seed: int = 2) -> ChunkGuide:
    actions = torch.rand(b, policy.config.chunk_size, 4, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return ChunkGuide(actions, torch.tensor(counts), torch.tensor(delays))


def _noise(policy, b: int, seed: int = 1) -> torch.Tensor:
    shape = (b, policy.config.chunk_size, policy.config.action_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


POLICIES = {"pi05": lambda: tiny_policy(num_inference_steps=5), "groot": lambda: tiny_groot(num_inference_steps=5)}


@pytest.fixture(scope="module", params=sorted(POLICIES))
def policy(request):
    return POLICIES[request.param]().eval()


def test_guidance_pulls_the_frozen_steps_onto_the_committed_actions(policy):
    obs, noise = _observation(3), _noise(policy, 3)
    guide = _committed(policy, 3, counts=[6, 5, 4], delays=[3, 2, 2])
    unguided = policy.predict_action_chunk(obs, noise=noise)
    guided = policy.predict_action_chunk(obs, noise=noise, guide=guide)
    frozen = torch.arange(policy.config.chunk_size)[None] < guide.delay[:, None]
    distance = {name: (chunk - guide.actions).abs().mean(-1)[frozen].mean().item()
                for name, chunk in (("guided", guided), ("unguided", unguided))}
    assert distance["guided"] < 0.2 * distance["unguided"], distance
    after = torch.arange(policy.config.chunk_size)[None] >= guide.count[:, None]  # nothing to agree with there
    assert (guided - unguided).abs().mean(-1)[after].mean() < (guided - unguided).abs().mean(-1)[frozen].mean()
    assert all(p.grad is None for p in policy.parameters()) and not guided.requires_grad


def test_a_sample_without_committed_actions_gets_exactly_its_unguided_chunk(policy):
    obs, noise = _observation(3), _noise(policy, 3)
    unguided = policy.predict_action_chunk(obs, noise=noise)
    guided = policy.predict_action_chunk(obs, noise=noise, guide=_committed(policy, 3, [5, 0, 4], [2, 0, 1]))
    assert torch.equal(guided[1], unguided[1])
    assert not torch.allclose(guided[0], unguided[0], atol=1e-3)


def test_a_guided_chunk_does_not_depend_on_its_batch_mates(policy):
    obs, noise = _observation(3), _noise(policy, 3)
    guide = _committed(policy, 3, [5, 6, 0], [2, 3, 0])
    together = policy.predict_action_chunk(obs, noise=noise, guide=guide)
    alone = policy.predict_action_chunk(_rows(obs, [0]), noise=noise[:1],
                                        guide=ChunkGuide(guide.actions[:1], guide.count[:1], guide.delay[:1]))
    torch.testing.assert_close(alone[0], together[0], rtol=1e-5, atol=1e-6)


def test_committed_actions_of_the_wrong_shape_or_counts_are_refused(policy):
    obs, noise = _observation(2), _noise(policy, 2)
    t = policy.config.chunk_size
    with pytest.raises(ValueError, match="committed actions"):
        policy.predict_action_chunk(obs, noise=noise, guide=ChunkGuide(torch.zeros(2, t, 3), torch.tensor([1, 1]),
                                                                       torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="delay"):
        policy.predict_action_chunk(obs, noise=noise, guide=_committed(policy, 2, [2, 1], [0, 2]))


def test_a_fine_tuned_policys_padded_action_dimensions_are_left_unguided():
    from roboscale.models.normalize import Normalizer

    policy = tiny_policy().eval()  # actions 4 wide; the dataset's, here, 3
    policy.action_normalizer = Normalizer(4, "quantiles", data_dim=3)
    t = policy.config.chunk_size
    guide = ChunkGuide(torch.rand(2, t, 3), torch.tensor([4, 0]), torch.tensor([1, 0]), schedule="linear")
    sampler_guide = policy._sampler_guide(guide, (2, t, 4), torch.device("cpu"))
    assert sampler_guide.target.shape == (2, t, 4) and sampler_guide.weights.shape == (2, t, 4)
    torch.testing.assert_close(sampler_guide.weights[0, :, 0], prefix_weights(1, 4, t, "linear"))
    assert sampler_guide.weights[..., 3].abs().sum() == 0 and sampler_guide.weights[1].abs().sum() == 0
    chunk = policy.predict_action_chunk(_observation(2), noise=_noise(policy, 2), guide=guide)
    assert chunk.shape == (2, t, 3) and torch.isfinite(chunk).all()


# --- the runner ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("rtc") / "pretrained_model"
    tiny_policy().save_pretrained(path)
    return str(path)


def _item(slot: int, committed: np.ndarray | None = None, delay: int = 0) -> PredictItem:
    rng = np.random.default_rng(slot)
    images = {name.removeprefix("observation.images."): rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
              for name in CAMERAS}
    return PredictItem(slot, 100 + slot, 3, TASKS[slot % len(TASKS)], rng.standard_normal(4).astype(np.float32),
                       images, committed, delay)


def _leftover(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (n, 4)).astype(np.float32)


def test_the_runner_guides_the_items_with_committed_actions_and_keeps_the_order(checkpoint):
    runner = PolicyRunner(checkpoint)
    items = [_item(0), _item(1, _leftover(5, 1), 2), _item(2), _item(3, _leftover(6, 3), 3)]
    mixed = runner.predict(items)
    plain = runner.predict([_item(0), _item(2)])
    for got, want in zip([mixed[0], mixed[2]], plain, strict=True):
        assert np.array_equal(got.chunk, want.chunk)  # the unguided items: the unguided call's chunks, exactly
    for index in (1, 3):
        alone = runner.predict([items[index]])[0].chunk
        np.testing.assert_allclose(mixed[index].chunk, alone, rtol=1e-5, atol=1e-6)
        unguided = runner.predict([_item(index)])[0].chunk
        frozen = slice(0, items[index].delay)
        committed = items[index].committed[frozen]
        assert (np.abs(alone[frozen] - committed).mean() < 0.5 * np.abs(unguided[frozen] - committed).mean())


@pytest.mark.parametrize("committed, delay, message", [
    (_leftover(7, 0), 0, "committed has shape"),  # longer than the chunk (6)
    (_leftover(3, 0)[:, :3], 0, "committed has shape"),  # the dataset's actions are 4 wide
    (np.array([[0.0, np.nan, 0.0, 0.0]], dtype=np.float32), 0, "committed has non-finite"),
    (_leftover(3, 0), -1, "delay must be in"),
    (_leftover(3, 0), 4, "delay must be in"),
])
def test_the_runner_refuses_bad_committed_actions_naming_the_field(checkpoint, committed, delay, message):
    with pytest.raises(ValueError, match=message):
        PolicyRunner(checkpoint).predict([_item(0), _item(1, committed, delay)])


def test_the_sde_sampler_and_an_unknown_schedule_refuse_real_time_chunking(checkpoint):
    with pytest.raises(ValueError, match="committed: .*sde"):
        PolicyRunner(checkpoint, sampler=SDESampler()).predict([_item(0, _leftover(3, 0), 1)])
    with pytest.raises(ValueError, match="rtc_schedule"):
        PolicyRunner(checkpoint, rtc_schedule="cosine")
