"""GR00T for ONNX export (``roboscale.models.onnx``): the VLM, ``vlln``, the VL self-attention and the state encoder
as the encoder, one pass of the action encoder, the DiT and the action decoder as the denoiser, in the padded
layout (one row per sample: the camera tokens, then the prompt right-padded; key-padding masks).

The policy's attention over VL tokens reads a flat stream with ``cu_seqlens`` (``VLLayout``, ``varlen_attention``),
whose segment bounds are Python integers a graph cannot hold; here the same layers' weights run over padded rows
with masks, which gives every real token the same keys: the language model's causal attention sees the sample's
own earlier real tokens, the VL self-attention and the DiT's cross-attention its own real tokens. Padding rows
compute values nothing real reads.

The encoder returns the VL features [B, L_vl, W] after the VL self-attention, their key mask [B, L_vl] and the
encoded state token [B, 1, dit_width]: what ``GrootPolicy.encode`` keeps for every Euler step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roboscale.models.attention import eager_attention
from roboscale.models.groot.head import Attention, CategorySpecificLinear, CategorySpecificMLP, sincos
from roboscale.models.groot.modeling import GrootPolicy
from roboscale.models.groot.vlm import Qwen3Layer
from roboscale.models.layers import apply_rotary, rotary_tables
from roboscale.models.onnx import OnnxModules, exportable_backend
from roboscale.utils.images import signed_unit_images

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], bool mask broadcasting to [B, 1, Lq, Lk]. The heads are repeated
    here rather than by SDPA's ``enable_gqa``, which the ONNX exporter does not take; query head h reads key head
    h // groups either way."""
    if backend == "eager":  # varlen_attention's eager path: the fp32 masked softmax
        return eager_attention(q, k, v, mask)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _linear(layer: CategorySpecificLinear, x: torch.Tensor, embodiment: int) -> torch.Tensor:
    # the one-embodiment path of ``CategorySpecificLinear.forward``, whose test of the ids is a data-dependent
    # branch; the export's embodiment is the config's, the same for every sample (as ``_embodiment`` gives)
    return x @ layer.W[embodiment] + layer.b[embodiment]


def _mlp(mlp: CategorySpecificMLP, x: torch.Tensor, embodiment: int) -> torch.Tensor:
    return _linear(mlp.layer2, F.relu(_linear(mlp.layer1, x, embodiment)), embodiment)


def _qwen3(layer: Qwen3Layer, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
           backend: str) -> torch.Tensor:
    """``Qwen3Layer.forward`` over rows x [B, L, W] (its q/k norms are per head, before the rotation)."""
    b, n, _ = x.shape
    h = layer.input_norm(x)
    q = layer.q_norm(layer.q_proj(h).view(b, n, layer.heads, layer.head_dim)).transpose(1, 2)
    k = layer.k_norm(layer.k_proj(h).view(b, n, layer.kv_heads, layer.head_dim)).transpose(1, 2)
    v = layer.v_proj(h).view(b, n, layer.kv_heads, layer.head_dim).transpose(1, 2)
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    attn = _attend(q, k, v, mask, backend).transpose(1, 2).reshape(b, n, layer.heads * layer.head_dim)
    x = x + layer.o_proj(attn)
    return x + layer.mlp(layer.post_norm(x))


def _attention(attn: Attention, x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, backend: str) -> torch.Tensor:
    """``Attention.forward_stream`` (kv = x) or ``forward_cross`` (kv = the VL rows) over rows, keys masked."""
    b, n, d = x.shape
    q = attn.to_q(x).view(b, n, attn.heads, attn.head_dim).transpose(1, 2)
    k, v = (proj(kv).view(b, kv.shape[1], attn.heads, attn.head_dim).transpose(1, 2)
            for proj in (attn.to_k, attn.to_v))
    return attn.to_out(_attend(q, k, v, mask, backend).transpose(1, 2).reshape(b, n, d))


class GrootEncoder(nn.Module):
    def __init__(self, policy: GrootPolicy, backend: str):
        super().__init__()
        self.policy, self.backend = policy, backend

    def forward(self, images: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor):
        policy, cfg = self.policy, self.policy.config
        vlm, head = policy.vlm, policy.action_head
        b = images.shape[0]
        image_tokens = vlm.image_tokens(signed_unit_images(images.flatten(0, 1), cfg.image_size), b)
        x = torch.cat([image_tokens, vlm.embed_tokens(tokens)], dim=1)
        mask = torch.cat([token_mask.new_ones(b, image_tokens.shape[1]), token_mask], dim=1).bool()
        # the packed stream's positions restart at 0 per sample and count its real tokens (padding is right)
        positions = mask.long().cumsum(1) - 1
        rope = rotary_tables(positions, cfg.llm_head_dim, base=cfg.rope_theta)
        keys = mask[:, None, None, :]
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        for layer in vlm.layers:
            x = _qwen3(layer, x, rope, causal & keys, self.backend)
        vl = head.vlln(vlm.norm(x))
        for block in head.vl_self_attention:  # ``VLSelfAttentionBlock.forward``
            h = block.norm1(vl)
            vl = vl + _attention(block.attn, h, h, keys, self.backend)
            vl = vl + block.ff(block.norm3(vl))
        # the state arrives normalized (the runtime's), so no ``state_normalizer`` here
        state_features = _mlp(head.state_encoder, state[:, None], cfg.embodiment_id)
        return vl, mask, state_features


class GrootDenoiser(nn.Module):
    def __init__(self, policy: GrootPolicy, backend: str):
        super().__init__()
        self.policy, self.backend = policy, backend

    def forward(self, x: torch.Tensor, t: torch.Tensor, vl: torch.Tensor, vl_mask: torch.Tensor,
                state_features: torch.Tensor) -> torch.Tensor:
        """``GrootPolicy.velocity`` -> ``FlowMatchingActionHead.velocity`` -> ``DiT.forward``."""
        cfg, head = self.policy.config, self.policy.action_head
        dit, embodiment = head.dit, cfg.embodiment_id
        b, steps, _ = x.shape
        timesteps = (t * cfg.num_timestep_buckets).long()
        enc = head.action_encoder  # ``ActionEncoder.forward``
        a = _linear(enc.W1, x, embodiment)
        tau = sincos(timesteps[:, None].expand(-1, steps), enc.width).to(a.dtype)
        a = _linear(enc.W3, F.silu(_linear(enc.W2, torch.cat([a, tau], dim=-1), embodiment)), embodiment)
        actions = a + head.position_embedding[:steps]
        h = torch.cat([state_features, head.future_tokens[None].expand(b, -1, -1), actions], dim=1)
        temb = dit.timestep_encoder(timesteps)
        keys = vl_mask[:, None, None, :]
        for block in dit.blocks:  # ``DiTBlock.forward``
            normed = block.norm1(h, temb)
            h = h + (_attention(block.attn, normed, vl, keys, self.backend) if block.cross
                     else block.attn.forward_self(normed))
            h = h + block.ff(F.layer_norm(h, h.shape[-1:], eps=1e-5))
        shift, scale = dit.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        h = F.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        out = dit.proj_out_2(h)
        return _mlp(head.action_decoder, out[:, -steps:], embodiment)


def onnx_modules(policy: GrootPolicy) -> OnnxModules:
    backend = exportable_backend(policy.config.attention_backend)
    return OnnxModules(GrootEncoder(policy, backend), GrootDenoiser(policy, backend),
                       context=("vl", "vl_mask", "state_features"), prompt="task")
