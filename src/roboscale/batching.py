"""The batch contract between data and policies: ``PackedBatch`` (flat token streams with ``cu_seqlens``, or one
sample per row), and the generic packing algorithms (best-fit-decreasing bins under a token budget, balancing
micro-batches across data-parallel ranks).

Neutral ground: the loader, the policies and the trainer may all import it; it imports only torch. How a policy
lays its tokens out (which positions are images, state, language, actions) belongs to that policy
(``roboscale.models.pi05.layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch


def cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """int32 [B + 1] cumulative lengths: the varlen attention description of segments of ``lengths`` [B]."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(lengths, 0)
    return out


@dataclass
class PackedBatch:
    """What the models consume. ``packed``: one flat stream (rows == 1, no padding); otherwise one sample per row.

    Per sample i (B samples): ``state[i]``, ``actions[i]``; its prefix occupies ``seq_lens[i]`` real positions
    starting at ``sample_offsets[i]`` of the flattened [rows * row_len] stream; in the packed layout these are
    contiguous and ``cu_seqlens`` is the flash-attention varlen description of the stream.
    """

    packed: bool
    images: torch.Tensor
    """[N_img, 3, H, W]: every real camera of every sample (packed), or every slot (padded)."""
    image_sample: torch.Tensor
    """long [N_img]: the sample each image belongs to."""
    image_real: torch.Tensor
    """bool [N_img]: False for an empty slot kept (padded layout only)."""
    tokens: torch.Tensor
    """long [N_tok]: all prompts, concatenated, no padding."""
    token_cu_seqlens: torch.Tensor
    """int32 [B + 1]: prompt i is ``tokens[token_cu_seqlens[i]:token_cu_seqlens[i+1]]``."""
    state: torch.Tensor
    """float [B, S] (normalized)."""
    prefix_index: torch.Tensor
    """long [rows, row_len]: bank row at each prefix position (see the module docstring)."""
    position_ids: torch.Tensor
    """long [rows, row_len]: restart at 0 for every sample; count real tokens only."""
    valid: torch.Tensor
    """bool [rows, row_len]: False at padding (and at empty camera slots in the padded layout)."""
    cu_seqlens: torch.Tensor
    """int32 [B + 1]: cumulative real prefix lengths (the packed stream's segment boundaries)."""
    sample_offsets: torch.Tensor
    """long [B]: where sample i's prefix starts in the flattened [rows * row_len] stream."""
    seq_lens: torch.Tensor
    """long [B]: real prefix tokens of sample i."""
    max_seqlen: int
    tokens_per_image: int
    extra_tokens: int
    suffix_len: int
    actions: torch.Tensor | None = None
    """float [B, T, A] (normalized)."""
    actions_is_pad: torch.Tensor | None = None
    episode_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    frame_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    sample_seed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    """long [B]: the loader's per-sample seeds for the objective's random draws (empty: none)."""

    @property
    def num_samples(self) -> int:
        return int(self.state.shape[0])

    @property
    def rows(self) -> int:
        return int(self.prefix_index.shape[0])

    @property
    def row_len(self) -> int:
        return int(self.prefix_index.shape[1])

    @property
    def real_tokens(self) -> int:
        """Prefix + action tokens that carry data (what tokens/s should count)."""
        return int(self.seq_lens.sum()) + self.num_samples * self.suffix_len

    @property
    def computed_tokens(self) -> int:
        """Positions the model computes over, padding included."""
        return self.rows * self.row_len + self.num_samples * self.suffix_len

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device, non_blocking=non_blocking)
            moved[f.name] = value
        return PackedBatch(**moved)

    def pin_memory(self) -> PackedBatch:
        """torch's DataLoader calls this when ``pin_memory=True``."""
        return PackedBatch(
            **{
                f.name: (v.pin_memory() if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                for f in fields(self)
            }
        )


# --------------------------------------------------------------------------------------------------- planning


class PackingError(ValueError):
    """A sample cannot be packed under the token budget."""


def best_fit_decreasing(lengths: Sequence[int], budget: int, describe=None) -> list[list[int]]:
    """Bins of sample indices, each summing to <= ``budget`` tokens: longest sample first, into the fullest bin
    that still fits it (best-fit decreasing: at most 11/9 OPT + 1 bins).

    ``describe(i)`` names sample i in the error raised for a sample longer than the budget.
    """
    if budget <= 0:
        raise PackingError(f"token budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > budget:
            what = describe(i) if describe else f"sample {i}"
            raise PackingError(
                f"{what} has {n} tokens, more than the token budget of {budget}; raise the budget to at least {n} "
                "or shorten the sample (fewer cameras, a lower max_language_tokens, a shorter action chunk)"
            )
        best = -1
        for b, room in enumerate(free):
            if n <= room and (best < 0 or room < free[best]):
                best = b
        if best < 0:
            bins.append([i])
            free.append(budget - n)
        else:
            bins[best].append(i)
            free[best] -= n
    return bins


def balance_ranks(
    bins: list[list[int]], lengths: Sequence[int], num_ranks: int, budget: int = 0
) -> list[list[list[int]]]:
    """Deal bins to ``num_ranks`` data-parallel ranks so every rank gets the same number of micro-batches (DDP and
    FSDP need the same number of forward/backward calls per step) and about the same number of tokens.

    Bins are split (largest first) until their count is a multiple of the ranks, then dealt largest-first to the
    least-loaded rank that still has room (LPT scheduling). With ``budget``, samples are then moved or swapped
    between the most and least loaded ranks while that narrows the gap and every bin still fits: LPT balances
    whole bins, this balances to about a sample.
    """
    bins = [list(b) for b in bins if b]
    if sum(len(b) for b in bins) < num_ranks:
        raise PackingError(
            f"{sum(len(b) for b in bins)} samples cannot feed {num_ranks} ranks; use a batch of at least "
            f"{num_ranks} samples"
        )
    tokens = lambda b: sum(lengths[i] for i in b)  # noqa: E731
    while len(bins) % num_ranks:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            break
        big = max(splittable, key=tokens)
        bins.remove(big)
        big.sort(key=lambda i: -lengths[i])
        halves: list[list[int]] = [[], []]
        for i in big:  # greedy halves: each sample to the lighter half
            min(halves, key=tokens).append(i)
        bins.extend(halves)
    per_rank = -(-len(bins) // num_ranks)
    ranks: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for b in sorted(bins, key=lambda b: -tokens(b)):
        r = min((r for r in range(num_ranks) if len(ranks[r]) < per_rank), key=lambda r: load[r])
        ranks[r].append(b)
        load[r] += tokens(b)
    if budget:
        _refine(ranks, lengths, budget)
    return ranks


def _refine(ranks: list[list[list[int]]], lengths: Sequence[int], budget: int, rounds: int = 200) -> None:
    """Narrow the token gap between the heaviest and lightest rank by one sample move or swap per round."""
    tokens = lambda b: sum(lengths[i] for i in b)  # noqa: E731
    for _ in range(rounds):
        loads = [sum(tokens(b) for b in r) for r in ranks]
        hi, lo = max(range(len(ranks)), key=loads.__getitem__), min(range(len(ranks)), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        best = None  # (new gap, bin_hi, i, bin_lo, j or None)
        for bh in ranks[hi]:
            room_h = budget - tokens(bh)
            for bl in ranks[lo]:
                room_l = budget - tokens(bl)
                for i in bh:
                    if len(bh) > 1 and lengths[i] <= room_l:  # move i (never empty a bin)
                        new = abs(gap - 2 * lengths[i])
                        if new < gap and (best is None or new < best[0]):
                            best = (new, bh, i, bl, None)
                    for j in bl:  # swap i and j
                        delta = lengths[i] - lengths[j]
                        if 0 < delta and delta <= room_l and -delta <= room_h:
                            new = abs(gap - 2 * delta)
                            if new < gap and (best is None or new < best[0]):
                                best = (new, bh, i, bl, j)
        if best is None:
            return
        _, bh, i, bl, j = best
        bh.remove(i)
        bl.append(i)
        if j is not None:
            bl.remove(j)
            bh.append(j)


def plan_micro_batches(lengths: Sequence[int], budget: int, num_ranks: int = 1, describe=None) -> list[list[list[int]]]:
    """``[rank][micro_batch] -> sample indices``: best-fit-decreasing bins under ``budget``, balanced over ranks."""
    return balance_ranks(best_fit_decreasing(lengths, budget, describe), lengths, num_ranks, budget)
