"""LeRobot pi0.5 checkpoints <-> our Pi05Policy: tensor names, the few layout differences, the config, and the
processing conventions a LeRobot checkpoint is run with.

Checked against LeRobot 0.4.4's own ``PI05Policy`` (``lerobot/policies/pi05/``, on transformers 4.53.2 with openpi's
``transformers_replace`` patch) by ``tests/models/test_lerobot_oracle.py``: a random LeRobot model, saved by LeRobot,
loads here and computes LeRobot's action chunk and loss; ours, saved by ``save_lerobot_pi05``, loads in LeRobot and
computes ours.

Tensor names. LeRobot (and openpi's PyTorch port) name pi0.5's tensors after Hugging Face's PaliGemma/Gemma/SigLIP
modules, under ``model.paligemma_with_expert.{paligemma,gemma_expert}``. Per tensor family:

| ours | LeRobot (``model.`` + ...) | transform |
|---|---|---|
| ``vision.patch_embed`` | ``paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding`` | - |
| ``vision.pos_embed`` [1, N, D] | ``...embeddings.position_embedding.weight`` [N, D] | reshape |
| ``vision.blocks.{i}.qkv`` | ``...encoder.layers.{i}.self_attn.{q,k,v}_proj`` | concatenate / split |
| ``vision.blocks.{i}.proj``, ``norm1``, ``norm2``, ``fc1``, ``fc2`` | ``...self_attn.out_proj``, ``layer_norm1``, ``layer_norm2``, ``mlp.fc1``, ``mlp.fc2`` | - |
| ``vision.norm`` | ``...vision_model.post_layernorm`` | - |
| ``projector`` | ``paligemma_with_expert.paligemma.model.multi_modal_projector.linear`` | - |
| ``embed_tokens`` | ``paligemma_with_expert.paligemma.lm_head`` (tied: see below) | - |
| ``layers.{i}.{q,k,v,o}_proj``, ``input_norm``, ``post_norm``, ``mlp.*`` | ``...language_model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``input_layernorm``, ``post_attention_layernorm``, ``mlp.*`` | - |
| ``layers.{i}.expert_*`` | ``paligemma_with_expert.gemma_expert.model.layers.{i}.*`` (same names) | - |
| ``layers.{i}.expert_{input,post}_norm.modulation`` | ``...input_layernorm.dense`` / ``post_attention_layernorm.dense`` | gate bias + 1 |
| ``expert_norm.modulation`` | ``paligemma_with_expert.gemma_expert.model.norm.dense`` | gate bias + 1 |
| ``action_in_proj``, ``action_out_proj`` | ``action_in_proj``, ``action_out_proj`` | - |
| ``time_mlp.0``, ``time_mlp.2`` | ``time_mlp_in``, ``time_mlp_out`` | - |

Facts behind the table, with their sources:

- **The input embedding is stored once, as ``lm_head``.** PaliGemma ties its language model's ``embed_tokens`` to
  ``lm_head`` (one Parameter); LeRobot's ``save_pretrained`` writes the file with safetensors' ``save_model``,
  which keeps one name of a shared tensor, ``model.paligemma_with_expert.paligemma.lm_head.weight``, and records
  ``{"...language_model.embed_tokens.weight": "...paligemma.lm_head.weight"}`` as the file's only metadata
  (``lerobot/policies/pretrained.py``). LeRobot reads it back through the tie. We read ``embed_tokens`` from
  ``lm_head`` when it is absent, and write it the same way.
- **"gate bias + 1".** LeRobot's (openpi's) adaRMSNorm gates the residual branch with the gate itself,
  ``x + y * gate`` (``_gated_residual`` in openpi's ``transformers_replace/models/gemma/modeling_gemma.py``); ours
  with ``1 + gate`` (a zero-initialised modulation starts as a plain residual). So LeRobot's gate bias is ours
  plus one: loading subtracts 1 from the last third of the modulation bias ([scale | shift | gate]), saving adds 1.
- **Tensors nothing reads.** Both ``lm_head`` weights (the expert's too), the language model's final ``norm``, and
  the last language-model layer's query/output projections, post-attention norm and MLP: LeRobot computes and
  discards them (only the last layer's keys and values feed the action expert). We do not build them; loading
  drops them, saving writes them as zeros (LeRobot's strict load wants every tensor).
- **Architecture.** ``paligemma_variant`` / ``action_expert_variant`` name openpi's Gemma configs
  (``GEMMA_VARIANTS``: ``get_gemma_config`` in ``modeling_pi05.py``); the vision tower is SigLIP So400m/14
  (``SIGLIP``: transformers' PaliGemma default vision config, with ``intermediate_size = 4304`` set by
  ``modeling_pi05.py``; LayerNorm eps 1e-6); the vocabulary is PaliGemma's 257,152 (read from the weights).
- **Widths.** ``max_state_dim`` / ``max_action_dim`` (32) are the model's; the dataset's widths are the shapes of
  ``observation.state`` and ``action`` in ``input_features`` / ``output_features``, and the processor files'
  statistics have the dataset's width (``policy_preprocessor_step_*_normalizer_processor.safetensors``, keys
  ``<feature>.<stat>``). Normalized values are zero-padded to the model's width, predictions cropped back
  (``PI05Policy.prepare_action``, ``predict_action_chunk``).

Processing conventions a LeRobot checkpoint gets (set by ``config_from_lerobot``, each an option of Pi05Config):

- **The prompt** (``Pi05PrepareStateTokenizerProcessorStep``, ``processor_pi05.py``): the normalized state zero-padded
  to ``max_state_dim`` *before* it is digitized (``prompt_state_padded=True``: 32 numbers for an 8-d state; openpi's
  tokenizer writes the unpadded state), ``np.digitize(x, linspace(-1, 1, 257)[:-1]) - 1`` with no clamp (a value
  below -1 is bin -1), the task stripped with underscores and newlines made spaces, in
  ``"Task: {task}, State: {bins};\\nAction: "``; the tokenizer adds ``<bos>`` and truncates to
  ``tokenizer_max_length``.
- **A missing camera** (``PI05Policy._preprocess_images``): a camera slot of the checkpoint that the observation does
  not have is an image of -1 with its mask off (``missing_cameras="empty"``); at least one camera must be present.
- **The loss** (``PI05Policy.forward``): the mean over the dataset's action dimensions (``loss_action_dims=
  "dataset"``; ours and openpi's average over all 32). ``--policy.loss_action_dims=all`` chooses openpi's.
  LeRobot's pi0.5 also counts the action steps past an episode's end; we leave them out unless
  ``--policy.action_loss_mask=false``.
- **Images** are float in [0, 1] mapped to [-1, 1]; frames of another size are resized by LeRobot with
  ``resize_with_pad_torch`` (bilinear, no antialiasing), by us with antialiasing (the same at the checkpoint's
  resolution).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.pi05.modeling import Pi05Policy
from roboscale.utils.io import load_json

VLM = "model.paligemma_with_expert.paligemma.model."
VISION = VLM + "vision_tower.vision_model."
LANGUAGE = VLM + "language_model."
EXPERT = "model.paligemma_with_expert.gemma_expert.model."
LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
EXPERT_LM_HEAD = "model.paligemma_with_expert.gemma_expert.lm_head.weight"
EMBED = LANGUAGE + "embed_tokens.weight"

# Gemma variants LeRobot knows (openpi gemma.get_config): width, depth, mlp_dim, num_heads, num_kv_heads, head_dim.
GEMMA_VARIANTS = {
    "gemma_2b": (2048, 18, 16384, 8, 1, 256),
    "gemma_300m": (1024, 18, 4096, 8, 1, 256),
}
# PaliGemma's vision tower in LeRobot's pi0.5: SigLIP So400m/14 (our Pi05Config field names).
SIGLIP = dict(vit_patch_size=14, vit_dim=1152, vit_depth=27, vit_heads=16, vit_mlp_dim=4304, vit_norm_eps=1e-6)
# The processor names LeRobot's pi0.5 writes (processor_pi05.py) and their file names (processor/pipeline.py).
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor", "policy_postprocessor"
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"
# our normalization modes <-> LeRobot's NormalizationMode names
_NORM_MODES = {"identity": "IDENTITY", "mean_std": "MEAN_STD", "min_max": "MIN_MAX", "quantiles": "QUANTILES"}

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
    "expert_norm.modulation": EXPERT + "norm.dense",
    "action_in_proj": "model.action_in_proj",
    "action_out_proj": "model.action_out_proj",
    "time_mlp.0": "model.time_mlp_in",
    "time_mlp.2": "model.time_mlp_out",
}
# LeRobot tensors with no counterpart here (nothing reads them).
_UNUSED = [
    re.compile(re.escape(EXPERT_LM_HEAD)),
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


def unused_tensors(cfg: Pi05Config) -> dict[str, tuple[int, ...]]:
    """LeRobot's tensors that nothing reads (we do not build them), by name and shape."""
    w, q, last = cfg.width, cfg.num_heads * cfg.head_dim, f"{LANGUAGE}layers.{cfg.depth - 1}."
    return {
        EXPERT_LM_HEAD: (cfg.vocab_size, cfg.expert_width),
        LANGUAGE + "norm.weight": (w,),
        last + "self_attn.q_proj.weight": (q, w),
        last + "self_attn.o_proj.weight": (w, q),
        last + "post_attention_layernorm.weight": (w,),
        last + "mlp.gate_proj.weight": (cfg.mlp_dim, w),
        last + "mlp.up_proj.weight": (cfg.mlp_dim, w),
        last + "mlp.down_proj.weight": (w, cfg.mlp_dim),
    }


def _is_modulation(name: str) -> bool:
    return name.endswith(".modulation")


def _shift_gate_bias(bias: torch.Tensor, delta: float) -> torch.Tensor:
    """adaRMSNorm bias is [scale | shift | gate]; move the gate part by ``delta``."""
    out = bias.clone()
    third = out.shape[0] // 3
    out[2 * third :] += delta
    return out


def to_lerobot(state: Mapping[str, torch.Tensor], cfg: Pi05Config) -> dict[str, torch.Tensor]:
    """Our state dict -> every tensor of LeRobot's ``PI05Policy`` under its names (the ones nothing reads as
    zeros; the tied input embedding under ``lm_head`` only, as LeRobot's files store it). Normalizer buffers and a
    value head are not LeRobot's and are left out."""
    renames = _renames(cfg)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module in renames:
            if _is_modulation(module) and leaf == "bias":
                value = _shift_gate_bias(value, 1.0)
            out[f"{renames[module]}.{leaf}"] = value
        elif key == "embed_tokens.weight":
            out[LM_HEAD] = value
        elif key == "vision.pos_embed":
            out[VISION + "embeddings.position_embedding.weight"] = value[0]
        elif m := re.fullmatch(r"vision\.blocks\.(\d+)\.qkv\.(weight|bias)", key):
            for name, part in zip("qkv", value.chunk(3, dim=0), strict=True):
                out[f"{VISION}encoder.layers.{m[1]}.self_attn.{name}_proj.{m[2]}"] = part.contiguous()
    dtype = next(iter(out.values())).dtype if out else torch.float32
    for name, shape in unused_tensors(cfg).items():
        out.setdefault(name, torch.zeros(shape, dtype=dtype))
    return out


def lerobot_key_fixes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The key fixes LeRobot's ``PI05Policy.from_pretrained`` applies before loading (``_fix_pytorch_state_dict_keys``,
    after openpi's): files converted from openpi's PyTorch port name ``action_time_mlp_*`` what is ``time_mlp_*``,
    may carry a ``state_proj`` (pi0's) and the expert's plain RMSNorm weights (the adaRMSNorm replaces them), and
    may lack the ``model.`` prefix."""
    plain_expert_norm = re.compile(r"paligemma_with_expert\.gemma_expert\.model\.(layers\.\d+\.(input_layernorm|"
                                   r"post_attention_layernorm)|norm)\.weight")
    fixed: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        bare = key.removeprefix("model.")
        if plain_expert_norm.fullmatch(bare) or bare.startswith("state_proj."):
            continue
        for old, new in (("action_time_mlp_in.", "time_mlp_in."), ("action_time_mlp_out.", "time_mlp_out.")):
            if bare.startswith(old):
                bare = new + bare.removeprefix(old)
        fixed["model." + bare] = value
    return fixed


def from_lerobot(state: Mapping[str, torch.Tensor], cfg: Pi05Config, source: Path) -> dict[str, torch.Tensor]:
    """LeRobot tensor names -> ours (after LeRobot's own key fixes). Unknown LeRobot tensors are an error (a
    different architecture)."""
    state = lerobot_key_fixes(state)
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
                value = _shift_gate_bias(value, -1.0)
            out[f"{ours}.{leaf}"] = value
        elif key in (EMBED, LM_HEAD):
            if key == EMBED or "embed_tokens.weight" not in out:  # tied: either name holds the embedding
                out["embed_tokens.weight"] = value
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


def _features(lerobot: dict, key: str, source: Path) -> dict[str, dict]:
    features = lerobot.get(key) or {}
    if not isinstance(features, dict) or not all(isinstance(f, dict) for f in features.values()):
        raise CheckpointError(source, f"{key} must map feature names to {{type, shape}}")
    return features


def _width(features: dict[str, dict], name: str, room: int, source: Path) -> int:
    """The dataset's width of ``name`` (its feature's shape) when narrower than the model's ``room``, else 0."""
    shape = (features.get(name) or {}).get("shape")
    if shape is None:
        return 0
    try:
        width = int(torch.Size(shape).numel())
    except (TypeError, ValueError):
        raise CheckpointError(source, f"{name}: shape {shape!r} is not a list of sizes") from None
    if width > room:
        raise CheckpointError(source, f"{name} has {width} values, more than the model's {room} (max_*_dim)")
    return width if width < room else 0


def config_from_lerobot(lerobot: dict, source: Path) -> Pi05Config:
    """Our config for a LeRobot pi0.5 config.json: its architecture, I/O settings and processing conventions."""
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
    for name, ours in (("time_sampling_beta_beta", 1.0), ("time_sampling_scale", 0.999),
                       ("time_sampling_offset", 0.001), ("min_period", 4e-3), ("max_period", 4.0)):
        if float(lerobot.get(name, ours)) != ours:
            raise CheckpointError(source, f"{name} is {lerobot[name]}; we compute pi0.5 with {ours}")
    inputs = _features(lerobot, "input_features", source)
    outputs = _features(lerobot, "output_features", source)
    cameras = [k for k, f in inputs.items() if f.get("type") == "VISUAL"]
    resolution = lerobot.get("image_resolution") or [224, 224]
    cfg = preset_config("pi05", "full", **SIGLIP, vocab_size=0)  # the vocabulary: from the weights
    cfg.width, cfg.depth, cfg.mlp_dim = width, depth, mlp
    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim = heads, kv, head_dim
    cfg.expert_width, cfg.expert_mlp_dim = e_width, e_mlp
    cfg.image_size = int(resolution[0])
    cfg.image_keys = cameras or cfg.image_keys
    cfg.state_dim = int(lerobot.get("max_state_dim", 32))
    cfg.action_dim = int(lerobot.get("max_action_dim", 32))
    cfg.dataset_state_dim = _width(inputs, cfg.state_key, cfg.state_dim, source)
    cfg.dataset_action_dim = _width(outputs, cfg.action_key, cfg.action_dim, source)
    cfg.chunk_size = int(lerobot.get("chunk_size", 50))
    cfg.n_action_steps = int(lerobot.get("n_action_steps", cfg.chunk_size))
    cfg.num_inference_steps = int(lerobot.get("num_inference_steps", 10))
    cfg.max_language_tokens = int(lerobot.get("tokenizer_max_length", 200))
    cfg.pad_language_to = cfg.max_language_tokens
    cfg.time_beta_alpha = float(lerobot.get("time_sampling_beta_alpha", 1.5))
    modes = {v: k for k, v in _NORM_MODES.items()}
    mapping = lerobot.get("normalization_mapping") or {}
    cfg.state_norm = modes.get(str(mapping.get("STATE", "QUANTILES")), "quantiles")
    cfg.action_norm = modes.get(str(mapping.get("ACTION", "QUANTILES")), "quantiles")
    # LeRobot's processing (the module docstring)
    cfg.state_input = "prompt"
    cfg.prompt_state_padded = True
    cfg.missing_cameras = "empty"
    cfg.loss_action_dims = "dataset"
    return cfg


def _normalizer_stats(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Stats from LeRobot's normalizer processor files: ``{feature: {stat: tensor}}``."""
    from safetensors.torch import load_file

    stats: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(directory.glob(f"{PREPROCESSOR}_step_*_normalizer_processor.safetensors")):
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
    """Load a LeRobot pi0.5 ``pretrained_model`` directory (config.json + model.safetensors + processor files).

    ``tokenizer_path``: a local PaliGemma ``tokenizer.json`` (LeRobot fetches it from the Hub; we never do).
    ``config``: our config to build, if not the one derived from LeRobot's config.json (fine-tuning adapts it).
    """
    from safetensors.torch import load_file

    from roboscale.models.tokenizer import TaskTokenizer

    directory = Path(directory)
    adapted = config is not None  # fine-tuning's: its widths are a dataset's, whose statistics it sets itself
    if config is None:
        config = config_from_lerobot(load_json((directory / "config.json").read_text()), directory / "config.json")
    tokenizer_path = Path(tokenizer_path) if tokenizer_path else directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(
            tokenizer_path,
            "LeRobot checkpoints do not contain their tokenizer; pass the PaliGemma tokenizer.json you have on disk "
            "(--policy.tokenizer_path=/path/to/tokenizer.json)",
        )
    tokenizer = TaskTokenizer.from_file(tokenizer_path)
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(weights, "weights file not found")
    ours = from_lerobot((read_state or (lambda p: load_file(str(p))))(weights), config, weights)
    if "embed_tokens.weight" not in ours:
        raise CheckpointError(weights, f"has neither {EMBED} nor {LM_HEAD} (the input embedding)")
    rows = ours["embed_tokens.weight"].shape[0]
    if tokenizer.vocab_size > rows:
        raise CheckpointError(tokenizer_path, f"has {tokenizer.vocab_size} tokens, the checkpoint's embedding {rows}")
    config.vocab_size = rows
    config.state_input = "prompt"  # pi0.5 writes the state into the prompt; it has no state projection
    policy = Pi05Policy(config, tokenizer)
    # Normalization statistics are not weights in LeRobot: they come from its processor files below.
    buffers = frozenset(k for k in policy.state_dict() if k.startswith(("state_normalizer.", "action_normalizer.")))
    policy.check_state_dict(ours, weights, optional=buffers)
    policy.load_state_dict(ours, strict=False)
    stats = _normalizer_stats(directory)
    for normalizer, feature in ((policy.state_normalizer, config.state_key),
                                (policy.action_normalizer, config.action_key)):
        width = normalizer.data_dim or normalizer.dim
        if feature in stats and not (adapted and any(v.numel() != width for v in stats[feature].values())):
            try:  # LeRobot normalizes with the checkpoint's statistics as they are (no degenerate-range repair)
                normalizer.set_stats({k: v.numpy() for k, v in stats[feature].items()}, feature, repair=False)
            except ValueError as exc:
                raise CheckpointError(directory / f"{PREPROCESSOR}.json", str(exc)) from None
    return policy


def lerobot_config(cfg: Pi05Config) -> dict[str, Any]:
    """LeRobot's config.json (``PI05Config``) for a policy of ours, or a ConfigError naming what LeRobot's pi0.5
    cannot compute."""
    variants = {dims: name for name, dims in GEMMA_VARIANTS.items()}
    lm = (cfg.width, cfg.depth, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    expert = (cfg.expert_width, cfg.depth, cfg.expert_mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    required = {**SIGLIP, "state_input": "prompt", "vit_conv_stem": False, "pixel_shuffle": 1,
                "state_key": "observation.state", "action_key": "action"}
    if cfg.dataset_state_dim:  # LeRobot writes the padded state into the prompt; without padding both agree
        required["prompt_state_padded"] = True
    problems = [f"policy.{name} is {getattr(cfg, name)!r} (LeRobot: {value!r})" for name, value in required.items()
                if getattr(cfg, name) != value]
    for tower, dims in (("language model", lm), ("action expert", expert)):
        if dims not in variants:
            problems.append(f"the {tower} (width, depth, mlp, heads, kv heads, head dim) {dims} is none of "
                            f"LeRobot's Gemma variants {GEMMA_VARIANTS}")
    if problems:
        raise ConfigError("LeRobot's pi0.5 cannot compute this policy: " + "; ".join(problems))
    s = cfg.image_size
    return {
        "type": "pi05",
        "input_features": {**{k: {"type": "VISUAL", "shape": [3, s, s]} for k in cfg.image_keys},
                           cfg.state_key: {"type": "STATE", "shape": [cfg.dataset_state_dim or cfg.state_dim]}},
        "output_features": {cfg.action_key: {"type": "ACTION", "shape": [cfg.dataset_action_dim or cfg.action_dim]}},
        "paligemma_variant": variants[lm],
        "action_expert_variant": variants[expert],
        "dtype": "float32",
        "chunk_size": cfg.chunk_size,
        "n_action_steps": cfg.n_action_steps,
        "max_state_dim": cfg.state_dim,
        "max_action_dim": cfg.action_dim,
        "num_inference_steps": cfg.num_inference_steps,
        "time_sampling_beta_alpha": cfg.time_beta_alpha,
        "image_resolution": [s, s],
        "tokenizer_max_length": cfg.max_language_tokens,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": _NORM_MODES[cfg.state_norm],
                                  "ACTION": _NORM_MODES[cfg.action_norm]},
    }


def _processors(cfg: Pi05Config, features: dict[str, Any], norm_map: dict[str, str]) -> dict[str, dict]:
    """LeRobot's processor pipelines of pi0.5 (``make_pi05_pre_post_processors``) as its json files hold them."""
    normalized = {**features["input_features"], **features["output_features"]}
    return {
        PREPROCESSOR: {"name": PREPROCESSOR, "steps": [
            {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
            {"registry_name": "to_batch_processor", "config": {}},
            {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "features": normalized,
                                                                 "norm_map": norm_map},
             "state_file": f"{PREPROCESSOR}_step_2_normalizer_processor.safetensors"},
            {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
            {"registry_name": "tokenizer_processor", "config": {
                "max_length": cfg.max_language_tokens, "task_key": "task", "padding_side": "right",
                "padding": "max_length", "truncation": True, "tokenizer_name": PALIGEMMA_TOKENIZER}},
            {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
        ]},
        POSTPROCESSOR: {"name": POSTPROCESSOR, "steps": [
            {"registry_name": "unnormalizer_processor", "config": {"eps": 1e-8,
                                                                   "features": features["output_features"],
                                                                   "norm_map": norm_map},
             "state_file": f"{POSTPROCESSOR}_step_0_unnormalizer_processor.safetensors"},
            {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
        ]},
    }


def save_lerobot_pi05(policy: Pi05Policy, directory: str | Path) -> Path:
    """Write ``policy`` as LeRobot writes a pi0.5 ``pretrained_model``: config.json, model.safetensors (LeRobot's
    names, the embedding stored once as ``lm_head``), the processor files with the dataset-width statistics, and
    our tokenizer.json beside them (LeRobot's processor asks the Hub for PaliGemma's). Each file atomically."""
    from safetensors.torch import save_file

    from roboscale.utils.io import atomic_path, atomic_write_json

    cfg = policy.config
    config = lerobot_config(cfg)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in to_lerobot(policy.state_dict(), cfg).items()}
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={EMBED: LM_HEAD})  # safetensors' save_model's record of the tie
    for name, pipeline in _processors(cfg, config, config["normalization_mapping"]).items():
        atomic_write_json(directory / f"{name}.json", pipeline, indent=2)
    stats = {}
    for feature, normalizer in ((cfg.state_key, policy.state_normalizer), (cfg.action_key, policy.action_normalizer)):
        width = normalizer.data_dim or normalizer.dim
        stats.update({f"{feature}.{k}": v[:width].detach().float().contiguous().cpu()
                      for k, v in normalizer.stats().items()})
    for path in (f"{PREPROCESSOR}_step_2_normalizer_processor.safetensors",
                 f"{POSTPROCESSOR}_step_0_unnormalizer_processor.safetensors"):  # LeRobot writes both with all stats
        with atomic_path(directory / path) as tmp:
            save_file(stats, str(tmp))
    atomic_write_json(directory / "config.json", config)
    if policy.tokenizer is not None:
        policy.tokenizer.save(directory / "tokenizer.json")
    return directory
