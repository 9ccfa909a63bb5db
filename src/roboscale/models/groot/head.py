"""GR00T N1.5's flow-matching action head.

- ``vlln`` (LayerNorm) and a small self-attention transformer over the VL tokens;
- per-embodiment state encoder, action encoder and action decoder: category-specific linear layers whose weights
  are indexed by an embodiment id (one robot's weights never train on another robot's data);
- a DiT over [1 state token, K learned "future" tokens, T action tokens]: even blocks cross-attend to the VL
  tokens, odd blocks self-attend; every block's first norm is an adaLN on the flow timestep, and the output norm
  is modulated by it too. A cross-attending block projects its own keys/values from the VL features in its
  ``forward``, so a wrapper that hooks the block (FSDP, activation checkpointing, compile) covers all its work.

Cross-attention reads the VL tokens as a flat stream with ``VLLayout`` segments through ``varlen_attention``:
each sample's queries see exactly its own VL tokens, never padding. (GR00T passes no mask to the DiT's
cross-attention, so its padded batches attend to pad tokens; we do not reproduce that.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from roboscale.models.attention import varlen_attention
from roboscale.models.dropout import DropoutKeys, SampleDropout
from roboscale.models.groot.config import GrootConfig
from roboscale.models.groot.vlm import VLLayout


# --- per-embodiment layers ------------------------------------------------------------------------------------
class CategorySpecificLinear(nn.Module):
    """A linear layer per embodiment: W [C, in, out], b [C, out]; ``forward(x [B, N, in], ids [B])``."""

    def __init__(self, num_categories: int, in_dim: int, out_dim: int):
        super().__init__()
        self.W = nn.Parameter(torch.empty(num_categories, in_dim, out_dim))
        self.b = nn.Parameter(torch.empty(num_categories, out_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """W ~ N(0, 1 / in_dim), b = 0. GR00T draws W with std 0.02, about 1/sqrt(fan_in) at its widths (1024-3072).
        Scaling by fan_in keeps that at full size and gives small configs unit gain too: with 0.02 at width 32, the
        five such layers between a noisy action and its velocity shrink the signal ~10^4-fold and a tiny model
        barely trains."""
        in_dim = self.W.shape[1]
        # randn scaled, not normal_(std=...): a fixed-seed build keeps its exact values
        self.W.copy_(torch.randn(self.W.shape, device=self.W.device) * in_dim**-0.5)
        self.b.zero_()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if bool((ids == ids[0]).all()):  # one embodiment in the batch (the usual case): no [B, in, out] gather
            return x @ self.W[ids[0]] + self.b[ids[0]]
        return torch.bmm(x, self.W[ids]) + self.b[ids][:, None]


class CategorySpecificMLP(nn.Module):
    def __init__(self, num_categories: int, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, in_dim, hidden)
        self.layer2 = CategorySpecificLinear(num_categories, hidden, out_dim)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, ids)), ids)


def sincos(t: torch.Tensor, dim: int, shift: float = 0.0, cos_first: bool = False) -> torch.Tensor:
    """Transformer-style sinusoidal embedding of (discretized) timesteps t [...] -> [..., dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / (half - shift))
    angles = t.float()[..., None] * freqs
    parts = [angles.cos(), angles.sin()] if cos_first else [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=-1)


class ActionEncoder(nn.Module):
    """GR00T's multi-embodiment action encoder: W3(swish(W2([W1(a), sincos(t)])))."""

    def __init__(self, num_categories: int, action_dim: int, width: int):
        super().__init__()
        self.width = width
        self.W1 = CategorySpecificLinear(num_categories, action_dim, width)
        self.W2 = CategorySpecificLinear(num_categories, 2 * width, width)
        self.W3 = CategorySpecificLinear(num_categories, width, width)

    def forward(self, actions: torch.Tensor, timesteps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """actions [B, T, A]; timesteps [B] (discretized); ids [B] -> [B, T, width]."""
        a = self.W1(actions, ids)
        tau = sincos(timesteps[:, None].expand(-1, actions.shape[1]), self.width).to(a.dtype)
        return self.W3(F.silu(self.W2(torch.cat([a, tau], dim=-1), ids)), ids)


class TimestepEncoder(nn.Module):
    """Diffusers' Timesteps(256, flip_sin_to_cos, shift 1) + TimestepEmbedding: [B] -> [B, dim]."""

    channels = 256

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(self.channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, timesteps: torch.Tensor) -> torch.Tensor:
        emb = sincos(timesteps, self.channels, shift=1.0, cos_first=True).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


# --- attention ------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Diffusers-style attention (biased q/k/v/out). Self-attention over [B, N, D] rows, or cross-attention from
    such rows to a VL stream with ``VLLayout`` segments (``kv_dim`` set)."""

    def __init__(self, dim: int, heads: int, kv_dim: int | None = None, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"attention width {dim} is not a multiple of its {heads} heads")
        self.heads, self.head_dim = heads, dim // heads
        kv_dim = kv_dim or dim
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(kv_dim, dim)
        self.to_v = nn.Linear(kv_dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.dropout = SampleDropout(dropout)

    def kv(self, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of a VL stream [T, kv_dim] -> two [T, H, Dh]."""
        t = stream.shape[0]
        return (self.to_k(stream).view(t, self.heads, self.head_dim),
                self.to_v(stream).view(t, self.heads, self.head_dim))

    def forward_self(self, x: torch.Tensor, keys: DropoutKeys = None) -> torch.Tensor:
        """Bidirectional self-attention within each row of x [B, N, D] (no padding inside a row). ``keys``: the
        per-sample dropout keys of the rows (``VLLayout.row_dropout_keys``)."""
        b, n, d = x.shape
        q, k, v = (proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.dropout(self.to_out(out), keys)

    def forward_stream(self, x: torch.Tensor, layout: VLLayout, keys: DropoutKeys = None) -> torch.Tensor:
        """Self-attention within the segments of a flat stream x [T, D]."""
        t, d = x.shape
        q, k, v = (proj(x).view(t, self.heads, self.head_dim) for proj in (self.to_q, self.to_k, self.to_v))
        cu, n = layout.cu_seqlens, layout.max_seqlen
        out = varlen_attention(q, k, v, cu, cu, n, n, backend=layout.backend)
        return self.dropout(self.to_out(out.reshape(t, d)), keys)

    def forward_cross(self, x: torch.Tensor, vl: torch.Tensor, layout: VLLayout, keys: DropoutKeys = None
                      ) -> torch.Tensor:
        """Rows x [B, N, D] (sample i = row i) attend to sample i's tokens of the VL stream vl [T, kv_dim] only."""
        b, n, d = x.shape
        q = self.to_q(x).reshape(b * n, self.heads, self.head_dim)
        k, v = self.kv(vl)
        cu_q, max_q = layout.query_cu_seqlens(n)
        out = varlen_attention(q, k, v, cu_q.to(x.device), layout.cu_seqlens, max_q, layout.max_seqlen,
                               backend=layout.backend)
        return self.dropout(self.to_out(out.reshape(b, n, d)), keys)


class FeedForward(nn.Module):
    """Diffusers FeedForward("gelu-approximate"): Linear -> GELU(tanh) -> Linear, 4x wide."""

    def __init__(self, dim: int, dropout: float = 0.0, mult: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(dim, mult * dim)
        self.proj_out = nn.Linear(mult * dim, dim)
        self.dropout_hidden = SampleDropout(dropout)  # its own module: its own masks
        self.dropout = SampleDropout(dropout)

    def forward(self, x: torch.Tensor, keys: DropoutKeys = None) -> torch.Tensor:
        hidden = self.dropout_hidden(F.gelu(self.proj_in(x), approximate="tanh"), keys)
        return self.dropout(self.proj_out(hidden), keys)


class AdaLayerNorm(nn.Module):
    """LayerNorm (no affine) scaled and shifted by a projection of the timestep embedding."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * (1 + scale[:, None]) + shift[:, None]


class VLSelfAttentionBlock(nn.Module):
    """Pre-LayerNorm transformer block over the VL stream (GR00T's ``vl_self_attention``)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout=dropout)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout)

    def forward(self, x: torch.Tensor, layout: VLLayout) -> torch.Tensor:
        keys = layout.stream_dropout_keys()
        x = x + self.attn.forward_stream(self.norm1(x), layout, keys)
        return x + self.ff(self.norm3(x), keys)


class DiTBlock(nn.Module):
    """adaLN(t) -> attention (cross to the VL tokens, or self) -> LayerNorm -> FF, both residual. A unit of
    ``GrootPolicy.parallel_units``: a cross-attending block projects the VL features to its keys/values here."""

    def __init__(self, dim: int, heads: int, cross_dim: int | None, dropout: float = 0.0):
        super().__init__()
        self.cross = cross_dim is not None
        self.norm1 = AdaLayerNorm(dim)
        self.attn = Attention(dim, heads, kv_dim=cross_dim, dropout=dropout)
        self.ff = FeedForward(dim, dropout)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, vl: torch.Tensor, layout: VLLayout) -> torch.Tensor:
        """x [B, N, D]; temb [B, D] the timestep embedding; vl [T, W] the VL stream (read by cross blocks only)."""
        h = self.norm1(x, temb)
        keys = layout.row_dropout_keys(x.shape[1])
        x = x + (self.attn.forward_cross(h, vl, layout, keys) if self.cross else self.attn.forward_self(h, keys))
        return x + self.ff(F.layer_norm(x, x.shape[-1:], eps=1e-5), keys)


class DiT(nn.Module):
    """GR00T's DiT with interleaved cross-/self-attention blocks (block 0 cross-attends)."""

    def __init__(self, dim: int, heads: int, layers: int, cross_dim: int, output_dim: int, dropout: float = 0.0):
        super().__init__()
        self.timestep_encoder = TimestepEncoder(dim)
        self.blocks = nn.ModuleList(
            [DiTBlock(dim, heads, cross_dim if i % 2 == 0 else None, dropout) for i in range(layers)]
        )
        self.proj_out_1 = nn.Linear(dim, 2 * dim)
        self.proj_out_2 = nn.Linear(dim, output_dim)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, vl: torch.Tensor, layout: VLLayout) -> torch.Tensor:
        """x [B, N, D] at discretized timesteps [B], conditioned on the VL stream vl [T, W] -> [B, N, output_dim]."""
        temb = self.timestep_encoder(timesteps)
        for block in self.blocks:
            x = block(x, temb, vl, layout)
        shift, scale = self.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        x = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(x)


class FlowMatchingActionHead(nn.Module):
    """VL processing, per-embodiment encoders/decoder and the DiT; predicts the flow velocity of an action chunk."""

    def __init__(self, cfg: GrootConfig, backbone_dim: int):
        super().__init__()
        self.cfg = cfg
        w, c = cfg.dit_width, cfg.num_embodiments
        self.vlln = nn.LayerNorm(backbone_dim)
        self.vl_self_attention = nn.ModuleList(
            [VLSelfAttentionBlock(backbone_dim, cfg.vl_heads, cfg.dropout) for _ in range(cfg.vl_layers)]
        )
        self.state_encoder = CategorySpecificMLP(c, cfg.state_dim, cfg.hidden_size, w)
        self.action_encoder = ActionEncoder(c, cfg.action_dim, w)
        self.action_decoder = CategorySpecificMLP(c, cfg.hidden_size, cfg.hidden_size, cfg.action_dim)
        self.future_tokens = nn.Parameter(torch.empty(cfg.num_future_tokens, w))
        self.position_embedding = nn.Parameter(torch.empty(cfg.max_seq_len, w))
        self.reset_parameters()  # here, not last: a fixed seed draws these before the DiT's weights
        self.dit = DiT(w, cfg.dit_heads, cfg.dit_layers, backbone_dim, cfg.hidden_size, cfg.dropout)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The learned future tokens and action positions ~ N(0, 0.02^2) (GR00T's)."""
        for param in (self.future_tokens, self.position_embedding):
            param.copy_(0.02 * torch.randn(param.shape, device=param.device))

    def encode_vl(self, vl: torch.Tensor, layout: VLLayout) -> torch.Tensor:
        """VL stream [T, W] -> the features the DiT cross-attends to: ``vlln``, then the VL self-attention."""
        x = self.vlln(vl)
        for block in self.vl_self_attention:
            x = block(x, layout)
        return x

    def velocity(self, x_t: torch.Tensor, timesteps: torch.Tensor, state_features: torch.Tensor, vl: torch.Tensor,
                 layout: VLLayout, embodiment: torch.Tensor) -> torch.Tensor:
        """Velocity [B, T, A] of noisy actions x_t at discretized timesteps [B], given the state features [B, 1, W],
        the VL features [T_vl, W_vl] from ``encode_vl`` and the embodiment ids [B]."""
        b, t, _ = x_t.shape
        actions = self.action_encoder(x_t, timesteps, embodiment) + self.position_embedding[:t]
        future = self.future_tokens[None].expand(b, -1, -1)
        x = torch.cat([state_features, future, actions], dim=1)
        out = self.dit(x, timesteps, vl, layout)
        return self.action_decoder(out[:, -t:], embodiment)
