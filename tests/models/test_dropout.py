"""Per-sample dropout masks: a function of (sample seed, site, place in the sample), whatever the batch."""

import pytest
import torch

from roboscale.models.dropout import SampleDropout, keep_mask, number_sites


def test_masks_keep_the_asked_share_and_depend_on_seed_site_and_place_only():
    seeds = torch.tensor([0, 7, -3, 2**62 + 5])  # negative and beyond 32 bits: the loader's seeds are int64
    positions = torch.arange(64)
    mask = keep_mask(seeds[:, None], positions[None], site=3, width=128, p=0.25)
    assert mask.shape == (4, 64, 128)
    assert abs(mask.float().mean().item() - 0.75) < 0.01
    again = keep_mask(seeds[:, None], positions[None], site=3, width=128, p=0.25)
    assert torch.equal(mask, again)
    # a sample's mask is the same alone or among others, and differs between samples, sites and positions
    alone = keep_mask(seeds[2:3, None], positions[None], site=3, width=128, p=0.25)
    assert torch.equal(alone[0], mask[2])
    assert not torch.equal(mask[0], mask[1]) and not torch.equal(mask[2], mask[3])
    assert not torch.equal(keep_mask(seeds[:1, None], positions[None], 4, 128, 0.25)[0], mask[0])
    assert not torch.equal(mask[0, 0], mask[0, 1])
    # a flat stream of tokens (seed and position per token) draws what rows draw
    stream = keep_mask(seeds.repeat_interleave(64), positions.repeat(4), site=3, width=128, p=0.25)
    assert torch.equal(stream.view(4, 64, 128), mask)


def test_the_module_scales_kept_units_and_is_the_identity_in_eval():
    dropout = SampleDropout(0.5)
    x = torch.ones(3, 5, 16)
    keys = (torch.tensor([[1], [2], [3]]), torch.arange(5)[None])
    out = dropout(x, keys)
    assert set(out.unique().tolist()) == {0.0, 2.0}
    assert torch.equal(out, dropout(x, keys))  # no RNG stream: the same keys, the same mask
    assert torch.equal(dropout.eval()(x, keys), x)
    with pytest.raises(ValueError, match="dropout probability 1.0"):
        SampleDropout(1.0)


def test_sites_are_numbered_in_module_order():
    model = torch.nn.Sequential(SampleDropout(0.1), torch.nn.Linear(2, 2), torch.nn.Sequential(SampleDropout(0.1)))
    number_sites(model)
    assert [m.site for m in model.modules() if isinstance(m, SampleDropout)] == [0, 1]
