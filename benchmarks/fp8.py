"""bf16 vs FP8 training (torchao float8, the policies' FP8 filters) on one CUDA GPU, side by side in one run.

Two stacks at full width, one training step each (forward + backward + AdamW step), bf16 autocast over fp32
master weights, the same batch for both precisions:
- pi0.5: SigLIP So400m/14 ViT, ``--fp8-layers`` joint layers of Gemma 2B + the 300M expert (full: 18), packed
  pi0.5-shaped samples (1-3 cameras of 3, prompts of 10-60 tokens, 50 actions);
- GR00T-N1.5: ViT, 12 Qwen3 layers (frozen, as its fine-tuning), 4 VL self-attention blocks, 16 DiT blocks;
  one 224² camera, 200 prompt tokens, 16 actions.
Printed per stack: ms per step, tokens/s, peak memory, FP8/bf16 speed-up of the whole step; then the large GEMMs
alone: each converted Linear shape (M tokens x K -> N, found by hooks during a bf16 step) timed forward +
backward as nn.Linear in bf16 and as torchao's Float8Linear, compiled (the casts fused, as torchao intends), and
the FLOP-weighted speed-up over the shapes measured. The stacks run eager unless ``--fp8-compile`` compiles
their blocks (the trainer's ``--compile``); eager FP8 pays unfused casts per layer.

    python benchmarks/fp8.py                   # CUDA (sm89+), ~2 minutes on an H200 (estimate)
    python benchmarks/fp8.py --dry-run         # CPU, tiny widths, emulated FP8: checks the script (seconds)
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import Shape, bench_config, layouts, make_samples, measure  # noqa: E402

from roboscale.models.objective import flow_matching_loss  # noqa: E402
from roboscale.models.groot.modeling import GrootPolicy  # noqa: E402
from roboscale.models.groot.transform import TOKENS, TOKENS_MASK  # noqa: E402
from roboscale.models.pi05.modeling import Pi05Policy  # noqa: E402
from roboscale.models.registry import preset_config  # noqa: E402
from roboscale.train.fp8 import apply_fp8  # noqa: E402

TINY_MIN_FEATURES = 16  # --dry-run: convert the tiny widths too, so the FP8 path runs


def pi05_stack(layers: int, samples: int, dry: bool, seed: int):
    if dry:
        shape = Shape(depth=layers or 1)
        cfg = bench_config(shape, packing=True)
    else:
        cfg = preset_config("pi05", "full", state_norm="identity", action_norm="identity")
        cfg.depth = layers or cfg.depth
        shape = Shape(vocab=cfg.vocab_size, image_size=cfg.image_size, chunk=cfg.chunk_size)
    with torch.device("meta"):  # the layout needs the policy's prefix spec only
        spec_only = Pi05Policy(cfg)
    batch, _ = layouts(spec_only, make_samples(samples, shape, seed, cfg.image_size))
    return (lambda: Pi05Policy(cfg)), batch, batch.real_tokens


def groot_stack(samples: int, dry: bool, seed: int):
    cams = ["observation.images.ego_view"]
    if dry:
        cfg = preset_config("groot", "tiny", image_keys=cams, state_dim=8, action_dim=4, vocab_size=64)
    else:
        cfg = preset_config("groot", "full", vocab_size=151680)
    cfg.state_norm = cfg.action_norm = "identity"
    g = torch.Generator().manual_seed(seed)
    n, size = samples, cfg.image_size
    batch = {cams[0]: torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8),
             "observation.state": torch.randn(n, cfg.state_dim, generator=g),
             "action": torch.randn(n, cfg.chunk_size, cfg.action_dim, generator=g),
             "action_is_pad": torch.zeros(n, cfg.chunk_size, dtype=torch.bool),
             TOKENS: torch.randint(2, cfg.vocab_size, (n, cfg.max_language_tokens), generator=g),
             TOKENS_MASK: torch.ones(n, cfg.max_language_tokens, dtype=torch.bool)}
    tokens_per_sample = (cfg.image_size // cfg.vit_patch_size // cfg.pixel_shuffle) ** 2 + cfg.max_language_tokens
    tokens = n * (tokens_per_sample + 1 + cfg.num_future_tokens + cfg.chunk_size)
    return (lambda: GrootPolicy(cfg)), batch, tokens


def to_device(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch.to(device)


def train_step(policy: nn.Module, batch, autocast: torch.dtype | None) -> Callable[[], None]:
    trainable = [p for p in policy.parameters() if p.requires_grad]
    device = next(policy.parameters()).device
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss, _ = flow_matching_loss(policy, batch)
        loss.backward()
        optimizer.step()

    return step


def gemm_shapes(policy: nn.Module, step: Callable[[], None], converted: list[str]) -> Counter:
    """(M, K, N) -> how many converted Linear calls of one step have that shape (hooks on the bf16 model)."""
    shapes: Counter = Counter()
    wanted = set(converted)
    hooks = [module.register_forward_hook(lambda m, args, out: shapes.update(
        [(math.prod(args[0].shape[:-1]), m.in_features, m.out_features)]))
        for name, module in policy.named_modules() if name in wanted]
    step()
    for hook in hooks:
        hook.remove()
    return shapes


def linear_fns(shapes: list[tuple[int, int, int]], device, autocast, emulate: bool, compile: bool) -> dict:
    """Forward + backward of one Linear per shape, bf16 and FP8 (torchao), as named callables."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    fns = {}
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, requires_grad=True)
        for precision in ("bf16", "fp8"):
            layer = nn.Linear(k, n, bias=False).to(device)
            if precision == "fp8":
                layer = convert_to_float8_training(nn.Sequential(layer),
                                                   config=Float8LinearConfig(emulate=emulate))[0]
            run = torch.compile(layer) if compile else layer

            def fn(run=run, x=x):
                with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
                    out = run(x)
                out.float().sum().backward()

            fns[(m, k, n, precision)] = fn
    return fns


def peak_memory(fn: Callable[[], None], device) -> float:
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


def run_stack(name: str, build: Callable[[], nn.Module], batch, tokens: int, args, device, autocast) -> None:
    from gpu_suite import runnable  # run each variant once, skip one that fails with its error

    torch.manual_seed(args.seed)
    batch = to_device(batch, device)
    fns, policies, converted = {}, {}, []
    base_name = f"{name} {'bf16' if autocast else 'fp32'}"  # the dry run has no bf16 autocast on CPU
    for precision in ("bf16", "fp8"):
        with torch.device(device):
            policy = build().train()
        if precision == "fp8":
            try:
                converted = apply_fp8(policy, device=device, fsdp=False,
                                      min_features=TINY_MIN_FEATURES if args.dry_run else None)
            except Exception as exc:  # no FP8 on this GPU: report and time bf16 alone
                print(f"[{name} fp8] skipped: {type(exc).__name__}: {exc}")
                continue
        if args.fp8_compile:
            for unit in policy.parallel_units():
                unit.compile()
        policies[precision] = policy
        fns[base_name if precision == "bf16" else f"{name} fp8"] = train_step(policy, batch, autocast)
    ok, _ = runnable(fns)
    seconds = measure(ok, args.steps, max(args.warmup - 1, 0), device, "cpu" if args.dry_run else "wall")
    memory = {n: peak_memory(fn, device) for n, fn in ok.items()}
    params = sum(p.numel() for p in policies["bf16"].parameters())
    print(f"\n{name}: {params / 1e9:.2f} B parameters, {len(converted)} Linear layers in FP8, {tokens:,} tokens "
          f"per step, {'compiled blocks' if args.fp8_compile else 'eager'}\n")
    print("| precision | ms/step | tokens/s | peak GiB | FP8 / bf16 speed |")
    print("|---|---:|---:|---:|---:|")
    base = seconds.get(base_name)
    for variant in fns:
        s = seconds.get(variant)
        if s is None:
            print(f"| {variant} | - | - | - | - |")
            continue
        ratio = f"{base / s:.2f}x" if base else "-"
        gib = f"{memory[variant]:.1f}" if device.type == "cuda" else "-"
        print(f"| {variant} | {s * 1e3:.1f} | {tokens / s:,.0f} | {gib} | {ratio} |")
    if not converted or "bf16" not in policies:
        return
    shapes = gemm_shapes(policies["bf16"], fns[base_name], converted)
    flops = {s: 2 * math.prod(s) * count for s, count in shapes.items()}
    top = sorted(flops, key=flops.get, reverse=True)[: args.gemm_shapes]
    covered = sum(flops[s] for s in top) / sum(flops.values())
    del policies, fns, ok
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gemm = linear_fns(top, device, autocast, emulate=device.type != "cuda", compile=not args.dry_run)
    ok, _ = runnable(gemm)
    seconds = measure(ok, args.steps, max(args.warmup - 1, 0), device, "cpu" if args.dry_run else "wall")
    print(f"\n{name}: the large GEMMs alone (fwd + bwd, {'compiled' if not args.dry_run else 'eager'}), the "
          f"{len(top)} largest converted shapes = {100 * covered:.0f}% of the stack's FP8 GEMM FLOPs\n")
    print("| M x K -> N | layers | bf16 ms | fp8 ms | FP8 / bf16 speed |")
    print("|---|---:|---:|---:|---:|")
    total_bf16 = total_fp8 = 0.0
    for m, k, n in top:
        b, f = seconds.get((m, k, n, "bf16")), seconds.get((m, k, n, "fp8"))
        if b is None or f is None:
            print(f"| {m} x {k} -> {n} | {shapes[(m, k, n)]} | - | - | - |")
            continue
        total_bf16 += shapes[(m, k, n)] * b
        total_fp8 += shapes[(m, k, n)] * f
        print(f"| {m} x {k} -> {n} | {shapes[(m, k, n)]} | {b * 1e3:.3f} | {f * 1e3:.3f} | {b / f:.2f}x |")
    if total_fp8:
        print(f"| all measured shapes, per step | | {total_bf16 * 1e3:.1f} | {total_fp8 * 1e3:.1f} | "
              f"{total_bf16 / total_fp8:.2f}x |")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8-layers", type=int, default=4, help="pi0.5 joint layers in its stack (full: 18)")
    parser.add_argument("--fp8-samples", type=int, default=8, help="samples per step of each stack")
    parser.add_argument("--fp8-compile", action="store_true", help="compile the stacks' blocks (slower start)")
    parser.add_argument("--gemm-shapes", type=int, default=4, help="largest converted GEMM shapes timed per stack")


def run_fp8_section(args: argparse.Namespace) -> None:
    """The whole bf16 vs FP8 comparison (``args``: gpu_suite's options plus ``add_arguments``')."""
    if args.dry_run:
        device, autocast = torch.device("cpu"), None
        args.fp8_samples = min(args.fp8_samples, 2)
    else:
        device, autocast = torch.device("cuda"), torch.bfloat16
    print(f"\n## bf16 vs FP8 (torchao float8, tensorwise; {'emulated on CPU' if args.dry_run else 'CUDA'})")
    build, batch, tokens = pi05_stack(args.fp8_layers if not args.dry_run else 1, args.fp8_samples, args.dry_run,
                                      args.seed)
    run_stack("pi0.5", build, batch, tokens, args, device, autocast)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    build, batch, tokens = groot_stack(args.fp8_samples, args.dry_run, args.seed)
    run_stack("GR00T-N1.5", build, batch, tokens, args, device, autocast)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny widths, emulated FP8, 1 step")
    add_arguments(parser)
    args = parser.parse_args()
    if args.dry_run:
        args.steps, args.warmup = 1, 0
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        sys.exit("fp8.py needs a CUDA GPU (use --dry-run to check it on CPU)")
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    run_fp8_section(args)


if __name__ == "__main__":
    main()
