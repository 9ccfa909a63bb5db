"""`roboscale export --format=onnx`: a checkpoint as ONNX graphs the runtime (``roboscale.deploy.runtime``) runs.

The policy's own modules are split where its computation splits (``roboscale.models.onnx``, each policy's
``PolicySpec.onnx``) and exported by ``torch.onnx.export`` (torch.export underneath) with the batch and the
prompt's length dynamic:

- ``encoder`` and ``denoise``, always;
- ``denoise_guided`` (``rtc``): the denoiser with real-time chunking's guidance, whose vector-Jacobian product ONNX
  has no operator for: the guided velocity (``models.rtc.guided_velocity``) is traced with its backward pass by
  ``make_fx`` into plain operations first, the weights as inputs, and that graph is exported;
- ``chunk`` (``unrolled``): the encoder and every Euler step in one graph.

Before the directory is renamed into place the runtime runs it against PyTorch on the same observations and noise
(batch 1 and 3, and guided where there is a guided graph): an export whose actions differ by more than
``tolerance`` (relative to the chunk's largest action) is not written.
"""

from __future__ import annotations

import contextlib
import io
import logging
import platform
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from roboscale.deploy.format import (
    CONFIG_NAME,
    NORMALIZATION_NAME,
    TOKENIZER_NAME,
    ExportedConfig,
    GraphSpec,
    TensorSpec,
)
from roboscale.config import to_dict
from roboscale.errors import ConfigError
from roboscale.models.onnx import ENCODER_INPUTS, OnnxModules, UnsupportedOperation
from roboscale.models.policy import Policy
from roboscale.utils.io import atomic_directory, atomic_write_json

log = logging.getLogger(__name__)

TOLERANCE = 1e-4
EXTERNAL_DATA_BYTES = 1 << 30
_DTYPE_NAMES = {1: "float32", 7: "int64", 9: "bool", 2: "uint8"}  # onnx.TensorProto element types


@dataclass
class ExportReport:
    directory: Path
    seconds: float
    bytes: dict[str, int]
    errors: dict[str, float]
    """Relative action error against PyTorch, per check (``check_parity``)."""


def onnx_modules(policy: Policy) -> OnnxModules:
    from roboscale.models.registry import get_spec

    spec = get_spec(policy.name)
    if spec.onnx is None:
        raise ConfigError(f"--format=onnx: the {policy.name} policy has no ONNX export")
    return spec.onnx_function()(policy)


# --- example inputs -------------------------------------------------------------------------------------------
def example_observation(policy: Policy, batch: int, seed: int = 0, prompts: Sequence[str] | None = None
                        ) -> dict[str, Any]:
    """An observation batch as the rollout builds it (``rollout.observation``): the dataset's state width, uint8
    CHW cameras at the policy's size, one prompt per sample (of different lengths)."""
    cfg = policy.config
    generator = torch.Generator().manual_seed(seed)
    width = policy.state_normalizer.data_dim or cfg.state_dim
    observation: dict[str, Any] = {
        cfg.state_key: torch.randn(batch, width, generator=generator),
        "task": list(prompts) if prompts is not None else
        [" ".join(["open the drawer", "press the button", "turn the faucet"][: 1 + i % 3]) for i in range(batch)]}
    for key in cfg.image_keys:
        observation[key] = torch.randint(0, 256, (batch, 3, cfg.image_size, cfg.image_size), generator=generator,
                                         dtype=torch.uint8)
    return observation


def _runtime_inputs(observation: dict[str, Any], policy: Policy) -> tuple[dict[str, np.ndarray], np.ndarray, list]:
    cfg = policy.config
    images = {key: observation[key].permute(0, 2, 3, 1).numpy() for key in cfg.image_keys}
    return images, observation[cfg.state_key].numpy(), list(observation["task"])


# --- graphs ---------------------------------------------------------------------------------------------------
class _Chunk(nn.Module):
    """The unrolled graph: the encoder and every Euler step of the policy's flow (``FlowMatching.sample``)."""

    def __init__(self, modules: OnnxModules, data_at: int, steps: int):
        super().__init__()
        self.encoder, self.denoise, self.data_at, self.steps = modules.encoder, modules.denoise, data_at, steps

    def forward(self, images, state, tokens, token_mask, noise):
        context = self.encoder(images, state, tokens, token_mask)
        x, b = noise, noise.shape[0]
        for i in range(self.steps):
            if self.data_at == 0:
                dt = -1.0 / self.steps
                x = x + dt * self.denoise(x, noise.new_full((b,), 1.0 + i * dt), *context)
            else:
                x = x + self.denoise(x, noise.new_full((b,), i / self.steps), *context) / self.steps
        return x


class _Traced(nn.Module):
    """A make_fx graph whose weights were inputs, with them held as buffers again."""

    def __init__(self, graph: nn.Module, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.graph, self.names = graph, list(weights)
        for i, value in enumerate(weights.values()):
            self.register_buffer(f"w{i}", value.detach().clone())

    def forward(self, *inputs):
        return self.graph({name: getattr(self, f"w{i}") for i, name in enumerate(self.names)}, *inputs)


def guided_denoiser(denoise: nn.Module, data_at: int, example: tuple[torch.Tensor, ...]) -> nn.Module:
    """``denoise`` with real-time chunking's guidance (``models.rtc.guided_velocity``): ``forward(x, t, *context,
    target, weights, beta)``; the backward pass it needs traced into forward operations."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from roboscale.models.rtc import Guide, guided_velocity

    weights = {**dict(denoise.named_parameters()), **dict(denoise.named_buffers())}

    def step(weights, x, t, *rest):
        *context, target, step_weights, beta = rest
        velocity = partial(lambda x, t: torch.func.functional_call(denoise, weights, (x, t, *context)))
        return guided_velocity(velocity, x, t, Guide(target, step_weights, beta), data_at)

    # attention's math kernel (matmuls and a softmax, whose backward has ONNX operators: the fused CPU kernel's
    # backward has none), and every backward op decomposed into core operators
    from torch._decomp import core_aten_decompositions
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # no duck sizing: two sizes that happen to be equal in the example (a prompt's prefix and the chunk) must not
    # become one symbol, or the graph only runs where they are equal
    from torch.fx.experimental import _config as fx_config

    with sdpa_kernel(SDPBackend.MATH), fx_config.patch(use_duck_shape=False):
        graph = make_fx(step, tracing_mode="symbolic", decomposition_table=core_aten_decompositions())(
            weights, *example)
    return _Traced(graph, weights)


def _export(module: nn.Module, args: tuple[torch.Tensor, ...], names: Sequence[str], outputs: Sequence[str],
            dynamic: dict[str, dict[int, Any]], path: Path) -> None:
    import torch.onnx

    shapes = tuple(dynamic.get(name, {}) for name in names)
    if isinstance(module, _Traced):  # forward(*inputs): one structure for all of them
        shapes = (shapes,)
    start = time.perf_counter()
    quiet = logging.getLogger("torch.onnx")  # its registry's notes (torchvision's operators absent), its progress
    level, quiet.level = quiet.level, logging.ERROR
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations, not ours to act on
            program = torch.onnx.export(module.eval(), args, input_names=list(names), output_names=list(outputs),
                                        dynamic_shapes=shapes, dynamo=True, verbose=False)
    finally:
        quiet.level = level
    # protobuf's 2 GB limit: the full presets' weights go to a file beside the graph (path.name + ".data")
    weights = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    program.save(str(path), external_data=weights > EXTERNAL_DATA_BYTES)
    log.info("exported %s in %.1f s", path.name, time.perf_counter() - start)


def _graph_spec(path: Path) -> GraphSpec:
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def specs(values) -> list[TensorSpec]:
        return [TensorSpec(v.name, _DTYPE_NAMES[v.type.tensor_type.elem_type],
                           [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]) for v in values]

    return GraphSpec(path.name, path.stat().st_size, specs(model.graph.input), specs(model.graph.output))


def _opset(path: Path) -> int:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def export_onnx(checkpoint: str | Path, output: str | Path, *, attention_backend: str = "", rtc: bool = True,
                unrolled: bool = True, preferred_graph: str = "chunk", tolerance: float = TOLERANCE,
                policy: Policy | None = None, source: Path | None = None) -> ExportReport:
    """Write ``output`` (which must not exist) from ``checkpoint``; ``policy``: the checkpoint's policy already
    loaded, or one built here (a randomly initialised architecture: ``checkpoint`` then names nothing); ``source``:
    the checkpoint directory ``policy`` was loaded from."""
    from roboscale.models.policy import resolve_checkpoint
    from roboscale.utils.io import sha256_file

    start = time.perf_counter()
    output = Path(output)
    if output.exists():
        raise ConfigError(f"--output {output}: already exists; export writes a new directory")
    origin: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    if policy is None:
        source_dir = resolve_checkpoint(checkpoint)
        policy = Policy.from_pretrained(source_dir)
    else:
        source_dir = source
    if source_dir is not None:
        origin.update(checkpoint=str(source_dir), weights_sha256=sha256_file(source_dir / "model.safetensors"))
    policy = policy.float().cpu().eval().requires_grad_(False)
    if attention_backend:
        policy.config.attention_backend = attention_backend
    origin["policy_config"] = to_dict(policy.config)
    try:
        modules = onnx_modules(policy)
    except UnsupportedOperation as exc:
        raise ConfigError(f"--format=onnx: {exc}") from None
    if preferred_graph not in ("split", "chunk"):
        raise ConfigError(f"--onnx.preferred_graph must be split or chunk, got {preferred_graph!r}")
    if preferred_graph == "chunk" and not unrolled:
        preferred_graph = "split"  # nothing else to run
    if policy.tokenizer is None:
        raise ConfigError(f"--format=onnx: the {policy.name} policy has no tokenizer to export")
    cfg, flow = policy.config, policy.flow_matching
    with atomic_directory(output) as tmp:
        graphs = _export_graphs(policy, modules, flow.data_at, tmp, rtc, unrolled)
        policy.tokenizer.save(tmp / TOKENIZER_NAME)
        atomic_write_json(tmp / NORMALIZATION_NAME, {
            "state": _normalization(policy.state_normalizer), "action": _normalization(policy.action_normalizer)})
        state_width = policy.state_normalizer.data_dim or cfg.state_dim
        config = ExportedConfig(
            policy=policy.name, opset=_opset(tmp / graphs["encoder"].file), image_keys=list(cfg.image_keys),
            image_size=cfg.image_size, state_key=cfg.state_key, state_dim=cfg.state_dim, action_dim=cfg.action_dim,
            dataset_action_dim=policy.action_normalizer.data_dim or cfg.action_dim, chunk_size=cfg.chunk_size,
            n_action_steps=cfg.n_action_steps, max_language_tokens=cfg.max_language_tokens, prompt=modules.prompt,
            data_at=flow.data_at, steps=cfg.num_inference_steps,
            prompt_state_width=cfg.state_dim if getattr(cfg, "prompt_state_padded", False) else state_width,
            context=list(modules.context), graphs=graphs, preferred_graph=preferred_graph, source=origin)
        atomic_write_json(tmp / CONFIG_NAME, config.to_dict())
        errors = check_parity(policy, tmp, guided="denoise_guided" in graphs)
        worst = max(errors.values())
        if worst > tolerance:
            raise ConfigError(f"--format=onnx: the exported graphs' actions differ from PyTorch's by {worst:.2e} "
                              f"(relative; {errors}), over the tolerance {tolerance:g}: nothing was written")
    return ExportReport(output, time.perf_counter() - start, {name: spec.bytes for name, spec in graphs.items()},
                        errors)


def _normalization(normalizer) -> dict[str, Any]:
    return {"mode": normalizer.mode.value, "eps": normalizer.eps, "dim": normalizer.dim,
            "data_dim": normalizer.data_dim,
            "stats": {k: v.detach().cpu().float().tolist() for k, v in normalizer.stats().items()}}


def _export_graphs(policy: Policy, modules: OnnxModules, data_at: int, directory: Path, rtc: bool,
                   unrolled: bool) -> dict[str, GraphSpec]:
    """Export each graph with examples of batch 2 (torch.export specializes a size of 1) and prompts of different
    lengths; every axis that is not a weight's size is dynamic (``Dim.AUTO``: torch.export finds which sizes are
    the same)."""
    auto = torch.export.Dim.AUTO
    cfg = policy.config
    feed = preprocessor(policy)(*_runtime_inputs(example_observation(policy, 2), policy))
    encoder_args = tuple(torch.from_numpy(feed[name]) for name in ENCODER_INPUTS)
    encoder_dynamic = {"images": {0: auto}, "state": {0: auto}, "tokens": {0: auto, 1: auto},
                       "token_mask": {0: auto, 1: auto}}
    graphs: dict[str, GraphSpec] = {}
    _export(modules.encoder, encoder_args, ENCODER_INPUTS, modules.context, encoder_dynamic,
            directory / "encoder.onnx")
    graphs["encoder"] = _graph_spec(directory / "encoder.onnx")
    with torch.no_grad():
        context = modules.encoder(*encoder_args)
    b = encoder_args[0].shape[0]
    x = torch.randn(b, cfg.chunk_size, cfg.action_dim)
    t = torch.full((b,), 0.5)
    # a context axis is dynamic where it follows the batch or the prompt: it differs between two observations
    wider = preprocessor(policy)(*_runtime_inputs(example_observation(policy, 3, prompts=[
        "open the drawer and then close it again slowly"] * 3), policy))
    with torch.no_grad():
        other = modules.encoder(*(torch.from_numpy(wider[name]) for name in ENCODER_INPUTS))
    context_dynamic = {name: {axis: auto for axis in range(a.dim()) if a.shape[axis] != o.shape[axis]}
                       for name, a, o in zip(modules.context, context, other, strict=True)}
    denoise_names = ("x", "t", *modules.context)
    denoise_dynamic = {"x": {0: auto}, "t": {0: auto}, **context_dynamic}
    _export(modules.denoise, (x, t, *context), denoise_names, ("velocity",), denoise_dynamic,
            directory / "denoise.onnx")
    graphs["denoise"] = _graph_spec(directory / "denoise.onnx")
    if rtc:
        target = torch.randn(b, cfg.chunk_size, cfg.action_dim)
        weights = torch.rand(b, cfg.chunk_size, cfg.action_dim)
        beta = torch.tensor(5.0)
        guided = guided_denoiser(modules.denoise, data_at, (x, t, *context, target, weights, beta))
        _export(guided, (x, t, *context, target, weights, beta), (*denoise_names, "target", "weights", "beta"),
                ("velocity",), {**denoise_dynamic, "target": {0: auto}, "weights": {0: auto}},
                directory / "denoise_guided.onnx")
        graphs["denoise_guided"] = _graph_spec(directory / "denoise_guided.onnx")
    if unrolled:
        chunk = _Chunk(modules, data_at, cfg.num_inference_steps)
        _export(chunk, (*encoder_args, x), (*ENCODER_INPUTS, "noise"), ("actions",),
                {**encoder_dynamic, "noise": {0: auto}}, directory / "chunk.onnx")
        graphs["chunk"] = _graph_spec(directory / "chunk.onnx")
    return graphs


def preprocessor(policy: Policy):
    """The runtime's preprocessing (``deploy.runtime.Preprocessor``) for this policy, as the export writes it."""
    from roboscale.deploy.runtime import Normalization, Preprocessor

    cfg = policy.config
    state_width = policy.state_normalizer.data_dim or cfg.state_dim
    prompt_state_width = cfg.state_dim if getattr(cfg, "prompt_state_padded", False) else state_width
    return Preprocessor(list(cfg.image_keys), cfg.image_size, cfg.max_language_tokens, onnx_modules(policy).prompt,
                        prompt_state_width, Normalization.from_dict(_normalization(policy.state_normalizer)),
                        policy.tokenizer.backend)


# --- parity ---------------------------------------------------------------------------------------------------
def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| over the largest |expected|: the error relative to the chunk's scale."""
    return float(np.abs(actual - expected).max() / max(float(np.abs(expected).max()), 1e-6))


def check_parity(policy: Policy, directory: Path, guided: bool, batches: Sequence[int] = (1, 8)
                 ) -> dict[str, float]:
    """The runtime's actions against PyTorch's on the same observations and noise: the relative error of each
    check, by graph and batch size (``split1``, ``split8``; ``unrolled1``, ``unrolled8`` where there is an unrolled
    graph; ``guided8``: the guided denoiser, one sample of the batch unguided)."""
    from roboscale.deploy.format import ExportedConfig
    from roboscale.deploy.runtime import Guide, OnnxPolicy
    from roboscale.models.rtc import ChunkGuide

    graphs = {"split": OnnxPolicy(directory, graph="split")}
    if "chunk" in ExportedConfig.read(directory).graphs:
        graphs["unrolled"] = OnnxPolicy(directory, graph="chunk")
    cfg = policy.config
    errors = {}
    for b in batches:
        observation = example_observation(policy, b, seed=b)
        noise = torch.randn(b, cfg.chunk_size, cfg.action_dim, generator=torch.Generator().manual_seed(b))
        expected = policy.predict_action_chunk(observation, noise=noise).numpy()
        for label, runtime in graphs.items():
            actual = runtime.predict(*_runtime_inputs(observation, policy), noise.numpy())
            errors[f"{label}{b}"] = relative_error(actual, expected)
        if guided and b > 1:
            width = policy.action_normalizer.data_dim or cfg.action_dim
            committed = torch.from_numpy(expected[:, ::-1].copy()) + 0.1  # something to pull towards
            count = torch.tensor([min(cfg.chunk_size, 4 + i) for i in range(b)])
            count[0] = 0  # one sample unguided: its chunk is the plain one
            delay = torch.minimum(count, torch.tensor(2))
            guide = ChunkGuide(committed[..., :width], count, delay)
            expected = policy.predict_action_chunk(observation, noise=noise, guide=guide).numpy()
            actual = graphs["split"].predict(*_runtime_inputs(observation, policy), noise.numpy(),
                                             Guide(committed[..., :width].numpy(), count.numpy(), delay.numpy()))
            errors[f"guided{b}"] = relative_error(actual, expected)
    return errors


# --- int8 -------------------------------------------------------------------------------------------------------
def quantize_directory(source: str | Path, output: str | Path, graphs: Sequence[str] = ("encoder", "denoise",
                                                                                        "chunk")) -> Path:
    """A copy of an exported directory whose ``graphs`` have their weight MatMuls quantized to int8 (onnxruntime's
    dynamic quantization: int8 weights, activations quantized per call; attention's MatMuls of two activations
    stay float). The guided denoiser is left float (its backward pass is where quantization error would be
    differentiated)."""
    import json

    from onnxruntime.quantization import QuantType, quantize_dynamic

    source, output = Path(source), Path(output)
    if output.exists():
        raise ConfigError(f"{output}: already exists")
    config = ExportedConfig.read(source)
    with atomic_directory(output) as tmp:
        for path in source.iterdir():
            if path.is_file():
                (tmp / path.name).write_bytes(path.read_bytes())
        data = json.loads((tmp / CONFIG_NAME).read_text())
        for name in graphs:
            if name in config.graphs:
                file = config.graphs[name].file
                # reduce_range: 7-bit weights, as onnxruntime advises for x86 without VNNI, where u8 x s8 products
                # saturate (full-range int8 weights gave 51% action error here, 7-bit ones 2%)
                quantize_dynamic(str(source / file), str(tmp / file), op_types_to_quantize=["MatMul"],
                                 weight_type=QuantType.QInt8, reduce_range=True,
                                 extra_options={"MatMulConstBOnly": True})
                data["graphs"][name]["bytes"] = (tmp / file).stat().st_size
        data["source"]["quantized"] = {"graphs": [g for g in graphs if g in config.graphs],
                                       "weights": "int8 (7-bit range)", "ops": ["MatMul"]}
        atomic_write_json(tmp / CONFIG_NAME, data)
    return output
