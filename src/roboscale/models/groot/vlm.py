"""GR00T N1.5's vision-language backbone, Eagle 2.5 style, over packed token streams.

- a SigLIP-style ViT per camera image (``layers.VisionTransformer``), optional pixel shuffle, and an MLP
  projector to the language model's width (Eagle's ``mlp1``);
- a Qwen3-style decoder (RMSNorm, RoPE, grouped-query attention with per-head q/k RMSNorm, SwiGLU), causal,
  truncated to ``llm_layers`` layers: the normed hidden states of the last kept layer are the VL tokens
  (GR00T keeps 12 of Qwen3-1.7B's 28 layers and reads ``hidden_states[12]``).

Weights are laid out as Hugging Face's Qwen3 except for the norms: ``layers.RMSNorm`` stores its scale as an
offset from 1 (Gemma's convention), so a Qwen3 norm weight w loads as w - 1.

Every sample is one segment of a flat token stream ``[T, W]`` described by a ``VLLayout`` (flash-attention's
``cu_seqlens`` convention). A *packed* stream holds only real tokens; a *padded* stream gives each sample a row
of the same length whose tail is a separate padding segment that nothing real attends to. Attention goes through
``attention.varlen_attention``, so both layouts compute the same numbers for the real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from roboscale.models.attention import varlen_attention
from roboscale.models.groot.config import GrootConfig
from roboscale.models.layers import GatedMLP, RMSNorm, VisionTransformer, apply_rotary, rotary_tables


@dataclass
class VLLayout:
    """Segments of a flat VL token stream.

    ``cu_seqlens`` [S + 1] bounds segments of the stream; ``is_sample`` [S] tells a sample's segment (True) from a
    padding segment (False, padded layout only); sample ``i`` is the ``i``-th sample segment. ``position_ids`` [T]
    restart at 0 in every segment.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    is_sample: torch.Tensor
    backend: str = "auto"  # the varlen_attention backend of every attention over this stream
    sample_seeds: torch.Tensor | None = None
    """The samples' seeds (int64 [B], the loader's ``sample_seed``) for per-sample dropout masks (set while
    training; None: ``SampleDropout`` falls back to the process's RNG)."""

    def stream_dropout_keys(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(seed, position within its sample) of every token of the stream [T], for ``SampleDropout``. A padding
        segment borrows the seed of the sample before it (nothing real reads its tokens)."""
        if self.sample_seeds is None:
            return None
        segment_sample = (self.is_sample.to(torch.int64).cumsum(0) - 1).clamp_min(0)
        seeds = self.sample_seeds[segment_sample.to(self.sample_seeds.device)]
        return torch.repeat_interleave(seeds, self.cu_seqlens.diff().to(seeds.device)), self.position_ids

    def row_dropout_keys(self, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(seed [B, 1], position [1, length]) for rows [B, length, D] (sample i = row i), for ``SampleDropout``."""
        if self.sample_seeds is None:
            return None
        seeds = self.sample_seeds
        return seeds[:, None], torch.arange(length, device=seeds.device)[None]

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor, padded: bool = False) -> VLLayout:
        """Packed: segments of ``lengths`` back to back. Padded: each sample a row of ``max(lengths)`` tokens,
        real tokens first, the row's tail a padding segment."""
        lengths = lengths.to(torch.int64).cpu()
        if padded:
            row = int(lengths.max())
            seg = torch.stack([lengths, row - lengths], dim=1).flatten()  # real, pad, real, pad, ...
            is_sample = torch.tensor([True, False] * len(lengths))
            keep = seg > 0
            seg, is_sample = seg[keep], is_sample[keep]
        else:
            seg, is_sample = lengths, torch.ones(len(lengths), dtype=torch.bool)
        cu = torch.zeros(len(seg) + 1, dtype=torch.int32)
        cu[1:] = seg.cumsum(0)
        starts = torch.repeat_interleave(cu[:-1].to(torch.int64), seg)
        positions = torch.arange(int(cu[-1])) - starts
        return cls(cu, int(seg.max()), positions, is_sample)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def sample_tokens(self) -> int:
        """Tokens of sample segments: the stream without its padding."""
        return int(self.cu_seqlens.diff().cpu()[self.is_sample].sum())

    def query_cu_seqlens(self, queries_per_sample: int) -> tuple[torch.Tensor, int]:
        """cu_seqlens for ``queries_per_sample`` query rows per sample attending to this stream (padding segments
        get no queries), for ``varlen_attention(q [B * n, H, D], k/v from this stream, ...)``."""
        counts = self.is_sample.to(torch.int32) * queries_per_sample
        cu = torch.zeros(len(counts) + 1, dtype=torch.int32)
        cu[1:] = counts.cumsum(0)
        return cu, queries_per_sample

    def to(self, device: torch.device) -> VLLayout:
        """Tensors the attention kernels read on ``device`` (flash-attention wants cu_seqlens there)."""
        seeds = self.sample_seeds.to(device) if self.sample_seeds is not None else None
        return VLLayout(self.cu_seqlens.to(device), self.max_seqlen, self.position_ids.to(device), self.is_sample,
                        self.backend, seeds)


def pack_tokens(tokens: torch.Tensor, mask: torch.Tensor, padded: bool) -> tuple[torch.Tensor, VLLayout]:
    """Left-aligned per-sample tokens [B, L, W] with mask [B, L] -> (flat stream [T, W], layout)."""
    lengths = mask.sum(1)
    if padded:
        row = int(lengths.max())
        return tokens[:, :row].flatten(0, 1), VLLayout.from_lengths(lengths, padded=True).to(tokens.device)
    return tokens[mask], VLLayout.from_lengths(lengths).to(tokens.device)


def rotate_stream(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on a flat stream x [T, H, D] with tables [T, D] (``layers.apply_rotary`` wants [B, H, L, D])."""
    cos, sin = rope
    return apply_rotary(x.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)


class Qwen3Layer(nn.Module):
    """Pre-norm decoder layer: GQA with q/k RMSNorm per head (Qwen3's addition over Qwen2), SwiGLU MLP."""

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, mlp_dim: int):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"llm_heads {heads} must be a multiple of llm_kv_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_norm = RMSNorm(width)
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)
        self.post_norm = RMSNorm(width)
        self.mlp = GatedMLP(width, mlp_dim, activation="silu")

    def forward(self, x: torch.Tensor, rope, layout: VLLayout) -> torch.Tensor:
        t = x.shape[0]
        h = self.input_norm(x)
        q = rotate_stream(self.q_norm(self.q_proj(h).view(t, self.heads, self.head_dim)), rope)
        k = rotate_stream(self.k_norm(self.k_proj(h).view(t, self.kv_heads, self.head_dim)), rope)
        v = self.v_proj(h).view(t, self.kv_heads, self.head_dim)
        cu, n = layout.cu_seqlens, layout.max_seqlen
        attn = varlen_attention(q, k, v, cu, cu, n, n, causal=True, backend=layout.backend)
        x = x + self.o_proj(attn.flatten(1))
        return x + self.mlp(self.post_norm(x))


class EagleVLM(nn.Module):
    """ViT + projector + truncated Qwen3 decoder. ``forward`` -> VL tokens [T, W] (a flat stream) and layout."""

    def __init__(self, cfg: GrootConfig):
        super().__init__()
        self.cfg = cfg
        self.vision = VisionTransformer.from_config(cfg)
        d, w = self.vision.out_dim, cfg.llm_width
        # Eagle's mlp1: 2 layers = LayerNorm, Linear, GELU, Linear (with pixel shuffle); 1 layer = one Linear.
        self.projector = (
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, w), nn.GELU(), nn.Linear(w, w))
            if cfg.projector_layers == 2
            else nn.Sequential(nn.Linear(d, w))
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, w)
        self.layers = nn.ModuleList(
            [
                Qwen3Layer(w, cfg.llm_heads, cfg.llm_kv_heads, cfg.llm_head_dim, cfg.llm_mlp_dim)
                for _ in range(cfg.llm_layers)
            ]
        )
        self.norm = RMSNorm(w)  # HF's last hidden_states entry is after the final norm; GR00T reads that one

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_tokens

    def image_tokens(self, images: torch.Tensor, batch_size: int) -> torch.Tensor:
        """images [B * n_cam, 3, S, S] in [-1, 1] -> [B, n_cam * tokens_per_image, W]."""
        return self.projector(self.vision(images)).reshape(batch_size, -1, self.cfg.llm_width)

    def forward(
        self, images: torch.Tensor, ids: torch.Tensor, lang_mask: torch.Tensor, padded: bool = False
    ) -> tuple[torch.Tensor, VLLayout]:
        """images [B * n_cam, 3, S, S]; ids/lang_mask [B, L] right-padded -> (VL stream [T, W], layout).

        A sample's sequence is [its camera tokens, its instruction tokens] (Eagle puts images before the text in
        its chat template), attended causally."""
        b = ids.shape[0]
        img = self.image_tokens(images, b)
        tokens = torch.cat([img, self.embed_tokens(ids)], dim=1)
        mask = torch.cat([lang_mask.new_ones(b, img.shape[1]), lang_mask], dim=1).bool()
        x, layout = pack_tokens(tokens, mask, padded)
        layout.backend = self.cfg.attention_backend
        rope = rotary_tables(layout.position_ids[None], self.cfg.llm_head_dim, base=self.cfg.rope_theta)
        rope = (rope[0][0], rope[1][0])
        for layer in self.layers:
            x = layer(x, rope, layout)
        return self.norm(x), layout
