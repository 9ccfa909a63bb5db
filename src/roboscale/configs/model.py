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
class OnnxExportOptions:
    """--format=onnx: which graphs to write (``roboscale.deploy.export``)."""

    attention_backend: str = ""
    """The attention the graphs compute (empty: the checkpoint's; auto is sdpa): sdpa, dense or eager. varlen and
    flex are kernels with no ONNX operator."""
    rtc: bool = True
    """Also write the guided denoiser real-time chunking needs (serve --rtc; its backward pass traced in)."""
    unrolled: bool = True
    """Also write the whole chunk as one graph (the encoder and every Euler step unrolled): 4.2x eager PyTorch at
    batch 1 on 2 CPU cores against the split graphs' 1.3x (docs/benchmarks.md); false saves its export time and
    file."""
    preferred_graph: str = "chunk"
    """What the runtime runs by default: chunk (the unrolled graph; real-time chunking's guided requests always run
    the split graphs) or split (the encoder, then the denoiser once per step)."""
    tolerance: float = 1e-4
    """The export is checked against PyTorch on the same observations and noise before it is written: the largest
    action error allowed, relative to the chunk's largest action."""


@dataclass
class ExportConfig:
    """`roboscale export CHECKPOINT --output DIR`: a checkpoint's consolidated policy as a standalone directory."""

    checkpoint: str = ""
    """A training output directory (its last checkpoint), a step directory (checkpoints/000500) or a
    pretrained_model directory."""
    output: str = ""
    """The directory to write (config.json, model.safetensors, tokenizer.json); must not exist yet."""
    format: str = "roboscale"
    """roboscale (ours), onnx (graphs onnxruntime runs: `roboscale serve --backend=onnx`, `roboscale eval
    --policy.backend=onnx`, examples/onnx_client.py; --onnx.*), or lerobot (pi0.5: LeRobot's pretrained_model, which its PI05Policy.from_pretrained and
    processors load; the architecture must be one LeRobot builds: Gemma 2B/300M, SigLIP So400m, the state in the
    prompt)."""
    onnx: OnnxExportOptions = field(default_factory=OnnxExportOptions)
    """--format=onnx: the graphs to write."""
