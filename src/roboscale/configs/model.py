"""`roboscale model info`: which policy and size to describe."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelInfoConfig:
    """`roboscale model info`: parameter breakdown of a policy at a named size, built on the meta device."""

    policy: str = "pi05"
    """Policy type (pi05 or groot)."""
    preset: str = "full"
    """Named size: full (the published architecture), demo (the CPU demo) or tiny (unit tests)."""
    overrides: dict[str, str] = field(default_factory=dict)
    """Config fields to change on top of the preset, e.g. {depth: 12}."""


@dataclass
class ExportConfig:
    """`roboscale export CHECKPOINT --output DIR`: a checkpoint's consolidated policy as a standalone directory."""

    checkpoint: str = ""
    """A training output directory (its last checkpoint), a step directory (checkpoints/000500) or a
    pretrained_model directory."""
    output: str = ""
    """The directory to write (config.json, model.safetensors, tokenizer.json); must not exist yet."""
    format: str = "roboscale"
    """roboscale (ours), or lerobot (pi0.5: LeRobot's pretrained_model, which its PI05Policy.from_pretrained and
    processors load; the architecture must be one LeRobot builds: Gemma 2B/300M, SigLIP So400m, the state in the
    prompt)."""
