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

Batches are ``PackedBatch``es (``roboscale.data.packing``): with ``packing`` on, all samples share one flat token
stream (no empty camera slots, no language padding) and attention is two segment-aware calls per layer (prefix
varlen self-attention; actions over [their prefix, themselves]) on the configured backend; with it off, one
padded row per sample and key-padding masks. ``forward`` also takes LeRobot-style dict batches (collated here).

Departure from pi0.5, on purpose: the state enters as one continuous token (a linear projection, as in pi0.5's
MEM variant) instead of 256-bin digits written into the prompt. With a tokenizer trained on a few task strings
and a few thousand frames, digit tokens would have to learn numeracy from scratch; the projection does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from roboscale.config import register
from roboscale.errors import ConfigError
from roboscale.data.packing import PackCollate, PackedBatch, PrefixSpec, TokenizedSample
from roboscale.models.attention import (
    BACKENDS,
    PrefixSuffixLayout,
    pick_backend,
    prefix_attention,
    suffix_attention,
    varlen_attention,
)
from roboscale.models.flow_matching import euler_sample, noisy_actions, sample_time
from roboscale.models.layers import (
    AdaRMSNorm,
    GatedMLP,
    RMSNorm,
    VisionTransformer,
    rotary_tables,
    sinusoidal_embedding,
)
from roboscale.models.normalize import Normalizer
from roboscale.models.policy import TOKENIZER_NAME, Policy, PolicyConfig
from roboscale.models.tokenizer import TaskTokenizer
from roboscale.utils.images import resize_with_pad


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

    def prefix_forward(self, h, rope, layout: Pi05Layout):
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

    def suffix_forward(self, h, cond, rope, prefix_k, prefix_v, layout: Pi05Layout):
        """Action-expert stream [B, S, We]: attends to this layer's prefix k/v of its sample and to itself."""
        x, gate = self.expert_input_norm(h, cond)
        q = _rotary(self._split(self.expert_q_proj(x), self.heads), *rope)
        k = _rotary(self._split(self.expert_k_proj(x), self.kv_heads), *rope)
        v = self._split(self.expert_v_proj(x), self.kv_heads)
        attn = layout.suffix(q, prefix_k, prefix_v, k, v)
        h = h + gate * self.expert_o_proj(attn.flatten(2))
        x, gate = self.expert_post_norm(h, cond)
        return h + gate * self.expert_mlp(x)


class Pi05Transform:
    """Per-sample preprocessing the loader's workers run: normalization (from the policy's statistics) and
    tokenization -> ``TokenizedSample``. Picklable (plain tensors and a ``tokenizers`` tokenizer).

    Accepts a LeRobot-style sample (one key per camera, ``observation.state``, ``action``, ``action_is_pad``,
    ``task``; a camera key that is absent, or False in an optional ``image_mask``, is an empty slot) or the design's
    Sample (``images`` [n_cam, 3, H, W] + ``image_mask``, ``state``, ``actions``, ``actions_is_pad``, ``task`` or
    ``tokens``).
    """

    def __init__(self, cfg: Pi05Config, state_normalizer: Normalizer, action_normalizer: Normalizer,
                 tokenizer: TaskTokenizer | None):
        self.image_keys = list(cfg.image_keys)
        self.image_size = cfg.image_size
        self.state_key, self.action_key = cfg.state_key, cfg.action_key
        self.max_language_tokens = cfg.max_language_tokens
        self.state_input = cfg.state_input
        self.state_normalizer = state_normalizer.snapshot()
        self.action_normalizer = action_normalizer.snapshot()
        self.tokenizer = tokenizer
        self._task_cache: dict[str, torch.Tensor] = {}

    # Tokenizing the same few task strings every step is wasted work; the cache is per process (worker).
    def _tokens(self, task: str, normalized_state: torch.Tensor) -> torch.Tensor:
        if self.state_input == "prompt":
            task = state_prompt(task, normalized_state)
        elif task in self._task_cache:
            return self._task_cache[task]
        if self.tokenizer is None:
            raise RuntimeError("this policy has no tokenizer; pass pre-tokenized observation.language.tokens")
        ids = torch.tensor(self.tokenizer.encode(task)[: self.max_language_tokens], dtype=torch.long)
        if self.state_input != "prompt" and len(self._task_cache) < 4096:
            self._task_cache[task] = ids
        return ids

    def _images(self, sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "images" in sample:
            images = torch.as_tensor(sample["images"])
            mask = torch.as_tensor(sample.get("image_mask", torch.ones(images.shape[0], dtype=torch.bool))).bool()
            return images, mask
        # cameras may differ in size (a wrist camera smaller than the scene's): fit each before stacking them
        present = {k: resize_with_pad(torch.as_tensor(sample[k]), self.image_size) for k in self.image_keys
                   if k in sample}
        if not present:
            raise KeyError(f"sample has none of the cameras this policy reads: {self.image_keys}")
        blank = torch.zeros_like(next(iter(present.values())))
        images = torch.stack([present.get(k, blank) for k in self.image_keys])
        mask = torch.tensor([k in sample for k in self.image_keys], dtype=torch.bool)
        if "image_mask" in sample:
            mask &= torch.as_tensor(sample["image_mask"]).bool()
        return images, mask

    def __call__(self, sample: dict[str, Any]) -> TokenizedSample:
        images, image_mask = self._images(sample)
        state = torch.as_tensor(sample.get("state", sample.get(self.state_key))).float()
        state = self.state_normalizer.normalize(state)
        actions = sample.get("actions", sample.get(self.action_key))
        is_pad = sample.get("actions_is_pad", sample.get(f"{self.action_key}_is_pad"))
        if actions is not None:
            actions = self.action_normalizer.normalize(torch.as_tensor(actions).float())
            is_pad = torch.zeros(actions.shape[0], dtype=torch.bool) if is_pad is None else torch.as_tensor(is_pad)
            is_pad = is_pad.bool()
        if "tokens" in sample:
            tokens = torch.as_tensor(sample["tokens"]).long()[: self.max_language_tokens]
        elif "observation.language.tokens" in sample:
            ids = torch.as_tensor(sample["observation.language.tokens"]).long()
            mask = torch.as_tensor(sample["observation.language.attention_mask"]).bool()
            tokens = ids[mask][: self.max_language_tokens]
        else:
            tokens = self._tokens(sample["task"], state)
        return TokenizedSample(
            images=images,
            image_mask=image_mask,
            state=state,
            tokens=tokens,
            actions=actions,
            actions_is_pad=is_pad,
            episode_index=int(sample.get("episode_index", -1)),
            frame_index=int(sample.get("frame_index", -1)),
        )

    def from_batch(self, batch: dict[str, Any]) -> list[TokenizedSample]:
        """A LeRobot-style *batch* dict (what eval and the in-memory loader give) -> samples. A camera the policy
        reads that is absent from the whole batch is an error, not an empty slot."""
        missing = [k for k in self.image_keys if k not in batch]
        if missing:
            raise KeyError(
                f"observation has no {missing[0]!r}; this policy reads cameras {self.image_keys} (a camera missing "
                "from a whole batch is a configuration error: set policy.image_keys to the cameras the data has)"
            )
        state = self.state_normalizer.normalize(torch.as_tensor(batch[self.state_key]).float().cpu())
        b = state.shape[0]
        tasks = batch.get("task")
        tasks = [tasks] * b if isinstance(tasks, str) else tasks
        # Normalize the whole batch at once, then cut it into samples (views): per-sample calls cost Python time.
        actions, is_pad = batch.get(self.action_key), batch.get(f"{self.action_key}_is_pad")
        if actions is not None:
            actions = self.action_normalizer.normalize(torch.as_tensor(actions).float().cpu())
            is_pad = torch.zeros(actions.shape[:2], dtype=torch.bool) if is_pad is None else torch.as_tensor(is_pad)
            is_pad = is_pad.bool().cpu()
        images = torch.stack([resize_with_pad(torch.as_tensor(batch[k]).cpu(), self.image_size)
                              for k in self.image_keys], dim=1)
        image_mask = batch.get("image_mask")
        if image_mask is None:
            image_mask = torch.ones(images.shape[:2], dtype=torch.bool)
        image_mask = torch.as_tensor(image_mask).bool().cpu()
        if "observation.language.tokens" in batch:
            ids = torch.as_tensor(batch["observation.language.tokens"]).long().cpu()
            lang_mask = torch.as_tensor(batch["observation.language.attention_mask"]).bool().cpu()
            tokens = [ids[i][lang_mask[i]][: self.max_language_tokens] for i in range(b)]
        else:
            if tasks is None:
                raise KeyError("batch has neither 'task' strings nor observation.language.tokens")
            tokens = [self._tokens(tasks[i], state[i]) for i in range(b)]
        episode = batch.get("episode_index")
        frame = batch.get("frame_index")
        return [
            TokenizedSample(
                images=images[i],
                image_mask=image_mask[i],
                state=state[i],
                tokens=tokens[i],
                actions=None if actions is None else actions[i],
                actions_is_pad=None if actions is None else is_pad[i],
                episode_index=int(episode[i]) if isinstance(episode, torch.Tensor) else -1,
                frame_index=int(frame[i]) if isinstance(frame, torch.Tensor) else -1,
            )
            for i in range(b)
        ]


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
        if cfg.attention_backend not in BACKENDS:
            raise ConfigError(f"policy.attention_backend: {cfg.attention_backend!r} is not one of {list(BACKENDS)}")
        self.tokenizer = tokenizer
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
        collate = PackCollate(self.prefix_spec(), packed=self.config.packing, budget=self.config.pack_token_budget)
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
        """uint8 (or [0, 1] float) [N, 3, H, W] -> float [N, 3, S, S] in [-1, 1]."""
        images = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
        images = resize_with_pad(images, self.config.image_size)
        if self.training and self.config.random_shift > 0:
            images = random_shift(images, self.config.random_shift)
        return images * 2.0 - 1.0

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
    def _prefix_cache(self, tokens: torch.Tensor, layout: Pi05Layout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rope = rotary_tables(layout.positions, self.config.head_dim)
        cache = []
        h = tokens
        for layer in self.layers:
            h, k, v = layer.prefix_forward(h, rope, layout)
            cache.append((k, v))
        return cache

    def _velocity(self, x_t, t, cache, layout: Pi05Layout) -> torch.Tensor:
        """Predicted velocity for noisy normalized actions x_t [B, T, A] at times t [B], given the prefix cache."""
        cond = self._time_condition(t)
        h = self.action_in_proj(x_t)
        rope = rotary_tables(layout.suffix_positions(), self.config.head_dim)
        for layer, (k, v) in zip(self.layers, cache, strict=True):
            h = layer.suffix_forward(h, cond, rope, k, v, layout)
        h, _ = self.expert_norm(h, cond)
        return self.action_out_proj(h)

    def forward(self, batch: dict[str, Any] | PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        batch = self.as_packed_batch(batch)
        if batch.actions is None:
            raise ValueError("a training batch needs actions; this one was collated without them")
        if batch.actions.shape[1] != batch.suffix_len:
            raise ValueError(
                f"batch has {batch.actions.shape[1]} actions per sample, the policy predicts chunks of "
                f"{batch.suffix_len}; set policy.chunk_size to match the loader's action window"
            )
        tokens, layout = self.embed_prefix(batch)
        actions = batch.actions.float()
        noise = torch.randn_like(actions)
        t = sample_time(actions.shape[0], actions.device, self.config.time_beta_alpha)
        x_t, target = noisy_actions(actions, noise, t)
        cache = self._prefix_cache(tokens, layout)
        pred = self._velocity(x_t, t, cache, layout)
        err = (pred - target).pow(2).mean(-1)  # [B, T]
        if self.config.action_loss_mask and batch.actions_is_pad is not None:
            keep = (~batch.actions_is_pad.bool()).float()
            weight = keep.sum().clamp_min(1.0)
            loss = (err * keep).sum() / weight
        else:
            weight = torch.tensor(float(err.numel()))
            loss = err.mean()
        # loss_weight: the loss's denominator, so micro-batch losses combine into the whole batch's mean
        return loss, {"loss": float(loss.detach()), "loss_weight": float(weight), "tokens": batch.real_tokens,
                      "computed_tokens": batch.computed_tokens}

    @torch.no_grad()
    def predict_action_chunk(self, observation: dict[str, Any] | PackedBatch) -> torch.Tensor:
        batch = self.as_packed_batch(observation)
        tokens, layout = self.embed_prefix(batch)
        cache = self._prefix_cache(tokens, layout)  # once per chunk, reused by every Euler step
        b = batch.num_samples
        noise = torch.randn(b, self.config.chunk_size, self.config.action_dim, device=tokens.device)
        actions = euler_sample(lambda x, t: self._velocity(x, t, cache, layout), noise, self.config.num_inference_steps)
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
