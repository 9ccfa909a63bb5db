"""Run an exported policy (``roboscale.deploy.format``) with onnxruntime and numpy: no torch.

``OnnxPolicy(DIR).predict(images, state, prompts, noise)`` computes what ``Policy.predict_action_chunk`` computes:
the prompt tokenized (``tokenizers``), the state normalized (and zero-padded to the model's width), the cameras
fitted to the policy's square, the encoder run once, the Euler steps of the policy's flow from ``noise`` (each a
run of the denoiser, or of its guided twin for real-time chunking), the actions un-normalized and cropped to the
dataset's width. With ``graph="chunk"`` (an export with ``--unrolled``) one run of the unrolled graph does the
encoder and the steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.deploy.format import (
    NORMALIZATION_NAME,
    TOKENIZER_NAME,
    ExportedConfig,
    ExportedDirectoryError,
    GraphSpec,
)

SCHEDULES = ("exp", "linear", "ones", "zeros")
_NUMPY_DTYPES = {"float32": np.float32, "int64": np.int64, "bool": np.bool_, "uint8": np.uint8}
_ORT_TYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(bool)": "bool", "tensor(uint8)": "uint8"}
STATE_BINS = 256


# --- preprocessing -------------------------------------------------------------------------------------------
def normalize_task(text: str) -> str:
    """The instruction as the policy's tokenizer saw it in training (``models.tokenizer.normalize_task``)."""
    return " ".join(text.replace("_", " ").split())


def state_prompt(task: str, normalized_state: np.ndarray) -> str:
    """pi0.5's prompt with the state digitized into 256 bins (``models.pi05.transform.state_prompt``)."""
    bins = np.digitize(normalized_state.astype(np.float32), np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]) - 1
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(str(int(b)) for b in bins)};\nAction: "


def _resize_weights(in_size: int, out_size: int) -> np.ndarray:
    """[out, in]: antialiased bilinear (triangle filter widened by the scale when shrinking), align_corners=False:
    torch's ``interpolate(mode="bilinear", antialias=True)`` along one axis."""
    scale = in_size / out_size
    support = scale if scale >= 1.0 else 1.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    weights = np.zeros((out_size, in_size), dtype=np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        low = max(int(center - support + 0.5), 0)
        high = min(int(center + support + 0.5), in_size)
        taps = np.maximum(0.0, 1.0 - np.abs((np.arange(low, high) - center + 0.5) * invscale))
        weights[i, low:high] = taps / taps.sum() if taps.sum() else 0.0
    return weights


def fit_image(image: np.ndarray, size: int) -> np.ndarray:
    """H x W x 3 uint8 -> size x size x 3 uint8: the longer side scaled to ``size``, centred on black
    (``utils.images.resize_with_pad``); a frame already at the size is returned as it is."""
    height, width = image.shape[:2]
    if (height, width) == (size, size):
        return image
    scale = min(size / height, size / width)
    content_h, content_w = max(1, round(height * scale)), max(1, round(width * scale))
    resized = np.einsum("oh,hwc,pw->opc", _resize_weights(height, content_h), image.astype(np.float64),
                        _resize_weights(width, content_w))
    canvas = np.zeros((size, size, image.shape[2]), dtype=np.uint8)
    top, left = (size - content_h) // 2, (size - content_w) // 2
    canvas[top:top + content_h, left:left + content_w] = np.clip(np.round(resized), 0, 255).astype(np.uint8)
    return canvas


@dataclass
class Normalization:
    """One feature's statistics as the policy normalizes with them (``models.normalize``)."""

    mode: str
    stats: dict[str, np.ndarray]
    eps: float
    dim: int
    data_dim: int

    @classmethod
    def from_dict(cls, data: dict) -> Normalization:
        return cls(data["mode"], {k: np.asarray(v, dtype=np.float32) for k, v in data["stats"].items()},
                   float(data["eps"]), int(data["dim"]), int(data["data_dim"]))

    def _low_high(self) -> tuple[np.ndarray, np.ndarray]:
        low, high = (self.stats[k] for k in (("min", "max") if self.mode == "min_max" else ("q01", "q99")))
        return low, np.maximum(high - low, np.float32(self.eps))

    def normalize(self, x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float32)
        if self.data_dim and x.shape[-1] == self.data_dim:
            x = np.concatenate([x, np.zeros((*x.shape[:-1], self.dim - self.data_dim), np.float32)], -1)
        if self.mode == "identity":
            return x
        if self.mode == "mean_std":
            return (x - self.stats["mean"]) / (self.stats["std"] + np.float32(self.eps))
        low, span = self._low_high()
        return np.float32(2.0) * (x - low) / span - np.float32(1.0)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        if self.mode == "mean_std":
            x = x * (self.stats["std"] + np.float32(self.eps)) + self.stats["mean"]
        elif self.mode != "identity":
            low, span = self._low_high()
            x = (x + np.float32(1.0)) * np.float32(0.5) * span + low
        return x[..., :self.data_dim] if self.data_dim else x


# --- real-time chunking ---------------------------------------------------------------------------------------
def prefix_weights(delay: int, committed: int, total: int, schedule: str = "exp") -> np.ndarray:
    """float32 [total]: each step's guidance weight (``models.rtc.prefix_weights``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if not 0 <= delay <= committed <= total:
        raise ValueError(f"need 0 <= delay <= committed <= total, got delay={delay}, committed={committed}, "
                         f"total={total}")
    weights = np.zeros(total, dtype=np.float32)
    weights[:delay] = 1.0
    if schedule == "zeros":
        return weights
    if schedule == "ones":
        weights[:committed] = 1.0
        return weights
    decay = np.linspace(1.0, 0.0, committed - delay + 2, dtype=np.float32)[1:-1]
    if schedule == "exp":
        decay = decay * np.expm1(decay) / np.float32(math.e - 1)
    weights[delay:committed] = decay
    return weights


@dataclass
class Guide:
    """Real-time chunking's request, per sample, in the dataset's units (``models.rtc.ChunkGuide``)."""

    actions: np.ndarray
    """float [B, chunk_size, A_data]: committed actions, aligned with the new chunk (entries from count on unused)."""
    count: np.ndarray
    """int [B]: committed actions per sample (0: unguided)."""
    delay: np.ndarray
    """int [B]: of those, how many run before the new chunk arrives."""
    schedule: str = "exp"
    max_guidance: float = 5.0


# --- the encoder's inputs -------------------------------------------------------------------------------------
@dataclass
class Preprocessor:
    """Observations -> the encoder's inputs, as the policy's own transform builds them in PyTorch: the state
    normalized (and zero-padded), the prompt written and tokenized, each camera fitted to the policy's square."""

    image_keys: list[str]
    image_size: int
    max_language_tokens: int
    prompt: str
    prompt_state_width: int
    state: Normalization
    tokenizer: Any
    """A ``tokenizers.Tokenizer``."""

    def __post_init__(self) -> None:
        pad = self.tokenizer.token_to_id("<pad>")
        self.pad_id = 0 if pad is None else pad
        self.bos_id = self.tokenizer.token_to_id("<bos>")

    def check(self, images: dict[str, np.ndarray], state: np.ndarray, prompts: list[str]) -> int:
        """The batch size, or a ValueError naming the input that does not fit."""
        state = np.asarray(state)
        width = self.state.data_dim or self.state.dim
        if state.ndim != 2 or state.shape[1] != width or state.dtype.kind != "f":
            raise ValueError(f"state: expected float [batch, {width}], got {state.dtype} {list(state.shape)}")
        b = state.shape[0]
        if len(prompts) != b or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompts: expected {b} strings, got {len(prompts)}")
        for key in self.image_keys:
            if key not in images:
                raise ValueError(f"images: no {key!r}; this policy reads {self.image_keys}")
            frames = np.asarray(images[key])
            if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[0] != b or frames.shape[3] != 3:
                raise ValueError(f"images[{key!r}]: expected uint8 [{b}, H, W, 3], got {frames.dtype} "
                                 f"{list(frames.shape)}")
        return b

    def tokenize(self, prompts: list[str], normalized_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded ids [B, L] and their mask, L the longest prompt (``models.tokenizer.TaskTokenizer``)."""
        encoded = []
        for prompt, state in zip(prompts, normalized_state, strict=True):
            if self.prompt == "state_bins":
                text = state_prompt(prompt, state[:self.prompt_state_width])
            else:
                text = normalize_task(prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            encoded.append((([self.bos_id] if self.bos_id is not None else []) + ids)[:self.max_language_tokens])
        tokens = np.full((len(encoded), max(1, max(map(len, encoded)))), self.pad_id, dtype=np.int64)
        mask = np.zeros(tokens.shape, dtype=bool)
        for row, ids in enumerate(encoded):
            tokens[row, :len(ids)], mask[row, :len(ids)] = ids, True
        return tokens, mask

    def __call__(self, images: dict[str, np.ndarray], state: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
        normalized = self.state.normalize(np.asarray(state, dtype=np.float32))
        tokens, mask = self.tokenize(prompts, normalized)
        cameras = [np.stack([fit_image(frame, self.image_size) for frame in np.asarray(images[key])])
                   for key in self.image_keys]
        stacked = np.ascontiguousarray(np.stack(cameras, axis=1).transpose(0, 1, 4, 2, 3))  # [B, C, 3, S, S]
        return {"images": stacked, "state": normalized, "tokens": tokens, "token_mask": mask}


# --- the policy -----------------------------------------------------------------------------------------------
class OnnxPolicy:
    """An exported policy run by onnxruntime. ``providers``: onnxruntime's execution providers (default: the CPU's);
    ``threads``: intra-op threads (0: onnxruntime's choice); ``graph``: ``split`` (encoder + a denoiser run per
    step), ``chunk`` (the unrolled graph, which the export must hold) or ``auto`` (the export's preference)."""

    def __init__(self, directory: str | Path, providers: list[str] | None = None, threads: int = 0,
                 graph: str = "auto"):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        self.config = config = ExportedConfig.read(self.directory)
        if graph == "auto":
            graph = config.preferred_graph
        if graph not in ("split", "chunk"):
            raise ValueError(f"graph must be split, chunk or auto, got {graph!r}")
        if graph == "chunk" and "chunk" not in config.graphs:
            raise ExportedDirectoryError(f"{self.directory}: exported without the unrolled graph (chunk.onnx); "
                                         "export with --onnx.unrolled=true or run with graph=split")
        self.graph = graph
        self.normalization = self.read_normalization(self.directory)
        tokenizer_path = self.directory / TOKENIZER_NAME
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ExportedDirectoryError(f"{tokenizer_path}: not a readable tokenizer.json ({exc})") from None
        self.preprocess = Preprocessor(config.image_keys, config.image_size, config.max_language_tokens,
                                       config.prompt, config.prompt_state_width, self.normalization["state"],
                                       self.tokenizer)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only (not its notes on the constants it could not fold)
        if threads:
            options.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]
        names = ("encoder", "denoise", "denoise_guided") if graph == "split" else ("chunk", "encoder", "denoise",
                                                                                 "denoise_guided")
        self.sessions = {name: self._session(ort, name, config.graphs[name], options, providers)
                         for name in names if name in config.graphs}

    @staticmethod
    def read_normalization(directory: Path) -> dict[str, Normalization]:
        path = directory / NORMALIZATION_NAME
        try:
            data = json.loads(path.read_text())
            return {key: Normalization.from_dict(data[key]) for key in ("state", "action")}
        except FileNotFoundError:
            raise ExportedDirectoryError(f"{path}: missing") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ExportedDirectoryError(f"{path}: not the statistics this runtime reads ({exc!r})") from None

    def _session(self, ort, name: str, spec: GraphSpec, options, providers):
        path = self.directory / spec.file
        if not path.is_file():
            raise ExportedDirectoryError(f"{path}: missing (config.json names it for the {name} graph)")
        if path.stat().st_size != spec.bytes:
            raise ExportedDirectoryError(f"{path}: {path.stat().st_size} bytes, config.json says {spec.bytes}: the "
                                         "file is not the one exported with this config.json")
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime's own exception types
            raise ExportedDirectoryError(f"{path}: onnxruntime cannot load it ({str(exc).splitlines()[0]})") from None
        for what, declared, actual in (("inputs", spec.inputs, session.get_inputs()),
                                       ("outputs", spec.outputs, session.get_outputs())):
            found = [(a.name, _ORT_TYPES.get(a.type, a.type), len(a.shape)) for a in actual]
            expected = [(d.name, d.dtype, len(d.shape)) for d in declared]
            if found != expected:
                raise ExportedDirectoryError(f"{path}: its {what} are {found}, config.json declares {expected}")
        return session

    # --- prediction -----------------------------------------------------------------------------------------
    def predict(self, images: dict[str, np.ndarray], state: np.ndarray, prompts: list[str], noise: np.ndarray,
                guide: Guide | None = None) -> np.ndarray:
        """Actions [B, chunk_size, A_data] in the dataset's units. ``images``: {camera key: uint8 [B, H, W, 3]};
        ``state`` [B, S_data]; ``noise`` [B, chunk_size, action_dim]: the flow's starting point."""
        cfg = self.config
        b = self.preprocess.check(images, state, prompts)
        shape = (b, cfg.chunk_size, cfg.action_dim)
        noise = np.asarray(noise, dtype=np.float32)
        if noise.shape != shape:
            raise ValueError(f"noise: expected shape {list(shape)}, got {list(noise.shape)}")
        feed = self.preprocess(images, state, prompts)
        guided = self._guide(guide, b) if guide is not None and int(np.max(guide.count, initial=0)) else None
        if self.graph == "chunk" and guided is None:
            (actions,) = self.sessions["chunk"].run(None, {**feed, "noise": noise})
        else:
            actions = self.denoise(self.encode(feed), noise, guided)
        return self.normalization["action"].unnormalize(actions)

    def encode(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.sessions["encoder"].run(None, feed)
        return dict(zip(self.config.context, outputs, strict=True))

    def denoise(self, context: dict[str, np.ndarray], noise: np.ndarray,
                guided: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """The Euler steps of the policy's flow from ``noise`` (``models.flow_matching.FlowMatching.sample``)."""
        steps, b = self.config.steps, noise.shape[0]
        session = self.sessions["denoise_guided" if guided is not None else "denoise"]
        extra = guided or {}
        x = noise
        for i in range(steps):
            if self.config.data_at == 0:  # t from 1 (noise) down to 0
                dt = -1.0 / steps
                t = np.full((b,), 1.0 + i * dt, dtype=np.float32)
            else:  # t from 0 (noise) up to 1
                t = np.full((b,), i / steps, dtype=np.float32)
            (velocity,) = session.run(None, {"x": x, "t": t, **context, **extra})
            x = x + np.float32(dt) * velocity if self.config.data_at == 0 else x + velocity / np.float32(steps)
        return x

    def _guide(self, guide: Guide, b: int) -> dict[str, np.ndarray]:
        """The guided denoiser's extra inputs: normalized targets, weights per step and dimension, beta."""
        if "denoise_guided" not in self.sessions:
            raise ExportedDirectoryError(f"{self.directory}: exported without the guided denoiser "
                                         "(denoise_guided.onnx): export with --onnx.rtc=true for real-time chunking")
        cfg = self.config
        width = self.normalization["action"].data_dim or cfg.action_dim
        actions = np.asarray(guide.actions, dtype=np.float32)
        if actions.shape != (b, cfg.chunk_size, width):
            raise ValueError(f"guide.actions: expected shape {[b, cfg.chunk_size, width]}, got {list(actions.shape)}")
        weights = np.stack([prefix_weights(int(d), int(n), cfg.chunk_size, guide.schedule)
                            for n, d in zip(guide.count, guide.delay, strict=True)])
        dims = (np.arange(cfg.action_dim) < width).astype(np.float32)
        return {"target": self.normalization["action"].normalize(actions),
                "weights": np.ascontiguousarray(weights[..., None] * dims, dtype=np.float32),
                "beta": np.asarray(guide.max_guidance, dtype=np.float32)}
