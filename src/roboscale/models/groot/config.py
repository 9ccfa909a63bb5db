"""``GrootConfig``: the options of the GR00T policy (a light module: no model code)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from roboscale.errors import ConfigError
from roboscale.models.config import PolicyConfig


@dataclass
class GrootConfig(PolicyConfig):
    """GR00T N1.5-style policy. Defaults are the CPU-trainable demo size; ``--preset full`` is GR00T N1.5 (2.4 B)."""

    type: ClassVar[str] = "groot"
    finetune_options: ClassVar[frozenset[str]] = PolicyConfig.finetune_options | {
        "tune_llm", "tune_visual", "max_language_tokens", "packed", "attention_backend", "embodiment_id", "dropout",
        "num_inference_steps", "noise_beta_alpha", "noise_beta_beta", "noise_s", "state_norm", "action_norm",
        "action_loss_mask"}

    # --- vision (SigLIP-style ViT) and projector ---
    vit_patch_size: int = 8
    """ViT patch size in pixels (SigLIP: 14)."""
    vit_dim: int = 64
    """ViT width (SigLIP So400m: 1152)."""
    vit_depth: int = 2
    """ViT blocks (SigLIP So400m: 27)."""
    vit_heads: int = 2
    """ViT attention heads."""
    vit_mlp_dim: int = 0
    """ViT feed-forward size (0: 4 x vit_dim; SigLIP So400m: 4304)."""
    vit_conv_stem: bool = True
    """Embed patches with stride-2 3x3 convolutions instead of one patchify convolution (better at small data)."""
    vit_norm_eps: float = 1e-5
    """Epsilon of the ViT's LayerNorms (SigLIP-2's: 1e-6)."""
    pixel_shuffle: int = 4
    """Merge r x r neighbouring patch tokens into one before the projector (Eagle's pixel shuffle, ratio 1/r;
    1 = none, which is what GR00T N1.5's Eagle checkpoint uses: 256 tokens per 224² image)."""
    projector_layers: int = 2
    """Eagle's mlp1: 2 = LayerNorm, Linear, GELU, Linear; 1 = one Linear (GR00T N1.5)."""
    # --- language model (Qwen3-style, truncated) ---
    llm_width: int = 128
    """Language model width (Qwen3-1.7B: 2048). Also the VL token width the action head cross-attends to."""
    llm_layers: int = 2
    """Decoder layers kept; the last one's (normed) hidden states are the VL tokens (GR00T: select_layer=12 of 28)."""
    llm_heads: int = 4
    """Query heads (Qwen3-1.7B: 16)."""
    llm_kv_heads: int = 2
    """Key/value heads, grouped-query attention (Qwen3-1.7B: 8)."""
    llm_head_dim: int = 32
    """Per-head size (Qwen3: 128)."""
    llm_mlp_dim: int = 384
    """SwiGLU hidden size (Qwen3-1.7B: 6144)."""
    rope_theta: float = 1_000_000.0
    """RoPE base (Qwen3: 1e6)."""
    tune_llm: bool = True
    """Train the language model. GR00T's fine-tuning freezes it (the full preset: false); the demo trains from
    random initialization, where a frozen language model could only pass on random features."""
    tune_visual: bool = True
    """Train the ViT and the projector (GR00T fine-tuning via LeRobot: false; the demo: true, as tune_llm)."""
    vocab_size: int = 0
    """Tokenizer vocabulary size (set from the tokenizer)."""
    tokenizer_path: str = ""
    """A tokenizer.json to use instead of training a small BPE on the dataset's task strings."""
    tokenizer_train_vocab: int = 512
    """Vocabulary size when training the tokenizer."""
    max_language_tokens: int = 48
    """Instruction tokens kept (longer prompts are truncated)."""
    packed: bool = True
    """VL tokens as one packed stream without padding (true) or one padded row per sample (false). Results are
    the same; packing skips the padding's compute."""
    attention_backend: str = "auto"
    """Kernel of every attention over VL tokens (LLM, VL self-attention, DiT cross-attention): auto, varlen, flex,
    sdpa, dense or eager, as ``roboscale.models.attention.varlen_attention``."""
    # --- action head ---
    vl_layers: int = 1
    """Self-attention blocks over the VL tokens before the DiT (GR00T N1.5: 4)."""
    vl_heads: int = 4
    """Their heads (GR00T: 32 x 64 = the 2048-wide VL tokens)."""
    dit_layers: int = 4
    """DiT blocks; even ones cross-attend to the VL tokens, odd ones self-attend (GR00T N1.5: 16)."""
    dit_width: int = 128
    """DiT width, also the width of the state/action/future tokens (GR00T: 32 heads x 48 = 1536)."""
    dit_heads: int = 4
    """DiT attention heads (GR00T: 32)."""
    hidden_size: int = 128
    """DiT output width and the hidden width of the state encoder and action decoder MLPs (GR00T: 1024)."""
    num_future_tokens: int = 4
    """Learned tokens between the state token and the action tokens in the DiT input (GR00T: 32)."""
    max_seq_len: int = 16
    """Rows of the learned action position embedding; must be >= chunk_size (GR00T: 1024)."""
    num_embodiments: int = 1
    """Per-embodiment weight slots of the state encoder, action encoder and decoder (GR00T: 32)."""
    embodiment_id: int = 0
    """Slot this dataset trains and evaluates with, unless a batch brings ``embodiment_id`` (GR00T's
    new_embodiment: 31)."""
    dropout: float = 0.0
    """Dropout in the action head's attention and feed-forward blocks (GR00T: 0.2)."""
    # --- flow matching ---
    num_inference_steps: int = 4
    """Euler steps from noise to actions at inference (GR00T: 4)."""
    noise_beta_alpha: float = 1.5
    """t = (s - u) / s with u ~ Beta(alpha, beta): alpha > 1 puts more training samples near pure noise."""
    noise_beta_beta: float = 1.0
    """Beta's second parameter (GR00T: 1.0)."""
    noise_s: float = 0.999
    """s in t = (s - u) / s (GR00T: 0.999)."""
    num_timestep_buckets: int = 1000
    """The flow time is discretized into this many buckets before its sinusoidal embeddings (GR00T: 1000)."""
    state_norm: str = "min_max"
    """Normalization of the state: identity, mean_std, min_max ([min, max] -> [-1, 1], GR00T's) or quantiles."""
    action_norm: str = "min_max"
    """Normalization of actions (same choices)."""
    action_loss_mask: bool = True
    """Exclude actions past the episode end (``action_is_pad``) from the loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_size > self.max_seq_len:
            raise ConfigError(
                f"policy.chunk_size {self.chunk_size} exceeds policy.max_seq_len {self.max_seq_len} "
                "(rows of the action position embedding); raise max_seq_len"
            )
        if self.projector_layers not in (1, 2):
            raise ConfigError(f"policy.projector_layers must be 1 or 2, got {self.projector_layers}")
        if not 0 <= self.embodiment_id < self.num_embodiments:
            raise ConfigError(
                f"policy.embodiment_id {self.embodiment_id} is not a slot of num_embodiments={self.num_embodiments}"
            )
        for name, width, heads in (("dit", self.dit_width, self.dit_heads), ("vl", self.llm_width, self.vl_heads)):
            if width % heads:
                raise ConfigError(f"policy.{name}_heads {heads} does not divide the {name} width {width}")
