"""A GR00T N1.5-style vision-language-action policy.

Structure (as NVIDIA's GR00T N1.5 / LeRobot 0.5.1, scaled by config):
- ``groot.vlm``: an Eagle 2.5-style VLM (SigLIP-style ViT, MLP projector, Qwen3-style decoder truncated to
  ``llm_layers``) whose last kept layer's normed hidden states are the VL tokens; frozen by GR00T's fine-tuning
  recipe (``tune_llm`` / ``tune_visual``);
- ``groot.head``: the flow-matching action head (VL LayerNorm + self-attention, per-embodiment state/action
  encoders and action decoder, a DiT alternating cross-attention to the VL tokens and self-attention, adaLN on
  the flow timestep);
- flow matching in GR00T's convention (``FlowMatching(data_at=1)``: t = 0 is noise, t = 1 the actions; t = (s - u)
  / s with u ~ Beta(1.5, 1) and s = 0.999, so more samples near the noise end; inference integrates 4 Euler
  steps from t = 0 to 1). ``velocity`` discretizes t into 1000 buckets for the timestep embeddings.

``encode`` runs the VLM, the VL LayerNorm and self-attention and the state encoder once per batch or observation;
``velocity`` runs the action encoder, the DiT and the decoder for each flow time. The VL tokens of a batch travel
as one flat stream with ``cu_seqlens`` (``packed``, the default: no padding) or as one padded row per sample;
attention uses ``attention.varlen_attention`` so both give the same results.

Units for FSDP, activation checkpointing and torch.compile (``parallel_units``): the ViT blocks, the language
model's layers, the VL self-attention blocks and the DiT blocks. Each does all its work in its ``forward``: a
cross-attending DiT block projects the VL features to its own keys/values, so its weights are gathered once
for the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from roboscale.errors import ConfigError
from roboscale.models.attention import BACKENDS
from roboscale.models.dropout import number_sites
from roboscale.models.flops import SampleFlops, attention_flops, linear_flops, sample_flops, vit_flops
from roboscale.models.flow_matching import FlowMatching, sample_seeds
from roboscale.models.groot.config import GrootConfig
from roboscale.models.groot.head import FlowMatchingActionHead
from roboscale.models.groot.transform import TOKENS, TOKENS_MASK, GrootCollate, GrootTransform
from roboscale.models.groot.vlm import EagleVLM, VLLayout
from roboscale.models.layers import fp8_eligible
from roboscale.models.normalize import Normalizer
from roboscale.models.policy import Encoded, Policy
from roboscale.models.tokenizer import TaskTokenizer
from roboscale.models.value import segment_means
from roboscale.utils.images import signed_unit_images

# Config fields that set the shape of each top-level part of the model: named in the error when a checkpoint's
# tensors do not fit its config.json.
SHAPE_FIELDS = {
    "vlm.vision": ["image_size", "vit_patch_size", "vit_dim", "vit_depth", "vit_mlp_dim", "vit_conv_stem"],
    "vlm.projector": ["pixel_shuffle", "projector_layers", "vit_dim", "llm_width"],
    "vlm.embed_tokens": ["vocab_size", "llm_width"],
    "vlm.layers": ["llm_layers", "llm_width", "llm_heads", "llm_kv_heads", "llm_head_dim", "llm_mlp_dim"],
    "action_head.vl": ["vl_layers", "llm_width"],
    "action_head.state_encoder": ["num_embodiments", "state_dim", "hidden_size", "dit_width"],
    "action_head.action_encoder": ["num_embodiments", "action_dim", "dit_width"],
    "action_head.action_decoder": ["num_embodiments", "hidden_size", "action_dim"],
    "action_head.future_tokens": ["num_future_tokens", "dit_width"],
    "action_head.position_embedding": ["max_seq_len", "dit_width"],
    "action_head.dit": ["dit_layers", "dit_width", "hidden_size", "llm_width"],
    "state_normalizer": ["state_dim"],
    "action_normalizer": ["action_dim"],
}

# Top-level prefixes -> component names for `roboscale model info`.
COMPONENTS = {
    "vlm.vision": "vision encoder (ViT)",
    "vlm.projector": "image projector (mlp1)",
    "vlm.embed_tokens": "token embeddings",
    "vlm.layers": "language model layers",
    "vlm.norm": "language model layers",
    "action_head.vl": "VL LayerNorm + self-attention",
    "action_head.dit": "DiT",
    "action_head.state_encoder": "state/action encoders + decoder",
    "action_head.action_encoder": "state/action encoders + decoder",
    "action_head.action_decoder": "state/action encoders + decoder",
    "action_head.future_tokens": "future tokens + action positions",
    "action_head.position_embedding": "future tokens + action positions",
}


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n > 1e8 else f"{n / 1e6:.2f} M"


def _longest_prefix(name: str, table: dict[str, Any]) -> str | None:
    matches = [p for p in table if name == p or name.startswith(p)]
    return max(matches, key=len) if matches else None


def component_of(name: str) -> str:
    prefix = _longest_prefix(name, COMPONENTS)
    return COMPONENTS[prefix] if prefix else name.split(".")[0]


@dataclass
class GrootEncoded(Encoded):
    """What every flow time of one batch (or observation) shares."""

    vl: torch.Tensor
    """float [T, W]: the VL stream after ``vlln`` and the VL self-attention, what the DiT cross-attends to."""
    layout: VLLayout
    """Where each sample's tokens are in ``vl``."""
    state_features: torch.Tensor
    """float [B, 1, dit_width]: the encoded state token."""
    embodiment: torch.Tensor
    """long [B]: the embodiment slot of each sample."""


class GrootPolicy(Policy):
    name = "groot"

    def __init__(self, config: GrootConfig, tokenizer: TaskTokenizer | None = None):
        super().__init__(config, tokenizer)
        cfg = config
        if cfg.attention_backend not in BACKENDS:
            raise ConfigError(f"policy.attention_backend: {cfg.attention_backend!r} is not one of {list(BACKENDS)}")
        self.vlm = EagleVLM(cfg)
        self.action_head = FlowMatchingActionHead(cfg, cfg.llm_width)
        number_sites(self.action_head)
        # a dataset narrower than the state/action sizes (a checkpoint's padded maxima) is zero-padded to them
        self.state_normalizer = Normalizer(cfg.state_dim, cfg.state_norm, data_dim=cfg.dataset_state_dim)
        self.action_normalizer = Normalizer(cfg.action_dim, cfg.action_norm, data_dim=cfg.dataset_action_dim)
        self.vlm.vision.requires_grad_(cfg.tune_visual)
        self.vlm.projector.requires_grad_(cfg.tune_visual)
        for module in (self.vlm.embed_tokens, self.vlm.layers, self.vlm.norm):
            module.requires_grad_(cfg.tune_llm)
        self.add_value_head(cfg.llm_width + cfg.dit_width)

    @property
    def flow_matching(self) -> FlowMatching:
        cfg = self.config
        return FlowMatching(data_at=1, time_alpha=cfg.noise_beta_alpha, time_beta=cfg.noise_beta_beta,
                            noise_s=cfg.noise_s)

    def features(self, encoded: GrootEncoded) -> torch.Tensor:
        """The mean of each sample's VL tokens (as the DiT reads them) beside its encoded state token."""
        layout = encoded.layout
        vl = segment_means(encoded.vl, layout.cu_seqlens, layout.is_sample)
        return torch.cat([vl, encoded.state_features[:, 0]], dim=-1)

    def parallel_units(self) -> list[nn.Module]:
        """The ViT blocks, the language model's layers, the VL self-attention blocks and the DiT blocks, in
        execution order. Outside every unit (the root's): the ViT's patch embedding, positions and final norm, the
        projector, the token embeddings, the language model's final norm, ``vlln``, the per-embodiment state/action
        encoders and action decoder, the future tokens and action positions, and the DiT's timestep encoder and
        output projections. At the full preset that is 27% of the weights: the frozen token embeddings (13%) and
        the 32 embodiment slots of the encoders and decoder (13%)."""
        head = self.action_head
        return [*self.vlm.vision.blocks, *self.vlm.layers, *head.vl_self_attention, *head.dit.blocks]

    def shape_fields(self, tensor_names: list[str]) -> list[str]:
        """Config fields that set these tensors' shapes (``SHAPE_FIELDS`` of their top-level part)."""
        return sorted({field for name in tensor_names
                       for field in SHAPE_FIELDS.get(_longest_prefix(name, SHAPE_FIELDS) or "", [])})

    @staticmethod
    def component_of(parameter_name: str) -> str:
        return component_of(parameter_name)

    flops_components: ClassVar[dict[str, str]] = {"vlm.vision": "vision", "vlm.projector": "vision", "vlm.embed_tokens": "language",
                        "vlm.layers": "language", "vlm.norm": "language", "action_head": "action",
                        "value_head": "action"}

    def parameter_note(self, total: int) -> str:
        """How our count relates to the GR00T N1.5 checkpoint's."""
        cfg = self.config
        lm_head = cfg.vocab_size * cfg.llm_width
        trainable = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return (
            f"Trainable with tune_llm={cfg.tune_llm}, tune_visual={cfg.tune_visual}: {_count(trainable)}.\n"
            f"Not built, because nothing reads them: the language model's lm_head ({_count(lm_head)}, tied to\n"
            f"the token embeddings in Qwen3) and its layers past llm_layers. With the lm_head counted (as a\n"
            f"checkpoint that stores it untied does): {_count(total + lm_head)}."
        )

    def data_transforms(self) -> tuple[GrootTransform | None, GrootCollate | None]:
        """``(transform, collate)`` for the loader's workers: tokenization there, not in the training loop."""
        if self.tokenizer is None:
            return None, None
        return GrootTransform(self.tokenizer, self.config.max_language_tokens), GrootCollate(self.tokenizer.pad_id)

    # --- inputs ---------------------------------------------------------------------------------------------
    def _images(self, batch: dict[str, Any]) -> torch.Tensor:
        """Cameras stacked to float [B * n_cam, 3, S, S] in [-1, 1] (SigLIP's input range); each camera is fitted
        to S x S on its own first (cameras may differ in size)."""
        missing = [key for key in self.config.image_keys if key not in batch]
        if missing:
            raise KeyError(f"observation has no {missing[0]!r}; this policy reads cameras {self.config.image_keys}")
        frames = [signed_unit_images(batch[key], self.config.image_size) for key in self.config.image_keys]
        return torch.stack(frames, dim=1).flatten(0, 1)

    def _language(self, batch: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded token ids [B, L] and mask; tokenizes ``task`` unless the batch brings token ids.
        Each sample keeps its own instruction (LeRobot 0.5.1's GR00T gave the whole batch the first one's)."""
        if TOKENS in batch:
            tokens, mask = batch[TOKENS], batch[TOKENS_MASK]
            return tokens.to(device), mask.to(device).bool()
        if self.tokenizer is None:
            raise RuntimeError("this policy has no tokenizer; pass observation.language.tokens")
        tasks = batch["task"]
        tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        ids, mask = self.tokenizer.encode_batch(tasks, self.config.max_language_tokens)
        return ids.to(device), mask.to(device)

    def _embodiment(self, batch: dict[str, Any], b: int, device: torch.device) -> torch.Tensor:
        ids = batch.get("embodiment_id")
        if ids is None:
            return torch.full((b,), self.config.embodiment_id, dtype=torch.long, device=device)
        ids = torch.as_tensor(ids, device=device).long().reshape(-1).expand(b)
        if bool((ids < 0).any() or (ids >= self.config.num_embodiments).any()):
            raise ValueError(f"embodiment_id {ids.tolist()} outside [0, num_embodiments={self.config.num_embodiments})")
        return ids

    # --- model ----------------------------------------------------------------------------------------------
    def encode(self, batch: dict[str, Any], *, cache: bool = False) -> GrootEncoded:
        """Cameras and instruction through the VLM, ``vlln`` and the VL self-attention; the state through its
        encoder; for a training batch, the normalized actions and which of them the loss counts.

        ``cache`` changes nothing: what every Euler step shares is always kept, and each cross-attending DiT block
        projects its keys/values from the VL features in its own ``forward`` (so the block is a whole unit)."""
        cfg = self.config
        images = self._images(batch)
        device = images.device
        ids, mask = self._language(batch, device)
        b = ids.shape[0]
        vl, layout = self.vlm(images, ids, mask, padded=not cfg.packed)
        seeds = sample_seeds(batch)
        if self.training and cfg.dropout > 0 and seeds is not None:  # masks per sample, not per rank (models.dropout)
            layout = replace(layout, sample_seeds=seeds.to(device))
        vl = self.action_head.encode_vl(vl, layout)
        embodiment = self._embodiment(batch, b, device)
        state = self.state_normalizer.normalize(batch[cfg.state_key].float().to(device))
        state_features = self.action_head.state_encoder(state[:, None], embodiment)
        actions = action_mask = None
        if cfg.action_key in batch and not cache:  # an observation's actions (a dataset row) are not targets
            actions = self.action_normalizer.normalize(batch[cfg.action_key].float().to(device))
            pad_key = f"{cfg.action_key}_is_pad"
            if cfg.action_loss_mask and pad_key in batch:
                action_mask = ~batch[pad_key].to(device).bool()
        # the VL stream, plus the DiT's [state, future tokens, actions] per sample
        steps = actions.shape[1] if actions is not None else cfg.chunk_size
        dit_tokens = b * (1 + cfg.num_future_tokens + steps)
        return GrootEncoded(b, actions, action_mask, layout.sample_tokens + dit_tokens, layout.num_tokens + dit_tokens,
                            vl=vl, layout=layout, state_features=state_features, embodiment=embodiment)

    def velocity(self, encoded: GrootEncoded, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """dx/dt [B, T, A] at GR00T's flow times t [B] in [0, 1] (1 = actions), which the timestep embeddings read
        discretized into ``num_timestep_buckets``."""
        buckets = (t * self.config.num_timestep_buckets).long()
        return self.action_head.velocity(x_t, buckets, encoded.state_features, encoded.vl, encoded.layout,
                                         encoded.embodiment)


# The Linear layers FP8 training leaves in full precision: the vision stem, the projector into the language
# model, the timestep encoder and the DiT's output projections (the first and last layers of the flow: their error
# reaches the actions unfiltered), and the adaLN modulations (one row per sample, the timestep embedding: nothing
# to gain, and their error scales every token of a block). The per-embodiment encoders and decoder are not
# ``nn.Linear``; layers whose dimensions are not multiples of 16 (the FP8 GEMM's tile constraint) or too small to
# gain stay too.
_FP8_EXCLUDED = ("vlm.vision.patch_embed", "vlm.projector", "action_head.state_encoder", "action_head.action_encoder",
                 "action_head.action_decoder", "action_head.dit.timestep_encoder", "action_head.dit.proj_out")
_FP8_EXCLUDED_SUFFIXES = (".norm1.linear",)


def fp8_filter(name: str, module: nn.Module, min_features: int | None = None) -> bool:
    """True for the Linear layers FP8 training converts (see ``_FP8_EXCLUDED``); ``min_features`` lowers the width
    floor (tests of tiny policies)."""
    return fp8_eligible(module, _FP8_EXCLUDED, name, _FP8_EXCLUDED_SUFFIXES, min_features)


def flops_per_sample(cfg: GrootConfig) -> SampleFlops:
    """FLOPs of one training sample at the config's nominal size (every camera, the prompt at
    ``max_language_tokens``, one ``chunk_size`` action chunk) by component: "vision" (ViT and projector, trained
    with ``tune_visual``), "language" (the language model, ``tune_llm``), "action" (the action head, always
    trained: VL self-attention, per-embodiment encoders and decoder, DiT). With the full preset's frozen VLM
    nothing upstream of the head trains, so the VLM costs its forward only (``roboscale.models.flops``)."""
    if not cfg.image_keys:
        raise ConfigError("policy.image_keys is empty: FLOPs per sample need the cameras (set --policy.image_keys)")
    cams, w, d, hidden, t = len(cfg.image_keys), cfg.llm_width, cfg.dit_width, cfg.hidden_size, cfg.chunk_size
    image_tokens = (cfg.image_size // cfg.vit_patch_size // cfg.pixel_shuffle) ** 2
    vit_linear, vit_attention = vit_flops(cfg)
    projector = linear_flops(image_tokens, cfg.vit_dim * cfg.pixel_shuffle**2, w)
    if cfg.projector_layers == 2:
        projector += linear_flops(image_tokens, w, w)
    vl = cams * image_tokens + cfg.max_language_tokens  # the VL tokens of one sample
    q_width, kv_width = cfg.llm_heads * cfg.llm_head_dim, cfg.llm_kv_heads * cfg.llm_head_dim
    llm_layer = (2 * linear_flops(vl, w, q_width) + 2 * linear_flops(vl, w, kv_width)
                 + 3 * linear_flops(vl, w, cfg.llm_mlp_dim))
    vl_block = 4 * linear_flops(vl, w, w) + 2 * linear_flops(vl, w, 4 * w)
    n = 1 + cfg.num_future_tokens + t  # DiT tokens: state, future tokens, actions
    cross, self_blocks = (cfg.dit_layers + 1) // 2, cfg.dit_layers // 2  # even blocks cross-attend
    dit = (cfg.dit_layers * (linear_flops(1, d, 2 * d) + 2 * linear_flops(n, d, d) + 2 * linear_flops(n, d, 4 * d))
           + cross * 2 * linear_flops(vl, w, d) + self_blocks * 2 * linear_flops(n, d, d))
    # the timestep encoder and the output modulation run once per sample; the decoder reads the action tokens only
    head = (cfg.vl_layers * vl_block + linear_flops(1, cfg.state_dim, hidden) + linear_flops(1, hidden, d)
            + linear_flops(t, cfg.action_dim, d) + linear_flops(t, 2 * d, d) + linear_flops(t, d, d)
            + linear_flops(1, 256, d) + linear_flops(1, d, d) + dit + linear_flops(1, d, 2 * d)
            + linear_flops(n, d, hidden) + linear_flops(t, hidden, hidden) + linear_flops(t, hidden, cfg.action_dim))
    head_attention = (cfg.vl_layers * attention_flops(vl, vl, 1, w) + cross * attention_flops(n, vl, 1, d)
                      + self_blocks * attention_flops(n, n, 1, d))
    return sample_flops([
        ("vision", cams * (vit_linear + projector), cams * vit_attention, cfg.tune_visual),
        ("language", cfg.llm_layers * llm_layer, cfg.llm_layers * attention_flops(vl, vl, cfg.llm_heads,
                                                                                   cfg.llm_head_dim), cfg.tune_llm),
        ("action", head, head_attention, True),
    ], tokens=vl + n)


def layout_of(policy: GrootPolicy, batch: dict[str, Any]) -> VLLayout:
    """The VL layout a batch gets (for tests and benchmarks)."""
    images = policy._images(batch)
    ids, mask = policy._language(batch, images.device)
    return policy.vlm(images, ids, mask, padded=not policy.config.packed)[1]
