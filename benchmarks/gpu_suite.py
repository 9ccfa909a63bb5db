"""All pi0.5 packing/attention claims on one CUDA GPU, in one run, printed as tables.

bf16 autocast (fp32 master weights), full model width (``--preset full``: SigLIP So400m/14 at 224, Gemma 2B,
Gemma 300M expert; ``--layers`` cuts the joint depth when the full stack does not fit the time), pi0.5-shaped
samples (1-3 real cameras of 3 slots x 256 tokens, 10-60 prompt tokens padded to 200, 50 actions).

Training step (fwd + bwd), real tokens/s, speed-ups against LeRobot's eager dense mask and against padded SDPA:
    padded + eager (LeRobot) | padded + dense SDPA | padded + key-mask SDPA |
    packed + varlen (flash) | packed + flex (compiled) | packed + sdpa (per segment)
Inference (one chunk, 10 Euler steps): prefix KV cache vs recomputing the prefix every step (packed, auto).
ONNX Runtime's execution providers (CPU, CUDA, TensorRT; benchmarks/export.py) against eager PyTorch on the GPU:
chunk latency of the demo-size pi0.5 at batch 1 and 8 (--skip-onnx leaves it out).
bf16 vs FP8 (torchao float8, benchmarks/fp8.py): a pi0.5 layer stack and the GR00T-N1.5 stack, one training step
each (fwd + bwd + AdamW): ms, tokens/s, peak memory, FP8/bf16 speed-up of the step and of its large GEMMs alone.

A variant that cannot run here (no varlen kernel in this torch, a compile failure, out of memory) prints its
error and a "-" row; the others still run.

    python benchmarks/gpu_suite.py                           # CUDA, full width, 18 layers
    python benchmarks/gpu_suite.py --layers 6 --samples 8    # a representative layer stack, faster
    python benchmarks/gpu_suite.py --dry-run                 # CPU, tiny widths, checks the script end to end
    python benchmarks/gpu_suite.py --only-fp8                # the bf16 vs FP8 section alone

Time on one H200 (estimate, not measured yet): the packing/attention/inference sections ~3-4 min, the FP8
section ~2 min (two stacks eager, 8 GEMM shapes compiled twice each); --fp8-compile adds ~2-3 min of compiling.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import inference_fns  # noqa: E402
from fp8 import add_arguments as add_fp8_arguments  # noqa: E402
from fp8 import run_fp8_section  # noqa: E402
from packing import Shape, bench_config, layouts, make_samples, measure, print_table, train_step  # noqa: E402

from roboscale.models import attention as attn  # noqa: E402
from roboscale.models.pi05.config import Pi05Config  # noqa: E402
from roboscale.models.pi05.modeling import Pi05Policy  # noqa: E402
from roboscale.models.registry import preset_config  # noqa: E402


def full_config(layers: int) -> Pi05Config:
    cfg = preset_config("pi05", "full")
    cfg.depth = layers or cfg.depth
    cfg.state_norm = cfg.action_norm = "identity"
    cfg.pad_language_to = 200  # LeRobot pads every prompt to 200 positions
    cfg.num_inference_steps = 10
    return cfg


def runnable(fns: dict[str, Callable[[], None]]) -> tuple[dict[str, Callable[[], None]], list[str]]:
    """Run each variant once (it is also the first warm-up: compiles, autotuning); keep the ones that work."""
    ok, failed = {}, []
    for name, fn in fns.items():
        try:
            fn()
        except Exception as exc:  # report and continue: one missing kernel must not cost the whole GPU run
            print(f"[{name}] skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            if "--verbose" in sys.argv:
                traceback.print_exc()
            failed.append(name)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            ok[name] = fn
    return ok, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["full", "bench"], default="full",
                        help="full: pi0.5 widths; bench: benchmarks/packing.py's small widths")
    parser.add_argument("--layers", type=int, default=0, help="joint layers (0: the preset's; full = 18)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny widths, fp32, 1 step: checks the script")
    parser.add_argument("--verbose", action="store_true", help="tracebacks of skipped variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-fp8", action="store_true", help="leave out the bf16 vs FP8 section")
    parser.add_argument("--only-fp8", action="store_true", help="run the bf16 vs FP8 section alone")
    parser.add_argument("--skip-onnx", action="store_true", help="leave out the ONNX Runtime providers section")
    add_fp8_arguments(parser)
    args = parser.parse_args()
    if args.dry_run:
        device, autocast, clock = torch.device("cpu"), None, "cpu"
        args.preset, args.steps, args.warmup, args.samples = "bench", 1, 0, min(args.samples, 3)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_suite.py needs a CUDA GPU (use --dry-run to check it on CPU)")
        device, autocast, clock = torch.device("cuda"), torch.bfloat16, "wall"
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    if not args.only_fp8:
        packing_sections(args, device, autocast, clock)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the full pi0.5 is gone; the FP8 stacks build their own
    if not args.skip_fp8:
        run_fp8_section(args)
    if not args.skip_onnx and not args.only_fp8:
        try:
            from export import provider_section  # benchmarks/export.py (needs onnx and onnxruntime)
        except ImportError as exc:
            print(f"\n## ONNX Runtime execution providers: skipped ({exc})")
        else:
            provider_section("cpu" if device.type == "cpu" else "cuda", calls=3 if args.dry_run else 20,
                             preset="tiny" if args.dry_run else "demo")


def packing_sections(args: argparse.Namespace, device: torch.device, autocast, clock: str) -> None:
    """Packing and attention (training step) and the prefix KV cache (inference) on pi0.5."""
    if args.preset == "full":
        cfg = full_config(args.layers)
        shape = Shape(vocab=cfg.vocab_size, image_size=cfg.image_size, chunk=cfg.chunk_size)
    else:
        shape = Shape(depth=args.layers or (1 if args.dry_run else Shape.depth))
        cfg = bench_config(shape)
    policy = Pi05Policy(cfg).to(device)
    params = sum(p.numel() for p in policy.parameters())
    samples = make_samples(args.samples, shape, args.seed, cfg.image_size)
    packed, padded = (b.to(device) for b in layouts(policy, samples))
    real = packed.real_tokens
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    print(
        f"{gpu}; torch {torch.__version__}; varlen kernel: {attn.varlen_available()}; flex: {attn.flex_available()}\n"
        f"pi0.5 {args.preset}: {params / 1e9:.2f} B parameters, {cfg.depth} joint layers, width {cfg.width}/"
        f"{cfg.expert_width}, head_dim {cfg.head_dim}; {'bf16 autocast' if autocast else 'fp32'}; {clock} time\n"
        f"{args.samples} samples: {real} real tokens; padded layout {padded.computed_tokens} positions, "
        f"{padded.images.shape[0]} images encoded vs {packed.images.shape[0]} packed"
    )

    policy.train()
    fns = {
        "padded + eager (LeRobot)": train_step(policy, padded, "eager", autocast),
        "padded + dense SDPA": train_step(policy, padded, "dense", autocast),
        "padded + key-mask SDPA": train_step(policy, padded, "sdpa", autocast),
        "packed + varlen (flash)": train_step(policy, packed, "varlen", autocast),
        "packed + flex": train_step(policy, packed, "flex", autocast),
        "packed + sdpa (per segment)": train_step(policy, packed, "sdpa", autocast),
        "packed + auto": train_step(policy, packed, "auto", autocast),
    }
    ok, failed = runnable(fns)
    seconds = measure(ok, args.steps, max(args.warmup - 1, 0), device, clock)
    rows = [(n, seconds.get(n), real) for n in fns]
    baselines = [b for b in ("padded + eager (LeRobot)", "padded + key-mask SDPA") if b in seconds]
    if baselines:
        print_table("Training step (fwd + bwd)", rows, baselines)
    policy.zero_grad(set_to_none=True)

    policy.eval()
    infer = inference_fns(policy, packed, "auto", autocast)
    ok, failed = runnable(infer)
    seconds = measure(ok, args.steps, max(args.warmup - 1, 0), device, clock)
    if "recompute prefix every step" in seconds:
        print_table(f"Inference: one {cfg.chunk_size}-action chunk, {cfg.num_inference_steps} Euler steps, packed",
                    [(n, seconds.get(n), args.samples) for n in infer], "recompute prefix every step",
                    unit="chunks/s")
    if device.type == "cuda":
        print(f"\npeak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
