"""A GR00T N1.5-style vision-language-action policy.

Structure (as NVIDIA's GR00T N1.5 / LeRobot 0.5.1, scaled by config):
- ``groot_vlm``: an Eagle 2.5-style VLM (SigLIP-style ViT, MLP projector, Qwen3-style decoder truncated to
  ``llm_layers``) whose last kept layer's normed hidden states are the VL tokens; frozen by GR00T's fine-tuning
  recipe (``tune_llm`` / ``tune_visual``);
- ``groot_head``: the flow-matching action head (VL LayerNorm + self-attention, per-embodiment state/action
  encoders and action decoder, a DiT alternating cross-attention to the VL tokens and self-attention, adaLN on
  the flow timestep);
- flow matching as GR00T: t = 0 is noise and t = 1 data, x_t = (1 - t) noise + t actions, target velocity
  actions - noise, t = (s - u) / s with u ~ Beta(1.5, 1) and s = 0.999 (more samples near the noise end), the
  timestep discretized into 1000 buckets for the embeddings; inference integrates 4 Euler steps from t = 0 to 1.

The VL tokens of a batch travel as one flat stream with ``cu_seqlens`` (``packed``, the default: no padding) or
as one padded row per sample; attention uses ``attention.varlen_attention`` so both give the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roboscale.config import register
from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.attention import BACKENDS
from roboscale.models.groot_head import FlowMatchingActionHead
from roboscale.models.groot_vlm import EagleVLM, VLLayout
from roboscale.models.normalize import Normalizer
from roboscale.models.policy import TOKENIZER_NAME, Policy, PolicyConfig
from roboscale.models.tokenizer import TaskTokenizer, pad_token_ids
from roboscale.utils.images import resize_with_pad

TOKENS, TOKENS_MASK = "observation.language.tokens", "observation.language.attention_mask"


@register(PolicyConfig, "groot")
@dataclass
class GrootConfig(PolicyConfig):
    """GR00T N1.5-style policy. Defaults are the CPU-trainable demo size; ``--preset full`` is GR00T N1.5 (2.4 B)."""

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

    def __post_init__(self):
        if self.chunk_size > self.max_seq_len:
            raise ConfigError(
                f"policy.chunk_size {self.chunk_size} exceeds policy.max_seq_len {self.max_seq_len} "
                "(rows of the action position embedding); raise max_seq_len"
            )
        if self.attention_backend not in BACKENDS:
            raise ConfigError(f"policy.attention_backend: {self.attention_backend!r} is not one of {list(BACKENDS)}")
        if self.projector_layers not in (1, 2):
            raise ConfigError(f"policy.projector_layers must be 1 or 2, got {self.projector_layers}")
        if not 0 <= self.embodiment_id < self.num_embodiments:
            raise ConfigError(
                f"policy.embodiment_id {self.embodiment_id} is not a slot of num_embodiments={self.num_embodiments}"
            )
        for name, width, heads in (("dit", self.dit_width, self.dit_heads), ("vl", self.llm_width, self.vl_heads)):
            if width % heads:
                raise ConfigError(f"policy.{name}_heads {heads} does not divide the {name} width {width}")


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


class GrootTransform:
    """Per-sample work for the loader's workers: the instruction becomes token ids (cut to
    ``max_language_tokens``), so the training loop never tokenizes. Images, state and actions pass through: the
    policy normalizes them on its device. Picklable (a ``tokenizers`` tokenizer and ints)."""

    def __init__(self, tokenizer: TaskTokenizer, max_language_tokens: int):
        self.tokenizer = tokenizer
        self.max_language_tokens = max_language_tokens
        self._cache: dict[str, torch.Tensor] = {}  # per worker: a dataset has a few task strings

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if TOKENS in sample:
            return sample
        task = sample["task"]
        ids = self._cache.get(task)
        if ids is None:
            ids = torch.tensor(self.tokenizer.encode(task)[: self.max_language_tokens], dtype=torch.long)
            if len(self._cache) < 4096:
                self._cache[task] = ids
        sample[TOKENS] = ids
        return sample


class GrootCollate:
    """Stacks samples as torch's default collate, with the token ids right-padded to the batch's longest (the
    layout ``TaskTokenizer.encode_batch`` gives, so a batch is the same whether workers or the policy tokenized)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        samples = [dict(s) for s in samples]
        tokens = [s.pop(TOKENS) for s in samples]
        batch = torch.utils.data.default_collate(samples)
        batch[TOKENS], batch[TOKENS_MASK] = pad_token_ids([t.tolist() for t in tokens], self.pad_id)
        return batch


class GrootPolicy(Policy):
    config_class = GrootConfig
    name = "groot"

    def __init__(self, config: GrootConfig, tokenizer: TaskTokenizer | None = None):
        super().__init__(config)
        cfg = config
        if not cfg.image_keys or not cfg.state_dim or not cfg.action_dim or not cfg.vocab_size:
            raise ValueError(
                "GrootConfig needs image_keys, state_dim, action_dim and vocab_size; build it with "
                "roboscale.models.registry.build_policy(config, dataset_meta) to fill them from a dataset"
            )
        self.tokenizer = tokenizer
        self.vlm = EagleVLM(cfg)
        self.action_head = FlowMatchingActionHead(cfg, cfg.llm_width)
        self.state_normalizer = Normalizer(cfg.state_dim, cfg.state_norm)
        self.action_normalizer = Normalizer(cfg.action_dim, cfg.action_norm)
        self.vlm.vision.requires_grad_(cfg.tune_visual)
        self.vlm.projector.requires_grad_(cfg.tune_visual)
        for module in (self.vlm.embed_tokens, self.vlm.layers, self.vlm.norm):
            module.requires_grad_(cfg.tune_llm)

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
        frames = []
        for key in self.config.image_keys:
            if key not in batch:
                raise KeyError(f"observation has no {key!r}; this policy reads cameras {self.config.image_keys}")
            img = batch[key]
            img = img.float() / 255.0 if img.dtype == torch.uint8 else img.float()
            frames.append(resize_with_pad(img, self.config.image_size))
        return torch.stack(frames, dim=1).flatten(0, 1) * 2.0 - 1.0

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

    def encode_observation(self, batch: dict[str, Any]):
        """-> (DiT cross-attention context, VL layout, state features [B, 1, W], embodiment ids [B])."""
        images = self._images(batch)
        device = images.device
        ids, mask = self._language(batch, device)
        b = ids.shape[0]
        vl, layout = self.vlm(images, ids, mask, padded=not self.config.packed)
        context = self.action_head.encode_vl(vl, layout)
        embodiment = self._embodiment(batch, b, device)
        state = self.state_normalizer.normalize(batch[self.config.state_key].float().to(device))
        state_features = self.action_head.state_encoder(state[:, None], embodiment)
        return context, layout, state_features, embodiment

    # --- flow matching --------------------------------------------------------------------------------------
    def sample_time(self, b: int, device: torch.device) -> torch.Tensor:
        """GR00T's t = (s - u) / s, u ~ Beta(alpha, beta): t near 0 (noise) is likelier. Uses torch's global RNG,
        whose state the trainer checkpoints."""
        cfg = self.config
        beta = torch.distributions.Beta(torch.tensor(cfg.noise_beta_alpha), torch.tensor(cfg.noise_beta_beta))
        return ((cfg.noise_s - beta.sample((b,))) / cfg.noise_s).to(device)

    def _buckets(self, t: torch.Tensor) -> torch.Tensor:
        return (t * self.config.num_timestep_buckets).long()

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        context, layout, state_features, embodiment = self.encode_observation(batch)
        device = state_features.device
        actions = self.action_normalizer.normalize(batch[self.config.action_key].float().to(device))
        noise = torch.randn_like(actions)
        t = self.sample_time(actions.shape[0], device)
        x_t = (1 - t[:, None, None]) * noise + t[:, None, None] * actions
        target = actions - noise
        pred = self.action_head.velocity(x_t, self._buckets(t), state_features, context, layout, embodiment)
        err = (pred - target).pow(2).mean(-1)  # [B, T]
        pad_key = f"{self.config.action_key}_is_pad"
        if self.config.action_loss_mask and pad_key in batch:
            keep = (~batch[pad_key].to(device).bool()).float()
            loss = (err * keep).sum() / keep.sum().clamp_min(1.0)
        else:
            loss = err.mean()
        # VL stream + the DiT's [state, future tokens, actions] per sample
        dit_tokens = actions.shape[0] * (1 + self.config.num_future_tokens + actions.shape[1])
        return loss, {"loss": float(loss.detach()), "tokens": layout.sample_tokens + dit_tokens,
                      "computed_tokens": layout.num_tokens + dit_tokens}

    @torch.no_grad()
    def predict_action_chunk(self, observation: dict[str, Any]) -> torch.Tensor:
        context, layout, state_features, embodiment = self.encode_observation(observation)
        b, device = state_features.shape[0], state_features.device
        x = torch.randn(b, self.config.chunk_size, self.config.action_dim, device=device)
        steps = self.config.num_inference_steps
        for i in range(steps):  # Euler from t = 0 (noise) to t = 1 (actions)
            t = torch.full((b,), i / steps, device=device)
            v = self.action_head.velocity(x, self._buckets(t), state_features, context, layout, embodiment)
            x = x + v / steps
        return self.action_normalizer.unnormalize(x)

    # --- persistence ----------------------------------------------------------------------------------------
    def _save_extra(self, directory: Path) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save(directory / TOKENIZER_NAME)

    def _load_extra(self, directory: Path) -> None:
        self.tokenizer = TaskTokenizer.from_file(directory / TOKENIZER_NAME)

    def load_weights(self, path: Path) -> None:
        """The base class's strict load; when shapes disagree, also name the config.json fields that set them."""
        try:
            super().load_weights(path)
        except CheckpointError as exc:
            if "shape mismatch" not in str(exc):
                raise
            own = self.state_dict()
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                bad = [k for k in f.keys() if k in own and tuple(f.get_slice(k).get_shape()) != tuple(own[k].shape)]
            fields = sorted({fld for k in bad for fld in SHAPE_FIELDS.get(_longest_prefix(k, SHAPE_FIELDS) or "", [])})
            raise CheckpointError(
                path,
                str(exc).split(": ", 1)[1] + f" The fields of config.json that set those shapes are {fields}; "
                "restore the values the checkpoint was trained with.",
            ) from None


def layout_of(policy: GrootPolicy, batch: dict[str, Any]) -> VLLayout:
    """The VL layout a batch gets (for tests and benchmarks)."""
    images = policy._images(batch)
    ids, mask = policy._language(batch, images.device)
    return policy.vlm(images, ids, mask, padded=not policy.config.packed)[1]
