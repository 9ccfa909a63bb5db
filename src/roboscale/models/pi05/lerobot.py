"""LeRobot pi0.5 checkpoints <-> our Pi05Policy: tensor names, the few layout differences, and the config.

LeRobot (and openpi's PyTorch port) name pi0.5's tensors after Hugging Face's PaliGemma/Gemma/SigLIP modules, under
``model.paligemma_with_expert.{paligemma,gemma_expert}``. The mapping, per tensor family:

| ours | LeRobot (``model.`` + ...) | transform |
|---|---|---|
| ``vision.patch_embed`` | ``paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding`` | - |
| ``vision.pos_embed`` [1, N, D] | ``...embeddings.position_embedding.weight`` [N, D] | reshape |
| ``vision.blocks.{i}.qkv`` | ``...encoder.layers.{i}.self_attn.{q,k,v}_proj`` | concatenate / split |
| ``vision.blocks.{i}.proj``, ``norm1``, ``norm2``, ``fc1``, ``fc2`` | ``...self_attn.out_proj``, ``layer_norm1``, ``layer_norm2``, ``mlp.fc1``, ``mlp.fc2`` | - |
| ``vision.norm`` | ``...vision_model.post_layernorm`` | - |
| ``projector`` | ``paligemma_with_expert.paligemma.model.multi_modal_projector.linear`` | - |
| ``embed_tokens`` | ``paligemma_with_expert.paligemma.model.language_model.embed_tokens`` | - |
| ``layers.{i}.{q,k,v,o}_proj``, ``input_norm``, ``post_norm``, ``mlp.*`` | ``...language_model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp.*`` | - |
| ``layers.{i}.expert_*`` | ``paligemma_with_expert.gemma_expert.model.layers.{i}.*`` (same names) | - |
| ``layers.{i}.expert_{input,post}_norm.modulation`` | ``...input_layernorm.dense`` / ``post_attention_layernorm.dense`` | gate bias - 1 |
| ``expert_norm.modulation`` | ``paligemma_with_expert.gemma_expert.model.norm.dense`` | gate bias - 1 |
| ``action_in_proj``, ``action_out_proj`` | ``action_in_proj``, ``action_out_proj`` | - |
| ``time_mlp.0``, ``time_mlp.2`` | ``time_mlp_in``, ``time_mlp_out`` | - |

"gate bias - 1": LeRobot's adaRMSNorm gates the residual branch with ``gate``, ours with ``1 + gate`` (so that a
zero-initialised modulation starts as a plain residual); the last third of the bias shifts by one.

LeRobot tensors we do not build, because nothing reads them, are dropped on load: both ``lm_head`` weights, the
language model's final ``norm``, and the last language-model layer's query/output projections, post-attention
norm and MLP. Normalization statistics come from LeRobot's ``policy_preprocessor_step_*_normalizer_processor
.safetensors`` (keys ``<feature>.<stat>``) when present.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from roboscale.errors import CheckpointError
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.pi05.modeling import Pi05Policy

VLM = "model.paligemma_with_expert.paligemma.model."
VISION = VLM + "vision_tower.vision_model."
LANGUAGE = VLM + "language_model."
EXPERT = "model.paligemma_with_expert.gemma_expert.model."

# Gemma variants LeRobot knows (openpi gemma.get_config): width, depth, mlp_dim, num_heads, num_kv_heads, head_dim.
GEMMA_VARIANTS = {
    "gemma_2b": (2048, 18, 16384, 8, 1, 256),
    "gemma_300m": (1024, 18, 4096, 8, 1, 256),
}

_VISION_BLOCK = {
    "proj": "self_attn.out_proj",
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}
_PREFIX_LAYER = {
    "input_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj",
}
_EXPERT_LAYER = {
    "expert_input_norm.modulation": "input_layernorm.dense",
    "expert_post_norm.modulation": "post_attention_layernorm.dense",
    "expert_q_proj": "self_attn.q_proj",
    "expert_k_proj": "self_attn.k_proj",
    "expert_v_proj": "self_attn.v_proj",
    "expert_o_proj": "self_attn.o_proj",
    "expert_mlp.gate_proj": "mlp.gate_proj",
    "expert_mlp.up_proj": "mlp.up_proj",
    "expert_mlp.down_proj": "mlp.down_proj",
}
_TOP = {
    "vision.patch_embed": VISION + "embeddings.patch_embedding",
    "vision.norm": VISION + "post_layernorm",
    "projector": VLM + "multi_modal_projector.linear",
    "embed_tokens": LANGUAGE + "embed_tokens",
    "expert_norm.modulation": EXPERT + "norm.dense",
    "action_in_proj": "model.action_in_proj",
    "action_out_proj": "model.action_out_proj",
    "time_mlp.0": "model.time_mlp_in",
    "time_mlp.2": "model.time_mlp_out",
}
# LeRobot tensors with no counterpart here (nothing reads them).
_UNUSED = [
    re.compile(r"model\.paligemma_with_expert\.(paligemma|gemma_expert)\.lm_head\.weight"),
    re.compile(re.escape(LANGUAGE) + r"norm\.weight"),
    re.compile(re.escape(EXPERT) + r"embed_tokens\.weight"),
]


def _renames(cfg: Pi05Config) -> dict[str, str]:
    """our module prefix -> LeRobot module prefix, for every module with the same tensors on both sides."""
    names = dict(_TOP)
    for i in range(cfg.vit_depth):
        for ours, theirs in _VISION_BLOCK.items():
            names[f"vision.blocks.{i}.{ours}"] = f"{VISION}encoder.layers.{i}.{theirs}"
    for i in range(cfg.depth):
        last = i == cfg.depth - 1
        for ours, theirs in _PREFIX_LAYER.items():
            if last and ours not in ("input_norm", "k_proj", "v_proj"):
                continue  # the last prefix layer only provides keys and values
            names[f"layers.{i}.{ours}"] = f"{LANGUAGE}layers.{i}.{theirs}"
        for ours, theirs in _EXPERT_LAYER.items():
            names[f"layers.{i}.{ours}"] = f"{EXPERT}layers.{i}.{theirs}"
    return names


def _is_modulation(name: str) -> bool:
    return name.endswith(".modulation")


def _shift_gate_bias(bias: torch.Tensor, delta: float) -> torch.Tensor:
    """adaRMSNorm bias is [scale | shift | gate]; move the gate part by ``delta``."""
    out = bias.clone()
    third = out.shape[0] // 3
    out[2 * third :] += delta
    return out


def to_lerobot(state: dict[str, torch.Tensor], cfg: Pi05Config) -> dict[str, torch.Tensor]:
    """Our state dict -> LeRobot tensor names and layouts (normalizer buffers and state_proj are left out)."""
    renames = _renames(cfg)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module in renames:
            if _is_modulation(module) and leaf == "bias":
                value = _shift_gate_bias(value, -1.0)
            out[f"{renames[module]}.{leaf}"] = value
        elif key == "vision.pos_embed":
            out[VISION + "embeddings.position_embedding.weight"] = value[0]
        elif m := re.fullmatch(r"vision\.blocks\.(\d+)\.qkv\.(weight|bias)", key):
            for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"{VISION}encoder.layers.{m[1]}.self_attn.{name}_proj.{m[2]}"] = part.contiguous()
    return out


def from_lerobot(state: dict[str, torch.Tensor], cfg: Pi05Config, source: Path) -> dict[str, torch.Tensor]:
    """LeRobot tensor names -> ours. Unknown LeRobot tensors are an error (a different architecture)."""
    inverse = {theirs: ours for ours, theirs in _renames(cfg).items()}
    last = cfg.depth - 1
    dead_last_layer = re.compile(
        re.escape(f"{LANGUAGE}layers.{last}.") + r"(self_attn\.[qo]_proj|post_attention_layernorm|mlp\.\w+)\.weight"
    )
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module in inverse:
            ours = inverse[module]
            if _is_modulation(ours) and leaf == "bias":
                value = _shift_gate_bias(value, 1.0)
            out[f"{ours}.{leaf}"] = value
        elif key == VISION + "embeddings.position_embedding.weight":
            out["vision.pos_embed"] = value[None]
        elif m := re.fullmatch(re.escape(VISION) + r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", key):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = value
        elif any(p.fullmatch(key) for p in _UNUSED) or dead_last_layer.fullmatch(key):
            continue
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(source, f"tensors that are not part of pi0.5 as we build it: {unknown[:5]}")
    for (layer, leaf), parts in qkv.items():
        if set(parts) != set("qkv"):
            raise CheckpointError(source, f"vision layer {layer} has only {sorted(parts)} of q/k/v ({leaf})")
        out[f"vision.blocks.{layer}.qkv.{leaf}"] = torch.cat([parts[n] for n in "qkv"], dim=0)
    return out


def config_from_lerobot(lerobot: dict, source: Path) -> Pi05Config:
    """Our config for a LeRobot pi0.5 config.json: the full-size architecture with its I/O settings."""
    from roboscale.models.registry import preset_config

    try:
        width, depth, mlp, heads, kv, head_dim = GEMMA_VARIANTS[lerobot.get("paligemma_variant", "gemma_2b")]
        e_width, e_depth, e_mlp, e_heads, e_kv, e_head_dim = GEMMA_VARIANTS[
            lerobot.get("action_expert_variant", "gemma_300m")
        ]
    except KeyError as exc:
        raise CheckpointError(source, f"unknown Gemma variant {exc}; known: {sorted(GEMMA_VARIANTS)}") from None
    if (depth, heads, kv, head_dim) != (e_depth, e_heads, e_kv, e_head_dim):
        raise CheckpointError(source, "the language model and the action expert must share depth and head layout")
    features = lerobot.get("input_features") or {}
    cameras = [k for k, f in features.items() if isinstance(f, dict) and f.get("type") == "VISUAL"]
    resolution = lerobot.get("image_resolution") or [224, 224]
    cfg = preset_config("pi05", "full")
    cfg.width, cfg.depth, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim = width, depth, mlp, heads, kv, head_dim
    cfg.expert_width, cfg.expert_mlp_dim = e_width, e_mlp
    cfg.image_size = int(resolution[0])
    cfg.image_keys = cameras or cfg.image_keys
    cfg.state_dim = int(lerobot.get("max_state_dim", 32))
    cfg.action_dim = int(lerobot.get("max_action_dim", 32))
    cfg.chunk_size = int(lerobot.get("chunk_size", 50))
    cfg.n_action_steps = int(lerobot.get("n_action_steps", cfg.chunk_size))
    cfg.num_inference_steps = int(lerobot.get("num_inference_steps", 10))
    cfg.max_language_tokens = int(lerobot.get("tokenizer_max_length", 200))
    cfg.time_beta_alpha = float(lerobot.get("time_sampling_beta_alpha", 1.5))
    return cfg


def _normalizer_stats(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Stats from LeRobot's normalizer processor files: ``{feature: {stat: tensor}}``."""
    from safetensors.torch import load_file

    stats: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(directory.glob("policy_preprocessor_step_*_normalizer_processor.safetensors")):
        for key, value in load_file(str(path)).items():
            feature, _, stat = key.rpartition(".")
            stats.setdefault(feature, {})[stat] = value
    return stats


def load_lerobot_pi05(
    directory: str | Path,
    *,
    tokenizer_path: str | Path | None = None,
    config: Pi05Config | None = None,
    read_state: Callable[[Path], dict[str, torch.Tensor]] | None = None,
) -> Pi05Policy:
    """Load a LeRobot pi0.5 ``pretrained_model`` directory (config.json + model.safetensors).

    ``tokenizer_path``: a local PaliGemma ``tokenizer.json`` (LeRobot fetches it from the Hub; we never do).
    ``config``: our config to build, if not the one derived from LeRobot's config.json (e.g. tiny test sizes).
    """
    from safetensors.torch import load_file

    from roboscale.models.tokenizer import TaskTokenizer

    directory = Path(directory)
    if config is None:
        config = config_from_lerobot(json.loads((directory / "config.json").read_text()), directory / "config.json")
    tokenizer_path = Path(tokenizer_path) if tokenizer_path else directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(
            tokenizer_path,
            "LeRobot checkpoints do not contain their tokenizer; pass the PaliGemma tokenizer.json you have on disk "
            "(--policy.tokenizer_path=/path/to/tokenizer.json)",
        )
    tokenizer = TaskTokenizer.from_file(tokenizer_path)
    config.vocab_size = config.vocab_size or tokenizer.vocab_size
    config.state_input = "prompt"  # pi0.5 writes the state into the prompt; it has no state projection
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(weights, "weights file not found")
    state = (read_state or (lambda p: load_file(str(p))))(weights)
    policy = Pi05Policy(config, tokenizer)
    ours = from_lerobot(state, config, weights)
    # Normalization statistics are not weights in LeRobot: they come from its processor files below.
    buffers = frozenset(k for k in policy.state_dict() if k.startswith(("state_normalizer.", "action_normalizer.")))
    policy.check_state_dict(ours, weights, optional=buffers)
    policy.load_state_dict(ours, strict=False)
    stats = _normalizer_stats(directory)
    for normalizer, feature in ((policy.state_normalizer, config.state_key), (policy.action_normalizer, config.action_key)):
        if feature in stats:
            normalizer.set_stats({k: v.numpy() for k, v in stats[feature].items()}, feature)
    return policy
