"""Loader throughput: LeRobot's access pattern vs ours, on raw v3 files and on lake shards, side by side.

A pi0.5-shaped sample: the current frame of 2 cameras (224², AV1 as LeRobot writes it), the state, and a 50-step
action chunk with ``action_is_pad``; batches of 32 from 2 worker processes. Reports samples/s and CPU-seconds per
sample (main process + workers, after a warm-up), and the ratios against (a), all measured in this one run:

  (L) LeRobot 0.4.4 itself (its ``LeRobotDataset`` and a torch DataLoader, PyAV backend), run in LeRobot's venv
      (``--lerobot-python``, tests/oracles/README.md): the ratios are against it when it runs;
  (a) LeRobot's access pattern, re-implemented here: HF-datasets-style row access (each row and each window
      element converted to a Python dict / values, then to tensors), the episode's metadata row looked up per
      sample, and per camera a decoder opened per sample that seeks to the keyframe before the timestamp and decodes
      forward, converting each decoded frame (LeRobot's PyAV backend, ``decode_video_frames_pyav``; cameras in a
      new thread pool per sample, as LeRobot's HEAD does);
  (b) ``roboscale.data.build_loader`` on the same raw v3 dataset;
  (c) ``build_loader`` on a lake compiled from it (``roboscale lake build``), if ``roboscale.data.lake.build`` exists.

    .venv/bin/python benchmarks/loader.py                  # generates the dataset once (~1-2 min), then ~2 min
    .venv/bin/python benchmarks/loader.py --image-size 480 # cameras at 480² in the raw files (the lake: 224²)
    .venv/bin/python benchmarks/loader.py --elastic        # the cost of elastic batches: (b) on rank 0 of 1 and of 4
    .venv/bin/python benchmarks/loader.py --checksum       # the cost of the shard checksum on open: (c) vs (d)
    .venv/bin/python benchmarks/loader.py --finite         # the cost of the NaN/Inf check of a shard on open

``--elastic``: the global batch of 32 is split over ranks (``roboscale.data.loading.plan``); rank 0 of 4 reads 8
samples of each batch, a quarter of each block. Reports, side by side in one run, rank 0's CPU-seconds and decode
seconds per sample at world size 1 and 4 (their ratio is what elasticity costs per sample), and from the plan alone
the runs of consecutive frames (decoder seeks) per decoded sample at world sizes 1-8.

``--checksum``: (c) hashes every lake shard file (sha256) the first time the machine reads it (``LakeSource``'s
``verify_on_open``, the default; each run gets an empty record of verified files, as a machine that reads the lake
for the first time); (d) is (c) with it off. Reports (b), (c) and (d) side by side in one run: the
steady state (after the warm-up) and the start-up (building the loader, starting workers and the warm-up batches,
in which each worker of this small lake opens, and so hashes, every shard: pass ``--warmup 16``, a block per
worker). The three run interleaved ``--repeat`` times (medians reported): on a shared machine one run of each
swings by 2x.

The dataset (MetaWorld, 2 tasks x 10 episodes, 2 cameras at 224² or ``--image-size``) and its lake are cached
under outputs/bench/ (gitignored). Each configuration runs in a fresh process so caches and workers do not carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

CACHE = Path("outputs/bench")
LAKE_SIZE = 224  # the policy's resolution: lakes store frames resized to it
CAMERAS = ["observation.images.corner2", "observation.images.wrist"]
STATE, ACTION = "observation.state", "action"
CHUNK = 50
BATCH = 32
WORKERS = 2


# --------------------------------------------------------------------------------------------------- (a) LeRobot


class LeRobotPattern:
    """A torch Dataset reading the way LeRobot's ``LeRobotDataset.__getitem__`` does (see the module docstring).

    Nothing here is LeRobot's code; it reproduces its costs: Python objects per row and window element, a
    metadata row per sample, and a freshly opened, seeking decoder per camera and sample."""

    def __init__(self, root: Path, tolerance_s: float = 1e-4):
        from roboscale.data.lerobot import format as fmt

        self.root = root
        self.info = fmt.read_info(root)
        self.fps = self.info.fps
        self.tasks = fmt.read_tasks(root)
        self.episodes = fmt.read_episodes_table(root)  # one row per episode, accessed row by row
        tables = [fmt.read_parquet(p) for p in sorted((root / "data").glob("*/*.parquet"))]
        import pyarrow as pa

        self.table = pa.concat_tables(tables)  # the "hf_dataset": an Arrow table, accessed row by row
        self.tolerance_s = tolerance_s
        self.deltas = np.arange(CHUNK)

    def __len__(self) -> int:
        return self.table.num_rows

    def _row(self, idx: int) -> dict:
        import torch

        # hf_dataset[idx] with hf_transform_to_torch: every column of the row to Python, then to a tensor
        return {name: torch.tensor(self.table.column(name)[idx].as_py()) for name in self.table.column_names}

    def _episode(self, ep: int) -> dict:
        return {name: self.episodes.column(name)[ep].as_py() for name in self.episodes.column_names}

    def _decode(self, path: Path, ts: float):
        import av
        import torch

        # LeRobot's PyAV backend: open, seek to the keyframe before (one frame of margin), convert every decoded
        # frame to a CHW tensor until the query is covered, then pick the nearest and check the tolerance
        with av.open(str(path)) as container:  # a decoder opened for this sample
            stream = container.streams.video[0]
            container.seek(round(ts / stream.time_base) - 1, backward=True, any_frame=False, stream=stream)
            frames, times = [], []
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                t = float(frame.pts * stream.time_base)
                frames.append(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1).contiguous())
                times.append(t)
                if t >= ts:
                    break
        gaps = np.abs(np.array(times) - ts)
        if not times or gaps.min() > self.tolerance_s:
            raise RuntimeError(f"{path}: no frame within tolerance of {ts}")
        return frames[int(gaps.argmin())]

    def __getitem__(self, idx: int) -> dict:
        import torch

        item = self._row(idx)
        ep = self._episode(int(item["episode_index"]))
        start, end = ep["dataset_from_index"], ep["dataset_to_index"]
        query = idx + self.deltas
        item[f"{ACTION}_is_pad"] = torch.from_numpy((query < start) | (query >= end))
        query = np.clip(query, start, end - 1)
        # column-first window query: one Python value per window element
        item[ACTION] = torch.stack([torch.tensor(self.table.column(ACTION)[int(q)].as_py()) for q in query])
        ts = float(item["timestamp"])

        def camera(key: str):
            path = self.root / self.info.video_path.format(video_key=key, chunk_index=ep[f"videos/{key}/chunk_index"],
                                                           file_index=ep[f"videos/{key}/file_index"])
            return self._decode(path, ep[f"videos/{key}/from_timestamp"] + ts)

        with ThreadPoolExecutor(len(CAMERAS)) as pool:  # a new pool per sample
            for key, frame in zip(CAMERAS, pool.map(camera, CAMERAS), strict=True):
                item[key] = frame
        item["task"] = self.tasks[int(item["task_index"])]
        return item


def _lerobot_batches(dataset_root: Path):
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    dataset = LeRobotPattern(dataset_root)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, generator=torch.Generator()
                                                                         .manual_seed(0)),
                        num_workers=WORKERS, prefetch_factor=4, persistent_workers=True, drop_last=True)
    it = iter(loader)
    return it, (lambda: [w.pid for w in it._workers]), (lambda: None)


def _lerobot_itself(dataset_root: Path):
    """(L): LeRobot 0.4.4's own ``LeRobotDataset`` with a torch DataLoader as its training script builds one
    (shuffled, ``num_workers``), its PyAV video backend (torchcodec is not installable beside this torch), run by
    LeRobot's venv (``--lerobot-python``, tests/oracles/README.md)."""
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from torch.utils.data import DataLoader, RandomSampler

    fps = json.loads((dataset_root / "meta/info.json").read_text())["fps"]
    dataset = LeRobotDataset("local/bench", root=dataset_root, video_backend="pyav",
                             delta_timestamps={ACTION: [i / fps for i in range(CHUNK)]})
    loader = DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, generator=torch.Generator()
                                                                         .manual_seed(0)),
                        num_workers=WORKERS, prefetch_factor=4, persistent_workers=True, drop_last=True)
    it = iter(loader)
    return it, (lambda: [w.pid for w in it._workers]), (lambda: None)


def _paths(size: int) -> tuple[Path, Path]:
    """(raw dataset at ``size``², its lake at LAKE_SIZE²), cached under outputs/bench/."""
    return CACHE / f"metaworld-{size}", CACHE / f"metaworld-{size}-lake"


def _our_batches(source: Path, fps: float, world_size: int = 1, source_options: dict | None = None):
    from roboscale.data.loading.loader import build_loader

    loader = build_loader(source, batch_size=BATCH, num_workers=WORKERS, keys=[*CAMERAS, STATE, ACTION],
                          delta_timestamps={ACTION: [i / fps for i in range(CHUNK)]}, seed=0, rank=0,
                          world_size=world_size, source_options=source_options)
    next(loader)  # start the workers
    return loader, (lambda: [w.pid for w in loader._iter._workers]), loader.close


def seeks_per_sample(source: Path, world_size: int, epochs: int = 2) -> float:
    """Runs of consecutive frames (a decoder seek each, per camera) per sample rank 0 decodes, from the plan."""
    from roboscale.data.loading.loader import build_loader

    loader = build_loader(source, batch_size=BATCH, num_workers=0, keys=[STATE], seed=0, world_size=world_size)
    runs = samples = 0
    for epoch in range(epochs):
        order = loader._plan.epoch(epoch)
        for block in range(len(order.block_start) - 1):
            ids = np.sort(order.share(block, 0, world_size))
            ep, fr = loader.sample_index.locate(ids)
            runs += 1 + int(np.sum((np.diff(ep) != 0) | (np.diff(fr) != 1)))
            samples += len(ids)
    return runs / samples


# --------------------------------------------------------------------------------------------------- measuring


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(which: str, warmup: int, batches: int, size: int, world_size: int = 1) -> dict:
    dataset, lake = _paths(size)
    start, start_cpu = time.perf_counter(), time.process_time()
    if which == "a":
        it, pids, close = _lerobot_batches(dataset)
    elif which == "L":
        it, pids, close = _lerobot_itself(dataset)
    else:
        fps = json.loads((dataset / "meta/info.json").read_text())["fps"]
        options = {"verify_on_open": which == "c"} if which in ("c", "d") else None
        it, pids, close = _our_batches(dataset if which == "b" else lake, fps, world_size, options)
    for _ in range(warmup):
        next(it)
    workers = pids()
    main0, workers0 = time.process_time(), sum(_cpu_of(p) for p in workers)
    t0 = time.perf_counter()
    start_wall, start_cpu = t0 - start, main0 - start_cpu + workers0  # workers: all they used since they started
    n = 0
    for _ in range(batches):
        batch = next(it)
        n += len(batch["task"])
    wall = time.perf_counter() - t0
    main_cpu, workers_cpu = time.process_time() - main0, sum(_cpu_of(p) for p in workers) - workers0
    cpu = main_cpu + workers_cpu
    side = LAKE_SIZE if which in ("c", "d") else size
    assert batch[ACTION].shape[1:] == (CHUNK, batch[ACTION].shape[-1]) and batch[CAMERAS[0]].shape[-1] == side
    stats = it.stats() if hasattr(it, "stats") else {}  # decode: every block received, warm-up included
    close()
    return {"samples": n, "wall_s": wall, "cpu_s": cpu, "main_cpu_s": main_cpu, "workers_cpu_s": workers_cpu,
            "decode_s": stats.get("decode_s", 0.0),
            "decoded": stats.get("decoded_samples", 1), "start_wall_s": start_wall, "start_cpu_s": start_cpu}


# --------------------------------------------------------------------------------------------------- driver


def ensure_dataset(size: int) -> None:
    dataset, _ = _paths(size)
    if (dataset / "meta/info.json").is_file():
        return
    tmp = dataset.with_name(dataset.name + ".tmp")
    subprocess.run([sys.executable, "-m", "roboscale", "data", "generate", '--tasks=["drawer-open","button-press"]',
                    "--episodes_per_task=10", f"--image_size={size}", f"--out={tmp}"], check=True)
    tmp.rename(dataset)


def ensure_lake(size: int) -> bool:
    try:
        import roboscale.data.lake.build  # noqa: F401
    except ImportError:
        return False
    dataset, lake = _paths(size)
    if not (lake / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "roboscale", "lake", "build", str(dataset), "--output", str(lake),
                        "--image-size", str(LAKE_SIZE)], check=True)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40, help="measured batches for (b) and (c)")
    parser.add_argument("--baseline-batches", type=int, default=12, help="measured batches for (a)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224,
                        help="camera side of the raw dataset (the lake always holds 224²: the policy's resolution)")
    parser.add_argument("--elastic", action="store_true", help="the cost of elastic batches (see above)")
    parser.add_argument("--checksum", action="store_true", help="the cost of the shard checksum on open (see above)")
    parser.add_argument("--finite", action="store_true", help="the cost of the NaN/Inf check of a shard on open")
    parser.add_argument("--repeat", type=int, default=3, help="--checksum: runs of each configuration (medians)")
    parser.add_argument("--one", choices=["a", "b", "c", "d", "L"], help=argparse.SUPPRESS)
    parser.add_argument("--lerobot-python", type=Path, default=Path(".venv-lerobot/bin/python"),
                        help="LeRobot 0.4.4's venv (tests/oracles/README.md): adds (L), LeRobot itself")
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        batches = args.baseline_batches if args.one in ("a", "L") else args.batches
        print(json.dumps(measure(args.one, args.warmup, batches, args.image_size, args.world_size)))
        return

    ensure_dataset(args.image_size)
    if args.elastic:
        elastic(args)
        return
    have_lake = ensure_lake(args.image_size)
    if args.finite:
        finite(args)
        return
    if args.checksum:
        checksum(args)
        return
    lerobot = args.lerobot_python.is_file()
    results = {which: _run_one(which, args)
               for which in (["L"] if lerobot else []) + ["a", "b"] + (["c"] if have_lake else [])}
    names = {"L": "(L) LeRobot 0.4.4 itself: LeRobotDataset + DataLoader, PyAV",
             "a": "(a) LeRobot access pattern, raw v3",
             "b": "(b) roboscale loader, raw v3", "c": "(c) roboscale loader, lake shards"}
    reference = "L" if lerobot else "a"
    base = results[reference]["samples"] / results[reference]["wall_s"]
    print(f"{os.cpu_count()} cores; batch {BATCH}, {WORKERS} workers; 2 cameras {args.image_size}² AV1 (lake: "
          f"{LAKE_SIZE}²) + state + "
          f"{CHUNK}-step action chunk")
    if not lerobot:
        print(f"(L) skipped: no LeRobot venv at {args.lerobot_python} (tests/oracles/README.md)")
    print(f"| loader | samples/s | CPU-s / sample | samples/s per CPU-s | vs ({reference}) |")
    print("|---|---:|---:|---:|---:|")
    for which, r in results.items():
        rate = r["samples"] / r["wall_s"]
        per = r["cpu_s"] / r["samples"]
        print(f"| {names[which]} | {rate:,.0f} | {per * 1e3:.2f} ms | {1 / per:,.0f} | {rate / base:.1f}x |")
    if not have_lake:
        print("| (c) roboscale loader, lake shards | skipped (no lake) | | | |")
    for which, r in results.items():
        per = r["cpu_s"] / r["samples"]
        print(f"{names[which]}: a 3B VLA step consuming 20-40 samples/s per H100 needs {20 * per:.2f}-{40 * per:.2f} "
              "cores of loading")
    if "c" in results:
        per = results["c"]["cpu_s"] / results["c"]["samples"]
        print(f"(c) per core: {1 / per:,.0f} samples/s (target >= 1,000)")
    rates = {which: r["samples"] / r["wall_s"] for which, r in results.items()}
    print("ratios measured side by side in this run: " + ", ".join(
        f"({which})/({ref}) = {rates[which] / rates[ref]:.1f}x" for ref in (["L"] if lerobot else []) + ["a"]
        for which in ("b", "c") if which in rates))


def _run_one(which: str, args: argparse.Namespace) -> dict:
    """``measure(which)`` in a fresh process: no caches or workers carried over from another configuration, and
    no record of verified shards either (a machine that reads this lake for the first time: utils.io.HashChecks).
    (L) runs in LeRobot's venv."""
    python = str(args.lerobot_python) if which == "L" else sys.executable
    with tempfile.TemporaryDirectory(prefix="verified-") as verified:
        out = subprocess.run([python, __file__, "--one", which, "--batches", str(args.batches),
                              "--baseline-batches", str(args.baseline_batches), "--warmup", str(args.warmup),
                              "--image-size", str(args.image_size)],
                             check=True, capture_output=True, text=True,
                             env={**os.environ, "ROBOSCALE_CACHE_DIR": verified})
    return json.loads(out.stdout.strip().splitlines()[-1])


def checksum(args: argparse.Namespace) -> None:
    """(b) raw, (c) lake with the shard checksum on open, (d) lake without it, each in a fresh process."""
    _, lake = _paths(args.image_size)
    runs: dict[str, list[dict]] = {"b": [], "c": [], "d": []}
    hash_cpu = []
    for _ in range(args.repeat):  # interleaved: load from others on the machine falls on all three alike
        for which, done in runs.items():
            done.append(_run_one(which, args))
        hash_cpu.append(_hash_cpu_s(lake))
    results = {which: {key: float(np.median([r[key] for r in done])) for key in done[0]}
               for which, done in runs.items()}
    lake_mb = sum(p.stat().st_size for p in (lake / "shards").glob("*/*")) / 1e6
    print(f"{os.cpu_count()} cores; batch {BATCH}, {WORKERS} workers; 2 cameras {args.image_size}² AV1 (lake: "
          f"{LAKE_SIZE}², {lake_mb:,.0f} MB of shards) + state + {CHUNK}-step action chunk; warm-up {args.warmup} "
          f"batches, {args.batches} measured; medians of {args.repeat} interleaved runs")
    print("| loader | samples/s | CPU-s / sample | start-up wall-s | start-up CPU-s |")
    print("|---|---:|---:|---:|---:|")
    names = {"b": "(b) roboscale loader, raw v3", "c": "(c) lake shards, checksum on open (default)",
             "d": "(d) lake shards, verify_on_open=False"}
    for which, r in results.items():
        print(f"| {names[which]} | {r['samples'] / r['wall_s']:,.0f} | {r['cpu_s'] / r['samples'] * 1e3:.2f} ms | "
              f"{r['start_wall_s']:.2f} | {r['start_cpu_s']:.2f} |")
    b, c, d = (results[k] for k in "bcd")

    def rate(r: dict) -> float:
        return r["samples"] / r["wall_s"]

    hashing = float(np.median(hash_cpu))
    frames = _frames(args.image_size)
    print(f"ratios measured side by side in this run: steady state (c)/(d) = {rate(c) / rate(d):.2f}x samples/s, "
          f"{c['cpu_s'] / c['samples'] / (d['cpu_s'] / d['samples']):.2f}x CPU-s per sample; start-up (c)/(d) = "
          f"{c['start_wall_s'] / d['start_wall_s']:.2f}x wall, {c['start_cpu_s'] / d['start_cpu_s']:.2f}x CPU; "
          f"(c)/(b) = {rate(c) / rate(b):.1f}x samples/s, (d)/(b) = {rate(d) / rate(b):.1f}x")
    print(f"the checksum's one-off cost: hashing the {lake_mb:,.0f} MB of shards takes {hashing:.2f} CPU-s "
          f"({lake_mb / hashing:,.0f} MB/s), once per machine whatever its workers and ranks (later runs: none): "
          f"{hashing / frames * 1e3:.2f} ms per sample of the first epoch ({frames} samples), against (c)'s "
          f"{c['cpu_s'] / c['samples'] * 1e3:.2f} ms and (b)'s {b['cpu_s'] / b['samples'] * 1e3:.2f} ms per sample")


def finite(args: argparse.Namespace) -> None:
    """The cost of the NaN/Inf check of a shard's float columns when it is opened: every shard of the lake opened
    with and without it (interleaved, medians), CPU-s per shard and per sample."""
    from roboscale.data.lake.source import LakeSource

    _, lake = _paths(args.image_size)
    source = LakeSource(lake, verify_on_open=False)
    real = LakeSource._check_finite
    times: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(args.repeat):
        for which in times:
            source._check_finite = real.__get__(source) if which == "with" else (lambda *a, **k: None)
            t0 = time.process_time()
            for index in range(len(source.manifest["shards"])):
                source._open(index)
                source._open_shards.clear()
            times[which].append(time.process_time() - t0)
    opened, bare = (float(np.median(times[k])) for k in ("with", "without"))
    shards, frames = len(source.manifest["shards"]), len(source)
    print(f"opening all {shards} shards ({frames} samples), medians of {args.repeat}: {opened:.3f} CPU-s with the "
          f"NaN/Inf check, {bare:.3f} without: {opened / bare:.3f}x; the check costs "
          f"{(opened - bare) / shards * 1e3:.2f} ms per shard, {(opened - bare) / frames * 1e6:.2f} us per sample")


def _hash_cpu_s(lake: Path) -> float:
    """CPU-seconds to hash every shard file once: what a machine spends on the lake with the checksum."""
    from roboscale.data.lake.source import LakeSource

    source = LakeSource(lake, verify_on_open=False)
    t0 = time.process_time()
    source.verify_checksums()
    return time.process_time() - t0


def _frames(size: int) -> int:
    dataset, _ = _paths(size)
    return int(json.loads((dataset / "meta/info.json").read_text())["total_frames"])


def elastic(args: argparse.Namespace) -> None:
    """Rank 0 of world size 1 and 4 on the raw dataset, the same global batches (each in a fresh process)."""
    dataset, _ = _paths(args.image_size)
    results = {}
    for world_size in (1, 4):
        # the same number of samples for rank 0 of 4: 4x the batches of a quarter of the size
        out = subprocess.run([sys.executable, __file__, "--one", "b", "--batches", str(args.batches * world_size),
                              "--warmup", str(args.warmup * world_size), "--image-size", str(args.image_size),
                              "--world-size", str(world_size)], check=True, capture_output=True, text=True)
        results[world_size] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{os.cpu_count()} cores; global batch {BATCH}, {WORKERS} workers, block 256 samples, chunks of 16 frames; "
          f"2 cameras {args.image_size}² AV1 + state + {CHUNK}-step action chunk; rank 0 measured")
    print("| world size | rank 0 samples/batch | samples/s | CPU-s / sample | workers | main process | "
          "decode wall-s / sample |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for w, r in results.items():
        n = r["samples"]
        print(f"| {w} | {BATCH // w} | {n / r['wall_s']:,.0f} | {r['cpu_s'] / n * 1e3:.2f} ms | "
              f"{r['workers_cpu_s'] / n * 1e3:.2f} ms | {r['main_cpu_s'] / n * 1e3:.2f} ms | "
              f"{r['decode_s'] / r['decoded'] * 1e3:.2f} ms |")
    ratio = {key: results[4][key] / results[4]["samples"] / (results[1][key] / results[1]["samples"])
             for key in ("cpu_s", "workers_cpu_s", "main_cpu_s")}
    print(f"ratios W=4 / W=1 per sample, measured side by side in this run: CPU-s {ratio['cpu_s']:.2f}x (workers "
          f"{ratio['workers_cpu_s']:.2f}x, main process {ratio['main_cpu_s']:.2f}x)")
    print("runs of consecutive frames (decoder seeks) per decoded sample, from the plan (2 epochs): " + ", ".join(
        f"W={w}: {seeks_per_sample(dataset, w):.4f}" for w in (1, 2, 4, 8)))


if __name__ == "__main__":
    main()
