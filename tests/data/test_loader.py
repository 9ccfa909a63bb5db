import torch

from roboscale.data.loader import BatchLoader, EpisodeStore


def make_store(lengths=(5, 3, 7, 4)):
    starts, ends, task, idx = [], [], [], 0
    for e, n in enumerate(lengths):
        starts += [idx] * n
        ends += [idx + n] * n
        task += [e % 2] * n
        idx += n
    n = idx
    frames = torch.arange(n, dtype=torch.float32)
    return EpisodeStore(
        images={"observation.images.cam": torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 3, 2, 2)},
        columns={"observation.state": frames[:, None], "action": frames[:, None].repeat(1, 2)},
        episode_start=torch.tensor(starts),
        episode_end=torch.tensor(ends),
        task_index=torch.tensor(task),
        tasks=["even", "odd"],
    )


def test_windows_clamp_to_the_episode_and_flag_padding():
    store = make_store()
    batch = store.gather(torch.tensor([3, 5, 7]), {"action": [-1, 0, 1, 2]})
    # frame 3 is in episode 0 [0, 5): offsets -1..2 -> 2,3,4,(4 padded)
    assert batch["action"][0, :, 0].tolist() == [2, 3, 4, 4]
    assert batch["action_is_pad"][0].tolist() == [False, False, False, True]
    # frame 5 starts episode 1 [5, 8): offset -1 is padded with the first frame
    assert batch["action"][1, :, 0].tolist() == [5, 5, 6, 7]
    assert batch["action_is_pad"][1].tolist() == [True, False, False, False]
    assert batch["action"][2, :, 0].tolist() == [6, 7, 7, 7]
    assert batch["observation.state"][:, 0].tolist() == [3, 5, 7]
    assert batch["task"] == ["even", "odd", "odd"]
    assert batch["observation.images.cam"][:, 0, 0, 0].tolist() == [3, 5, 7]


def _take(loader, n):
    it = iter(loader)
    return [next(it)["index"].tolist() for _ in range(n)]


def test_epochs_cover_every_frame_once_and_reshuffle():
    store = make_store()  # 19 frames
    loader = BatchLoader(store, batch_size=3, delta_indices={}, seed=1)
    batches = _take(loader, 12)  # 6 batches per epoch
    first, second = sum(batches[:6], []), sum(batches[6:], [])
    assert len(set(first)) == 18 and len(set(second)) == 18
    assert first != second


def test_ranks_are_disjoint_and_together_cover_the_epoch():
    store = make_store()
    per_rank = [sum(_take(BatchLoader(store, 2, {}, seed=3, rank=r, world_size=3), 3), []) for r in range(3)]
    seen = [i for r in per_rank for i in r]
    assert len(seen) == len(set(seen)) == 18


def test_resume_continues_with_exactly_the_remaining_samples():
    store = make_store()
    reference = _take(BatchLoader(store, 4, {}, seed=7), 10)
    first = BatchLoader(store, 4, {}, seed=7)
    head = _take(first, 6)
    resumed = BatchLoader(store, 4, {}, seed=7)
    resumed.load_state_dict(first.state_dict())
    assert head + _take(resumed, 4) == reference
