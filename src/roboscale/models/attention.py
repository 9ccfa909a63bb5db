"""Attention over segments, with several backends, without materialising an [L, L] mask.

pi0.5's attention pattern: the prefix (image + state + language tokens) attends bidirectionally within itself;
the suffix (action tokens) attends to the prefix and bidirectionally to itself; nothing attends to padding or to
another sample. LeRobot implements it as one eager attention with a 4-D mask. The pattern decomposes exactly
into two *segment* attentions:

    prefix queries of sample i -> prefix keys of sample i
    suffix queries of sample i -> [prefix keys of sample i, suffix keys of sample i]

which is also exactly what inference with a cached prefix does, so training and inference share one code path.

Two layouts:
- **padded** ([B, H, L, D], one sample per row): ``prefix_attention`` / ``suffix_attention`` with a
  [B, 1, 1, Lk] key-padding mask that broadcasts (no [B, L, L] tensor);
- **packed** (flat [T, H, D] streams, flash-attention's varlen convention): ``varlen_attention`` with
  ``cu_seqlens``, one call, backends:

  ``varlen``  flash attention through ``torch.nn.attention.varlen.varlen_attn`` (or the ``flash_attn`` package);
              CUDA, fp16/bf16, head_dim <= 256; forward and backward.
  ``flex``    FlexAttention with a block mask built from the segment boundaries (tile lists, cached per layout);
              compiled on CUDA (training); on CPU forward only (FlexAttention has no CPU backward).
  ``sdpa``    one SDPA call per segment: exact work, no mask; the CPU training path.
  ``dense``   one SDPA call with the materialised block-diagonal [Tq, Tk] mask: the numerical reference.
  ``eager``   matmul + masked softmax + matmul with the materialised mask (LeRobot's ``eager_attention_forward``):
              the baseline the benchmarks compare against.
  ``auto``    the fastest available for the device, dtype and whether gradients are needed (``pick_backend``).

Only ``dense`` and ``eager`` build an [L, L] mask.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "varlen", "flex", "sdpa", "dense", "eager")


# --- padded layout (one sample per row) ---------------------------------------------------------------------
@dataclass
class PrefixSuffixLayout:
    """Which prefix tokens are real. ``prefix_mask``: bool [B, Lp], True for a real token."""

    prefix_mask: torch.Tensor

    def key_mask(self, suffix_len: int = 0) -> torch.Tensor:
        """Bool [B, 1, 1, Lp + suffix_len]: True where a key may be attended to."""
        mask = self.prefix_mask
        if suffix_len:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], suffix_len)], dim=1)
        return mask[:, None, None, :]

    def dense_mask(self, suffix_len: int = 0, queries: str = "all") -> torch.Tensor:
        """The materialised [B, 1, Lq, Lk] prefix-LM mask (LeRobot's ``make_att_2d_masks``); only for the
        ``dense``/``eager`` reference paths. ``queries``: "all" (prefix + suffix rows), "prefix" or "suffix"."""
        lp = self.prefix_mask.shape[1]
        length = lp + suffix_len
        key_real = self.key_mask(suffix_len)[:, 0, 0, :]  # [B, L]
        is_suffix = torch.arange(length, device=key_real.device) >= lp
        # Query i may see key j iff j is real and (j in prefix or i in suffix).
        allowed = key_real[:, None, :] & (~is_suffix[None, None, :] | is_suffix[None, :, None])
        rows = {"all": slice(None), "prefix": slice(0, lp), "suffix": slice(lp, None)}[queries]
        return allowed[:, rows][:, None]

    @property
    def all_real(self) -> bool:
        return bool(self.prefix_mask.all())


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LeRobot's eager attention: softmax(q k^T / sqrt(d) + mask) v in fp32, bool mask [B, 1, Lq, Lk].

    The benchmarks' baseline (what pi0.5 runs in LeRobot), also a second reference for the tests.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.matmul(scores.softmax(dim=-1).to(v.dtype), v)


def _masked(q, k, v, mask, backend: str) -> torch.Tensor:
    return eager_attention(q, k, v, mask) if backend == "eager" else _sdpa(q, k, v, mask)


def prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PrefixSuffixLayout, backend: str = "sdpa"
) -> torch.Tensor:
    """Prefix self-attention, padded layout. q: [B, H, Lp, Dh]; k, v: [B, Hkv, Lp, Dh].

    ``backend`` "dense"/"eager" materialise the [B, 1, Lp, Lp] mask (reference and baseline); anything else uses
    the broadcast key-padding mask.
    """
    if backend in ("dense", "eager"):
        return _masked(q, k, v, layout.dense_mask(0, "prefix"), backend)
    return _sdpa(q, k, v, None if layout.all_real else layout.key_mask())


def suffix_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    layout: PrefixSuffixLayout,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Suffix queries over [prefix keys, suffix keys], padded layout. q: [B, H, Ls, Dh]."""
    k = torch.cat([prefix_k, suffix_k], dim=2)
    v = torch.cat([prefix_v, suffix_v], dim=2)
    if backend in ("dense", "eager"):
        return _masked(q, k, v, layout.dense_mask(suffix_k.shape[2], "suffix"), backend)
    mask = None if layout.all_real else layout.key_mask(suffix_k.shape[2])
    return _sdpa(q, k, v, mask)


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PrefixSuffixLayout, suffix_len: int
) -> torch.Tensor:
    """The whole [prefix, suffix] sequence with an explicit [B, 1, L, L] mask (LeRobot's formulation)."""
    return _sdpa(q, k, v, layout.dense_mask(suffix_len))


# --- packed layout (flat streams, cu_seqlens) ---------------------------------------------------------------
def varlen_available() -> str | None:
    """Which varlen flash kernel this torch can call ("torch", "flash_attn") or None."""
    if not torch.cuda.is_available():
        return None
    if _torch_varlen() is not None:
        return "torch"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return None
    return "flash_attn"


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _flex_api():
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    return BlockMask, flex_attention


def flex_available() -> bool:
    return _flex_api() is not None


def pick_backend(device: torch.device, dtype: torch.dtype, needs_grad: bool, head_dim: int = 64) -> str:
    """``auto``'s choice.

    CUDA: flash varlen when the kernel exists and the dtype/head size fit it (fp16/bf16, head_dim <= 256),
    otherwise compiled FlexAttention, otherwise per-segment SDPA. CPU: per-segment SDPA, always: FlexAttention
    has no CPU backward, and even for inference its eager CPU path is ~10x slower than SDPA (compiled ≈ dense
    SDPA after a ~5 s compile per shape; reference/cpu-stack.md), while per-segment SDPA does exactly the real work.
    """
    del needs_grad  # every CUDA backend has a backward; on CPU the choice is sdpa either way
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and varlen_available():
            return "varlen"
        if flex_available():
            return "flex"
    return "sdpa"


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Attention over packed segments (flash-attention's varlen convention): segment ``i`` owns query rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and key rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``; nothing crosses
    segments. q: [Tq, H, D]; k, v: [Tk, Hkv, D] (Hkv divides H); returns [Tq, H, D]. ``causal`` aligns the
    last query with the last key of a segment (flash-attention's bottom-right convention).

    ``backend``: one of ``BACKENDS`` (the module docstring says what each does). The default stays the
    per-segment SDPA that works everywhere, so existing callers keep their behaviour.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        backend = pick_backend(q.device, q.dtype, needs_grad, q.shape[-1])
    if backend == "varlen":
        return _varlen_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    if backend == "flex":
        return _varlen_flex(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)
    if backend in ("dense", "eager"):
        mask = segment_mask(cu_seqlens_q, cu_seqlens_k, causal, q.device)
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
        return _masked(qs, ks, vs, mask[None, None], backend)[0].transpose(0, 1)
    return _varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, causal)


def _bounds(cu: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(x) for x in cu.tolist())


def _varlen_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool) -> torch.Tensor:
    """One SDPA per segment. Segments are written into a list and concatenated (not into a pre-allocated
    output by index assignment) so autograd sees plain ops."""
    bounds_q, bounds_k = _bounds(cu_seqlens_q), _bounds(cu_seqlens_k)
    if len(bounds_q) != len(bounds_k):
        raise ValueError(f"cu_seqlens_q has {len(bounds_q)} entries but cu_seqlens_k has {len(bounds_k)}")
    if bounds_q[0] > 0 or bounds_q[-1] < q.shape[0]:
        raise ValueError(f"cu_seqlens_q covers rows {bounds_q[0]}..{bounds_q[-1]} of {q.shape[0]} query rows")
    outs = []
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0:
            continue
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        mask = None
        if causal:
            lq, lk = q1 - q0, k1 - k0
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        outs.append(_sdpa(qs, ks, vs, mask)[0].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)


def _segment_ids(cu: torch.Tensor, total: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a flat stream: its segment index and its position inside the segment."""
    cu = cu.to(device=device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=total)
    pos = torch.arange(total, device=device) - cu[:-1][seg]
    return seg, pos


def segment_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, device) -> torch.Tensor:
    """The materialised bool [Tq, Tk] block-diagonal mask (reference paths only)."""
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    seg_q, pos_q = _segment_ids(cu_q, tq, device)
    seg_k, pos_k = _segment_ids(cu_k, tk, device)
    mask = seg_q[:, None] == seg_k[None, :]
    if causal:
        shift = _causal_shift(cu_q, cu_k, seg_q, pos_q, device)
        mask &= pos_k[None, :] <= shift[:, None]
    return mask


def _causal_shift(cu_q, cu_k, seg_q, pos_q, device) -> torch.Tensor:
    """Bottom-right causal alignment: query at position p of a segment with lq queries and lk keys sees keys at
    positions <= p + lk - lq."""
    lq = (cu_q[1:] - cu_q[:-1]).to(device=device, dtype=torch.long)
    lk = (cu_k[1:] - cu_k[:-1]).to(device=device, dtype=torch.long)
    return pos_q + (lk - lq)[seg_q]


# Flex block masks are built once per layout and cached: a training step reuses one across all layers, inference
# across all Euler steps.
_BLOCK_MASKS: OrderedDict[tuple, object] = OrderedDict()
_BLOCK_MASK_CACHE_SIZE = 32
FLEX_BLOCK = 128


def flex_block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, device: torch.device):
    """A cached FlexAttention BlockMask for the segment layout.

    Built from the segment boundaries at block granularity (``BlockMask.from_kv_blocks``), not with
    ``create_block_mask``, which evaluates the mask function over the whole [Tq, Tk] grid (a dense mask by another
    name: 1.5 GB of bools for a 38k-token pack). A 128 x 128 tile is *full* when its queries and keys all belong
    to one segment (no mask function needed), *partial* when its rows and columns share some segment (the mask
    function decides per element), and skipped otherwise.
    """
    api = _flex_api()
    if api is None:
        raise RuntimeError("this torch has no torch.nn.attention.flex_attention; use attention_backend=sdpa")
    key = (str(device), _bounds(cu_q), _bounds(cu_k), causal)
    cached = _BLOCK_MASKS.get(key)
    if cached is not None:
        _BLOCK_MASKS.move_to_end(key)
        return cached
    mask = _segment_block_mask(cu_q, cu_k, causal, torch.device(device))
    _BLOCK_MASKS[key] = mask
    if len(_BLOCK_MASKS) > _BLOCK_MASK_CACHE_SIZE:
        _BLOCK_MASKS.popitem(last=False)
    return mask


def _padded_ids(cu: torch.Tensor, total: int, sentinel: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Segment ids and in-segment positions on the host, padded to whole blocks with a sentinel segment (the mask
    function may be evaluated on the padded tail of the last block; it must index in bounds and never match)."""
    seg, pos = _segment_ids(cu, total, "cpu")
    blocks = max(1, -(-total // FLEX_BLOCK))
    pad = blocks * FLEX_BLOCK - total
    seg = torch.cat([seg, torch.full((pad,), sentinel, dtype=seg.dtype)])
    pos = torch.cat([pos, torch.zeros(pad, dtype=pos.dtype)])
    return seg, pos, blocks


def _tiles(seg: torch.Tensor, total: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: first and last segment id among its real rows, and whether the block is whole (not the tail)."""
    starts = torch.arange(blocks) * FLEX_BLOCK
    ends = torch.clamp(starts + FLEX_BLOCK, max=max(total, 1)) - 1
    whole = (starts + FLEX_BLOCK) <= total
    return seg[starts.clamp(max=max(total - 1, 0))], seg[ends], whole


def _block_lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> (count [1, 1, nq] int32, indices [1, 1, nq, nk] int32 with the True columns first)."""
    order = torch.argsort((~m).to(torch.int8), dim=1, stable=True)
    return m.sum(1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]


def _segment_block_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, device: torch.device):
    from torch.nn.attention.flex_attention import BlockMask

    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    seg_q, pos_q, nq = _padded_ids(cu_q, tq, sentinel=-1)
    seg_k, pos_k, nk = _padded_ids(cu_k, tk, sentinel=-2)
    q_first, q_last, q_whole = _tiles(seg_q, tq, nq)
    k_first, k_last, k_whole = _tiles(seg_k, tk, nk)
    # Segment ids grow along both streams, so a tile's rows span [first, last]; tiles whose spans meet share a
    # segment (or an empty one: harmless, the mask function then rejects every element).
    meet = (q_first[:, None] <= k_last[None, :]) & (k_first[None, :] <= q_last[:, None])
    one_segment = (q_first == q_last)[:, None] & (k_first == k_last)[None, :] & (q_first[:, None] == k_first[None, :])
    full = one_segment & q_whole[:, None] & k_whole[None, :] & (not causal)
    partial = meet & ~full
    shift = torch.zeros_like(pos_q)
    if causal:
        real = seg_q[:tq]
        shift[:tq] = _causal_shift(cu_q, cu_k, real, pos_q[:tq], "cpu")
    seg_q, pos_q, seg_k, pos_k, shift = (t.to(device) for t in (seg_q, pos_q, seg_k, pos_k, shift))

    def same_segment(b, h, q_idx, kv_idx):
        return seg_q[q_idx] == seg_k[kv_idx]

    def same_segment_causal(b, h, q_idx, kv_idx):
        return (seg_q[q_idx] == seg_k[kv_idx]) & (pos_k[kv_idx] <= shift[q_idx])

    kv_num, kv_idx = _block_lists(partial)
    full_num, full_idx = _block_lists(full)
    return BlockMask.from_kv_blocks(
        kv_num.to(device),
        kv_idx.to(device),
        full_num.to(device),
        full_idx.to(device),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_segment_causal if causal else same_segment,
        seq_lengths=(tq, tk),
    )


@functools.cache
def _compiled_flex():
    # FlexAttention is only fast compiled (eager it computes the dense scores); compile once per process.
    _, flex_attention = _flex_api()
    return torch.compile(flex_attention, dynamic=None)


def _varlen_flex(q, k, v, cu_q, cu_k, causal: bool) -> torch.Tensor:
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(
            "FlexAttention has no backward on CPU; use attention_backend=sdpa (or auto) to train on CPU, "
            "or run flex under torch.no_grad() for inference"
        )
    if not torch.is_grad_enabled():  # torch's CPU check looks at requires_grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    block_mask = flex_block_mask(cu_q, cu_k, causal, q.device)
    _, flex_attention = _flex_api()
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    with warnings.catch_warnings():
        # Uncompiled flex on CPU (inference) is known to be slow; auto never picks it, so the warning is noise.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(qs, ks, vs, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def _varlen_flash(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool) -> torch.Tensor:
    which = varlen_available()
    if which is None:
        raise RuntimeError(
            "attention_backend=varlen needs CUDA and torch.nn.attention.varlen (torch >= 2.9) or flash_attn; "
            "use attention_backend=auto to fall back to flex/sdpa"
        )
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the varlen flash kernel needs fp16/bf16 inputs, got {q.dtype}; train in bf16 or use flex")
    cu_q = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_k.to(device=q.device, dtype=torch.int32)
    if which == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)
    fn = _torch_varlen()
    params = _varlen_params()
    kwargs = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:  # torch >= 2.12
            kwargs["enable_gqa"] = True
        else:  # older varlen_attn: the kernel wants as many kv heads as query heads
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if causal:
        if "window_size" in params:  # torch >= 2.10: (-1, 0) is causal
            kwargs["window_size"] = (-1, 0)
        else:  # torch 2.9: is_causal
            kwargs["is_causal"] = True
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, int(max_q), int(max_k), **kwargs)


@functools.cache
def _varlen_params() -> frozenset[str]:
    fn = _torch_varlen()
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()
