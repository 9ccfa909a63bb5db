"""`roboscale model info`: parameter counts by component, from a build on the meta device (no memory, no time)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from roboscale.models.groot.modeling import component_of as groot_component
from roboscale.models.registry import get_spec, preset_config


@dataclass
class ModelInfoConfig:
    """`roboscale model info`: parameter breakdown of a policy at a named size, built on the meta device."""

    policy: str = "pi05"
    """Policy type (pi05 or groot)."""
    preset: str = "full"
    """Named size: full (the published architecture), demo (the CPU demo) or tiny (unit tests)."""
    overrides: dict[str, str] = field(default_factory=dict)
    """Config fields to change on top of the preset, e.g. {depth: 12}."""


# pi0.5: top-level module -> the component name users know. Joint layers are split into their two streams.
PI05_COMPONENTS = {
    "vision": "vision encoder (ViT)",
    "projector": "image projector",
    "embed_tokens": "token embeddings",
    "state_proj": "state projection",
    "action_in_proj": "action expert in/out + time MLP",
    "action_out_proj": "action expert in/out + time MLP",
    "time_mlp": "action expert in/out + time MLP",
    "expert_norm": "action expert layers",
}


def pi05_component(name: str) -> str:
    top = name.split(".")[0]
    if top == "layers":
        return "action expert layers" if ".expert_" in name else "language model layers"
    return PI05_COMPONENTS.get(top, top)


# Policy type -> parameter name -> component name.
COMPONENT_NAMERS: dict[str, Callable[[str], str]] = {"pi05": pi05_component, "groot": groot_component}


def component_of(name: str, policy: str = "pi05") -> str:
    return COMPONENT_NAMERS.get(policy, lambda n: n.split(".")[0])(name)


def parameter_breakdown(model: torch.nn.Module, policy: str = "pi05") -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():
        counts[component_of(name, policy)] += param.numel()
    return dict(counts)


def model_info(cfg: ModelInfoConfig) -> str:
    spec = get_spec(cfg.policy)
    from roboscale.config import from_dict, to_dict

    config = preset_config(cfg.policy, cfg.preset)
    if cfg.overrides:
        config = from_dict(spec.config_class, {**to_dict(config), **cfg.overrides}, where="--overrides")
    # Fields normally filled from the dataset and tokenizer: MetaWorld's sizes and our trained BPE's vocabulary.
    config.image_keys = config.image_keys or ["observation.images.corner2", "observation.images.wrist"]
    config.state_dim = config.state_dim or 4
    config.action_dim = config.action_dim or 4
    config.vocab_size = config.vocab_size or 512
    with torch.device("meta"):
        model = spec.policy_class(config)
    counts = parameter_breakdown(model, cfg.policy)
    total = sum(counts.values())
    lines = [f"{cfg.policy} ({cfg.preset}): {total / 1e9:.3f} B parameters" if total > 1e8 else
             f"{cfg.policy} ({cfg.preset}): {total / 1e6:.2f} M parameters"]
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:34s} {n / 1e6:10.2f} M  {100 * n / total:5.1f}%")
    note = getattr(model, "parameter_note", None)
    if note:
        lines += ["", note(total)]
    return "\n".join(lines)
