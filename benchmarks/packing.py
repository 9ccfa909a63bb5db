"""Packed + varlen attention vs LeRobot's padded layout + dense-mask attention: pi0.5 training step (fwd + bwd).

Same samples, same model, measured side by side in one run (runs interleaved, median step time). The samples
follow pi0.5's shape (reference/lerobot.md §4.1): 3 camera slots of 256 tokens with 1-3 real cameras, prompts of
10-60 tokens that LeRobot pads to 200 positions, 50 action tokens. Throughput counts *real* tokens (real
cameras + state + prompt + actions), the same number for every row, so the ratio is the speed-up on useful work.

Rows:
- ``padded + eager`` (baseline): every slot encoded, language padded to 200, LeRobot's eager attention with a
  materialised 4-D mask;
- ``padded + dense SDPA``: the same with SDPA reading the materialised mask;
- ``padded + key-mask SDPA``: the same layout, our two-call attention with broadcast key-padding masks;
- ``packed + <backend>``: one stream of real tokens, segment-aware attention (auto: flash varlen on CUDA bf16,
  per-segment SDPA on CPU).

    .venv/bin/python benchmarks/packing.py                  # CPU, small width, ~1-2 minutes
    .venv/bin/python benchmarks/packing.py --width 2048 --device cuda --dtype bf16 ...
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from roboscale.batching import PackedBatch
from roboscale.models.objective import flow_matching_loss
from roboscale.models.pi05.config import Pi05Config
from roboscale.models.pi05.layout import PrefixSpec, TokenizedSample, collate
from roboscale.models.pi05.modeling import Pi05Policy

CAMERAS = [f"observation.images.{name}" for name in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")]


@dataclass
class Shape:
    """pi0.5's sequence shape; the widths are what a CPU can afford (the full model is gpu_suite.py's job)."""

    width: int = 128
    depth: int = 2
    heads: int = 4
    head_dim: int = 32
    expert_width: int = 64
    vit_dim: int = 32
    vit_depth: int = 1
    image_size: int = 64
    patch: int = 4  # 64 / 4 = 16 x 16 = 256 tokens per camera, as SigLIP/14 at 224
    chunk: int = 50
    language_positions: int = 200
    min_prompt: int = 10
    max_prompt: int = 60
    vocab: int = 1024


def bench_config(shape: Shape, **overrides) -> Pi05Config:
    base = dict(
        image_keys=list(CAMERAS), state_dim=32, action_dim=32, vocab_size=shape.vocab, image_size=shape.image_size,
        vit_patch_size=shape.patch, vit_dim=shape.vit_dim, vit_depth=shape.vit_depth, vit_heads=2, pixel_shuffle=1,
        vit_conv_stem=False, width=shape.width, depth=shape.depth, num_heads=shape.heads, num_kv_heads=1,
        head_dim=shape.head_dim, mlp_dim=4 * shape.width, expert_width=shape.expert_width,
        expert_mlp_dim=4 * shape.expert_width, chunk_size=shape.chunk, max_language_tokens=shape.language_positions,
        state_norm="identity", action_norm="identity", pad_language_to=shape.language_positions,
    )
    base.update(overrides)
    return Pi05Config(**base)


def make_samples(n: int, shape: Shape, seed: int = 0, image_size: int | None = None) -> list[TokenizedSample]:
    """pi0.5-shaped samples: 1-3 real cameras of 3 slots, prompts of 10-60 tokens, 50 actions."""
    g = torch.Generator().manual_seed(seed)
    size = image_size or shape.image_size
    out = []
    for i in range(n):
        cams = int(torch.randint(1, 4, (), generator=g))
        prompt = int(torch.randint(shape.min_prompt, shape.max_prompt + 1, (), generator=g))
        out.append(
            TokenizedSample(
                images=torch.randint(0, 256, (3, 3, size, size), generator=g, dtype=torch.uint8),
                image_mask=torch.arange(3) < cams,
                state=torch.randn(32, generator=g),
                tokens=torch.randint(2, shape.vocab, (prompt,), generator=g),
                actions=torch.randn(shape.chunk, 32, generator=g),
                actions_is_pad=torch.zeros(shape.chunk, dtype=torch.bool),
                episode_index=i,
                frame_index=0,
            )
        )
    return out


def layouts(policy: Pi05Policy, samples: list[TokenizedSample]) -> tuple[PackedBatch, PackedBatch]:
    """(packed, padded) batches of the same samples."""
    spec = policy.prefix_spec()
    padded_spec = PrefixSpec(
        spec.tokens_per_image, spec.extra_tokens, spec.suffix_tokens, policy.config.pad_language_to
    )
    return collate(samples, spec, packed=True), collate(samples, padded_spec, packed=False)


def train_step(
    policy: Pi05Policy, batch: PackedBatch, backend: str, autocast: torch.dtype | None
) -> Callable[[], None]:
    def step():
        policy.config.attention_backend = backend
        policy.zero_grad(set_to_none=True)
        with torch.autocast(batch.state.device.type, dtype=autocast, enabled=autocast is not None):
            loss, _ = flow_matching_loss(policy, batch)
        loss.backward()

    return step


def measure(
    fns: dict[str, Callable[[], None]], steps: int, warmup: int, device: torch.device, clock: str = "wall"
) -> dict[str, float]:
    """Median seconds per call of each fn, runs interleaved (A B C A B C ...) so load drift hits all alike.

    ``clock`` "cpu" measures process CPU time: on a shared CPU machine (other jobs competing for the cores) wall
    time mostly measures the neighbours, CPU time measures the work. Use it with one torch thread.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    now = time.process_time if clock == "cpu" else time.perf_counter
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = now()
            fn()
            sync()
            times[name].append(now() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def print_table(
    title: str, rows: list[tuple[str, float | None, float]], baseline: str | list[str], unit: str = "real tok/s"
) -> None:
    """rows: (name, seconds or None if the variant failed, work units) -> a Markdown table with speed-ups over
    each ``baseline`` row."""
    baselines = [baseline] if isinstance(baseline, str) else baseline
    base = {b: next(s for n, s, _ in rows if n == b) for b in baselines}
    print(f"\n{title}\n")
    print(f"| variant | ms/step | {unit} | " + " | ".join(f"vs {b}" for b in baselines) + " |")
    print("|---|---:|---:|" + "---:|" * len(baselines))
    for name, seconds, work in rows:
        if seconds is None:
            print(f"| {name} | - | - | " + " | ".join("-" for _ in baselines) + " |")
            continue
        ratios = " | ".join(f"{base[b] / seconds:.2f}x" if base[b] else "-" for b in baselines)
        print(f"| {name} | {seconds * 1e3:.1f} | {work / seconds:,.0f} | {ratios} |")


def common_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every pi0.5 benchmark shares (this one and benchmarks/attention.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--width", type=int, default=Shape.width)
    parser.add_argument("--depth", type=int, default=Shape.depth)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast (CUDA)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                        help="auto: CPU time on a CPU device (robust to other jobs), wall time on CUDA")
    parser.add_argument("--seed", type=int, default=0)
    return parser


@dataclass
class RunSetup:
    device: torch.device
    clock: str
    autocast: torch.dtype | None
    shape: Shape


def setup_run(args: argparse.Namespace) -> RunSetup:
    """Apply the common options: threads, seed; pick the clock (CPU time on CPU, robust to other jobs)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    clock = args.clock if args.clock != "auto" else ("wall" if device.type == "cuda" else "cpu")
    autocast = torch.bfloat16 if args.dtype == "bf16" else None
    torch.manual_seed(args.seed)
    return RunSetup(device, clock, autocast, Shape(width=args.width, depth=args.depth,
                                                   expert_width=max(args.width // 2, 32)))


def main() -> None:
    parser = common_arguments(__doc__)
    parser.add_argument("--packed-backend", default="auto", help="attention backend of the packed rows")
    args = parser.parse_args()
    run = setup_run(args)
    device, clock, autocast, shape = run.device, run.clock, run.autocast, run.shape
    policy = Pi05Policy(bench_config(shape)).to(device).train()
    samples = make_samples(args.samples, shape, args.seed)
    packed, padded = (b.to(device) for b in layouts(policy, samples))
    real = packed.real_tokens
    print(
        f"{args.samples} samples, {real} real tokens; padded layout computes {padded.computed_tokens} positions "
        f"({padded.images.shape[0]} images encoded vs {packed.images.shape[0]} packed); width {shape.width}, "
        f"depth {shape.depth}, {device}, {args.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{clock} time"
    )
    fns = {
        "padded + eager (LeRobot)": train_step(policy, padded, "eager", autocast),
        "padded + dense SDPA": train_step(policy, padded, "dense", autocast),
        "padded + key-mask SDPA": train_step(policy, padded, "sdpa", autocast),
        f"packed + {args.packed_backend}": train_step(policy, packed, args.packed_backend, autocast),
    }
    seconds = measure(fns, args.steps, args.warmup, device, clock)
    print_table("Training step (fwd + bwd), pi0.5-shaped samples", [(n, s, real) for n, s in seconds.items()],
                ["padded + eager (LeRobot)", "padded + dense SDPA"])


if __name__ == "__main__":
    main()
