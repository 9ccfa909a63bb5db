"""Token-budget packing (roboscale.batching) and pi0.5's token layout on it: budget, coverage, positions, rank
balance, errors."""

import random

import pytest
import torch

from roboscale.batching import PackingError, balance_ranks, best_fit_decreasing, plan_micro_batches
from roboscale.models.pi05.layout import PackCollate, PrefixSpec, TokenizedSample, collate, pack_micro_batches

SPEC = PrefixSpec(tokens_per_image=4, extra_tokens=1, suffix_tokens=3)


def _sample(cams, n_tokens, i=0, slots=3):
    mask = torch.tensor([c < cams for c in range(slots)])  # the first `cams` slots are real
    return TokenizedSample(
        images=torch.full((slots, 3, 2, 2), i, dtype=torch.uint8),
        image_mask=mask,
        state=torch.full((2,), float(i)),
        tokens=torch.arange(n_tokens) + 100 * i,
        actions=torch.full((3, 2), float(i)),
        actions_is_pad=torch.zeros(3, dtype=torch.bool),
        episode_index=i,
        frame_index=i,
    )


def _lengths(n, seed):
    rng = random.Random(seed)
    return [rng.randint(5, 90) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_bins_respect_the_budget_and_hold_every_sample_once(seed):
    lengths = _lengths(60, seed)
    bins = best_fit_decreasing(lengths, budget=128)
    assert sorted(i for b in bins for i in b) == list(range(60))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # Best-fit decreasing stays within 11/9 OPT + 1 bins, and OPT >= total / budget.
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 128) + 1


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ranks_get_equal_micro_batch_counts_and_balanced_tokens(ranks):
    lengths = _lengths(50, ranks)
    plan = plan_micro_batches(lengths, budget=200, num_ranks=ranks)
    assert len(plan) == ranks and len({len(r) for r in plan}) == 1
    assert sorted(i for r in plan for b in r for i in b) == list(range(50))
    assert all(sum(lengths[i] for i in b) <= 200 for r in plan for b in r)
    loads = [sum(lengths[i] for b in r for i in b) for r in plan]
    assert max(loads) - min(loads) <= max(lengths)  # LPT: imbalance below one sample


def test_bins_are_split_so_every_rank_has_a_micro_batch():
    lengths = [10, 10, 10]
    plan = balance_ranks(best_fit_decreasing(lengths, 100), lengths, num_ranks=3)
    assert [len(r) for r in plan] == [1, 1, 1]
    with pytest.raises(PackingError, match="at least 4 samples"):
        balance_ranks([[0, 1, 2]], lengths, num_ranks=4)


def test_a_sample_over_the_budget_is_named_with_what_to_change():
    samples = [_sample(1, 5, i=0), _sample(3, 40, i=7)]  # 12 + 1 + 40 + 3 = 56 tokens
    with pytest.raises(PackingError, match=r"sample 1 \(episode 7.*has 56 tokens.*budget of 50.*at least 56"):
        pack_micro_batches(samples, SPEC, budget=50)
    with pytest.raises(PackingError, match="sample 1 .*at least 56"):
        PackCollate(SPEC, budget=50)(samples)


def test_packed_stream_drops_padding_and_empty_slots_and_restarts_positions():
    samples = [_sample(1, 5, i=0), _sample(3, 2, i=1), _sample(2, 7, i=2)]
    pb = collate(samples, SPEC, packed=True)
    lens = [1 * 4 + 1 + 5, 3 * 4 + 1 + 2, 2 * 4 + 1 + 7]
    assert pb.rows == 1 and pb.row_len == sum(lens) and bool(pb.valid.all())
    assert pb.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert pb.max_seqlen == max(lens) and pb.seq_lens.tolist() == lens
    assert pb.position_ids[0].tolist() == [p for n in lens for p in range(n)]
    assert pb.images.shape[0] == 6 and pb.image_sample.tolist() == [0, 1, 1, 1, 2, 2]
    assert pb.real_tokens == sum(lens) + 3 * 3 == pb.computed_tokens
    # The bank rows of sample 2: its 2 images (image rows 16..23), its state token, then its 7 prompt tokens.
    n_img_rows, n_extra = 6 * 4, 3
    start = int(pb.sample_offsets[2])
    row = pb.prefix_index[0, start : start + lens[2]].tolist()
    assert row[:8] == list(range(16, 24))
    assert row[8] == n_img_rows + 2
    assert row[9:] == list(range(n_img_rows + n_extra + 7, n_img_rows + n_extra + 14))
    assert pb.tokens[pb.token_cu_seqlens[2] : pb.token_cu_seqlens[3]].tolist() == list(range(200, 207))


def test_padded_layout_is_one_sample_per_row_with_lerobot_positions():
    samples = [_sample(1, 5, i=0), _sample(3, 2, i=1)]
    spec = PrefixSpec(tokens_per_image=4, extra_tokens=1, suffix_tokens=3, pad_language_to=8)
    pb = collate(samples, spec, packed=False)
    assert pb.rows == 2 and pb.row_len == 3 * 4 + 1 + 8
    assert pb.images.shape[0] == 6 and pb.image_real.tolist() == [True, False, False, True, True, True]
    assert pb.valid[0].tolist() == [True] * 4 + [False] * 8 + [True] * 6 + [False] * 3
    assert pb.seq_lens.tolist() == [10, 15]
    # Positions count real tokens only (cumsum(mask) - 1): the empty slots do not advance them.
    assert pb.position_ids[0][pb.valid[0]].tolist() == list(range(10))
    assert pb.sample_offsets.tolist() == [0, pb.row_len]
    pad_row = int(pb.prefix_index.max())
    assert pad_row == 6 * 4 + 2 * 1 + 7  # the zero row after images, state tokens and the 7 prompt tokens
    assert (pb.prefix_index[0, -3:] == pad_row).all() and (pb.prefix_index[1, -6:] == pad_row).all()


def test_micro_batches_cover_the_rank_share_and_fit():
    samples = [_sample(1 + i % 3, 3 + 5 * i, i=i) for i in range(10)]
    budget = 80
    seen = []
    for rank in range(2):
        for pb in pack_micro_batches(samples, SPEC, budget, num_ranks=2, rank=rank):
            assert pb.real_tokens <= budget
            seen += pb.episode_index.tolist()
    assert sorted(seen) == list(range(10))


def test_packed_batch_moves_as_one_object():
    pb = collate([_sample(3, 4, i=1)], SPEC)
    moved = pb.to("cpu")
    assert moved.packed and torch.equal(moved.prefix_index, pb.prefix_index) and moved.max_seqlen == pb.max_seqlen
