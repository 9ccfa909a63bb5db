"""`roboscale serve` against calling the policy in process: request latency and chunks/s with 1, 4 and 16 robot
clients, side by side in one run, for the demo-size pi0.5 and GR00T (untrained: a chunk costs what a trained
one's does).

For each policy: ``in process`` calls ``PolicyRunner.predict`` (what `roboscale eval` does) on batches of 1, 4 and
16 observations, each item with its own seed; ``server`` starts `roboscale serve` in its own process on loopback and
runs 1, 4 or 16 clients (threads of this process, one websocket each, each sending its next observation as soon as
its chunk came back: robots that infer synchronously, as openpi's ``ActionChunkBroker`` does). Per row: p50 and p99
of the request latency (a client's send to its reply; in process: the call), chunks/s over the window, the mean
batch the server formed, and the server's chunks/s as a share of in-process chunks/s at the same concurrency (its
own overhead: protocol, decoding, fitting images, the batching wait). Below each table: what a robot at 50 Hz with
50-step chunks would see (one chunk lasts 1 s: the p99 latency in control steps, the RTC delay to give).

    .venv/bin/python benchmarks/serve.py                    # ~4 min on 2 cores
    .venv/bin/python benchmarks/serve.py --device cuda      # on a GPU node (absolute figures)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from eval import demo_checkpoint  # noqa: E402

from roboscale.rollout.inference import PredictItem, RunnerSettings  # noqa: E402
from roboscale.sim.env import env_spec  # noqa: E402
from roboscale.transport.wire import pack, unpack  # noqa: E402

CLIENTS = (1, 4, 16)
ROBOT_HZ, ROBOT_CHUNK = 50, 50


def observation(rng: np.random.Generator, cameras: list[str], state_dim: int, size: int) -> dict:
    obs = {f"observation.images.{name}": rng.integers(0, 255, (size, size, 3), dtype=np.uint8) for name in cameras}
    obs["observation.state"] = rng.uniform(-1, 1, state_dim).astype(np.float32)
    obs["prompt"] = "Press the button from the top"
    return obs


def in_process(checkpoint: Path, device: str, threads: int, clients: int, seconds: float, size: int) -> dict:
    """Batches of ``clients`` observations through the engine's own runner for ``seconds``."""
    runner = RunnerSettings(str(checkpoint), device, threads).build()
    cameras = [k.removeprefix("observation.images.") for k in runner.image_keys]
    state_dim = runner.policy.config.dataset_state_dim or runner.policy.config.state_dim
    rng = np.random.default_rng(0)
    latencies, chunks, seed = [], 0, 0

    def items() -> list[PredictItem]:
        nonlocal seed
        batch = []
        for _ in range(clients):
            obs = observation(rng, cameras, state_dim, size)
            seed += 1
            batch.append(PredictItem(0, seed, 0, obs["prompt"], obs["observation.state"],
                                     {name: obs[f"observation.images.{name}"] for name in cameras}))
        return batch

    runner.predict(items())  # warm-up
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = items()
        began = time.perf_counter()
        runner.predict(batch)
        latencies.append(time.perf_counter() - began)
        chunks += clients
    wall = time.perf_counter() - start
    return {"latencies": latencies, "chunks_s": chunks / wall, "batch": float(clients)}


def start_server(checkpoint: Path, device: str, threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "roboscale", "serve", f"--checkpoint={checkpoint}", "--port=0",
         f"--runner.device={device}", f"--runner.threads={threads}", f"--runner.max_batch_size={max_batch}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "ROBOSCALE_LOG": "WARNING"})
    line = process.stdout.readline()
    if not line.startswith("serving on "):
        process.kill()
        raise RuntimeError(f"roboscale serve did not start: {line!r}")
    return process, line.split()[2]


def through_server(url: str, clients: int, seconds: float, size: int) -> dict:
    """``clients`` robots asking in closed loop for ``seconds`` (after one warm-up request each)."""
    from websockets.sync.client import connect

    connections = []
    for _ in range(clients):
        ws = connect(url, compression=None, max_size=None, legacy=True)
        metadata = unpack(ws.recv())
        connections.append(ws)
    keys = metadata["keys"]
    cameras = list(keys["images"])
    latencies: list[float] = []
    batches: list[int] = []
    counts = [0] * clients
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    stop = threading.Event()

    def robot(index: int) -> None:
        ws, rng = connections[index], np.random.default_rng(index)
        ws.send(pack({**observation(rng, cameras, keys["state_dim"], size), "seed": index}))  # warm-up
        ws.recv()
        barrier.wait()
        seed = index
        while not stop.is_set():
            seed += clients
            message = pack({**observation(rng, cameras, keys["state_dim"], size), "seed": seed})
            began = time.perf_counter()
            ws.send(message)
            reply = unpack(ws.recv())
            elapsed = time.perf_counter() - began
            with lock:
                latencies.append(elapsed)
                batches.append(reply["server_timing"]["batch_size"])
                counts[index] += 1

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    stop.wait(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    for ws in connections:
        ws.close()
    return {"latencies": latencies, "chunks_s": sum(counts) / wall, "batch": statistics.mean(batches)}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="pi05,groot")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the policy")
    parser.add_argument("--seconds", type=float, default=15.0, help="measuring window per row")
    parser.add_argument("--image-size", type=int, default=64, help="the size clients send (fitted by the server)")
    args = parser.parse_args()
    spec = env_spec("metaworld")
    tasks = spec.tasks_or_default([])
    for policy in args.policies.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = demo_checkpoint(Path(tmp), "demo", spec, tasks, policy=policy)
            rows = {}
            for clients in CLIENTS:
                rows[("in process", clients)] = in_process(checkpoint, args.device, args.threads, clients,
                                                           args.seconds, args.image_size)
            process, url = start_server(checkpoint, args.device, args.threads, max(CLIENTS))
            try:
                for clients in CLIENTS:
                    rows[("server", clients)] = through_server(url, clients, args.seconds, args.image_size)
            finally:
                process.terminate()
                process.wait(60)
        print(f"\n### {policy} (demo size, {args.device}, {args.threads} threads, {args.image_size}² images sent)\n")
        print("| path | clients | p50 ms | p99 ms | chunks/s | mean batch | server vs in process |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for (path, clients), r in rows.items():
            share = (f"{r['chunks_s'] / rows[('in process', clients)]['chunks_s']:.2f}x" if path == "server"
                     else "")
            print(f"| {path} | {clients} | {percentile(r['latencies'], 50):.1f} | {percentile(r['latencies'], 99):.1f}"
                  f" | {r['chunks_s']:.1f} | {r['batch']:.1f} | {share} |")
        one = rows[("server", 1)]
        p99 = percentile(one["latencies"], 99)
        step_ms = 1000 / ROBOT_HZ
        steps = math.ceil(p99 / step_ms)
        print(f"\nA robot at {ROBOT_HZ} Hz with {ROBOT_CHUNK}-step chunks ({ROBOT_CHUNK * step_ms:.0f} ms per chunk), "
              f"one client: p99 {p99:.0f} ms = {steps} control step{'s' * (steps != 1)}. Inferring synchronously "
              f"it pauses {p99:.0f} ms per chunk ({p99 / (ROBOT_CHUNK * step_ms):.0%} of its time); asking "
              f"{steps} step{'s' * (steps != 1)} before the chunk ends (--rtc with delay {steps}) it never pauses. "
              f"With 16 robots on one server: p99 "
              f"{percentile(rows[('server', 16)]['latencies'], 99):.0f} ms.")


if __name__ == "__main__":
    main()
