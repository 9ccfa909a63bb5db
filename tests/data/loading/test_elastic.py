"""Elastic determinism: global batches that do not depend on the world size, the rank or the worker count; resume
across them; per-sample seeds; batches as diverse as independent sampling at scale."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest
import torch

from roboscale.data.loading.loader import build_loader
from roboscale.data.loading.plan import EpochPlan, sample_seeds
from roboscale.errors import ConfigError

from ..conftest import SMALL_LENGTHS

KW = dict(keys=["action"], seed=1, block_samples=24, chunk_frames=3)  # blocks of 3 global batches of 8


def _samples(batch: dict) -> list[tuple[int, int, int]]:
    """(episode, frame, seed) per position."""
    return list(zip(batch["episode_index"].tolist(), batch["frame_index"].tolist(), batch["sample_seed"].tolist(),
                    strict=True))


def _run(root, n: int, world_size: int = 1, workers: int = 0, batch_size: int = 8, **kw) -> list[list[tuple]]:
    """``n`` global batches, each the ranks' slices put together (rank 0's first)."""
    ranks = []
    for rank in range(world_size):
        loader = build_loader(root, batch_size=batch_size, num_workers=workers, rank=rank, world_size=world_size,
                              **{**KW, **kw})
        try:
            ranks.append([_samples(next(loader)) for _ in range(n)])
        finally:
            loader.close()
    return [sum((r[step] for r in ranks), []) for step in range(n)]


# --------------------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("batch_size,block_batches,world_sizes", [(8, 3, (1, 2, 4, 8)), (6, 4, (1, 2, 3, 6)),
                                                                  (12, 1, (1, 4))])
def test_rank_slices_of_the_plan_put_together_are_the_global_batches(batch_size, block_batches, world_sizes):
    lengths = np.array([7, 11, 6, 9, 12, 30, 3])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    plan = EpochPlan(lengths, starts, np.zeros(len(lengths), np.int64), np.array([lengths.sum()]), batch_size,
                     block_batches, 4, True, 3)
    order = plan.epoch(2)
    whole = [order.batch(b) for b in range(order.batches)]
    for w in world_sizes:
        for b in range(order.batches):
            assert np.array_equal(np.concatenate([order.batch(b, r, w) for r in range(w)]), whole[b])
    ids = np.concatenate(whole)
    assert len(np.unique(ids)) == len(ids) == lengths.sum() // batch_size * batch_size


# --------------------------------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("workers", [0, 2])
def test_rank_slices_put_together_equal_the_one_rank_batches(small_root, workers):
    n = sum(SMALL_LENGTHS) // 8 + 2  # into the second epoch
    one = _run(small_root, n, 1, workers)
    assert _run(small_root, n, 2, workers) == one
    if workers == 0:
        assert _run(small_root, n, 4) == one
    else:  # and the global sequence does not depend on the worker count
        assert _run(small_root, n, 1, 0) == one
    for batch in one:
        seeds = [s for _, _, s in batch]
        assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)


def test_an_epoch_holds_every_sample_once_over_ranks(small_root):
    loaders = [build_loader(small_root, batch_size=8, num_workers=0, rank=r, world_size=2, **KW) for r in range(2)]
    assert {loader.batches_per_epoch for loader in loaders} == {sum(SMALL_LENGTHS) // 8}
    seen, seeds = [], []
    for loader in loaders:
        for _ in range(loader.batches_per_epoch):
            batch = next(loader)
            assert len(batch["episode_index"]) == 4  # this rank's half of the global batch
            seen += [(e, f) for e, f, _ in _samples(batch)]
            seeds += batch["sample_seed"].tolist()
    assert len(set(seen)) == len(seen) == sum(SMALL_LENGTHS) // 8 * 8  # only the last partial batch is dropped
    assert len(set(seeds)) == len(seeds)


@pytest.mark.parametrize("saved,loaded", [((2, 2), (1, 0)), ((1, 0), (2, 2))], ids=["W2-to-W1", "W1-to-W2"])
def test_resume_on_another_world_size_and_worker_count_continues_the_global_sequence(small_root, saved, loaded):
    (w_saved, workers_saved), (w_loaded, workers_loaded) = saved, loaded
    per_epoch = sum(SMALL_LENGTHS) // 8
    n, k = per_epoch + 3, 4  # save mid-epoch (mid-block: blocks of 3 batches), continue into the next epoch
    expected = _run(small_root, n)
    states = []
    for rank in range(w_saved):
        loader = build_loader(small_root, batch_size=8, num_workers=workers_saved, rank=rank, world_size=w_saved,
                              **KW)
        try:
            loader.take(k)
            states.append(loader.state_dict())
        finally:
            loader.close()
    assert all({**s, "world_size": 0} == {**states[0], "world_size": 0} for s in states)  # a global position
    resumed = []
    for rank in range(w_loaded):
        loader = build_loader(small_root, batch_size=8, num_workers=workers_loaded, rank=rank,
                              world_size=w_loaded, **KW)
        loader.load_state_dict(states[0])
        try:
            resumed.append([_samples(next(loader)) for _ in range(n - k)])
        finally:
            loader.close()
    assert [sum((r[step] for r in resumed), []) for step in range(n - k)] == expected[k:]


def test_resume_refuses_another_seed_batch_size_or_an_old_state(small_root):
    a = build_loader(small_root, batch_size=8, num_workers=0, **KW)
    a.take(2)
    state = a.state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        build_loader(small_root, batch_size=8, num_workers=0, **{**KW, "seed": 2}).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size=8"):
        build_loader(small_root, batch_size=4, num_workers=0, **KW).load_state_dict(state)
    with pytest.raises(ValueError, match="block_batches"):  # mid-epoch, the epoch's order must be the same
        build_loader(small_root, batch_size=8, num_workers=0, **{**KW, "block_samples": 16}).load_state_dict(state)
    old = {"epoch": 0, "position": 2, "seed": 1, "num_workers": 0, "batch_size": 8, "world_size": 1, "rank": 0,
           "skip": []}
    with pytest.raises(ValueError, match="format 1"):
        a.load_state_dict(old)


def test_a_batch_size_the_world_size_does_not_divide_is_refused(small_root):
    with pytest.raises(ConfigError, match=r"batch_size 6 .*not divisible by the world size 4"):
        build_loader(small_root, batch_size=6, num_workers=0, rank=0, world_size=4, keys=["action"])


def _check_seed_type(sample):
    sample["seed_is_int"] = isinstance(sample["sample_seed"], int)
    return sample


def test_sample_seeds_reach_transforms_as_ints_and_collate_to_int64(small_root):
    plain = build_loader(small_root, batch_size=8, num_workers=0, **KW)
    transformed = build_loader(small_root, batch_size=8, num_workers=0, transform=_check_seed_type, **KW)
    a, b = next(plain), next(transformed)
    assert b["seed_is_int"].all() and b["sample_seed"].dtype == torch.int64
    assert torch.equal(a["sample_seed"], b["sample_seed"])
    # a function of (seed, epoch, global batch, position) only
    assert a["sample_seed"].tolist() == sample_seeds(1, 0, 8, 0, np.arange(8)).tolist()


def test_a_refilled_sample_keeps_the_seed_of_its_position(small_root):
    from .test_loader import _FailingSource

    kw = {**KW, "chunk_frames": 2}
    good = build_loader(small_root, batch_size=8, num_workers=0, **kw)
    bad = build_loader(_FailingSource(small_root), batch_size=8, num_workers=0, skip_bad_episodes=True, **kw)
    refilled = 0
    for _ in range(good.batches_per_epoch):
        a, b = next(good), next(bad)
        assert torch.equal(a["sample_seed"], b["sample_seed"])
        lost = a["episode_index"] == _FailingSource.bad
        assert not (b["episode_index"] == _FailingSource.bad).any()
        assert torch.equal(a["frame_index"][~lost], b["frame_index"][~lost])
        refilled += int(lost.sum())
    assert refilled == bad.stats()["refilled_samples"] > 0


# --------------------------------------------------------------------------------------------------- diversity


class MemorySource:
    """A FrameSource of ``episodes`` episodes of ``length`` frames in memory (an action that names its frame)."""

    def __init__(self, episodes: int, length: int):
        self.features = {"action": {"dtype": "float32", "shape": [2], "names": None}}
        self.fps, self.camera_keys, self.tasks, self.stats = 10.0, [], ["task"], None
        self.episode_ids = np.arange(episodes, dtype=np.int64)
        self.episode_lengths = np.full(episodes, length, dtype=np.int64)

    def read(self, episode, frames, keys):
        frames = np.asarray(frames)
        return {"action": np.stack([np.full(len(frames), episode), frames], 1).astype(np.float32),
                "task_index": np.zeros(len(frames), np.int64)}

    def unreadable_episodes(self):
        return {}

    def close(self):
        pass


def _uniform_distinct(lengths: list[int], draws: int) -> float:
    """Expected distinct episodes among ``draws`` frames drawn uniformly without replacement."""
    total = sum(lengths)
    return sum(1 - comb(total - n, draws) / comb(total, draws) for n in lengths)


@pytest.mark.parametrize("world_size", [1, 2])
def test_batches_of_a_dataset_10x_the_block_are_as_diverse_as_uniform_sampling(world_size):
    episodes, length, batch_size, block = 80, 8, 16, 64  # 640 frames: 10 blocks; blocks of 4 batches
    source = MemorySource(episodes, length)
    loader = build_loader(source, batch_size=batch_size, num_workers=0, block_samples=block, chunk_frames=4, seed=0,
                          world_size=world_size)
    counts = []
    for _ in range(3 * loader.batches_per_epoch):
        batch = next(loader)
        counts.append(len(set(batch["episode_index"].tolist())))
    expected = _uniform_distinct([length] * episodes, batch_size // world_size)  # 14.6 (W=1), 7.7 (W=2)
    assert loader.stats()["distinct_episodes"] == pytest.approx(np.mean(counts))
    # at least as diverse as uniform sampling (a batch holds distinct chunks: slightly more diverse); the previous
    # in-block shuffle drew a global batch from the block's 16 chunks: ~11.8 distinct episodes
    assert expected - 0.4 < np.mean(counts) < expected + 1.0, (np.mean(counts), expected)
