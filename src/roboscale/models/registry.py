"""The policy registry: one ``PolicySpec`` per policy type, the one place a policy registers.

Nothing here imports a policy's model code: classes are named by "module:attribute" and imported on first use,
so ``roboscale train --help`` or a data command never pays for building GR00T. Importing this module makes every
policy's config selectable as ``--policy.type`` (``roboscale.config.register_lazy``).

What the engines need from a policy type is either here (presets, the objective, the FP8 filter, adapters for
another framework's checkpoints) or a method of the ``Policy`` contract (units to wrap, ``init_weights``,
``data_transforms``), so a new policy is one spec plus one package.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from roboscale.config import register_lazy
from roboscale.errors import CheckpointError, ConfigError
from roboscale.models.config import PolicyConfig
from roboscale.utils.imports import load as _load  # registered names only, never one read from a file

if TYPE_CHECKING:
    from roboscale.models.policy import Policy


@dataclass(frozen=True)
class Foreign:
    """Checkpoints written by another framework: ``detect(config_dict)`` recognises its config.json,
    ``load`` ("module:function", called as ``load(directory, **overrides)``) builds our policy from it,
    ``config`` ("module:function", called as ``config(config_dict, config_path)``) gives the config that policy is
    built with, which ``load`` also takes as ``config=`` (fine-tuning changes it first), and ``save`` writes one of
    ours in that framework's format."""

    detect: Callable[[dict], bool]
    load: str
    config: str | None = None
    save: str | None = None
    """"module:function" ``save(policy, directory)``: write our policy in the framework's format
    (``roboscale export --format=<format>``)."""
    format: str = "lerobot"
    """The framework's name, as ``--format`` takes it."""

    def loader(self) -> Callable[..., Any]:
        return _load(self.load)

    def saver(self) -> Callable[..., Any] | None:
        return _load(self.save) if self.save else None

    def config_reader(self) -> Callable[..., PolicyConfig] | None:
        return _load(self.config) if self.config else None


@dataclass(frozen=True)
class PolicySpec:
    name: str
    config: str
    """"module:Class" of the PolicyConfig subclass (a light module)."""
    policy: str
    """"module:Class" of the Policy."""
    presets: dict[str, dict] = field(default_factory=dict)
    """Named sizes: config overrides on top of the defaults (the defaults are the CPU demo size)."""
    objective: str = "roboscale.models.objective:flow_matching_loss"
    """"module:function" ``(policy, batch) -> (loss, metrics)`` the trainer minimises."""
    fp8_filter: str | None = None
    """"module:function" ``(module_name, module, min_features=None) -> bool``: the Linear layers FP8 training
    converts (``min_features`` lowers the width floor, for tests of tiny policies)."""
    flops: str | None = None
    """"module:function" ``(config) -> roboscale.models.flops.SampleFlops``: FLOPs of one training sample at the
    config's nominal size, by component; ``float()`` of it is the training total (MFU, ``roboscale plan``)."""
    foreign: Foreign | None = None
    onnx: str | None = None
    """"module:function" ``(policy) -> roboscale.models.onnx.OnnxModules``: its computation as the modules ONNX
    export traces (``roboscale export --format=onnx``); raises ``UnsupportedOperation`` for a configuration a graph
    cannot express."""
    uses_tokenizer: bool = True
    """The checkpoint carries tokenizer.json."""

    def config_class(self) -> type[PolicyConfig]:
        return _load(self.config)

    def policy_class(self) -> type[Policy]:
        return _load(self.policy)

    def loss(self) -> Callable[..., Any]:
        return _load(self.objective)

    def flops_function(self) -> Callable[..., Any] | None:
        return _load(self.flops) if self.flops else None

    def onnx_function(self) -> Callable[..., Any]:
        return _load(self.onnx)


PI05_PRESETS: dict[str, dict] = {
    "demo": {},
    # Unit tests: a few thousand parameters, milliseconds per step.
    "tiny": dict(image_size=32, vit_dim=32, vit_depth=1, vit_heads=2, pixel_shuffle=2, width=48, depth=2,
                 num_heads=2, head_dim=16, mlp_dim=64, expert_width=32, expert_mlp_dim=48),
    # openpi / LeRobot pi0.5: SigLIP So400m/14 at 224, PaliGemma's Gemma 2B, a Gemma 300M action expert,
    # 3 camera slots, 200 prompt tokens with the state written in, 50-step chunks, 32-d padded state/action.
    # Packed batches by default at this size (the packing benchmark's gain); --policy.packing=false gives
    # LeRobot's padded rows of 200 language positions.
    "full": dict(packing=True, pad_language_to=200, image_size=224, vit_patch_size=14, vit_dim=1152, vit_depth=27,
                 vit_heads=16, vit_mlp_dim=4304, vit_conv_stem=False, vit_norm_eps=1e-6, pixel_shuffle=1, width=2048,
                 depth=18, num_heads=8, num_kv_heads=1, head_dim=256, mlp_dim=16384, expert_width=1024, expert_mlp_dim=4096,
                 vocab_size=257152, state_input="prompt", max_language_tokens=200, chunk_size=50, n_action_steps=50,
                 state_dim=32, action_dim=32,
                 image_keys=["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb",
                             "observation.images.right_wrist_0_rgb"]),
}

GROOT_PRESETS: dict[str, dict] = {
    "demo": {},
    # Unit tests: well under a million parameters, milliseconds per step.
    "tiny": dict(image_size=32, vit_dim=32, vit_depth=1, vit_heads=2, pixel_shuffle=2, llm_width=48, llm_layers=2,
                 llm_heads=2, llm_kv_heads=1, llm_head_dim=16, llm_mlp_dim=64, vl_layers=1, vl_heads=2,
                 dit_layers=2, dit_width=32, dit_heads=2, hidden_size=32, num_future_tokens=2, num_embodiments=2,
                 chunk_size=6, n_action_steps=3, max_seq_len=8),
    # GR00T N1.5 (nvidia/GR00T-N1.5-3B): Eagle 2.5 with SigLIP-2 So400m/14 at 224 (no pixel shuffle, one-Linear
    # mlp1: 256 tokens per image), Qwen3-1.7B cut to 12 of 28 layers, frozen; 4 VL self-attention blocks at
    # 2048; a 16-block DiT at 1536 (32 x 48) with 1024-wide output; 32 embodiments (new_embodiment = 31);
    # 64-d state and 32-d actions (zero-padded maxima), 16-step chunks, 4 Euler steps, dropout 0.2.
    "full": dict(image_size=224, vit_patch_size=14, vit_dim=1152, vit_depth=27, vit_heads=16, vit_mlp_dim=4304,
                 vit_conv_stem=False, vit_norm_eps=1e-6, pixel_shuffle=1, projector_layers=1, llm_width=2048,
                 llm_layers=12, llm_heads=16, llm_kv_heads=8, llm_head_dim=128, llm_mlp_dim=6144, vocab_size=151680,
                 tune_llm=False, tune_visual=False, max_language_tokens=200, vl_layers=4, vl_heads=32,
                 dit_layers=16, dit_width=1536, dit_heads=32, hidden_size=1024, num_future_tokens=32,
                 max_seq_len=1024, num_embodiments=32, embodiment_id=31, dropout=0.2, chunk_size=16,
                 n_action_steps=16, state_dim=64, action_dim=32, image_keys=["observation.images.ego_view"]),
}

SPECS: dict[str, PolicySpec] = {
    "pi05": PolicySpec(
        "pi05",
        config="roboscale.models.pi05.config:Pi05Config",
        policy="roboscale.models.pi05.modeling:Pi05Policy",
        presets=PI05_PRESETS,
        fp8_filter="roboscale.models.pi05.modeling:fp8_filter",
        flops="roboscale.models.pi05.modeling:flops_per_sample",
        onnx="roboscale.models.pi05.onnx:onnx_modules",
        foreign=Foreign(detect=lambda config: "paligemma_variant" in config,
                        load="roboscale.models.pi05.lerobot:load_lerobot_pi05",
                        config="roboscale.models.pi05.lerobot:config_from_lerobot",
                        save="roboscale.models.pi05.lerobot:save_lerobot_pi05"),
    ),
    "groot": PolicySpec(
        "groot",
        config="roboscale.models.groot.config:GrootConfig",
        policy="roboscale.models.groot.modeling:GrootPolicy",
        presets=GROOT_PRESETS,
        fp8_filter="roboscale.models.groot.modeling:fp8_filter",
        flops="roboscale.models.groot.modeling:flops_per_sample",
        onnx="roboscale.models.groot.onnx:onnx_modules",
    ),
}
DEFAULT_POLICY = "pi05"

for _spec in SPECS.values():
    register_lazy(PolicyConfig, _spec.name, _spec.config)


def get_spec(name: str) -> PolicySpec:
    if name not in SPECS:
        raise ConfigError(f"unknown policy type {name!r}; known: {sorted(SPECS)}")
    return SPECS[name]


def spec_of_checkpoint(config_dict: dict, where: Path) -> PolicySpec:
    name = config_dict.get("type")
    if name not in SPECS:
        raise CheckpointError(where, f"unknown policy type {name!r}; this roboscale knows {sorted(SPECS)}")
    return SPECS[name]


def default_policy_config() -> PolicyConfig:
    """The policy a training gets without --policy.type (pi0.5 at the CPU demo size)."""
    return get_spec(DEFAULT_POLICY).config_class()()


def preset_config(name: str, preset: str = "demo", **overrides) -> PolicyConfig:
    """The config of a named size, e.g. ``preset_config("pi05", "full")``."""
    spec = get_spec(name)
    if preset not in spec.presets:
        raise ConfigError(f"policy {name!r} has no preset {preset!r}; presets: {sorted(spec.presets)}")
    return spec.config_class()(**{**spec.presets[preset], **overrides})


# Policy config fields a build fills from the dataset (or the tokenizer) when left at 0 / empty; fine-tuning
# (roboscale.models.finetune) fills the dataset_* widths.
FILLED_AT_BUILD = ("image_keys", "state_dim", "action_dim", "fps", "vocab_size", "dataset_state_dim",
                   "dataset_action_dim")


def feature_size(meta, key: str) -> int:
    """Values per frame of a dataset feature (its flattened shape), or a ConfigError naming the dataset."""
    if key not in meta.features:
        raise ConfigError(f"the dataset at {meta.root} has no feature {key!r} (it has {sorted(meta.features)})")
    return int(np.prod(meta.features[key]["shape"]))


def fit_to_dataset(cfg: PolicyConfig, meta) -> None:
    """Check a policy config against a dataset and fill its dataset-derived fields (cameras, state/action sizes,
    fps); a config already filled (a checkpoint's) is only checked. Errors name the feature and the dataset."""
    features = meta.features
    for key in (cfg.state_key, cfg.action_key):
        feature_size(meta, key)
    depth_keys = set(getattr(meta, "depth_keys", ()))
    if not cfg.image_keys:  # depth maps (LeRobot 0.6) are distances, not the RGB frames a policy's encoder takes
        cfg.image_keys = [k for k in meta.camera_keys if k not in depth_keys]
    missing = [k for k in cfg.image_keys if k not in features]
    if missing:
        raise ConfigError(f"cameras {missing} are not in the dataset at {meta.root} (cameras: {meta.camera_keys})")
    depth = [k for k in cfg.image_keys if k in depth_keys]
    if depth:
        raise ConfigError(f"camera {depth[0]!r} of the dataset at {meta.root} is a depth map (12-bit distances); "
                          f"{type(cfg).type} takes RGB frames: leave it out of --policy.image_keys")
    for name, key in (("state_dim", cfg.state_key), ("action_dim", cfg.action_key)):
        size = feature_size(meta, key)
        padded_from = getattr(cfg, f"dataset_{name}")
        if padded_from:  # fine-tuned from a checkpoint with room for more: the data is zero-padded to its size
            if padded_from != size:
                raise ConfigError(f"policy.dataset_{name} is {padded_from} (zero-padded to policy.{name}="
                                  f"{getattr(cfg, name)}) but {key!r} of the dataset at {meta.root} has {size} values")
            continue
        if getattr(cfg, name) and getattr(cfg, name) != size:
            # a full-size preset's padded sizes (32 / 64): only fine-tuning (pretrained_path) zero-pads a dataset
            raise ConfigError(f"policy.{name} is {getattr(cfg, name)} but {key!r} of the dataset at {meta.root} has "
                              f"{size} values; set --policy.{name}={size} (or 0 to take it from the dataset)")
        setattr(cfg, name, getattr(cfg, name) or size)
    if cfg.fps and float(cfg.fps) != float(meta.fps):
        raise ConfigError(f"policy.fps is {cfg.fps} but the dataset at {meta.root} has fps {meta.fps}: its action "
                          "chunks would span another stretch of time")
    cfg.fps = cfg.fps or float(meta.fps)


def build_policy(cfg: PolicyConfig, meta, extra_texts: Sequence[str] = ()) -> Policy:
    """A policy for a dataset: its config filled from the data, a tokenizer (the config's tokenizer.json, or a small
    BPE trained on the dataset's task strings and ``extra_texts``: the instructions training will read besides),
    weights initialised, normalization statistics set."""
    from roboscale.models.tokenizer import TaskTokenizer

    fit_to_dataset(cfg, meta)
    spec = get_spec(type(cfg).type)
    tokenizer = None
    if spec.uses_tokenizer:
        tokenizer = (TaskTokenizer.from_file(cfg.tokenizer_path) if cfg.tokenizer_path
                     else TaskTokenizer.train([*meta.task_list, *extra_texts], cfg.tokenizer_train_vocab))
        cfg.vocab_size = tokenizer.vocab_size
    policy = spec.policy_class()(cfg, tokenizer)
    if meta.stats is None:
        raise ConfigError(f"the dataset at {meta.root} has no normalization statistics (meta/stats.json)")
    policy.set_normalization(meta.stats)
    return policy
