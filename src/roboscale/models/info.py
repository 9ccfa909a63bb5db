"""`roboscale model info`: parameter counts by component, from a build on the meta device (no memory, no time)."""

from __future__ import annotations

from collections import defaultdict

import torch

from roboscale.config import from_dict, to_dict
from roboscale.models.registry import get_spec, preset_config

# Fields a build fills from the dataset and tokenizer: MetaWorld's sizes and our trained BPE's vocabulary.
_DATASET_DEFAULTS = dict(image_keys=["observation.images.corner2", "observation.images.wrist"], state_dim=4,
                         action_dim=4, vocab_size=512)


def model_info(policy: str, preset: str, overrides: dict[str, str] | None = None) -> str:
    """Parameters per component of ``policy`` at its ``preset`` size (``overrides``: config fields over it), built
    on the meta device (`roboscale model info`)."""
    spec = get_spec(policy)
    config = preset_config(policy, preset)
    if overrides:
        config = from_dict(spec.config_class(), {**to_dict(config), **overrides}, where="--overrides")
    for name, value in _DATASET_DEFAULTS.items():
        setattr(config, name, getattr(config, name) or value)
    with torch.device("meta"):
        model = spec.policy_class()(config)
    counts: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():
        counts[model.component_of(name)] += param.numel()
    total = sum(counts.values())
    lines = [f"{policy} ({preset}): {total / 1e9:.3f} B parameters" if total > 1e8 else
             f"{policy} ({preset}): {total / 1e6:.2f} M parameters"]
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:34s} {n / 1e6:10.2f} M  {100 * n / total:5.1f}%")
    note = model.parameter_note(total)
    return "\n".join([*lines, "", note] if note else lines)
