"""pi0.5's token layout: normalized, tokenized samples -> ``PackedBatch`` (``roboscale.batching``).

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
from dataclasses import dataclass

import torch

from roboscale.batching import PackedBatch, PackingError, best_fit_decreasing, cu_seqlens, plan_micro_batches


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
    sample_seed: int = -1
    """The loader's per-sample seed for the objective's random draws (-1: none)."""


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
    cu = cu_seqlens(seq_lens)
    token_cu = cu_seqlens(torch.tensor(token_lens))
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
        sample_seed=(torch.tensor([s.sample_seed for s in samples], dtype=torch.long)
                     if all(s.sample_seed >= 0 for s in samples) else torch.zeros(0, dtype=torch.long)),
    )


def pack_micro_batches(
    samples: Sequence[TokenizedSample], spec: PrefixSpec, budget: int, num_ranks: int = 1, rank: int = 0,
    require_every_camera: bool = True,
) -> list[PackedBatch]:
    """This rank's packed micro-batches (gradient-accumulation steps) for a global batch of samples: best-fit
    decreasing under ``budget`` tokens each, the same number of micro-batches on every rank, tokens balanced."""
    if require_every_camera:
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
    require_every_camera: bool = True
    """A camera slot empty in every sample is an error (policy.missing_cameras=error)."""

    def __call__(self, samples: Sequence[TokenizedSample]) -> PackedBatch | list[PackedBatch]:
        if self.packed and self.budget:
            return pack_micro_batches(samples, self.spec, self.budget, require_every_camera=self.require_every_camera)
        return collate(samples, self.spec, packed=self.packed, budget=self.budget,
                       require_every_camera=self.require_every_camera)
