"""pi0.5 for ONNX export (``roboscale.models.onnx``): the prefix pass as the encoder, one action-expert pass as the
denoiser, in the padded layout (every camera, the state token, the prompt right-padded; key-padding masks).

The encoder returns the prefix keys/values of every layer stacked, [depth, 2, B, L, kv_heads, head_dim], with the
prefix's key mask [B, L] and each sample's prefix length [B] (where its action tokens' positions start): exactly
what ``Pi05Policy.encode(cache=True)`` keeps, so each Euler step runs only the action expert.
"""

from __future__ import annotations

import torch
from torch import nn

from roboscale.models.attention import PrefixSuffixLayout
from roboscale.models.layers import rotary_tables
from roboscale.models.onnx import OnnxModules, exportable_backend
from roboscale.models.pi05.modeling import Pi05Layout, Pi05Policy
from roboscale.utils.images import signed_unit_images

class _MaskedPrefix(PrefixSuffixLayout):
    """The key-padding layout with the mask always applied: ``all_real`` is a data-dependent branch a graph cannot
    hold (and applying an all-true mask changes nothing)."""

    @property
    def all_real(self) -> bool:
        return False


def _layout(prefix_mask: torch.Tensor, prefix_len: torch.Tensor, suffix_len: int, backend: str) -> Pi05Layout:
    positions = (prefix_mask.long().cumsum(1) - 1).clamp_min(0)  # the padded collate's: cumsum(mask) - 1
    return Pi05Layout(False, backend, positions=positions, seq_lens=prefix_len, suffix_len=suffix_len,
                      padded=_MaskedPrefix(prefix_mask))


class Pi05Encoder(nn.Module):
    def __init__(self, policy: Pi05Policy, backend: str):
        super().__init__()
        self.policy, self.backend = policy, backend

    def forward(self, images: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor):
        policy, cfg = self.policy, self.policy.config
        b, cameras = images.shape[:2]
        image_tokens = policy.projector(policy.vision(signed_unit_images(images.flatten(0, 1), cfg.image_size)))
        parts = [image_tokens.reshape(b, -1, cfg.width)]
        if cfg.state_input == "token":
            parts.append(policy.state_proj(state)[:, None])
        parts.append(policy.embed_tokens(tokens) * (cfg.width**0.5))  # Gemma scales embeddings by sqrt(width)
        prefix = torch.cat(parts, dim=1)
        fixed = prefix.shape[1] - tokens.shape[1]  # image and state tokens: always real
        prefix_mask = torch.cat([token_mask.new_ones(b, fixed), token_mask], dim=1)
        prefix_len = prefix_mask.long().sum(1)
        layout = _layout(prefix_mask, prefix_len, cfg.chunk_size, self.backend)
        rope = rotary_tables(layout.positions, cfg.head_dim)
        cache = []
        for layer in policy.layers:
            prefix, _, (k, v) = layer(prefix, None, None, rope, None, layout)
            cache.append(torch.stack([k, v]))
        return torch.stack(cache), prefix_mask, prefix_len


class Pi05Denoiser(nn.Module):
    def __init__(self, policy: Pi05Policy, backend: str):
        super().__init__()
        self.policy, self.backend = policy, backend

    def forward(self, x: torch.Tensor, t: torch.Tensor, prefix_kv: torch.Tensor, prefix_mask: torch.Tensor,
                prefix_len: torch.Tensor) -> torch.Tensor:
        policy, cfg = self.policy, self.policy.config
        layout = _layout(prefix_mask, prefix_len, cfg.chunk_size, self.backend)
        cond = policy._time_condition(t)
        h = policy.action_in_proj(x)
        suffix_rope = rotary_tables(layout.suffix_positions(), cfg.head_dim)
        for i, layer in enumerate(policy.layers):
            _, h, _ = layer(None, h, cond, None, suffix_rope, layout, kv=(prefix_kv[i, 0], prefix_kv[i, 1]))
        h, _ = policy.expert_norm(h, cond)
        return policy.action_out_proj(h)


def onnx_modules(policy: Pi05Policy) -> OnnxModules:
    backend = exportable_backend(policy.config.attention_backend)
    return OnnxModules(Pi05Encoder(policy, backend), Pi05Denoiser(policy, backend),
                       context=("prefix_kv", "prefix_mask", "prefix_len"),
                       prompt="state_bins" if policy.config.state_input == "prompt" else "task")
