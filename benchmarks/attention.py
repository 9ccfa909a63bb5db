"""pi0.5 attention: our implementation vs LeRobot's eager dense-mask attention, and prefix-KV-cache inference vs
recomputing the prefix at every Euler step. Same model, same samples, measured side by side in one run.

Training (fwd + bwd), LeRobot's padded layout for every row (3 slots x 256 image tokens, 200 language positions,
50 actions), so only the attention differs:
- ``eager dense mask`` (baseline): LeRobot's ``eager_attention_forward``: matmul, masked softmax over a
  materialised 4-D mask, matmul;
- ``SDPA dense mask``: the same mask handed to SDPA;
- ``SDPA key-padding, two calls``: ours: prefix -> prefix and actions -> [prefix, actions], [B, 1, 1, L] masks;
- ``packed + auto``: ours with packing on (for reference; benchmarks/packing.py is the packing claim).

Inference (one action chunk = ``num_inference_steps`` Euler steps, 10 as pi0.5), ``--layout`` packed (default)
or padded:
- ``recompute prefix`` (baseline): every Euler step re-runs vision + the prefix model + the action expert;
- ``prefix KV cache``: vision + prefix model once, then only the 50 action tokens per step.

    .venv/bin/python benchmarks/attention.py                  # CPU, small width, ~1-2 minutes
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import (  # noqa: E402
    bench_config,
    common_arguments,
    layouts,
    make_samples,
    measure,
    print_table,
    setup_run,
    train_step,
)

from roboscale.batching import PackedBatch  # noqa: E402
from roboscale.models.pi05.modeling import Pi05Policy  # noqa: E402


@torch.no_grad()
def chunk_with_cache(policy: Pi05Policy, batch: PackedBatch) -> torch.Tensor:
    return policy.predict_action_chunk(batch)


@torch.no_grad()
def chunk_recomputing_prefix(policy: Pi05Policy, batch: PackedBatch) -> torch.Tensor:
    """What inference costs without a KV cache: the whole prefix (vision included) at every Euler step."""
    cfg = policy.config

    def velocity(x, t):
        return policy.velocity(policy.encode(batch, cache=True), x, t)

    noise = torch.randn(batch.num_samples, cfg.chunk_size, cfg.action_dim, device=batch.state.device)
    actions = policy.flow_matching.sample(velocity, noise, cfg.num_inference_steps)
    return policy.action_normalizer.unnormalize(actions)


def inference_fns(policy: Pi05Policy, batch: PackedBatch, backend: str, autocast) -> dict[str, Callable[[], None]]:
    def run(fn):
        def call():
            policy.config.attention_backend = backend
            with torch.autocast(batch.state.device.type, dtype=autocast, enabled=autocast is not None):
                fn(policy, batch)

        return call

    return {"recompute prefix every step": run(chunk_recomputing_prefix), "prefix KV cache": run(chunk_with_cache)}


def main() -> None:
    parser = common_arguments(__doc__)
    parser.add_argument("--euler-steps", type=int, default=10)
    parser.add_argument("--layout", choices=["packed", "padded"], default="packed", help="inference layout")
    parser.add_argument("--skip", choices=["train", "infer"], default=None)
    args = parser.parse_args()
    run = setup_run(args)
    device, clock, autocast, shape = run.device, run.clock, run.autocast, run.shape
    policy = Pi05Policy(bench_config(shape, num_inference_steps=args.euler_steps)).to(device)
    packed, padded = (b.to(device) for b in layouts(policy, make_samples(args.samples, shape, args.seed)))
    real = packed.real_tokens
    print(
        f"{args.samples} samples, {real} real tokens, padded layout {padded.computed_tokens} positions; width "
        f"{shape.width}, depth {shape.depth}, {device}, {args.dtype}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {clock} time"
    )
    if args.skip != "train":
        policy.train()
        fns = {
            "eager dense mask (LeRobot)": train_step(policy, padded, "eager", autocast),
            "SDPA dense mask": train_step(policy, padded, "dense", autocast),
            "SDPA key-padding, two calls": train_step(policy, padded, "sdpa", autocast),
            "packed + auto": train_step(policy, packed, "auto", autocast),
        }
        seconds = measure(fns, args.steps, args.warmup, device, clock)
        print_table("Training step (fwd + bwd), padded pi0.5 layout unless noted",
                    [(n, s, real) for n, s in seconds.items()], "eager dense mask (LeRobot)")
    if args.skip != "infer":
        policy.eval()
        batch = packed if args.layout == "packed" else padded
        backend = "auto" if args.layout == "packed" else "sdpa"
        seconds = measure(inference_fns(policy, batch, backend, autocast), args.steps, args.warmup, device, clock)
        print_table(f"Inference: one {shape.chunk}-action chunk, {args.euler_steps} Euler steps, {args.layout} layout",
                    [(n, s, args.samples) for n, s in seconds.items()], "recompute prefix every step",
                    unit="chunks/s")


if __name__ == "__main__":
    main()
