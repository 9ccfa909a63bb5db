"""The exported directory: what ``roboscale export --format=onnx`` writes and the runtime reads (numpy and JSON
only: a robot's computer needs no torch to read it).

    DIR/config.json          FORMAT, the policy's shapes and keys, the flow (convention, steps), the prompt, each
                             graph's file, bytes, opset and inputs/outputs (names, dtypes, shapes; "batch" and the
                             other named axes are dynamic)
    DIR/encoder.onnx         observation -> context (``roboscale.models.onnx``)
    DIR/denoise.onnx         one Euler step's velocity
    DIR/denoise_guided.onnx  the same with real-time chunking's guidance (its vector-Jacobian product in the graph)
    DIR/chunk.onnx           the whole chunk in one graph: the encoder and every step unrolled (--onnx.unrolled)
    DIR/normalization.json   the state's and actions' statistics, as the policy normalizes with them
    DIR/tokenizer.json       the prompt's tokenizer (Hugging Face ``tokenizers``)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "roboscale-onnx"
VERSION = 1
CONFIG_NAME = "config.json"
NORMALIZATION_NAME = "normalization.json"
TOKENIZER_NAME = "tokenizer.json"
GRAPHS = ("encoder", "denoise", "denoise_guided", "chunk")
DTYPES = ("float32", "int64", "bool", "uint8")


class ExportedDirectoryError(ValueError):
    """An exported directory that cannot be run as it is: the message names the file and what is wrong."""


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list[int | str]
    """Sizes, or the names of dynamic axes ("batch", "tokens", "prefix", ...)."""

    @classmethod
    def parse(cls, data: Any, where: str) -> TensorSpec:
        if not isinstance(data, dict) or not {"name", "dtype", "shape"} <= data.keys():
            raise ExportedDirectoryError(f"{where}: expected an object with name, dtype and shape, got {data!r}")
        if data["dtype"] not in DTYPES or not isinstance(data["shape"], list):
            raise ExportedDirectoryError(f"{where}: dtype {data['dtype']!r} / shape {data['shape']!r} not understood")
        return cls(str(data["name"]), data["dtype"], list(data["shape"]))


@dataclass
class GraphSpec:
    file: str
    bytes: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    @classmethod
    def parse(cls, data: Any, where: str) -> GraphSpec:
        if not isinstance(data, dict) or not {"file", "bytes", "inputs", "outputs"} <= data.keys():
            raise ExportedDirectoryError(f"{where}: expected file, bytes, inputs and outputs")
        return cls(str(data["file"]), int(data["bytes"]),
                   [TensorSpec.parse(d, f"{where}.inputs[{i}]") for i, d in enumerate(data["inputs"])],
                   [TensorSpec.parse(d, f"{where}.outputs[{i}]") for i, d in enumerate(data["outputs"])])


@dataclass
class ExportedConfig:
    """config.json of an exported directory."""

    policy: str
    opset: int
    image_keys: list[str]
    image_size: int
    state_key: str
    state_dim: int
    action_dim: int
    dataset_action_dim: int
    chunk_size: int
    n_action_steps: int
    max_language_tokens: int
    prompt: str
    """``task`` or ``state_bins`` (``roboscale.models.onnx.OnnxModules.prompt``)."""
    data_at: int
    """The flow's time convention: 0 (pi0: t = 1 is noise), 1 (GR00T: t = 0 is noise)."""
    steps: int
    prompt_state_width: int
    """``state_bins``: how many of the normalized state's values the prompt writes (the dataset's, or the padded
    width: ``Pi05Config.prompt_state_padded``)."""
    context: list[str]
    graphs: dict[str, GraphSpec]
    preferred_graph: str = "split"
    """What the runtime runs by default: ``split`` (encoder + a denoiser per step) or ``chunk`` (the unrolled
    graph, where the export has it)."""
    source: dict[str, Any] = field(default_factory=dict)
    """Where it came from: the checkpoint's path and weights' sha256, the exporter's versions."""

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"format": FORMAT, "version": VERSION, **asdict(self)}

    @classmethod
    def read(cls, directory: Path) -> ExportedConfig:
        path = directory / CONFIG_NAME
        if not directory.is_dir():
            raise ExportedDirectoryError(f"{directory}: not a directory (an exported policy: roboscale export "
                                         "--format=onnx)")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ExportedDirectoryError(f"{path}: missing; is {directory} an exported policy (roboscale export "
                                         "--format=onnx)?") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ExportedDirectoryError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ExportedDirectoryError(f"{path}: not a {FORMAT} config (format: "
                                         f"{data.get('format') if isinstance(data, dict) else data!r})")
        if data.get("version") != VERSION:
            raise ExportedDirectoryError(f"{path}: version {data.get('version')!r}; this runtime reads {VERSION}")
        fields = {k: v for k, v in data.items() if k not in ("format", "version")}
        try:
            graphs = {name: GraphSpec.parse(spec, f"{path}: graphs.{name}")
                      for name, spec in fields.pop("graphs").items()}
            config = cls(graphs=graphs, **fields)
        except (KeyError, TypeError) as exc:
            raise ExportedDirectoryError(f"{path}: {exc}") from None
        for name in ("encoder", "denoise"):
            if name not in config.graphs:
                raise ExportedDirectoryError(f"{path}: no {name} graph")
        return config
