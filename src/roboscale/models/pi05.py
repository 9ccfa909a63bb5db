"""A pi0.5-style vision-language-action policy.

Structure (as openpi / LeRobot pi0.5, scaled by config):
- a SigLIP-style ViT encodes each camera; a linear projector maps its tokens to the language model's width;
- a Gemma-style decoder (RMSNorm, RoPE, GeGLU, multi-query attention) runs over the prefix
  [image tokens, state token, language tokens], bidirectionally;
- an action expert (same depth and head layout, narrower) runs over the action tokens *layer by layer jointly*
  with the prefix: in each layer the action tokens attend to the prefix keys/values of that layer and to
  themselves; its norms are adaRMSNorms conditioned on the flow-matching time;
- flow-matching loss on the action chunk; inference caches the prefix keys/values once and runs only the action
  expert for each of the Euler steps.

Departure from pi0.5, on purpose: the state enters as one continuous token (a linear projection, as in pi0.5's
MEM variant) instead of 256-bin digits written into the prompt. With a tokenizer trained on a few task strings
and a few thousand frames, digit tokens would have to learn numeracy from scratch; the projection does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from roboscale.config import register
from roboscale.errors import ConfigError
from roboscale.models.attention import PrefixSuffixLayout, prefix_attention, suffix_attention
from roboscale.models.flow_matching import euler_sample, noisy_actions, sample_time
from roboscale.models.layers import (
    AdaRMSNorm,
    GatedMLP,
    RMSNorm,
    VisionTransformer,
    apply_rotary,
    rotary_tables,
    sinusoidal_embedding,
)
from roboscale.models.normalize import Normalizer
from roboscale.models.policy import TOKENIZER_NAME, Policy, PolicyConfig
from roboscale.models.tokenizer import TaskTokenizer


@register(PolicyConfig, "pi05")
@dataclass
class Pi05Config(PolicyConfig):
    """pi0.5-style policy. Defaults are the CPU-trainable demo size (3.3M parameters, ~230 samples/s on 2 cores)."""

    vit_patch_size: int = 8
    """ViT patch size in pixels."""
    vit_dim: int = 64
    """ViT width."""
    vit_depth: int = 2
    """ViT blocks."""
    vit_heads: int = 2
    """ViT attention heads."""
    vit_mlp_dim: int = 0
    """ViT feed-forward size (0: 4 x vit_dim; SigLIP So400m uses 4304)."""
    pixel_shuffle: int = 4
    """Merge r x r neighbouring patch tokens into one before the language model (r^2 fewer prefix tokens; the
    merged token keeps every feature, so nothing is lost, and the language model can be wider for the same cost)."""
    vit_conv_stem: bool = True
    """Embed patches with stride-2 3x3 convolutions instead of one patchify convolution (better at small data)."""
    width: int = 256
    """Language model (prefix) width."""
    depth: int = 3
    """Layers of the language model and of the action expert (they run jointly, so depth is shared)."""
    num_heads: int = 4
    """Query heads (shared by both streams)."""
    num_kv_heads: int = 1
    """Key/value heads (1 = multi-query attention, as Gemma 2B)."""
    head_dim: int = 32
    """Per-head size (shared by both streams)."""
    mlp_dim: int = 1024
    """Language model feed-forward size."""
    expert_width: int = 128
    """Action expert width."""
    expert_mlp_dim: int = 512
    """Action expert feed-forward size."""
    state_input: str = "token"
    """How the state enters the prefix: "token" (one continuous token, the default at CPU scale) or "prompt"
    (pi0.5's way: the normalized state digitized into 256 bins and written into the prompt as integers)."""
    max_language_tokens: int = 48
    """Instruction tokens kept (longer prompts are truncated)."""
    vocab_size: int = 0
    """Tokenizer vocabulary size (set from the tokenizer)."""
    tokenizer_path: str = ""
    """A tokenizer.json to use instead of training a small BPE on the dataset's task strings."""
    tokenizer_train_vocab: int = 512
    """Vocabulary size when training the tokenizer."""
    time_beta_alpha: float = 1.5
    """Flow time t ~ Beta(alpha, 1) during training (pi0.5: 1.5). Larger alpha puts more samples near pure noise,
    where the velocity can only come from the observation, not from the partly denoised actions."""
    num_inference_steps: int = 10
    """Euler steps from noise to actions at inference."""
    state_norm: str = "quantiles"
    """Normalization of the state: identity, mean_std, min_max or quantiles (q01/q99 -> [-1, 1], pi0.5's)."""
    action_norm: str = "quantiles"
    """Normalization of actions (same choices)."""
    random_shift: int = 0
    """Training augmentation: random image translation of up to this many pixels (0 disables). Off by default:
    at 64² an object moves ~4 px per 10 cm, so a 4-pixel shift erases exactly the position signal the policy
    must learn (measured: the policy then ignores where the button is; see docs/benchmarks.md)."""
    action_loss_mask: bool = True
    """Exclude actions past the episode end (``action_is_pad``) from the loss."""


class JointLayer(nn.Module):
    """One layer of the prefix model and the action expert, sharing one attention.

    The last layer needs no prefix output (nothing reads it), so ``prefix_output=False`` leaves out its prefix
    q_proj, o_proj and MLP (only its keys/values are used, by the action tokens): no dead parameters (LeRobot's pi0.5 carries a dead 263M lm_head for the same reason).
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
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def prefix_forward(self, h, rope, layout: PrefixSuffixLayout):
        """Prefix stream of this layer -> (next prefix hidden or None, this layer's prefix k, v)."""
        x = self.input_norm(h)
        k = apply_rotary(self._split(self.k_proj(x), self.kv_heads), *rope)
        v = self._split(self.v_proj(x), self.kv_heads)
        if not self.prefix_output:
            return None, k, v
        q = apply_rotary(self._split(self.q_proj(x), self.heads), *rope)
        attn = prefix_attention(q, k, v, layout)
        h = h + self.o_proj(attn.transpose(1, 2).flatten(2))
        h = h + self.mlp(self.post_norm(h))
        return h, k, v

    def suffix_forward(self, h, cond, rope, prefix_k, prefix_v, layout: PrefixSuffixLayout):
        """Action-expert stream: attends to this layer's prefix k/v and to itself."""
        x, gate = self.expert_input_norm(h, cond)
        q = apply_rotary(self._split(self.expert_q_proj(x), self.heads), *rope)
        k = apply_rotary(self._split(self.expert_k_proj(x), self.kv_heads), *rope)
        v = self._split(self.expert_v_proj(x), self.kv_heads)
        attn = suffix_attention(q, prefix_k, prefix_v, k, v, layout)
        h = h + gate * self.expert_o_proj(attn.transpose(1, 2).flatten(2))
        x, gate = self.expert_post_norm(h, cond)
        return h + gate * self.expert_mlp(x)


class Pi05Policy(Policy):
    config_class = Pi05Config
    name = "pi05"

    def __init__(self, config: Pi05Config, tokenizer: TaskTokenizer | None = None):
        super().__init__(config)
        cfg = config
        if not cfg.image_keys or not cfg.state_dim or not cfg.action_dim or not cfg.vocab_size:
            raise ValueError(
                "Pi05Config needs image_keys, state_dim, action_dim and vocab_size; build it with "
                "roboscale.models.registry.build_policy(config, dataset_meta) to fill them from a dataset"
            )
        if cfg.state_input not in STATE_INPUTS:
            raise ConfigError(f"policy.state_input: {cfg.state_input!r} is not one of {sorted(STATE_INPUTS)}")
        self.tokenizer = tokenizer
        self.vision = VisionTransformer(
            cfg.image_size,
            cfg.vit_patch_size,
            cfg.vit_dim,
            cfg.vit_depth,
            cfg.vit_heads,
            mlp_dim=cfg.vit_mlp_dim,
            pixel_shuffle=cfg.pixel_shuffle,
            conv_stem=cfg.vit_conv_stem,
        )
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
        self.state_normalizer = Normalizer(cfg.state_dim, cfg.state_norm)
        self.action_normalizer = Normalizer(cfg.action_dim, cfg.action_norm)

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

    # --- inputs ---------------------------------------------------------------------------------------------
    def _images(self, batch: dict[str, Any]) -> torch.Tensor:
        """Stack cameras into float [B * n_cam, 3, S, S] in [-1, 1] (uint8 or [0, 1] float in)."""
        frames = []
        for key in self.config.image_keys:
            if key not in batch:
                raise KeyError(f"observation has no {key!r}; this policy reads cameras {self.config.image_keys}")
            img = batch[key]
            img = img.float() / 255.0 if img.dtype == torch.uint8 else img.float()
            frames.append(img)
        images = torch.stack(frames, dim=1).flatten(0, 1)
        size = self.config.image_size
        if images.shape[-2:] != (size, size):
            images = F.interpolate(images, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if self.training and self.config.random_shift > 0:
            images = random_shift(images, self.config.random_shift)
        return images * 2.0 - 1.0

    def _language(self, batch: dict[str, Any], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, L] and mask; tokenizes ``task`` strings unless the batch brings pre-tokenized ids."""
        device = state.device
        if "observation.language.tokens" in batch:
            tokens, mask = batch["observation.language.tokens"], batch["observation.language.attention_mask"]
            return tokens.to(device), mask.to(device)
        if self.tokenizer is None:
            raise RuntimeError("this policy has no tokenizer; pass observation.language.tokens")
        tasks = batch["task"]
        tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        if self.config.state_input == "prompt":
            tasks = [state_prompt(task, s) for task, s in zip(tasks, state.detach().cpu(), strict=True)]
        ids, mask = self.tokenizer.encode_batch(tasks, self.config.max_language_tokens)
        return ids.to(device), mask.to(device)

    def embed_prefix(self, batch: dict[str, Any]) -> tuple[torch.Tensor, PrefixSuffixLayout, torch.Tensor]:
        """Prefix embeddings [B, Lp, W], its layout, and position ids [B, Lp] (restarting per sample)."""
        images = self._images(batch)
        b = images.shape[0] // len(self.config.image_keys)
        device = images.device
        image_tokens = self.projector(self.vision(images)).view(b, -1, self.config.width)
        state = self.state_normalizer.normalize(batch[self.config.state_key].float().to(device))
        ids, lang_mask = self._language(batch, state)
        lang = self.embed_tokens(ids) * (self.config.width**0.5)  # Gemma scales embeddings by sqrt(width)
        parts = [image_tokens, lang]
        if self.config.state_input == "token":
            parts.insert(1, self.state_proj(state)[:, None])
        tokens = torch.cat(parts, dim=1)
        ones = torch.ones(b, tokens.shape[1] - lang.shape[1], dtype=torch.bool, device=device)
        mask = torch.cat([ones, lang_mask.bool()], dim=1)
        positions = mask.long().cumsum(1) - 1
        return tokens, PrefixSuffixLayout(mask), positions

    def _time_condition(self, t: torch.Tensor) -> torch.Tensor:
        return self.time_mlp(sinusoidal_embedding(t, self.config.expert_width))

    # --- model ----------------------------------------------------------------------------------------------
    def _prefix_cache(self, tokens, layout, positions) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rope = rotary_tables(positions, self.config.head_dim)
        cache = []
        h = tokens
        for layer in self.layers:
            h, k, v = layer.prefix_forward(h, rope, layout)
            cache.append((k, v))
        return cache

    def _velocity(self, x_t, t, cache, layout, positions) -> torch.Tensor:
        """Predicted velocity for noisy normalized actions x_t [B, T, A] at times t [B], given the prefix cache."""
        cond = self._time_condition(t)
        h = self.action_in_proj(x_t)
        start = positions.max(dim=1, keepdim=True).values + 1
        suffix_positions = start + torch.arange(x_t.shape[1], device=x_t.device)[None]
        rope = rotary_tables(suffix_positions, self.config.head_dim)
        for layer, (k, v) in zip(self.layers, cache, strict=True):
            h = layer.suffix_forward(h, cond, rope, k, v, layout)
        h, _ = self.expert_norm(h, cond)
        return self.action_out_proj(h)

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        tokens, layout, positions = self.embed_prefix(batch)
        actions = self.action_normalizer.normalize(batch[self.config.action_key].float().to(tokens.device))
        noise = torch.randn_like(actions)
        t = sample_time(actions.shape[0], actions.device, self.config.time_beta_alpha)
        x_t, target = noisy_actions(actions, noise, t)
        cache = self._prefix_cache(tokens, layout, positions)
        pred = self._velocity(x_t, t, cache, layout, positions)
        err = (pred - target).pow(2).mean(-1)  # [B, T]
        pad_key = f"{self.config.action_key}_is_pad"
        if self.config.action_loss_mask and pad_key in batch:
            keep = (~batch[pad_key].to(err.device).bool()).float()
            loss = (err * keep).sum() / keep.sum().clamp_min(1.0)
        else:
            loss = err.mean()
        return loss, {"loss": float(loss.detach())}

    @torch.no_grad()
    def predict_action_chunk(self, observation: dict[str, Any]) -> torch.Tensor:
        tokens, layout, positions = self.embed_prefix(observation)
        cache = self._prefix_cache(tokens, layout, positions)  # once per chunk, reused by every Euler step
        b = tokens.shape[0]
        noise = torch.randn(b, self.config.chunk_size, self.config.action_dim, device=tokens.device)
        actions = euler_sample(
            lambda x, t: self._velocity(x, t, cache, layout, positions), noise, self.config.num_inference_steps
        )
        return self.action_normalizer.unnormalize(actions)

    # --- persistence ----------------------------------------------------------------------------------------
    def _save_extra(self, directory: Path) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save(directory / TOKENIZER_NAME)

    def _load_extra(self, directory: Path) -> None:
        self.tokenizer = TaskTokenizer.from_file(directory / TOKENIZER_NAME)


STATE_INPUTS = ("token", "prompt")
STATE_BINS = 256


def state_prompt(task: str, normalized_state: torch.Tensor) -> str:
    """pi0.5's prompt: the state (normalized to [-1, 1]) digitized into 256 bins and written as integers."""
    edges = torch.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]
    bins = torch.bucketize(normalized_state.clamp(-1.0, 1.0), edges, right=True) - 1
    return f"Task: {task}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "


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
