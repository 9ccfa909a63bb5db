"""Loader workers keep bounded resources: open files and memory do not grow with the number of files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from roboscale.data import DatasetWriter
from roboscale.data.loading.loader import build_loader

EPISODES, FRAMES = 40, 6


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """40 episodes, each in its own mp4 and parquet file (tiny rotation limits)."""
    root = tmp_path_factory.mktemp("many") / "dataset"
    features = {"observation.images.cam": {"dtype": "video", "shape": [32, 32, 3],
                                           "names": ["height", "width", "channels"]},
                "action": {"dtype": "float32", "shape": [2], "names": None}}
    writer = DatasetWriter.create(root, fps=10, features=features, data_files_size_in_mb=0.0001,
                                  video_files_size_in_mb=0.0001, video_codec="libx264")
    rng = np.random.default_rng(0)
    with writer:
        for e in range(EPISODES):
            writer.add_episode({"observation.images.cam": rng.integers(0, 255, (FRAMES, 32, 32, 3), np.uint8),
                                "action": rng.normal(size=(FRAMES, 2)).astype(np.float32)}, "task")
    return root


def _probe(sample):
    """Runs in the worker: its open file descriptors and resident memory at this sample."""
    import torch

    sample["fds"] = torch.tensor(len(os.listdir("/proc/self/fd")))
    with open("/proc/self/statm") as f:
        sample["rss"] = torch.tensor(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    return sample


def _epochs(root, n_epochs, **options):
    loader = build_loader(root, batch_size=4, num_workers=1, transform=_probe, block_samples=8, chunk_frames=2,
                          source_options={"max_open_videos": 3, "max_open_parquet": 2, **options}, prefetch_factor=1)
    try:
        return [[next(loader) for _ in range(loader.batches_per_epoch)] for _ in range(n_epochs)]
    finally:
        loader.close()


def test_worker_files_and_memory_stay_bounded(many_files):
    videos = list((many_files / "videos").rglob("*.mp4"))
    assert len(videos) == EPISODES  # one file per episode: every block touches new files
    epochs = _epochs(many_files, 3)
    small = _epochs(many_files, 1, episodes=range(4))  # the same data, a tenth of it
    fds = np.concatenate([b["fds"].numpy() for e in epochs for b in e])
    rss = [max(int(b["rss"].max()) for b in e) for e in epochs]
    # a fresh worker has a baseline of descriptors (pipes, shared memory); files add at most 3 videos + 2 parquet
    assert fds.max() - fds.min() <= 5, (fds.min(), fds.max())
    # the epochs touch every file again: memory must not keep growing (allocator noise allowed)
    assert rss[2] - rss[1] < 16 * 2**20, rss
    # and a worker reading 10x the files and frames is not bigger than one reading a tenth
    small_rss = max(int(b["rss"].max()) for b in small[0])
    assert rss[0] - small_rss < 16 * 2**20, (rss[0], small_rss)
