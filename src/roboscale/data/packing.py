"""Token-budget packing: variable-length samples -> PackedBatch (flat token streams with ``cu_seqlens``).

A pi0.5 sample in LeRobot's layout is 3 camera slots x 256 tokens + 200 language positions + 50 action tokens,
whether or not the cameras exist and however short the prompt is (reference/lerobot.md §4.1). Packing keeps only
the real tokens: cameras a sample lacks are not encoded, language padding is dropped, samples are concatenated
into one stream and attention is confined to each sample by ``cu_seqlens``. Position ids restart per sample, so a
packed sample computes exactly what it computes alone.

The padded layout (one sample per row, the same ``PackedBatch`` class) keeps LeRobot's positions, so packed vs
padded runs are comparable in tests and benchmarks.

Layout of the prefix stream. Every prefix token is one row of a *bank* the model builds:

    bank = [image tokens (images x tokens_per_image) | extra tokens (samples x extra_tokens) | language tokens | 0]

and ``prefix_index`` [rows, row_len] says which bank row sits at each position (padding points at the final zero
row). Per sample the order is [its cameras in slot order, its extra (state) tokens, its language tokens].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch


@dataclass
class TokenizedSample:
    """One training example after the policy's transform (normalized, tokenized, not padded)."""

    images: torch.Tensor
    """uint8 (or float) [n_slots, 3, H, W]; slots without a camera may hold anything (see ``image_mask``)."""
    image_mask: torch.Tensor
    """bool [n_slots]: True where the sample has that camera."""
    state: torch.Tensor
    """float [S], normalized."""
    tokens: torch.Tensor
    """long [L], the prompt without padding."""
    actions: torch.Tensor | None = None
    """float [T, A], normalized (None at inference)."""
    actions_is_pad: torch.Tensor | None = None
    """bool [T]: True for steps past the episode end."""
    episode_index: int = -1
    frame_index: int = -1


@dataclass(frozen=True)
class PrefixSpec:
    """How many tokens each part of a sample becomes in the model (the policy supplies it)."""

    tokens_per_image: int
    extra_tokens: int = 0
    """Tokens between images and language (pi0.5 here: 1 continuous state token; 0 for state-in-prompt)."""
    suffix_tokens: int = 0
    """Action tokens per sample (counted in the budget; they are not part of the prefix stream)."""
    pad_language_to: int = 0
    """Padded layout only: language positions per row (LeRobot: 200); 0 = the longest prompt of the batch."""

    def prefix_tokens(self, sample: TokenizedSample) -> int:
        """Real prefix tokens of a sample (empty camera slots and language padding excluded)."""
        return int(sample.image_mask.sum()) * self.tokens_per_image + self.extra_tokens + int(sample.tokens.numel())

    def sample_tokens(self, sample: TokenizedSample) -> int:
        """Real tokens of a sample: its prefix plus its action tokens."""
        return self.prefix_tokens(sample) + self.suffix_tokens

    def describe(self, sample: TokenizedSample) -> str:
        cams = int(sample.image_mask.sum())
        return (
            f"{cams * self.tokens_per_image} image ({cams} cameras x {self.tokens_per_image}) + "
            f"{self.extra_tokens} state + {sample.tokens.numel()} language + {self.suffix_tokens} action"
        )


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


# --- planning: which samples go in which micro-batch ---------------------------------------------------------
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


# --- building the batch ---------------------------------------------------------------------------------------
def _check_cameras(samples: Sequence[TokenizedSample]) -> None:
    masks = torch.stack([s.image_mask.bool() for s in samples])
    missing = (~masks.any(0)).nonzero().flatten().tolist()
    if missing:
        raise ValueError(
            f"camera slot(s) {missing} are empty in every sample of this batch; a camera the policy reads "
            "(policy.image_keys) is missing from the data: fix the dataset or set policy.image_keys to the cameras "
            "it has"
        )


def _describer(samples: Sequence[TokenizedSample], spec: PrefixSpec):
    """Names sample i in errors: its place in the batch, its episode and frame, and what its tokens are."""

    def describe(i: int) -> str:
        s = samples[i]
        return f"sample {i} (episode {s.episode_index}, frame {s.frame_index}: {spec.describe(s)})"

    return describe


def _stack_optional(values: list[torch.Tensor | None]) -> torch.Tensor | None:
    if any(v is None for v in values):
        return None
    return torch.stack(values)


def collate(
    samples: Sequence[TokenizedSample],
    spec: PrefixSpec,
    packed: bool = True,
    budget: int = 0,
    require_every_camera: bool = True,
) -> PackedBatch:
    """One PackedBatch from samples: one flat stream (``packed``) or one sample per row (LeRobot's layout: every
    camera slot encoded and masked when empty, language padded). ``budget`` > 0: the packed stream (prefix +
    action tokens) must fit in it. ``require_every_camera``: a camera slot empty in every sample is an error (a
    misconfigured camera list); micro-batches cut from a checked batch skip the check."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    if require_every_camera:
        _check_cameras(samples)
    describe = _describer(samples, spec)
    if budget:
        lengths = [spec.sample_tokens(s) for s in samples]
        for i, n in enumerate(lengths):
            if n > budget:
                best_fit_decreasing([n], budget, lambda _: describe(i))  # raises with the explanation
        if sum(lengths) > budget:
            raise PackingError(
                f"{len(samples)} samples hold {sum(lengths)} tokens, more than the token budget of {budget}; "
                "use pack_micro_batches to split them, or lower the batch size"
            )
    tpi, extra = spec.tokens_per_image, spec.extra_tokens
    # Images: packed keeps real cameras only; padded keeps every slot (LeRobot encodes empty slots and masks them).
    image_list, image_sample, image_real = [], [], []
    for i, s in enumerate(samples):
        mask = s.image_mask.bool()
        slots = mask.nonzero().flatten().tolist() if packed else range(len(mask))
        for slot in slots:
            image_list.append(s.images[slot])
            image_sample.append(i)
            image_real.append(bool(mask[slot]))
    n_img, b = len(image_list), len(samples)
    token_lens = [int(s.tokens.numel()) for s in samples]
    n_tok = sum(token_lens)
    extra_base, lang_base, pad_row = n_img * tpi, n_img * tpi + b * extra, n_img * tpi + b * extra + n_tok

    # Per sample: the bank rows of its prefix and whether each is real.
    pieces, reals = [], []
    img_cursor, tok_cursor = 0, 0
    lang_width = max(spec.pad_language_to, max(token_lens)) if not packed else 0
    cams_per_sample = torch.bincount(torch.tensor(image_sample, dtype=torch.long), minlength=b).tolist()
    for i in range(b):
        n_cams = cams_per_sample[i]
        img_rows = torch.arange(img_cursor * tpi, (img_cursor + n_cams) * tpi)
        img_real = torch.tensor(image_real[img_cursor : img_cursor + n_cams]).repeat_interleave(tpi)
        img_cursor += n_cams
        ext_rows = torch.arange(extra_base + i * extra, extra_base + (i + 1) * extra)
        lang_rows = torch.arange(lang_base + tok_cursor, lang_base + tok_cursor + token_lens[i])
        tok_cursor += token_lens[i]
        rows = [img_rows, ext_rows, lang_rows]
        real = [img_real, torch.ones(extra, dtype=torch.bool), torch.ones(token_lens[i], dtype=torch.bool)]
        if not packed:  # language padding up to the row's language width
            pad = lang_width - token_lens[i]
            rows.append(torch.full((pad,), pad_row))
            real.append(torch.zeros(pad, dtype=torch.bool))
        pieces.append(torch.cat(rows))
        reals.append(torch.cat(real))

    seq_lens = torch.tensor([int(r.sum()) for r in reals], dtype=torch.long)
    if packed:
        prefix_index = torch.cat(pieces)[None]
        valid = torch.ones_like(prefix_index, dtype=torch.bool)
        positions = torch.cat([torch.arange(int(n)) for n in seq_lens])[None]
        offsets = torch.cumsum(seq_lens, 0) - seq_lens
    else:
        row_len = max(len(p) for p in pieces)
        prefix_index = torch.full((b, row_len), pad_row, dtype=torch.long)
        valid = torch.zeros(b, row_len, dtype=torch.bool)
        for i, (p, r) in enumerate(zip(pieces, reals, strict=True)):
            prefix_index[i, : len(p)], valid[i, : len(r)] = p, r
        positions = (valid.long().cumsum(1) - 1).clamp_min(0)  # LeRobot: cumsum(pad_mask) - 1
        offsets = torch.arange(b, dtype=torch.long) * row_len
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq_lens, 0)
    token_cu = torch.zeros(b + 1, dtype=torch.int32)
    token_cu[1:] = torch.cumsum(torch.tensor(token_lens), 0)
    first = samples[0].images
    return PackedBatch(
        packed=packed,
        images=torch.stack(image_list) if image_list else first.new_zeros((0, *first.shape[1:])),
        image_sample=torch.tensor(image_sample, dtype=torch.long),
        image_real=torch.tensor(image_real, dtype=torch.bool),
        tokens=torch.cat([s.tokens.long() for s in samples]),
        token_cu_seqlens=token_cu,
        state=torch.stack([s.state.float() for s in samples]),
        prefix_index=prefix_index,
        position_ids=positions,
        valid=valid,
        cu_seqlens=cu,
        sample_offsets=offsets,
        seq_lens=seq_lens,
        max_seqlen=int(seq_lens.max()),
        tokens_per_image=tpi,
        extra_tokens=extra,
        suffix_len=spec.suffix_tokens,
        actions=_stack_optional([s.actions for s in samples]),
        actions_is_pad=_stack_optional([s.actions_is_pad for s in samples]),
        episode_index=torch.tensor([s.episode_index for s in samples], dtype=torch.long),
        frame_index=torch.tensor([s.frame_index for s in samples], dtype=torch.long),
    )


def pack_micro_batches(
    samples: Sequence[TokenizedSample], spec: PrefixSpec, budget: int, num_ranks: int = 1, rank: int = 0
) -> list[PackedBatch]:
    """This rank's packed micro-batches (gradient-accumulation steps) for a global batch of samples: best-fit
    decreasing under ``budget`` tokens each, the same number of micro-batches on every rank, tokens balanced."""
    _check_cameras(samples)  # on the whole batch: a micro-batch may lack a camera that the batch has
    lengths = [spec.sample_tokens(s) for s in samples]
    describe = _describer(samples, spec)
    plan = plan_micro_batches(lengths, budget, num_ranks, describe)
    return [
        collate([samples[i] for i in sorted(b)], spec, packed=True, budget=budget, require_every_camera=False)
        for b in plan[rank]
    ]


@dataclass
class PackCollate:
    """A picklable collate for the loader's workers: a list of samples -> one PackedBatch, or, packed with a
    ``budget``, the list of micro-batches (each within the budget) that the trainer accumulates gradients over."""

    spec: PrefixSpec
    packed: bool = True
    budget: int = 0

    def __call__(self, samples: Sequence[TokenizedSample]) -> PackedBatch | list[PackedBatch]:
        if self.packed and self.budget:
            return pack_micro_batches(samples, self.spec, self.budget)
        return collate(samples, self.spec, packed=self.packed, budget=self.budget)
