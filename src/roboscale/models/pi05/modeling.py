"""A pi0.5-style vision-language-action policy.

Structure (as openpi / LeRobot pi0.5, scaled by config):
- a SigLIP-style ViT encodes each camera; a linear projector maps its tokens to the language model's width;
- a Gemma-style decoder (RMSNorm, RoPE, GeGLU, multi-query attention) runs over the prefix
  [image tokens, state token, language tokens], bidirectionally;
- an action expert (same depth and head layout, narrower) runs over the action tokens *layer by layer jointly*
  with the prefix: in each layer the action tokens attend to the prefix keys/values of that layer and to
  themselves; its norms are adaRMSNorms conditioned on the flow-matching time;
- flow matching on the action chunk (pi0's convention, t = 1 is noise); inference caches the prefix keys/values
  once and runs only the action expert for each of the Euler steps.

Units for FSDP, activation checkpointing and torch.compile: one ``JointLayer`` holds a layer of both towers and
runs both in its ``forward`` (the prefix pass, then the action pass over that layer's prefix keys/values). The
action tokens of layer i read only layer i's prefix keys/values, and layer i + 1's prefix reads only layer i's
prefix, so running the towers layer by layer computes exactly what all-prefix-then-all-actions computes, and one
all-gather of a layer's weights serves both passes (grouping by tower would gather every layer twice per step).
At inference the prefix passes run once per observation (``encode(cache=True)``) and each Euler step runs the
action passes against the cache.

Batches are ``PackedBatch``es (``roboscale.batching``, laid out by ``roboscale.models.pi05.layout``): with ``packing`` on, all samples share one flat token
stream (no empty camera slots, no language padding) and attention is two segment-aware calls per layer (prefix
varlen self-attention; actions over [their prefix, themselves]) on the configured backend; with it off, one
padded row per sample and key-padding masks. ``forward`` also takes LeRobot-style dict batches (collated here).

Departure from pi0.5, on purpose: the state enters as one continuous token (a linear projection, as in pi0.5's
MEM variant) instead of 256-bin digits written into the prompt. With a tokenizer trained on a few task strings
and a few thousand frames, digit tokens would have to learn numeracy from scratch; the projection does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from roboscale.batching import PackedBatch
from roboscale.errors import ConfigError
from roboscale.models.attention import (
    BACKENDS,
    PrefixSuffixLayout,
    pick_backend,
    prefix_attention,
    suffix_attention,
    varlen_attention,
)
from roboscale.models.flops import SampleFlops, attention_flops, linear_flops, sample_flops, vit_flops
from roboscale.models.flow_matching import FlowMatching
from roboscale.models.layers import (
    AdaRMSNorm,
    GatedMLP,
    RMSNorm,
    VisionTransformer,
    fp8_eligible,
    rotary_tables,
    sinusoidal_embedding,
)
from roboscale.models.normalize import Normalizer
from roboscale.models.pi05.config import STATE_INPUTS, Pi05Config
from roboscale.models.pi05.layout import PackCollate, PrefixSpec
from roboscale.models.pi05.transform import Pi05Transform
from roboscale.models.value import segment_means
from roboscale.models.policy import Encoded, Policy
from roboscale.models.tokenizer import TaskTokenizer
from roboscale.utils.images import signed_unit_images


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of q or k [R, L, heads, Dh] by tables [R, L, Dh] (rotate-half, as layers.apply_rotary;
    this model keeps heads after tokens so packed streams need no transposes)."""
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@dataclass
class Pi05Layout:
    """Where every sample's tokens are, resolved once per batch and shared by all layers and Euler steps.

    Packed: the prefix is one flat stream ``[1, T]``; prefix attention is a varlen call over ``cu_prefix``;
    suffix queries of sample i attend to the stream ``kv_index`` gathers from [prefix keys, suffix keys]:
    [prefix_i, suffix_i] for every i, described by ``cu_suffix_k``. Padded: one sample per row, key-padding masks.
    """

    packed: bool
    backend: str
    """Resolved attention backend (never "auto")."""
    positions: torch.Tensor
    """long [R, L]: prefix position ids."""
    seq_lens: torch.Tensor
    """long [B]: real prefix tokens per sample (the first suffix position)."""
    suffix_len: int
    padded: PrefixSuffixLayout | None = None
    cu_prefix: torch.Tensor | None = None
    max_prefix: int = 0
    cu_suffix_q: torch.Tensor | None = None
    cu_suffix_k: torch.Tensor | None = None
    max_suffix_k: int = 0
    kv_index: torch.Tensor | None = None

    def suffix_positions(self) -> torch.Tensor:
        """long [B, S]: the action tokens continue the positions of their own sample's prefix."""
        steps = torch.arange(self.suffix_len, device=self.seq_lens.device)
        return self.seq_lens[:, None] + steps[None]

    def prefix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Prefix self-attention. q: [R, L, H, D]; k, v: [R, L, Hkv, D] -> [R, L, H, D]."""
        if self.packed:
            out = varlen_attention(
                q[0], k[0], v[0], self.cu_prefix, self.cu_prefix, self.max_prefix, self.max_prefix,
                backend=self.backend,
            )
            return out[None]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return prefix_attention(q, k, v, self.padded, backend=self.backend).transpose(1, 2)

    def suffix(self, q, prefix_k, prefix_v, suffix_k, suffix_v) -> torch.Tensor:
        """Suffix queries [B, S, H, D] over their sample's [prefix keys, suffix keys] -> [B, S, H, D]."""
        if self.packed:
            b, s = q.shape[:2]
            k = torch.cat([prefix_k[0], suffix_k.flatten(0, 1)])[self.kv_index]
            v = torch.cat([prefix_v[0], suffix_v.flatten(0, 1)])[self.kv_index]
            out = varlen_attention(
                q.flatten(0, 1), k, v, self.cu_suffix_q, self.cu_suffix_k, s, self.max_suffix_k, backend=self.backend
            )
            return out.view(b, s, *out.shape[1:])
        q, pk, pv, sk, sv = (t.transpose(1, 2) for t in (q, prefix_k, prefix_v, suffix_k, suffix_v))
        return suffix_attention(q, pk, pv, sk, sv, self.padded, backend=self.backend).transpose(1, 2)


def build_layout(
    batch: PackedBatch, backend: str, device: torch.device, dtype: torch.dtype, head_dim: int
) -> Pi05Layout:
    """The attention layout of a PackedBatch (index arithmetic on the CPU copies; one small transfer)."""
    if backend not in BACKENDS:
        raise ConfigError(f"policy.attention_backend: {backend!r} is not one of {list(BACKENDS)}")
    s = batch.suffix_len
    seq_lens = batch.seq_lens.cpu()
    common = dict(positions=batch.position_ids.to(device), seq_lens=seq_lens.to(device), suffix_len=s)
    if not batch.packed:
        # Padded rows: key-padding masks (or the materialised mask for the dense/eager references).
        resolved = backend if backend in ("dense", "eager") else "sdpa"
        return Pi05Layout(False, resolved, padded=PrefixSuffixLayout(batch.valid.to(device)), **common)
    if batch.rows != 1:
        raise ValueError(f"a packed batch has one row, this one has {batch.rows}")
    if backend == "auto":
        backend = pick_backend(device, dtype, torch.is_grad_enabled(), head_dim)
    b = batch.num_samples
    total = batch.row_len
    lens_k = seq_lens + s
    cu_k = torch.zeros(b + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(lens_k, 0)
    seg = torch.repeat_interleave(torch.arange(b), lens_k)
    pos = torch.arange(int(cu_k[-1])) - cu_k[:-1].long()[seg]
    in_prefix = pos < seq_lens[seg]
    kv_index = torch.where(in_prefix, batch.sample_offsets.cpu()[seg] + pos, total + seg * s + (pos - seq_lens[seg]))
    cu_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    # varlen wants int32 boundaries on the GPU; the other backends read them on the host (no device sync).
    where = device if backend == "varlen" else torch.device("cpu")
    return Pi05Layout(
        True,
        backend,
        cu_prefix=batch.cu_seqlens.to(where, torch.int32),
        max_prefix=int(seq_lens.max()),
        cu_suffix_q=cu_q.to(where),
        cu_suffix_k=cu_k.to(where),
        max_suffix_k=int(lens_k.max()),
        kv_index=kv_index.to(device),
        **common,
    )


class JointLayer(nn.Module):
    """One layer of the prefix model and the action expert, sharing one attention.

    The last layer needs no prefix output (nothing reads it), so ``prefix_output=False`` leaves out its prefix
    q_proj, o_proj and MLP (only its keys/values are used, by the action tokens): no dead parameters (LeRobot's
    pi0.5 carries a dead 263M lm_head for the same reason).
    """

    def __init__(self, cfg: Pi05Config, prefix_output: bool = True):
        super().__init__()
        h, kv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, dh
        # Prefix (VLM) stream.
        self.input_norm = RMSNorm(cfg.width)
        self.k_proj = nn.Linear(cfg.width, kv * dh, bias=False)
        self.v_proj = nn.Linear(cfg.width, kv * dh, bias=False)
        self.prefix_output = prefix_output
        if prefix_output:
            self.q_proj = nn.Linear(cfg.width, h * dh, bias=False)
            self.o_proj = nn.Linear(h * dh, cfg.width, bias=False)
            self.post_norm = RMSNorm(cfg.width)
            self.mlp = GatedMLP(cfg.width, cfg.mlp_dim)
        # Action expert stream.
        ew = cfg.expert_width
        self.expert_input_norm = AdaRMSNorm(ew, ew)
        self.expert_q_proj = nn.Linear(ew, h * dh, bias=False)
        self.expert_k_proj = nn.Linear(ew, kv * dh, bias=False)
        self.expert_v_proj = nn.Linear(ew, kv * dh, bias=False)
        self.expert_o_proj = nn.Linear(h * dh, ew, bias=False)
        self.expert_post_norm = AdaRMSNorm(ew, ew)
        self.expert_mlp = GatedMLP(ew, cfg.expert_mlp_dim)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.unflatten(-1, (heads, self.head_dim))  # [R, L, heads, Dh]

    def forward(self, prefix, suffix, cond, prefix_rope, suffix_rope, layout: Pi05Layout, kv=None):
        """This layer of both towers: prefix [R, L, W] (None when ``kv`` holds its cached keys/values), actions
        [B, S, We] (None while encoding) -> (next prefix, next actions, this layer's prefix (k, v))."""
        if kv is None:
            prefix, k, v = self.prefix_pass(prefix, prefix_rope, layout)
        else:
            k, v = kv
        if suffix is not None:
            suffix = self.suffix_pass(suffix, cond, suffix_rope, k, v, layout)
        return prefix, suffix, (k, v)

    def prefix_pass(self, h, rope, layout: Pi05Layout):
        """Prefix stream of this layer: h [R, L, W] -> (next prefix hidden or None, this layer's k, v)."""
        x = self.input_norm(h)
        k = _rotary(self._split(self.k_proj(x), self.kv_heads), *rope)
        v = self._split(self.v_proj(x), self.kv_heads)
        if not self.prefix_output:
            return None, k, v
        q = _rotary(self._split(self.q_proj(x), self.heads), *rope)
        attn = layout.prefix(q, k, v)
        h = h + self.o_proj(attn.flatten(2))
        h = h + self.mlp(self.post_norm(h))
        return h, k, v

    def suffix_pass(self, h, cond, rope, prefix_k, prefix_v, layout: Pi05Layout):
        """Action-expert stream [B, S, We]: attends to this layer's prefix k/v of its sample and to itself."""
        x, gate = self.expert_input_norm(h, cond)
        q = _rotary(self._split(self.expert_q_proj(x), self.heads), *rope)
        k = _rotary(self._split(self.expert_k_proj(x), self.kv_heads), *rope)
        v = self._split(self.expert_v_proj(x), self.kv_heads)
        attn = layout.suffix(q, prefix_k, prefix_v, k, v)
        h = h + gate * self.expert_o_proj(attn.flatten(2))
        x, gate = self.expert_post_norm(h, cond)
        return h + gate * self.expert_mlp(x)


@dataclass
class Pi05Encoded(Encoded):
    batch: PackedBatch | None = None
    prefix: torch.Tensor | None = None
    """[R, L, W] prefix embeddings (before the layers)."""
    layout: Pi05Layout | None = None
    cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    """Per layer, the prefix keys/values (inference: computed once per observation)."""


# top-level module -> the component name users know (joint layers are split into their two towers)
COMPONENTS = {
    "vision": "vision encoder (ViT)",
    "projector": "image projector",
    "embed_tokens": "token embeddings",
    "state_proj": "state projection",
    "action_in_proj": "action expert in/out + time MLP",
    "action_out_proj": "action expert in/out + time MLP",
    "time_mlp": "action expert in/out + time MLP",
    "expert_norm": "action expert layers",
}


class Pi05Policy(Policy):
    name = "pi05"

    def __init__(self, config: Pi05Config, tokenizer: TaskTokenizer | None = None):
        super().__init__(config, tokenizer)
        cfg = config
        if cfg.state_input not in STATE_INPUTS:
            raise ConfigError(f"policy.state_input: {cfg.state_input!r} is not one of {sorted(STATE_INPUTS)}")
        if cfg.attention_backend not in BACKENDS:
            raise ConfigError(f"policy.attention_backend: {cfg.attention_backend!r} is not one of {list(BACKENDS)}")
        self.vision = VisionTransformer.from_config(cfg)
        self.projector = nn.Linear(self.vision.out_dim, cfg.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        if cfg.state_input == "token":
            self.state_proj = nn.Linear(cfg.state_dim, cfg.width)
        self.layers = nn.ModuleList(
            [JointLayer(cfg, prefix_output=i < cfg.depth - 1) for i in range(cfg.depth)]
        )
        ew = cfg.expert_width
        self.action_in_proj = nn.Linear(cfg.action_dim, ew)
        self.time_mlp = nn.Sequential(nn.Linear(ew, ew), nn.SiLU(), nn.Linear(ew, ew), nn.SiLU())
        self.expert_norm = AdaRMSNorm(ew, ew)
        self.action_out_proj = nn.Linear(ew, cfg.action_dim)
        # a dataset narrower than the state/action sizes (a checkpoint's padded maxima) is zero-padded to them
        self.state_normalizer = Normalizer(cfg.state_dim, cfg.state_norm, data_dim=cfg.dataset_state_dim)
        self.action_normalizer = Normalizer(cfg.action_dim, cfg.action_norm, data_dim=cfg.dataset_action_dim)
        self.add_value_head(cfg.width)

    @property
    def flow_matching(self) -> FlowMatching:
        return FlowMatching(data_at=0, time_alpha=self.config.time_beta_alpha)

    def features(self, encoded: Pi05Encoded) -> torch.Tensor:
        """The mean of each sample's prefix embeddings (its image tokens, state and prompt as embedded)."""
        layout, prefix = encoded.layout, encoded.prefix
        if layout.packed:
            return segment_means(prefix[0], layout.cu_prefix)
        real = (torch.arange(prefix.shape[1], device=prefix.device)[None] < layout.seq_lens[:, None]).to(prefix.dtype)
        return (prefix * real[..., None]).sum(1) / real.sum(1, keepdim=True).clamp_min(1)

    def parallel_units(self) -> list[nn.Module]:
        return [*self.vision.blocks, *self.layers]

    # the state token is part of the prefix; a joint layer's expert_* weights are the action expert's
    flops_components: ClassVar[dict[str, str]] = {"vision": "vision", "projector": "vision", "embed_tokens": "language",
                        "state_proj": "language", "layers": "language", "action_in_proj": "action",
                        "time_mlp": "action", "expert_norm": "action", "action_out_proj": "action",
                        "value_head": "action"}

    def flops_component_of(self, parameter_name: str) -> str:
        if parameter_name.startswith("layers.") and ".expert_" in parameter_name:
            return "action"
        return super().flops_component_of(parameter_name)

    @staticmethod
    def component_of(parameter_name: str) -> str:
        top = parameter_name.split(".")[0]
        if top == "layers":
            return "action expert layers" if ".expert_" in parameter_name else "language model layers"
        return COMPONENTS.get(top, top)

    def parameter_note(self, total: int) -> str:
        """How our count relates to LeRobot's ``num_learnable_params`` for the same architecture."""
        cfg = self.config
        last_layer = 2 * cfg.width * cfg.num_heads * cfg.head_dim + 3 * cfg.width * cfg.mlp_dim + cfg.width
        lm_head = cfg.vocab_size * cfg.expert_width
        return (
            f"Not built, because nothing reads them: the last language-model layer's query/output projections\n"
            f"and MLP ({last_layer / 1e6:.1f} M, which LeRobot computes and discards) and the action expert's\n"
            f"lm_head ({lm_head / 1e6:.1f} M in LeRobot). Counted LeRobot's way: {(total + last_layer) / 1e9:.3f} B "
            f"without the lm_head, {(total + last_layer + lm_head) / 1e9:.3f} B with it."
        )

    # --- data -----------------------------------------------------------------------------------------------
    def prefix_spec(self) -> PrefixSpec:
        cfg = self.config
        return PrefixSpec(
            tokens_per_image=self.vision.num_tokens,
            extra_tokens=1 if cfg.state_input == "token" else 0,
            suffix_tokens=cfg.chunk_size,
            pad_language_to=cfg.pad_language_to,
        )

    def data_transforms(self) -> tuple[Pi05Transform, PackCollate]:
        """``(transform, collate)`` for the loader's workers: per-sample normalization + tokenization, then packing
        into a PackedBatch (``config.packing``) or padding (one sample per row). Both are picklable."""
        transform = Pi05Transform(self.config, self.state_normalizer, self.action_normalizer, self.tokenizer)
        collate = PackCollate(self.prefix_spec(), packed=self.config.packing, budget=self.config.pack_token_budget,
                              require_every_camera=self.config.missing_cameras == "error")
        return transform, collate

    def as_packed_batch(self, batch: dict[str, Any] | PackedBatch) -> PackedBatch:
        """A PackedBatch on this policy's device: collated from a LeRobot-style dict batch if needed."""
        if not isinstance(batch, PackedBatch):
            transform, collate = self.data_transforms()
            batch = collate(transform.from_batch(batch))
        device = self.action_out_proj.weight.device
        return batch.to(device) if batch.state.device != device else batch

    # --- inputs ---------------------------------------------------------------------------------------------
    def _prepare_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 (or [0, 1] float) [N, 3, H, W] -> float [N, 3, S, S] in [-1, 1], shifted when training asks."""
        images = signed_unit_images(images, self.config.image_size)
        if self.training and self.config.random_shift > 0:
            images = random_shift(images, self.config.random_shift)
        return images

    def embed_prefix(self, batch: PackedBatch) -> tuple[torch.Tensor, Pi05Layout]:
        """Prefix embeddings [R, L, W] (gathered from the bank the PackedBatch indexes) and the attention layout."""
        cfg = self.config
        spec = self.prefix_spec()
        if (batch.tokens_per_image, batch.extra_tokens) != (spec.tokens_per_image, spec.extra_tokens):
            raise ValueError(
                f"batch was collated for {batch.tokens_per_image} tokens per image and {batch.extra_tokens} state "
                f"tokens, this policy makes {spec.tokens_per_image} and {spec.extra_tokens}; collate with "
                "policy.data_transforms() of this policy"
            )
        parts = []
        if batch.images.shape[0]:
            image_tokens = self.projector(self.vision(self._prepare_images(batch.images)))
            parts.append(image_tokens.flatten(0, 1))
        if cfg.state_input == "token":
            parts.append(self.state_proj(batch.state.float()))
        parts.append(self.embed_tokens(batch.tokens) * (cfg.width**0.5))  # Gemma scales embeddings by sqrt(width)
        parts.append(parts[-1].new_zeros(1, cfg.width))  # the row padding points at
        bank = torch.cat(parts)
        tokens = bank[batch.prefix_index]
        layout = build_layout(batch, cfg.attention_backend, tokens.device, self._compute_dtype(tokens), cfg.head_dim)
        return tokens, layout

    @staticmethod
    def _compute_dtype(x: torch.Tensor) -> torch.dtype:
        device = x.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return x.dtype

    def _time_condition(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(sinusoidal_embedding(t, self.config.expert_width))

    # --- model ----------------------------------------------------------------------------------------------
    def encode(self, batch: dict[str, Any] | PackedBatch, *, cache: bool = False) -> Pi05Encoded:
        batch = self.as_packed_batch(batch)
        actions = mask = None
        if batch.actions is not None and not cache:  # an observation's actions (a dataset row) are not targets
            if batch.actions.shape[1] != batch.suffix_len:
                raise ValueError(
                    f"batch has {batch.actions.shape[1]} actions per sample, the policy predicts chunks of "
                    f"{batch.suffix_len}; set policy.chunk_size to match the loader's action window"
                )
            actions = batch.actions.float()
            if self.config.action_loss_mask and batch.actions_is_pad is not None:
                mask = ~batch.actions_is_pad.bool()
        prefix, layout = self.embed_prefix(batch)
        encoded = Pi05Encoded(batch.num_samples, actions, mask, batch.real_tokens, batch.computed_tokens, batch,
                              prefix, layout)
        if cache:
            rope = rotary_tables(layout.positions, self.config.head_dim)
            encoded.cache = []
            for layer in self.layers:
                prefix, _, kv = layer(prefix, None, None, rope, None, layout)
                encoded.cache.append(kv)
        return encoded

    def velocity(self, encoded: Pi05Encoded, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        layout = encoded.layout
        cond = self._time_condition(t)
        h = self.action_in_proj(x_t)
        suffix_rope = rotary_tables(layout.suffix_positions(), self.config.head_dim)
        if encoded.cache is not None:
            for layer, kv in zip(self.layers, encoded.cache, strict=True):
                _, h, _ = layer(None, h, cond, None, suffix_rope, layout, kv=kv)
        else:
            prefix, prefix_rope = encoded.prefix, rotary_tables(layout.positions, self.config.head_dim)
            for layer in self.layers:
                prefix, h, _ = layer(prefix, h, cond, prefix_rope, suffix_rope, layout)
        h, _ = self.expert_norm(h, cond)
        return self.action_out_proj(h)


# The Linear layers FP8 training leaves in full precision: the vision stem and the projector into the language
# model, the first and last layers of the flow (the action in/out projections and the time MLP: their error reaches
# the actions unfiltered) and the adaRMSNorm modulations (one row per sample: nothing to gain, and their error
# scales every token of a layer); the shared rule (``fp8_eligible``) leaves out narrow and misaligned layers.
_FP8_EXCLUDED = ("vision.patch_embed", "projector", "state_proj", "action_in_proj", "action_out_proj", "time_mlp",
                 "embed_tokens")
_FP8_EXCLUDED_SUFFIXES = ("norm.modulation",)


def fp8_filter(name: str, module: nn.Module, min_features: int | None = None) -> bool:
    """True for the Linear layers FP8 training converts (see ``_FP8_EXCLUDED``); ``min_features`` lowers the width
    floor (tests of tiny policies)."""
    return fp8_eligible(module, _FP8_EXCLUDED, name, _FP8_EXCLUDED_SUFFIXES, min_features)


def flops_per_sample(cfg: Pi05Config) -> SampleFlops:
    """FLOPs of one training sample at the config's nominal size (every camera slot filled, the prompt at
    ``max_language_tokens``, one ``chunk_size`` action chunk) by component: "vision" (ViT and projector),
    "language" (the prefix tower), "action" (the action expert, its in/out projections and time MLP). Every
    component trains (``roboscale.models.flops`` has the rule)."""
    if not cfg.image_keys:
        raise ConfigError("policy.image_keys is empty: FLOPs per sample need the cameras (set --policy.image_keys)")
    cams, w, ew, s = len(cfg.image_keys), cfg.width, cfg.expert_width, cfg.chunk_size
    h, kv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    image_tokens = (cfg.image_size // cfg.vit_patch_size // cfg.pixel_shuffle) ** 2
    vit_linear, vit_attention = vit_flops(cfg)
    projector = linear_flops(image_tokens, cfg.vit_dim * cfg.pixel_shuffle**2, w)
    state_token = cfg.state_input == "token"
    prefix = cams * image_tokens + int(state_token) + cfg.max_language_tokens
    # every layer projects prefix keys/values (the action tokens read them); the last has no queries, output or MLP
    kv_proj = 2 * linear_flops(prefix, w, kv * dh)
    full_layer = kv_proj + 2 * linear_flops(prefix, w, h * dh) + 3 * linear_flops(prefix, w, cfg.mlp_dim)
    language = (linear_flops(1, cfg.state_dim, w) if state_token else 0) + (cfg.depth - 1) * full_layer + kv_proj
    # the action expert: two adaRMSNorm modulations per layer and the time MLP run once per sample, not per token
    expert_layer = (2 * linear_flops(1, ew, 3 * ew) + 2 * linear_flops(s, ew, h * dh) + 2 * linear_flops(s, ew, kv * dh)
                    + 3 * linear_flops(s, ew, cfg.expert_mlp_dim))
    action = (linear_flops(s, cfg.action_dim, ew) + 2 * linear_flops(1, ew, ew) + cfg.depth * expert_layer
              + linear_flops(1, ew, 3 * ew) + linear_flops(s, ew, cfg.action_dim))
    return sample_flops([
        ("vision", cams * (vit_linear + projector), cams * vit_attention, True),
        ("language", language, (cfg.depth - 1) * attention_flops(prefix, prefix, h, dh), True),
        ("action", action, cfg.depth * attention_flops(s, prefix + s, h, dh), True),
    ], tokens=prefix + s)


def random_shift(images: torch.Tensor, pad: int) -> torch.Tensor:
    """Translate each image by a random integer offset in [-pad, pad] with edge padding (DrQ's augmentation)."""
    n, c, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad), mode="replicate")
    dy = torch.randint(0, 2 * pad + 1, (n,), device=images.device)
    dx = torch.randint(0, 2 * pad + 1, (n,), device=images.device)
    rows = (dy[:, None] + torch.arange(h, device=images.device)[None])  # [N, H]
    cols = (dx[:, None] + torch.arange(w, device=images.device)[None])  # [N, W]
    padded = padded.gather(2, rows[:, None, :, None].expand(n, c, h, w + 2 * pad))
    return padded.gather(3, cols[:, None, None, :].expand(n, c, h, w))
