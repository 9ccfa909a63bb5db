"""Analytical FLOPs of one training sample, from a policy's config alone (for MFU and ``roboscale plan``).

Each policy's registry entry names a function ``(config) -> SampleFlops`` that counts the forward matmuls of its
components (``linear_flops`` for weight matmuls and convolutions, ``attention_flops`` for the score and value
matmuls) at the config's nominal size: every camera, the longest prompt, one action chunk. Element-wise work
(norms, activations, softmax, RoPE) is not counted, as in every MFU convention.

Training FLOPs per component, the rule (``ComponentFlops.training``):
- weights train: forward + backward = 3x (backward computes both the input and the weight gradient of every
  matmul, each as large as the forward);
- weights frozen, but something upstream trains, so gradients must flow through: weight matmuls 2x (input
  gradients only), attention matmuls 3x (both of their operands are activations, so both gradients are needed);
- weights frozen and nothing upstream trains: 1x (forward only; autograd records nothing).
Components are listed in data-flow order, so "upstream" is "listed earlier". The first layer's input gradient is
counted although nothing needs it (under 1% at every preset).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def linear_flops(tokens: int, fan_in: int, fan_out: int) -> int:
    """Forward FLOPs of a dense layer over ``tokens`` rows (a multiply-add counts 2)."""
    return 2 * tokens * fan_in * fan_out


def attention_flops(queries: int, keys: int, heads: int, head_dim: int) -> int:
    """Forward FLOPs of the score (QK^T) and value (PV) matmuls, every query against every key. A causal mask is
    not discounted: the usual MFU convention, and what ``torch.utils.flop_counter`` reports."""
    return 4 * queries * keys * heads * head_dim


def vit_flops(cfg) -> tuple[int, int]:
    """Forward FLOPs of one image through ``layers.VisionTransformer.from_config(cfg)``: (weight matmuls and
    convolutions, attention matmuls)."""
    grid = cfg.image_size // cfg.vit_patch_size
    dim, mlp = cfg.vit_dim, cfg.vit_mlp_dim or 4 * cfg.vit_dim
    if cfg.vit_conv_stem:  # layers.conv_stem_embed: stride-2 3x3 convolutions, widening to dim
        stages = cfg.vit_patch_size.bit_length() - 1
        widths = [3] + [max(dim >> (stages - i), 16) for i in range(1, stages)] + [dim]
        stem = sum(2 * (cfg.image_size >> (i + 1)) ** 2 * 9 * widths[i] * widths[i + 1] for i in range(stages))
    else:  # one patchify convolution: a dense layer per patch
        stem = linear_flops(grid * grid, 3 * cfg.vit_patch_size**2, dim)
    tokens = grid * grid
    block = linear_flops(tokens, dim, 3 * dim) + linear_flops(tokens, dim, dim) + 2 * linear_flops(tokens, dim, mlp)
    return stem + cfg.vit_depth * block, cfg.vit_depth * attention_flops(tokens, tokens, 1, dim)


@dataclass(frozen=True)
class ComponentFlops:
    """One component's forward FLOPs per sample and what its backward costs (the module docstring's rule)."""

    name: str
    linear: int
    """Forward FLOPs of weight matmuls and convolutions."""
    attention: int
    """Forward FLOPs of attention's score and value matmuls."""
    trains: bool
    """Its weights get gradients."""
    backprop: bool
    """Gradients flow through its activations to something upstream that trains."""

    @property
    def forward(self) -> int:
        return self.linear + self.attention

    @property
    def training(self) -> int:
        if self.trains:
            return 3 * self.forward
        if self.backprop:
            return 2 * self.linear + 3 * self.attention
        return self.forward


@dataclass(frozen=True)
class SampleFlops:
    """FLOPs of one training sample by component. ``float()`` of it is the training total (what MFU divides)."""

    components: tuple[ComponentFlops, ...]
    tokens: int = 0
    """Positions that carry data at this nominal size, counted as the policy's ``Encoded.tokens`` counts them, so
    the FLOPs can be scaled to the tokens real samples have (prompts shorter than the longest, missing cameras)."""

    @property
    def forward(self) -> int:
        return sum(c.forward for c in self.components)

    @property
    def training(self) -> int:
        return sum(c.training for c in self.components)

    def __float__(self) -> float:
        return float(self.training)

    def __getitem__(self, name: str) -> ComponentFlops:
        for component in self.components:
            if component.name == name:
                return component
        raise KeyError(f"no component {name!r}; components: {[c.name for c in self.components]}")

    def frozen(self, names: Iterable[str]) -> SampleFlops:
        """The same sample with the components ``names`` frozen (the backward rule applied again)."""
        names = set(names)
        return sample_flops([(c.name, c.linear, c.attention, c.trains and c.name not in names)
                             for c in self.components], self.tokens)


def sample_flops(components: Iterable[tuple[str, int, int, bool]], tokens: int = 0) -> SampleFlops:
    """``(name, forward linear FLOPs, forward attention FLOPs, trains)`` in data-flow order -> SampleFlops, with
    ``backprop`` set where something upstream trains."""
    out, upstream_trains = [], False
    for name, linear, attention, trains in components:
        out.append(ComponentFlops(name, int(linear), int(attention), bool(trains), upstream_trains))
        upstream_trains = upstream_trains or bool(trains)
    return SampleFlops(tuple(out), tokens)

