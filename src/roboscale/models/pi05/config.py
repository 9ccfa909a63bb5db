"""``Pi05Config``: the options of the pi0.5 policy (a light module: no model code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from roboscale.errors import ConfigError
from roboscale.models.config import PolicyConfig

STATE_INPUTS = ("token", "prompt")
MISSING_CAMERAS = ("error", "empty")


@dataclass
class Pi05Config(PolicyConfig):
    """pi0.5-style policy. Defaults are the CPU-trainable demo size (3.3M parameters)."""

    type: ClassVar[str] = "pi05"
    finetune_options: ClassVar[frozenset[str]] = PolicyConfig.finetune_options | {
        "max_language_tokens", "time_beta_alpha", "num_inference_steps", "state_norm", "action_norm", "random_shift",
        "action_loss_mask", "attention_backend", "packing", "pad_language_to", "pack_token_budget",
        "missing_cameras"}

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
    vit_norm_eps: float = 1e-5
    """Epsilon of the ViT's LayerNorms (SigLIP's, and so LeRobot's and openpi's: 1e-6)."""
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
    prompt_state_padded: bool = False
    """state_input=prompt: write the state zero-padded to state_dim (LeRobot's processor pads before it
    digitizes: 32 numbers for an 8-d state) instead of the dataset's values only (openpi's tokenizer)."""
    missing_cameras: str = "error"
    """A camera of image_keys absent from an observation: "error", or "empty": an empty, masked image slot (what
    LeRobot's pi0.5 feeds for a camera slot the batch lacks; at least one camera must be present)."""
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
    at 64² an object moves ~4 px per 10 cm, so a 4-pixel shift erases exactly the position signal the policy must
    learn (docs/benchmarks.md)."""
    action_loss_mask: bool = True
    """Exclude actions past the episode end (``action_is_pad``) from the loss."""
    attention_backend: str = "auto"
    """Attention kernel: auto (flash varlen on CUDA in bf16/fp16, else compiled flex, else per-segment SDPA; on CPU
    SDPA), varlen, flex, sdpa, dense (materialised mask: the numerical reference) or eager (LeRobot's)."""
    packing: bool = False
    """Pack each batch into one token stream: empty camera slots are not encoded, language padding is dropped and
    attention is confined to each sample by cu_seqlens. Off: one padded row per sample (LeRobot's layout) with
    key-padding masks. Off at demo size, where a sample is ~20 tokens: there is no padding worth removing and
    per-segment kernels cost Python time on CPU; turn it on for pi0.5-sized inputs (256 tokens per camera)."""
    pad_language_to: int = 0
    """Padded layout only: language positions per row (LeRobot pads to 200); 0 = the longest prompt of the batch."""
    pack_token_budget: int = 0
    """Packed layout: the most tokens (prefix + actions) one micro-batch may hold. A batch over it is split by
    best-fit decreasing into micro-batches whose gradients the trainer accumulates (the same update as the whole
    batch, at bounded activation memory). 0 = one micro-batch per batch."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.missing_cameras not in MISSING_CAMERAS:
            raise ConfigError(f"policy.missing_cameras: {self.missing_cameras!r} is not one of "
                              f"{list(MISSING_CAMERAS)}")
