"""What `roboscale export --format=onnx` buys, side by side in one run: chunk latency (p50/p99) at batch 1 and 8 of
eager PyTorch, torch.compile'd PyTorch, ONNX Runtime (split graphs: the encoder, then the denoiser per Euler step;
and the unrolled chunk graph), and ONNX Runtime with int8 weight MatMuls; the export's time, sizes and action error
against PyTorch; the closed-loop success of each backend on the demo tasks; and the full presets' architectures
(narrowed: the full size does not fit this machine's export) checked for parity.

Every latency is ``predict`` of the rollout's own predictors (``PolicyRunner``, ``OnnxPredictor``) on the same
items (each its own episode seed and chunk index), the same thread count for all, CPU execution provider with all
graph optimisations.

    .venv/bin/python benchmarks/export.py                       # the demo checkpoint (make demo first); ~20 min
    .venv/bin/python benchmarks/export.py --episodes 0          # latency and parity only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from eval import demo_checkpoint  # noqa: E402

from roboscale.deploy.export import export_onnx, quantize_directory, relative_error  # noqa: E402
from roboscale.rollout.inference import PolicyRunner, PredictItem  # noqa: E402
from roboscale.rollout.onnx import OnnxPredictor  # noqa: E402
from roboscale.sim.env import env_spec  # noqa: E402

DEMO_TASKS = env_spec("metaworld").tasks_or_default(["demo"])


def items(runner: PolicyRunner, batch: int, call: int) -> list[PredictItem]:
    rng = np.random.default_rng(call)
    cfg = runner.policy.config
    width = cfg.dataset_state_dim or cfg.state_dim
    return [PredictItem(i, 1000 * call + i, call % 7, "Press the button from the top",
                        rng.uniform(-1, 1, width).astype(np.float32),
                        {k.removeprefix("observation.images."): rng.integers(0, 255, (cfg.image_size, cfg.image_size, 3),
                                                                             dtype=np.uint8)
                         for k in cfg.image_keys}) for i in range(batch)]


def latency(predictor, reference: PolicyRunner, batch: int, calls: int) -> tuple[float, float]:
    for warm in range(3):
        predictor.predict(items(reference, batch, 10_000 + warm))
    times = []
    for call in range(calls):
        batch_items = items(reference, batch, call)
        start = time.perf_counter()
        predictor.predict(batch_items)
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1e3, times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3


def compiled(checkpoint: Path, threads: int) -> PolicyRunner:
    runner = PolicyRunner(str(checkpoint), "cpu", threads)
    for unit in runner.policy.parallel_units():
        unit.compile()
    return runner


def action_error(predictor, reference: PolicyRunner, batch: int) -> float:
    test = items(reference, batch, 99)
    return relative_error(np.stack([p.chunk for p in predictor.predict(test)]),
                          np.stack([p.chunk for p in reference.predict(test)]))


def evaluate(checkpoint: Path, backend: str, episodes: int, out: Path) -> dict:
    from roboscale.configs.eval import EvalConfig, EvalPolicy
    from roboscale.eval.closed_loop import evaluate as run

    start = time.perf_counter()
    run(EvalConfig(checkpoint=str(checkpoint), tasks=DEMO_TASKS, episodes=episodes, videos_per_task=0,
                   output_dir=str(out), policy=EvalPolicy(backend)), progress=False)
    report = json.loads((out / "report.json").read_text())
    episodes_run = {(e["task"], e["episode"]): e["success"] for e in report["episodes"]}
    return {"success": report["overall"]["success_rate"], "episodes": episodes_run, "seconds": time.perf_counter() - start}


def narrowed_full(policy_type: str):
    """The full preset's architecture (layout, cameras, image size and patches, prompt, chunk, padded widths) at
    widths this machine exports in seconds."""
    from types import SimpleNamespace

    from roboscale.models.registry import build_policy, preset_config

    narrow = dict(vit_dim=32, vit_depth=2, vit_heads=2, vit_mlp_dim=64)
    if policy_type == "pi05":
        narrow.update(width=64, depth=3, num_heads=2, head_dim=32, mlp_dim=128, expert_width=32, expert_mlp_dim=64)
    else:
        narrow.update(llm_width=64, llm_layers=2, llm_heads=2, llm_kv_heads=1, llm_head_dim=32, llm_mlp_dim=128,
                      vl_layers=1, vl_heads=2, dit_layers=2, dit_width=64, dit_heads=2, hidden_size=64,
                      num_future_tokens=4)
    cfg = preset_config(policy_type, "full", **narrow)
    dims = {"observation.state": cfg.state_dim, "action": cfg.action_dim}
    stats = {k: {"q01": -np.ones(d), "q99": np.ones(d), "mean": np.zeros(d), "std": np.ones(d), "min": -np.ones(d),
                 "max": np.ones(d)} for k, d in dims.items()}
    features = {k: {"shape": [d]} for k, d in dims.items()}
    features.update({k: {"dtype": "video", "shape": [cfg.image_size, cfg.image_size, 3]} for k in cfg.image_keys})
    # the tokenizer is trained on these (pi0.5's prompts carry the state's bins); byte-level, so any prompt encodes
    tasks = ["press the button", "open the drawer", "Task: State: Action:"] + [
        " ".join(str(i) for i in range(j, j + 16)) for j in range(0, 256, 16)]
    meta = SimpleNamespace(root="<benchmark>", features=features, camera_keys=list(cfg.image_keys), fps=50,
                           task_list=tasks, stats=stats)
    torch.manual_seed(0)
    return build_policy(cfg, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="outputs/demo/train", help="the trained pi0.5 (make demo)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--episodes", type=int, default=10, help="per demo task, per backend (0: no evaluation)")
    parser.add_argument("--policies", default="pi05,groot", help="which of the two to measure")
    parser.add_argument("--skip-full", action="store_true", help="leave out the full architectures' parity")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from roboscale.models.policy import resolve_checkpoint

    work = Path(tempfile.mkdtemp(prefix="export-bench-"))
    spec = env_spec("metaworld")
    policies = args.policies.split(",")
    checkpoints = {}
    if "pi05" in policies:
        checkpoints["pi05 (demo, trained)"] = resolve_checkpoint(args.checkpoint)
    if "groot" in policies:
        checkpoints["groot (demo size)"] = demo_checkpoint(work / "groot", "demo", spec, DEMO_TASKS, "groot")
    for name, checkpoint in checkpoints.items():
        slug = name.split()[0]
        report = export_onnx(checkpoint, work / f"{slug}-onnx", unrolled=True)
        sizes = ", ".join(f"{g} {b / 1e6:.1f} MB" for g, b in report.bytes.items())
        weights = (checkpoint / "model.safetensors").stat().st_size / 1e6
        print(f"\n## {name}: export {report.seconds:.0f} s; {sizes} (model.safetensors {weights:.1f} MB); "
              f"actions vs PyTorch: " + ", ".join(f"{k} {v:.1e}" for k, v in report.errors.items()))
        start = time.perf_counter()
        int8 = quantize_directory(work / f"{slug}-onnx", work / f"{slug}-int8")
        print(f"int8 quantization {time.perf_counter() - start:.0f} s; " + ", ".join(
            f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in sorted(int8.glob("*.onnx"))))
        reference = PolicyRunner(str(checkpoint), "cpu", args.threads)
        backends = {"eager PyTorch": reference, "torch.compile": compiled(checkpoint, args.threads),
                    "ONNX Runtime (split)": OnnxPredictor(str(work / f"{slug}-onnx"), "cpu", args.threads,
                                                          graph="split"),
                    "ONNX Runtime (unrolled)": OnnxPredictor(str(work / f"{slug}-onnx"), "cpu", args.threads,
                                                             graph="chunk"),
                    "ONNX Runtime int8 (split)": OnnxPredictor(str(int8), "cpu", args.threads, graph="split"),
                    "ONNX Runtime int8 (unrolled)": OnnxPredictor(str(int8), "cpu", args.threads, graph="chunk")}
        print("\n| backend | batch 1 p50 / p99 ms | vs eager | batch 8 p50 / p99 ms | vs eager | action error "
              "vs PyTorch |\n|---|---:|---:|---:|---:|---:|")
        base = {}
        for label, predictor in backends.items():
            row = [label]
            for batch in (1, 8):
                p50, p99 = latency(predictor, reference, batch, args.calls if batch == 1 else args.calls // 2)
                base.setdefault(batch, p50)
                row += [f"{p50:.1f} / {p99:.1f}", f"{base[batch] / p50:.2f}x"]
            row.append("0" if predictor is reference else f"{action_error(predictor, reference, 8):.1e}")
            print("| " + " | ".join(row) + " |", flush=True)
        if slug == "pi05" and args.episodes:
            results = {label: evaluate(path, backend, args.episodes, work / f"eval-{label}")
                       for label, path, backend in (("PyTorch", checkpoint, "torch"),
                                                    ("ONNX Runtime", work / "pi05-onnx", "onnx"),
                                                    ("ONNX Runtime int8", int8, "onnx"))}
            torch_episodes = results["PyTorch"]["episodes"]
            print(f"\nclosed loop, demo tasks, {args.episodes} episodes per task (same seeds):\n\n| backend | success | "
                  "episodes with PyTorch's outcome | eval s |\n|---|---:|---:|---:|")
            for label, result in results.items():
                same = sum(result["episodes"][k] == v for k, v in torch_episodes.items())
                print(f"| {label} | {result['success']:.1%} | {same}/{len(torch_episodes)} | "
                      f"{result['seconds']:.0f} |")
    if args.skip_full:
        return
    print("\n## full presets' architectures, narrowed (parity of the export)")
    for policy_type in ("pi05", "groot"):
        report = export_onnx("", work / f"full-{policy_type}", policy=narrowed_full(policy_type))
        print(f"{policy_type} full (narrowed): export {report.seconds:.0f} s; actions vs PyTorch: "
              + ", ".join(f"{k} {v:.1e}" for k, v in report.errors.items()), flush=True)


if __name__ == "__main__":
    main()


def provider_section(device: str, calls: int = 20, preset: str = "demo") -> None:
    """benchmarks/gpu_suite.py's ONNX section: the demo-size pi0.5 (untrained) in eager PyTorch on ``device`` and in
    ONNX Runtime with each execution provider this onnxruntime has (CPU; CUDA and TensorRT with onnxruntime-gpu),
    chunk latency at batch 1 and 8. A provider that is missing or fails prints its error and a "-" row. ``preset``:
    tiny for the CPU dry run (which exports the split graphs only)."""
    import onnxruntime as ort

    work = Path(tempfile.mkdtemp(prefix="export-providers-"))
    checkpoint = demo_checkpoint(work / "pi05", preset, env_spec("metaworld"), DEMO_TASKS, "pi05")
    quick = preset == "tiny"
    export_onnx(checkpoint, work / "onnx", rtc=not quick, unrolled=not quick)
    reference = PolicyRunner(str(checkpoint), device)
    rows = {f"eager PyTorch ({device})": lambda: reference}
    available = ort.get_available_providers()
    for name, provider in (("cpu", "CPUExecutionProvider"), ("cuda", "CUDAExecutionProvider"),
                           ("tensorrt", "TensorrtExecutionProvider")):
        rows[f"ONNX Runtime {provider}"] = (lambda name=name: OnnxPredictor(str(work / "onnx"), name)) \
            if provider in available else None
    print(f"\n## ONNX Runtime execution providers (onnxruntime {ort.__version__}: {available})\n\n"
          "| backend | batch 1 p50 / p99 ms | batch 8 p50 / p99 ms | action error vs PyTorch |\n|---|---:|---:|---:|")
    for label, build in rows.items():
        if build is None:
            print(f"| {label} | - | - | not in this onnxruntime |")
            continue
        try:
            predictor = build()
            cells = ["{:.1f} / {:.1f}".format(*latency(predictor, reference, b, calls)) for b in (1, 8)]
            error = "0" if predictor is reference else f"{action_error(predictor, reference, 8):.1e}"
            print(f"| {label} | {cells[0]} | {cells[1]} | {error} |", flush=True)
        except Exception as exc:  # a provider that fails to start: its error, and the other rows still run
            print(f"| {label} | - | - | {type(exc).__name__}: {str(exc).splitlines()[0][:80]} |", flush=True)
