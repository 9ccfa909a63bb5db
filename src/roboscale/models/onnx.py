"""What a policy hands the ONNX exporter (``roboscale.deploy.export``): its computation split where it splits.

A policy's inference is ``encode`` once per observation, then ``velocity`` once per Euler step. For export each
policy writes the two as plain modules over tensors only (registered in its ``PolicySpec.onnx``), in the padded
layout (one row per sample, masks instead of packed streams, no data-dependent Python), reusing the policy's own
layers so that the graphs compute what the policy computes:

- ``encoder(images, state, tokens, token_mask) -> context``: uint8 cameras [B, n_cameras, 3, S, S] in
  ``image_keys`` order (fitted to the policy's square by the runtime), the normalized state [B, state_dim], the
  prompt's token ids [B, L] (right-padded) and their mask; ``context`` is whatever every step shares (pi0.5's
  prefix keys/values, GR00T's VL tokens), as tensors named by ``context``.
- ``denoise(x, t, *context) -> velocity``: noisy normalized actions [B, chunk_size, action_dim] at flow times
  t [B], in the policy's own time convention (``flow_matching``).

Everything around them (tokenization, normalization, the Euler loop, real-time chunking's guidance, the crop to
the dataset's width) is the runtime's, ``roboscale.deploy.runtime``, which needs only numpy and onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

ENCODER_INPUTS = ("images", "state", "tokens", "token_mask")
DENOISE_INPUTS = ("x", "t")


@dataclass
class OnnxModules:
    encoder: nn.Module
    """``forward(images, state, tokens, token_mask)`` -> a tuple of the ``context`` tensors, in that order."""
    denoise: nn.Module
    """``forward(x, t, *context)`` -> velocity [B, chunk_size, action_dim]."""
    context: tuple[str, ...]
    """The names of the encoder's outputs, which the denoiser takes after ``x`` and ``t``."""
    prompt: str = "task"
    """How the runtime writes the prompt: ``task`` (the cleaned instruction) or ``state_bins`` (pi0.5's prompt
    with the normalized state digitized into 256 bins, ``pi05.transform.state_prompt``)."""


class UnsupportedOperation(ValueError):
    """A policy's configuration uses an operation ONNX cannot express; the message names the operation and the
    option that avoids it."""


EXPORTABLE_BACKENDS = {"auto": "sdpa", "sdpa": "sdpa", "dense": "dense", "eager": "eager"}
"""The attention backends a padded batch runs in a graph (auto: what it picks on the CPU); varlen and flex are
kernels (flash-attention's, a compiled flex kernel) with no ONNX operator."""


def exportable_backend(backend: str) -> str:
    """The attention backend the graphs compute for a policy configured with ``backend``."""
    if backend not in EXPORTABLE_BACKENDS:
        raise UnsupportedOperation(
            f"policy.attention_backend={backend}: the {backend} attention kernel has no ONNX operator; export "
            f"with --onnx.attention_backend=sdpa (the same weights, the padded layout's attention)")
    return EXPORTABLE_BACKENDS[backend]
