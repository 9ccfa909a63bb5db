import torch

from roboscale.models.attention import PrefixSuffixLayout, dense_reference, prefix_attention, suffix_attention


def _qkv(b, h, hkv, lp, ls, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lp + ls, d, generator=g)
    k = torch.randn(b, hkv, lp + ls, d, generator=g)
    v = torch.randn(b, hkv, lp + ls, d, generator=g)
    return q, k, v


def test_two_call_attention_equals_dense_prefix_lm_mask():
    b, h, hkv, lp, ls, d = 3, 4, 1, 9, 5, 8
    q, k, v = _qkv(b, h, hkv, lp, ls, d)
    mask = torch.ones(b, lp, dtype=torch.bool)
    mask[0, 6:] = False  # padded language tokens
    mask[2, 3:] = False
    layout = PrefixSuffixLayout(mask)
    reference = dense_reference(q, k, v, layout, ls)
    prefix = prefix_attention(q[:, :, :lp], k[:, :, :lp], v[:, :, :lp], layout)
    suffix = suffix_attention(q[:, :, lp:], k[:, :, :lp], v[:, :, :lp], k[:, :, lp:], v[:, :, lp:], layout)
    real = mask[:, None, :, None].expand_as(prefix)
    # Prefix outputs at real positions and all suffix outputs match the masked full attention.
    torch.testing.assert_close(prefix[real], reference[:, :, :lp][real])
    torch.testing.assert_close(suffix, reference[:, :, lp:])


def test_padding_does_not_leak_into_real_tokens():
    b, h, lp, ls, d = 2, 2, 6, 3, 8
    q, k, v = _qkv(b, h, h, lp, ls, d)
    mask = torch.ones(b, lp, dtype=torch.bool)
    mask[:, 4:] = False
    layout = PrefixSuffixLayout(mask)
    out1 = suffix_attention(q[:, :, lp:], k[:, :, :lp], v[:, :, :lp], k[:, :, lp:], v[:, :, lp:], layout)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 4:lp] = 100.0  # garbage in the padded slots
    v2[:, :, 4:lp] = -100.0
    out2 = suffix_attention(q[:, :, lp:], k2[:, :, :lp], v2[:, :, :lp], k2[:, :, lp:], v2[:, :, lp:], layout)
    torch.testing.assert_close(out1, out2)
