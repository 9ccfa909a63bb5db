"""The streaming loader: LeRobot-equal samples, epochs, rank sharding, resume, mixtures, skipping, errors."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from roboscale.data import LeRobotDataset
from roboscale.data.loading.loader import build_loader
from roboscale.data.loading.raw_source import RawSource
from roboscale.data.loading.source import open_source
from roboscale.data.loading.worker import LoaderError
from roboscale.errors import DatasetError

from ..conftest import SMALL_LENGTHS


def _item_index(ds: LeRobotDataset) -> dict[int, int]:
    starts = np.concatenate([[0], np.cumsum(ds._lengths)])
    return {ep: int(starts[i]) for i, ep in enumerate(ds.episode_indices)}


def assert_batch_matches(batch: dict, ds: LeRobotDataset) -> int:
    """Every sample of ``batch`` equals LeRobotDataset's item (uint8 cameras) key by key; returns the sample count."""
    first = _item_index(ds)
    n = len(batch["task"])
    for i in range(n):
        ep, fr = int(batch["episode_index"][i]), int(batch["frame_index"][i])
        item = ds[first[ep] + fr]
        assert item["task"] == batch["task"][i]
        for key, want in item.items():
            if key == "task":
                continue
            got = batch[key][i]
            assert got.dtype == want.dtype, (key, got.dtype, want.dtype)
            assert torch.equal(got, want), f"{key} differs at episode {ep} frame {fr}"
    return n


def _ids(batch: dict) -> list[tuple[int, int]]:
    return list(zip(batch["episode_index"].tolist(), batch["frame_index"].tolist(), strict=True))


def _take_ids(loader, n: int) -> list[list[tuple[int, int]]]:
    return [_ids(next(loader)) for _ in range(n)]


# --------------------------------------------------------------------------------------------------- samples


def test_samples_equal_lerobot_items_on_the_lerobot_fixture(fixture_root):
    fps = 10
    dt = {"action": [i / fps for i in range(-2, 6)], "observation.state": [-1 / fps, 0.0],
          "observation.images.corner": [-2 / fps, 0.0]}
    ds = LeRobotDataset(root=fixture_root, delta_timestamps=dt, return_uint8=True)
    loader = build_loader(fixture_root, batch_size=4, num_workers=0, delta_timestamps=dt, block_samples=16,
                          chunk_frames=4)
    seen = set()
    for _ in range(loader.batches_per_epoch):
        batch = next(loader)
        assert batch["observation.images.corner"].shape[1:3] == (2, 3)  # [B, T, C, H, W], uint8
        assert batch["observation.images.gripper"].dtype == torch.uint8
        assert_batch_matches(batch, ds)
        seen.update(_ids(batch))
    assert len(seen) == loader.batches_per_epoch * 4 == len(ds) // 4 * 4


def test_samples_equal_lerobot_items_on_a_rotated_dataset_with_workers(small_root):
    # 5 episodes over several data/video files and chunks, an image-dtype camera and a CHW-declared video
    dt = {"action": [-0.1, 0.0, 0.1, 0.2, 0.3], "next.reward": [0.0, 0.1]}
    ds = LeRobotDataset(root=small_root, delta_timestamps=dt, return_uint8=True)
    loader = build_loader(small_root, batch_size=5, num_workers=2, delta_timestamps=dt, block_samples=10,
                          chunk_frames=3, seed=4)
    try:
        count = sum(assert_batch_matches(next(loader), ds) for _ in range(loader.batches_per_epoch))
    finally:
        loader.close()
    assert count == sum(SMALL_LENGTHS) // 5 * 5
    assert loader.stats()["arena_batches"] == loader.batches_per_epoch  # handed over through the arena


def test_batches_too_big_for_the_arena_take_torchs_path_unchanged(small_root):
    # 8 frames of 64² x 3 = 98 KB: over the 64 KB from which tensors go through the arena
    kw = dict(batch_size=8, keys=["observation.images.front", "action"], seed=9, block_samples=16, chunk_frames=3)
    reference = build_loader(small_root, num_workers=0, **kw)
    loader = build_loader(small_root, num_workers=1, **kw)
    loader.arena_bytes = 1024  # smaller than one batch of frames
    try:
        for _ in range(4):
            a, b = next(reference), next(loader)
            assert _ids(a) == _ids(b) and torch.equal(a["observation.images.front"], b["observation.images.front"])
        assert loader.stats()["arena_batches"] == 0
    finally:
        loader.close()


# Transforms and collates run in workers started by a forkserver: they must be picklable (module level).
def _sum_state(sample):
    sample["state_sum"] = sample["observation.state"].sum()
    return sample


def _count_and_stack(samples):
    return {"n": len(samples), "state_sum": torch.stack([s["state_sum"] for s in samples]),
            "episode_index": torch.stack([s["episode_index"] for s in samples]),
            "frame_index": torch.stack([s["frame_index"] for s in samples]),
            "state": torch.stack([s["observation.state"] for s in samples])}


def test_transform_and_collate_run_per_sample_and_per_batch(small_root):
    transform, collate = _sum_state, _count_and_stack
    keys = ["observation.state"]
    plain = build_loader(small_root, batch_size=4, num_workers=0, keys=keys, seed=1)
    custom = build_loader(small_root, batch_size=4, num_workers=2, keys=keys, seed=1, transform=transform,
                          collate=collate)
    try:
        for _ in range(3):
            a, b = next(plain), next(custom)
            assert b["n"] == 4 and _ids(a) == _ids(b)
            torch.testing.assert_close(b["state_sum"], a["observation.state"].sum(1), rtol=0, atol=0)
            assert "observation.images.front" not in a  # only the requested keys are read
    finally:
        custom.close()


# --------------------------------------------------------------------------------------------------- epochs


def test_an_epoch_visits_each_frame_once_and_epochs_reshuffle(small_root):
    loader = build_loader(small_root, batch_size=4, num_workers=0, keys=["action"], seed=3, block_samples=8,
                          chunk_frames=4)
    per_epoch = loader.batches_per_epoch
    first = sum(_take_ids(loader, per_epoch), [])
    second = sum(_take_ids(loader, per_epoch), [])
    assert len(set(first)) == len(first) == per_epoch * 4 >= sum(SMALL_LENGTHS) - 3
    assert len(set(second)) == len(second) and first != second
    again = build_loader(small_root, batch_size=4, num_workers=0, keys=["action"], seed=3, block_samples=8,
                         chunk_frames=4)
    assert sum(_take_ids(again, per_epoch), []) == first  # same (seed, epoch): same order
    other = build_loader(small_root, batch_size=4, num_workers=0, keys=["action"], seed=4, block_samples=8,
                         chunk_frames=4)
    assert sum(_take_ids(other, per_epoch), []) != first


class _CountingReads:
    """Wraps a source's ``read``: how many frames each call asked for."""

    def __init__(self, source):
        self.read, self.frames = source.read, []
        source.read = self

    def __call__(self, episode, frames, keys):
        self.frames.append(len(frames))
        return self.read(episode, frames, keys)


def test_an_epoch_that_is_one_block_decodes_its_frames_once_and_serves_the_same_batches(small_root):
    """With the whole dataset in one block, every epoch reads the same frames: the first decodes them, the next
    ones reuse them (with 0 loader workers each epoch's decode stalled training at its first batch)."""
    keys = ["observation.images.front", "observation.state", "action"]
    dt = {"action": [0.0, 0.1, 0.2]}
    kept = build_loader(open_source(small_root), batch_size=4, num_workers=0, keys=keys, delta_timestamps=dt, seed=5)
    fresh = build_loader(open_source(small_root), batch_size=4, num_workers=0, keys=keys, delta_timestamps=dt, seed=5,
                         block_samples=sum(SMALL_LENGTHS))  # one block too; decoding again each epoch:
    fresh._dataset.keep_decoded = False
    assert kept._dataset.keep_decoded
    reads = _CountingReads(kept.sources[0])
    n = kept.batches_per_epoch
    for _ in range(3 * n):
        a, b = next(kept), next(fresh)
        assert _ids(a) == _ids(b)
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key
    first_epoch = len(reads.frames)
    assert first_epoch >= len(SMALL_LENGTHS)  # each episode read in the first epoch
    # later epochs read only frames the first epoch's cut to whole batches left out (at most once each)
    assert sum(reads.frames[first_epoch:]) <= sum(SMALL_LENGTHS) - n * 4 + 2 * len(SMALL_LENGTHS)


def test_in_the_training_process_a_blocks_batches_are_built_as_they_are_taken(small_root):
    """0 loader workers: a block's per-sample transforms run for the batch being taken, not for the whole block
    at its first batch (an epoch-start stall of the training loop)."""
    calls = []

    def counting(sample):
        calls.append(1)
        return sample

    loader = build_loader(small_root, batch_size=4, num_workers=0, keys=["action"], transform=counting,
                          multiprocessing_context="fork")
    assert loader.batches_per_epoch > 2
    for taken in range(1, 4):
        next(loader)
        assert len(calls) == 4 * taken


@pytest.mark.parametrize("workers", [0, 2])
def test_without_shuffle_samples_come_in_dataset_order(small_root, workers):
    loader = build_loader(small_root, batch_size=5, num_workers=workers, keys=["action"], shuffle=False)
    try:
        ids = sum(_take_ids(loader, 9), [])
    finally:
        loader.close()
    assert ids == [(e, f) for e, n in enumerate(SMALL_LENGTHS) for f in range(n)]


def test_blocks_read_runs_of_consecutive_frames(small_root):
    """Locality: what a rank decodes of a block is runs of consecutive frames (one decoder pass each), not scattered
    frames, on one rank and on several (each rank's share of a block is one contiguous run of the chunk stream)."""

    def mean_run(chunk: int, world_size: int = 1) -> float:
        loader = build_loader(small_root, batch_size=4, num_workers=0, keys=["action"], seed=0, block_samples=12,
                              chunk_frames=chunk)
        order = loader._plan.epoch(0)
        samples = runs = 0
        for block in range(len(order.block_start) - 1):
            for rank in range(world_size):
                ids = order.share(block, rank, world_size)
                ep, fr = loader.sample_index.locate(np.sort(ids))
                runs += 1 + int(np.sum((np.diff(ep) != 0) | (np.diff(fr) != 1)))
                samples += len(ids)
        return samples / runs

    # chunks of 4 frames (cut short at episode ends, episodes of 6-12 frames) vs. a frame-level shuffle
    assert mean_run(4) >= 2.5
    assert mean_run(4, world_size=2) >= 2.0  # a block's 3 chunks split over 2 ranks: one more run per block
    assert mean_run(1) < 1.6


# --------------------------------------------------------------------------------------------------- ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_are_disjoint_cover_the_epoch_and_get_equal_batch_counts(small_root, world_size):
    per_rank = []
    for rank in range(world_size):
        loader = build_loader(small_root, batch_size=6, num_workers=0, keys=["action"], seed=5, rank=rank,
                              world_size=world_size, block_samples=12, chunk_frames=3)
        assert loader.batches_per_epoch == sum(SMALL_LENGTHS) // 6  # global batches, the same on every rank
        per_rank.append(sum(_take_ids(loader, loader.batches_per_epoch), []))
    counts = {len(ids) for ids in per_rank}
    assert counts == {sum(SMALL_LENGTHS) // 6 * 6 // world_size}  # equal samples per rank
    seen = [s for ids in per_rank for s in ids]
    assert len(seen) == len(set(seen))
    assert sum(SMALL_LENGTHS) - len(seen) < 6  # only the last partial global batch is left out of the epoch


# --------------------------------------------------------------------------------------------------- resume


def test_resume_with_workers_continues_with_exactly_the_remaining_samples(small_root):
    kw = dict(batch_size=4, keys=["action", "observation.state"], seed=7, block_samples=8, chunk_frames=3)
    reference = build_loader(small_root, num_workers=2, **kw)
    first = build_loader(small_root, num_workers=2, **kw)
    resumed = build_loader(small_root, num_workers=2, **kw)
    try:
        n = reference.batches_per_epoch + 3  # across an epoch boundary
        expected = _take_ids(reference, n)
        head = _take_ids(first, 5)  # workers have prefetched beyond these 5
        state = first.state_dict()
        first.close()
        resumed.load_state_dict(state)
        assert head + _take_ids(resumed, n - 5) == expected
    finally:
        for loader in (reference, first, resumed):
            loader.close()


def test_resume_with_another_worker_count_serves_the_same_remaining_samples(small_root):
    kw = dict(batch_size=4, keys=["action"], seed=2, block_samples=8, chunk_frames=3)
    first = build_loader(small_root, num_workers=0, **kw)
    per_epoch = first.batches_per_epoch
    head = sum(_take_ids(first, 3), [])
    resumed = build_loader(small_root, num_workers=2, **kw)
    resumed.load_state_dict(first.state_dict())
    try:
        rest = sum(_take_ids(resumed, per_epoch - 3), [])
        epoch = build_loader(small_root, num_workers=0, **kw)
        whole = sum(_take_ids(epoch, per_epoch), [])
        assert sorted(head + rest) == sorted(whole) and not set(head) & set(rest)
        assert resumed.epoch == 1 and resumed.position == 0
    finally:
        resumed.close()


def test_state_from_another_batch_size_is_refused(small_root):
    a = build_loader(small_root, batch_size=4, num_workers=0, keys=["action"])
    b = build_loader(small_root, batch_size=5, num_workers=0, keys=["action"])
    with pytest.raises(ValueError, match="batch_size=4"):
        b.load_state_dict(a.state_dict())


# --------------------------------------------------------------------------------------------------- mixtures


def test_mixture_weights_set_each_source_share_of_an_epoch(small_root, fixture_root):
    keys = ["observation.state"]
    # both have 4-dim states at 10 fps; the small dataset has 45 frames, the fixture 58
    loader = build_loader([(small_root, 3.0), (fixture_root, 1.0)], batch_size=4, num_workers=0, keys=keys,
                          seed=0, block_samples=8, chunk_frames=4)
    tasks = [set(s.tasks) for s in loader.sources]
    assert tasks[0].isdisjoint(tasks[1])
    counts = np.zeros(2)
    samples = []
    for _ in range(loader.batches_per_epoch):
        batch = next(loader)
        counts += np.bincount(batch["dataset_index"].numpy(), minlength=2)
        samples += list(zip(batch["dataset_index"].tolist(), _ids(batch), strict=True))
        # each sample's task comes from its own source's task table
        assert all(t in tasks[d] for d, t in zip(batch["dataset_index"].tolist(), batch["task"], strict=True))
    share = counts[0] / counts.sum()
    assert abs(share - 0.75) < 0.08, share
    # the small dataset is oversampled (~77 draws of 45 frames): every frame at least once
    assert len({s for s in samples if s[0] == 0}) == sum(SMALL_LENGTHS)


# --------------------------------------------------------------------------------------------------- errors


class _FailingSource(RawSource):
    """A raw source whose episode ``bad`` cannot be read (as a truncated file would)."""

    bad = 2

    def read(self, episode, frames, keys):
        if int(self.episode_ids[episode]) == self.bad:
            raise DatasetError(self.root / "videos/x.mp4", "cannot decode video", episode=self.bad)
        return super().read(episode, frames, keys)


def test_bad_episodes_fail_loudly_or_are_skipped_and_counted(small_root):
    strict = build_loader(_FailingSource(small_root), batch_size=4, num_workers=2, keys=["action"], seed=0,
                          block_samples=48, chunk_frames=4)
    with pytest.raises(DatasetError, match=r"x.mp4: episode 2: cannot decode video \(to train on the other "
                                          r"episodes, skip unreadable ones: --skip-bad-episodes") as failure:
        next(strict)  # raised in the worker, re-raised here as it was
    assert failure.value.episode == 2
    loader = build_loader(_FailingSource(small_root), batch_size=4, num_workers=2, keys=["action"], seed=0,
                          skip_bad_episodes=True, block_samples=16, chunk_frames=4)
    try:
        ids = sum(_take_ids(loader, loader.batches_per_epoch), [])
        assert {e for e, _ in ids} == {0, 1, 3, 4}
        assert len(ids) == loader.batches_per_epoch * 4  # batches keep their size
        assert loader.stats()["skipped_episodes"] == 1
    finally:
        loader.close()


def test_a_corrupt_video_is_skipped_with_skip_bad_episodes(small_copy):
    source = RawSource(small_copy)
    path, _ = source.video_location(3, "observation.images.front")
    shared = [e for e in range(5) if source.video_location(e, "observation.images.front")[0] == path]
    path.write_bytes(path.read_bytes()[:200])  # truncated
    dt = {"action": [0.0, 0.1]}
    with pytest.raises(DatasetError, match=r"episode|mp4"):
        build_loader(small_copy, batch_size=4, num_workers=0, delta_timestamps=dt, shuffle=False, seed=0).take(12)
    loader = build_loader(small_copy, batch_size=4, num_workers=0, delta_timestamps=dt, skip_bad_episodes=True)
    ids = sum(_take_ids(loader, loader.batches_per_epoch), [])
    assert not {e for e, _ in ids} & set(shared)
    assert loader.stats()["skipped_episodes"] == len(shared)


@pytest.mark.parametrize("workers", [0, 2])
def test_skipping_an_episode_leaves_every_other_episodes_frames_exactly_once(small_copy, workers):
    """One epoch of single-sample batches, per episode: every frame of every readable episode once, nothing of the
    skipped one. (Skipped episodes used to shift the sample ids of every later episode: the skipped episode was
    still sampled and the last episode lost its tail.)"""
    from collections import Counter

    from tests.faults.damages import shift_timestamps

    def frames_per_episode(**kw) -> dict[int, list[int]]:
        loader = build_loader(small_copy, batch_size=1, num_workers=workers, keys=["action"], seed=3,
                              block_samples=8, chunk_frames=2, **kw)
        try:
            counts = Counter(_ids(b)[0] for b in loader.take(loader.batches_per_epoch))
        finally:
            loader.close()
        assert set(counts.values()) == {1}  # no frame twice
        out: dict[int, list[int]] = {}
        for ep, frame in sorted(counts):
            out.setdefault(ep, []).append(frame)
        return out

    everything = {ep: list(range(n)) for ep, n in enumerate(SMALL_LENGTHS)}
    assert frames_per_episode() == everything
    shift_timestamps(small_copy)  # episode 1
    with pytest.raises(DatasetError, match=r"1 of 5 episodes cannot be read .*episode 1: field 'timestamp'"):
        build_loader(small_copy, batch_size=1, num_workers=workers)
    assert frames_per_episode(skip_bad_episodes=True) == {ep: f for ep, f in everything.items() if ep != 1}


def _boom_at_episode_1_frame_5(sample):
    if int(sample["episode_index"]) == 1 and int(sample["frame_index"]) == 5:
        raise RuntimeError("boom")
    return sample


def _exit_at_episode_0(sample):
    if int(sample["episode_index"]) == 0:
        os._exit(3)  # a hard crash (segfault-like): no Python exception to forward
    return sample


def test_a_failing_worker_names_the_sample(small_root):
    loader = build_loader(small_root, batch_size=4, num_workers=2, keys=["action"],
                          transform=_boom_at_episode_1_frame_5)
    try:
        with pytest.raises(LoaderError, match=r"episode 1, frame 5.*boom"):
            loader.take(2 * loader.batches_per_epoch)  # (an epoch drops a partial batch: maybe this frame)
    finally:
        loader.close()


def test_a_crashed_worker_is_reported_with_its_batch(small_root):
    loader = build_loader(small_root, batch_size=4, num_workers=1, keys=["action"], transform=_exit_at_episode_0,
                          shuffle=False)
    with pytest.raises(LoaderError, match=r"batch 0 of epoch 0 \(first sample: .*episode 0, frame 0\)"):
        next(loader)


# held by a thread of the main process while workers start (as pyarrow's, a decoder's or gRPC's locks can be)
_BUSY_LOCK = threading.Lock()


def _use_busy_lock(sample):
    with _BUSY_LOCK:
        return sample


def test_workers_do_not_inherit_locks_held_by_the_trainers_threads(small_root):
    held, release = threading.Event(), threading.Event()

    def hold():
        with _BUSY_LOCK:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        # the default (forkserver) worker imports a fresh copy of this module: its lock is free
        clean = build_loader(small_root, batch_size=4, num_workers=1, keys=["action"], transform=_use_busy_lock,
                             worker_timeout_s=60)
        try:
            assert next(clean)["action"].shape[0] == 4
        finally:
            clean.close()
        # a forked worker copies the lock as held and blocks on it: the watchdog reports it instead of hanging
        forked = build_loader(small_root, batch_size=4, num_workers=1, keys=["action"], transform=_use_busy_lock,
                              multiprocessing_context="fork", worker_timeout_s=2, shuffle=False)
        with pytest.raises(LoaderError, match=r"batch 0 of epoch 0 .*no batch for 2 s .*timed out"):
            next(forked)
    finally:
        release.set()
        holder.join()


def test_a_transform_workers_cannot_receive_is_named_up_front(small_root):
    def local(sample):
        return sample

    with pytest.raises(ValueError, match=r"transform .*local.* cannot be pickled.*module level"):
        build_loader(small_root, batch_size=4, num_workers=1, keys=["action"], transform=local)
    forked = build_loader(small_root, batch_size=4, num_workers=1, keys=["action"], transform=local,
                          multiprocessing_context="fork")
    try:
        assert next(forked)["action"].shape[0] == 4  # closures are fine where workers are forked
    finally:
        forked.close()


def test_sources_are_recognized_by_their_layout(small_root, tmp_path):
    assert isinstance(open_source(small_root), RawSource)
    lake = tmp_path / "lake"
    lake.mkdir()
    (lake / "manifest.json").write_text('{"format": "roboscale-lake"}')
    try:
        import roboscale.data.lake.source  # noqa: F401
    except ImportError:
        with pytest.raises(DatasetError, match="roboscale lake"):
            open_source(lake)
    with pytest.raises(DatasetError, match="not a dataset"):
        open_source(tmp_path)
    with pytest.raises(DatasetError, match="field 'observation.nope': no such feature"):
        build_loader(small_root, batch_size=2, keys=["observation.nope"])
