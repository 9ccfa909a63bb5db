"""Building blocks shared by the policies: norms, rotary embeddings, MLPs, the ViT.

Kept free of policy-specific logic so pi0.5-style and GR00T-style policies (and their tiny and full-size
configurations) are assembled from the same parts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Gemma-style RMSNorm: the weight is stored as an offset from 1 (zero-init = identity)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * (1.0 + self.weight)


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale and shift, plus a residual gate, come from a conditioning vector (pi0.5's flow time).

    ``forward(x, cond)`` returns ``(normed, gate)``; the caller multiplies its residual branch by ``gate``. The
    projection is zero-initialised so that at init the norm is plain RMSNorm and the gate is 1.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.modulation = nn.Linear(cond_dim, 3 * dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, shift, gate = self.modulation(cond).unsqueeze(1).chunk(3, dim=-1)  # each [B, 1, D]
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * (1.0 + scale) + shift, 1.0 + gate


_GATE_ACTIVATIONS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class GatedMLP(nn.Module):
    """Gated feed-forward down(act(gate(x)) * up(x)): GeGLU (Gemma, ``gelu_tanh``) or SwiGLU (Qwen/Llama, ``silu``)."""

    def __init__(self, dim: int, hidden: int, activation: str = "gelu_tanh"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.activation = _GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


def rotary_tables(position_ids: torch.Tensor, head_dim: int, base: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, L, head_dim] for integer positions [B, L] (rotate-half convention)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, L, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k [B, H, L, Dh] by tables [B, L, Dh]."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sinusoidal_embedding(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """pi0's time embedding: sin/cos of t over log-spaced periods in [min_period, max_period]. t: [B] in [0, 1]."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, device=t.device, dtype=torch.float32)
    period = min_period * (max_period / min_period) ** fraction
    angles = t.to(torch.float32)[:, None] * (2 * math.pi / period)[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ViTBlock(nn.Module):
    """Pre-LayerNorm transformer block (SigLIP style), bidirectional attention over one image's patches."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, norm_eps: float = 1e-5):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.fc1 = nn.Linear(dim, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


def conv_stem_embed(patch_size: int, dim: int) -> nn.Sequential:
    """log2(patch_size) stride-2 3x3 convolutions, widening to ``dim``: a patch embedding with locality built in."""
    stages = patch_size.bit_length() - 1
    widths = [3] + [max(dim >> (stages - i), 16) for i in range(1, stages)] + [dim]
    layers: list[nn.Module] = []
    for i in range(stages):
        layers.append(nn.Conv2d(widths[i], widths[i + 1], kernel_size=3, stride=2, padding=1))
        if i < stages - 1:
            layers.append(nn.GELU())
    return nn.Sequential(*layers)


class VisionTransformer(nn.Module):
    """A small SigLIP-style ViT: patch embedding, learned positions, pre-LN blocks, final LayerNorm.

    ``conv_stem`` replaces the single patchify convolution by stride-2 3x3 convolutions (Xiao et al., 2021,
    "Early convolutions help transformers see better"): same tokens, far better sample efficiency at the few
    thousand frames a CPU demo trains on, for a few percent more compute.
    ``pixel_shuffle`` > 1 merges neighbouring patches by pixel shuffle (space-to-depth, as in
    Eagle/SmolVLM), which cuts the tokens the language model sees by the square of the ratio at no loss of
    information.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_dim: int = 0,
        pixel_shuffle: int = 1,
        conv_stem: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        if conv_stem and patch_size & (patch_size - 1):
            raise ValueError(f"conv_stem needs a power-of-two patch_size, got {patch_size}")
        self.grid = image_size // patch_size
        if self.grid % pixel_shuffle:
            raise ValueError(f"patch grid {self.grid} is not a multiple of pixel_shuffle {pixel_shuffle}")
        self.pixel_shuffle = pixel_shuffle
        self.patch_embed = conv_stem_embed(patch_size, dim) if conv_stem else nn.Conv2d(3, dim, patch_size, patch_size)
        self.pos_embed = nn.Parameter(torch.randn(1, self.grid * self.grid, dim) * 0.02)
        self.blocks = nn.ModuleList([ViTBlock(dim, heads, mlp_dim or 4 * dim, norm_eps) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=norm_eps)
        self.out_dim = dim * pixel_shuffle**2
        self.num_tokens = (self.grid // pixel_shuffle) ** 2

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos_embed, std=0.02)

    @classmethod
    def from_config(cls, cfg) -> VisionTransformer:
        """The per-camera encoder a policy config describes (its ``image_size`` and ``vit_*`` / ``pixel_shuffle``
        fields, shared by pi0.5 and GR00T)."""
        return cls(cfg.image_size, cfg.vit_patch_size, cfg.vit_dim, cfg.vit_depth, cfg.vit_heads,
                   mlp_dim=cfg.vit_mlp_dim, pixel_shuffle=cfg.pixel_shuffle, conv_stem=cfg.vit_conv_stem,
                   norm_eps=cfg.vit_norm_eps)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: float [N, 3, H, W] in [-1, 1] -> tokens [N, num_tokens, out_dim]."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.pixel_shuffle > 1:
            n, _, d = x.shape
            r, g = self.pixel_shuffle, self.grid
            x = x.view(n, g // r, r, g // r, r, d).permute(0, 1, 3, 2, 4, 5).reshape(n, (g // r) ** 2, r * r * d)
        return x


FP8_MIN_FEATURES = 1024
"""Below this width an FP8 GEMM gains less than its casts cost."""


def fp8_eligible(module: nn.Module, excluded_prefixes: tuple[str, ...], name: str,
                 excluded_suffixes: tuple[str, ...] = (), min_features: int | None = None) -> bool:
    """The rule both policies' FP8 filters share: an ``nn.Linear`` not excluded by name, both dimensions multiples
    of 16 (the FP8 GEMM's tile constraint) and at least ``min_features`` (default ``FP8_MIN_FEATURES``) wide.
    Tests lower ``min_features`` to convert a tiny policy; the exclusions by name hold at every width."""
    if not isinstance(module, nn.Linear) or name.startswith(excluded_prefixes) or name.endswith(excluded_suffixes):
        return False
    floor = FP8_MIN_FEATURES if min_features is None else min_features
    out_features, in_features = module.weight.shape
    return in_features % 16 == 0 and out_features % 16 == 0 and min(in_features, out_features) >= floor

