"""Run a policy exported by `roboscale export --format=onnx` on a robot's own computer: onnxruntime, numpy and
tokenizers only (pip install onnxruntime numpy tokenizers), no torch, no roboscale.

    python examples/onnx_client.py DIR --prompt "open the drawer" --state 0.1,0.2,0.3,0.4 \
        --image observation.images.corner2=corner2.npy --image observation.images.wrist=wrist.npy --output actions.npy

Each camera is an H x W x 3 uint8 .npy at the policy's image size (DIR/config.json: image_size). The chunk is
roboscale's for the same --seed and --chunk-index (its noise is drawn as `roboscale.rollout.noise` draws it).
roboscale's own runtime (`roboscale.deploy.runtime.OnnxPolicy`) adds resizing of other camera sizes and real-time
chunking; this file is the minimum, to read and to copy.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer


def normalize(stats: dict, x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """The policy's state/action normalization (normalization.json), and back (cropped to the data's width)."""
    mode, eps, s = stats["mode"], np.float32(stats["eps"]), {k: np.float32(v) for k, v in stats["stats"].items()}
    if not inverse and stats["data_dim"] and x.shape[-1] == stats["data_dim"]:  # zero-padded to the model's width
        x = np.concatenate([x, np.zeros((*x.shape[:-1], stats["dim"] - stats["data_dim"]), np.float32)], -1)
    if mode == "mean_std":
        x = x * (s["std"] + eps) + s["mean"] if inverse else (x - s["mean"]) / (s["std"] + eps)
    elif mode in ("min_max", "quantiles"):
        low, high = (s["min"], s["max"]) if mode == "min_max" else (s["q01"], s["q99"])
        span = np.maximum(high - low, eps)
        x = (x + 1) * np.float32(0.5) * span + low if inverse else np.float32(2) * (x - low) / span - 1
    return x[..., :stats["data_dim"]] if inverse and stats["data_dim"] else x


def prompt_ids(tokenizer: Tokenizer, config: dict, task: str, state: np.ndarray) -> list[int]:
    if config["prompt"] == "state_bins":  # pi0.5's prompt: the normalized state in 256 bins
        bins = np.digitize(state[:config["prompt_state_width"]], np.linspace(-1, 1, 257)[:-1]) - 1
        text = f"Task: {task.strip().replace('_', ' ').replace(chr(10), ' ')}, State: {' '.join(map(str, bins))};\nAction: "
    else:
        text = " ".join(task.replace("_", " ").split())
    bos = tokenizer.token_to_id("<bos>")
    return ([bos] if bos is not None else []) + tokenizer.encode(text, add_special_tokens=False).ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--state", required=True, help="comma-separated, in the dataset's units")
    parser.add_argument("--image", action="append", default=[], help="CAMERA_KEY=frame.npy, one per camera")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-index", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("actions.npy"))
    args = parser.parse_args()
    d = args.directory
    config = json.loads((d / "config.json").read_text())
    stats = json.loads((d / "normalization.json").read_text())
    tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
    session = {name: ort.InferenceSession(str(d / config["graphs"][name]["file"]), providers=["CPUExecutionProvider"])
               for name in ("encoder", "denoise")}

    state = normalize(stats["state"], np.array([float(v) for v in args.state.split(",")], np.float32))[None]
    ids = prompt_ids(tokenizer, config, args.prompt, state[0])[:config["max_language_tokens"]]
    frames = dict(item.split("=", 1) for item in args.image)
    images = np.stack([np.load(frames[key]).transpose(2, 0, 1) for key in config["image_keys"]])[None]
    context = session["encoder"].run(None, {"images": images, "state": state, "tokens": np.array([ids], np.int64),
                                            "token_mask": np.ones((1, len(ids)), bool)})
    context = dict(zip(config["context"], context))

    # the Euler steps of the policy's flow, from the noise roboscale draws for (seed, chunk index)
    shape = (1, config["chunk_size"], config["action_dim"])
    rng = np.random.Generator(np.random.PCG64([args.seed, args.chunk_index]))
    x, steps = rng.standard_normal(shape[1:], dtype=np.float32)[None], config["steps"]
    for i in range(steps):
        t = 1.0 - i / steps if config["data_at"] == 0 else i / steps  # pi0: t = 1 is noise; GR00T: t = 0
        (v,) = session["denoise"].run(None, {"x": x, "t": np.full((1,), t, np.float32), **context})
        x = x - v / np.float32(steps) if config["data_at"] == 0 else x + v / np.float32(steps)
    actions = normalize(stats["action"], x, inverse=True)[0]
    np.save(args.output, actions)
    print(f"{actions.shape[0]} actions of {actions.shape[1]} -> {args.output}; first: {np.round(actions[0], 4)}")


if __name__ == "__main__":
    main()
