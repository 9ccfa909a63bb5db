"""Prefix/suffix attention for pi0.5-style policies, without materialising an [L, L] mask.

pi0.5's attention pattern: the prefix (image + language + state tokens) attends bidirectionally within itself;
the suffix (action tokens) attends to the prefix and bidirectionally to itself; nothing attends to padding.
LeRobot implements it as one eager attention with a 4-D mask. The pattern decomposes exactly into two calls:

    prefix queries -> prefix keys                 (key-padding mask only)
    suffix queries -> [prefix keys, suffix keys]  (key-padding mask only)

which is also exactly what inference with a cached prefix does, so training and inference share one code path.
A key-padding mask is [B, 1, 1, Lk] and broadcasts; no [B, L, L] tensor is built. ``dense_reference`` builds
the full mask the LeRobot way and exists as the numerical reference for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefixSuffixLayout:
    """Which prefix tokens are real. ``prefix_mask``: bool [B, Lp], True for a real token."""

    prefix_mask: torch.Tensor

    def key_mask(self, suffix_len: int = 0) -> torch.Tensor:
        """Bool [B, 1, 1, Lp + suffix_len]: True where a key may be attended to."""
        mask = self.prefix_mask
        if suffix_len:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], suffix_len)], dim=1)
        return mask[:, None, None, :]

    @property
    def all_real(self) -> bool:
        return bool(self.prefix_mask.all())


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PrefixSuffixLayout) -> torch.Tensor:
    """Prefix self-attention. q: [B, H, Lp, Dh]; k, v: [B, Hkv, Lp, Dh]."""
    return _sdpa(q, k, v, None if layout.all_real else layout.key_mask())


def suffix_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    layout: PrefixSuffixLayout,
) -> torch.Tensor:
    """Suffix queries over [prefix keys, suffix keys]. q: [B, H, Ls, Dh]."""
    k = torch.cat([prefix_k, suffix_k], dim=2)
    v = torch.cat([prefix_v, suffix_v], dim=2)
    mask = None if layout.all_real else layout.key_mask(suffix_k.shape[2])
    return _sdpa(q, k, v, mask)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PrefixSuffixLayout, suffix_len: int
) -> torch.Tensor:
    """The whole [prefix, suffix] sequence with an explicit [B, 1, L, L] mask (LeRobot's formulation)."""
    b, lp = layout.prefix_mask.shape
    length = lp + suffix_len
    key_real = layout.key_mask(suffix_len)[:, 0, 0, :]  # [B, L]
    is_suffix = torch.arange(length, device=q.device) >= lp
    # Query i may see key j iff j is real and (j in prefix or i in suffix).
    allowed = key_real[:, None, :] & (~is_suffix[None, None, :] | is_suffix[None, :, None])
    return _sdpa(q, k, v, allowed[:, None])


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Attention over packed segments (flash-attention's varlen convention): segment ``i`` owns query rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; nothing crosses
    segments. q: [Tq, H, D]; k, v: [Tk, Hkv, D] (Hkv divides H); returns [Tq, H, D]. ``causal`` aligns the
    last query with the last key of a segment (flash-attention's bottom-right convention).

    This is the per-segment SDPA reference; ``roboscale.models.attention`` grows faster backends behind the
    same signature.
    """
    out = q.new_empty(q.shape)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0:
            continue
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        mask = None
        if causal:
            lq, lk = q1 - q0, k1 - k0
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        out[q0:q1] = _sdpa(qs, ks, vs, mask)[0].transpose(0, 1)
    return out
