"""The epoch plan: the sequence of *global* batches of an epoch, each rank's slice of them, how they are grouped
in blocks for decode locality, and each sample's random seed.

Elastic determinism: which samples a global batch holds, and in which positions, depends only on ``(seed, epoch,
batch_size, the data, block_samples, chunk_frames, shuffle)``, never on the world size, the rank or the number of
workers. Rank ``r`` of ``W`` returns positions ``[r*B/W, (r+1)*B/W)`` of each global batch (``B = batch_size``), so
the ranks' slices of a step put together are the 1-rank run's batch, position for position, and a run resumes at
another world size or worker count where it stood (the loader's state is a global batch count).

How an epoch is ordered (why: random access into video is what makes LeRobot's loader 20-40x slow; see
docs/architecture.md). Every rank computes the same plan from ``(seed, epoch)``:

1. Each episode is cut into *chunks* of ``chunk_frames`` consecutive frames, at a random phase per episode and
   epoch. Chunks are shuffled over the whole dataset (all mixture sources together; a source contributes
   ``weight / sum(weights)`` of the epoch's samples, repeating or truncating its own shuffled chunks). The
   shuffled stream, cut to whole global batches, is the epoch (the last partial batch is dropped).
2. The stream is cut into *blocks* of ``R = block_samples // B`` global batches (``R x B`` samples; the last block
   may be shorter). Inside a block the samples are *dealt* to the R batches with stride R: stream position ``i`` of
   the block goes to batch ``i mod R``, position ``i div R`` (the R batches then come in a random order). A chunk
   is at most ``chunk_frames`` consecutive stream positions, so when ``R >= chunk_frames`` every sample of a batch
   comes from a different chunk: a batch holds ``min(B, K)`` distinct chunks of the block's ``K = R*B/chunk_frames``
   (the most a pool of K chunks allows; the previous in-block random shuffle gave ~``K(1 - (1 - 1/K)^B)``, e.g. 14
   of 32 at K = 16). Chunks are shuffled over the whole dataset, so with ``block_samples >= B * chunk_frames``
   batches hold about as many distinct episodes as independent uniform sampling would (tested). What still
   correlates batches: the R batches of a block share its K chunks (neighbouring frames of the same trajectories in
   different steps of the block); mixing more blocks per batch would need their frames decoded at once, i.e. the
   same memory as a larger block.
3. Rank r's slice of every batch of a block is the *contiguous* stream range ``[R*r*B/W, R*(r+1)*B/W)`` of the
   block, so each rank decodes one run of whole chunks per block in one pass (each chunk a run of consecutive
   frames: decoders move forward through the file, one seek per chunk and camera, then ~0.5 ms per 224² AV1 frame
   instead of ~2 ms for a seek each). The cost of elasticity is the chunks cut at the W-1 rank boundaries (at most
   W-1 extra seeks per block, out of ~K) and a share of ``block_samples / W`` per block: ``benchmarks/loader.py
   --elastic`` measured 1.06x the workers' CPU per sample on rank 0 of 4 vs 1 (1.09x with the main process's
   per-batch cost; docs/benchmarks.md). Dealing each rank its positions of a randomly shuffled block instead would
   make every rank seek into every chunk. The one world-size-dependent detail: with ``skip_bad_episodes``, a
   sample of an episode found unreadable while decoding is replaced by another readable sample of the same rank's
   share (its position keeps its seed).

Blocks are the workers' tasks: block j goes to worker ``j mod num_workers`` (torch's DataLoader hands task ``p`` to
worker ``p % num_workers`` and returns results in order), which decodes this rank's share of it in one pass and
gathers all its batches; workers prefetch whole blocks ahead and the loader yields batches in the plan's order,
whatever ``num_workers``. A rank's share of a block is ``block_samples / W`` samples, so a worker holds one share of
decoded frames plus the share's gathered batches. Without ``shuffle`` every block is one batch and batches come in
dataset order. The main process holds the epoch's stream (8 bytes per sample).

Per-sample seeds (``sample_seeds``): a bijection of the sample's index ``batch * B + position`` in the epoch, keyed
by ``(seed, epoch)``, so seeds are distinct within an epoch, in ``[0, 2**63)``, and the same on every world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK63 = np.uint64((1 << 63) - 1)


def _mix63(x: np.ndarray) -> np.ndarray:
    """A bijection of [0, 2**63) (splitmix64's finalizer, in 63-bit arithmetic: xor-shifts and odd multipliers)."""
    x = np.asarray(x, dtype=np.uint64) & _MASK63
    with np.errstate(over="ignore"):
        x = ((x ^ (x >> np.uint64(31))) * np.uint64(0x7FB5D329728EA185)) & _MASK63
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x01C4CE3A5D5E8B0F)) & _MASK63
    return x ^ (x >> np.uint64(33))


def sample_seeds(seed: int, epoch: int, batch_size: int, batch: np.ndarray | int, positions: np.ndarray | int
                 ) -> np.ndarray:
    """int64 seeds in [0, 2**63) of ``positions`` of global batches ``batch`` of ``epoch`` (broadcast together):
    distinct within an epoch (a bijection of ``batch * batch_size + position``), independent of world size, rank
    and workers."""
    key = _mix63(np.uint64(int(seed) % (1 << 63)))
    with np.errstate(over="ignore"):
        key = _mix63(key + _mix63(np.uint64(int(epoch) % (1 << 63)) ^ np.uint64(0x5851F42D4C957F2D)))
        index = np.asarray(batch, dtype=np.uint64) * np.uint64(batch_size) + np.asarray(positions, dtype=np.uint64)
        return _mix63((index + key) & _MASK63).astype(np.int64)


@dataclass
class EpochOrder:
    """One epoch's global batches: ``ids`` is the stream (``batches x batch_size`` sample ids), cut into blocks of
    ``block_batches`` batches (``block_start[j]``: the first global batch of block j), each dealt with stride
    (module docstring); ``slot[b]``: the stride offset global batch b takes in its block."""

    epoch: int
    ids: np.ndarray
    batch_size: int
    block_start: np.ndarray  # [n_blocks + 1]
    slot: np.ndarray  # [batches]

    @property
    def batches(self) -> int:
        return len(self.slot)

    def block_of(self, batch: int) -> int:
        return int(np.searchsorted(self.block_start, batch, side="right") - 1)

    def _block(self, block: int) -> tuple[int, int]:
        """(first global batch, batches) of ``block``."""
        first = int(self.block_start[block])
        return first, int(self.block_start[block + 1]) - first

    def share(self, block: int, rank: int, world_size: int) -> np.ndarray:
        """Rank ``rank``'s samples of ``block``: one contiguous run of the stream (whole chunks but at the ends)."""
        first, n = self._block(block)
        per_rank = self.batch_size // world_size
        start = first * self.batch_size + n * rank * per_rank
        return self.ids[start:start + n * per_rank]

    def rows(self, batch: int, world_size: int) -> np.ndarray:
        """Indices into the block's ``share`` (any rank) of global batch ``batch``'s slice, in position order."""
        _, n = self._block(self.block_of(batch))
        return int(self.slot[batch]) + n * np.arange(self.batch_size // world_size)

    def batch(self, batch: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Sample ids of rank ``rank``'s slice of global batch ``batch`` (the whole batch for ``world_size=1``)."""
        return self.share(self.block_of(batch), rank, world_size)[self.rows(batch, world_size)]


@dataclass
class EpochPlan:
    """What every rank agrees on; ``epoch(e)`` gives the global batches of epoch ``e``."""

    lengths: np.ndarray  # frames per global episode (0 for excluded episodes)
    starts: np.ndarray  # first sample id of each global episode (of every episode: ids never shift when one is
    # excluded, since workers locate samples in the full id space)
    source_of: np.ndarray
    quotas: np.ndarray  # samples per source per epoch
    batch_size: int  # global
    block_batches: int
    chunk_frames: int
    shuffle: bool
    seed: int
    batches_per_epoch: int = 0

    def __post_init__(self) -> None:
        self.batches_per_epoch = int(self.quotas.sum()) // self.batch_size

    def _stream(self, rng: np.random.Generator, source: int, quota: int) -> tuple[np.ndarray, np.ndarray]:
        """``quota`` sample ids of one source and their chunk keys, chunk-shuffled (repeating passes if needed)."""
        eps = np.flatnonzero((self.source_of == source) & (self.lengths > 0))
        starts = self.starts
        ids, keys, have, base = [], [], 0, 0
        while have < quota:
            lengths = self.lengths[eps]
            order = rng.permutation(len(eps)) if self.shuffle else np.arange(len(eps))
            e, n = eps[order], lengths[order]
            frame = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            gid = np.repeat(starts[e], n) + frame
            if self.shuffle:
                phase = np.repeat(rng.integers(0, self.chunk_frames, len(e)), n)
                local_chunk = (frame + phase) // self.chunk_frames
                per_ep = (n - 1 + phase[np.cumsum(n) - 1]) // self.chunk_frames + 1
                chunk = np.repeat(np.cumsum(per_ep) - per_ep, n) + local_chunk
                chunk_order = rng.permutation(int(per_ep.sum()))
                key = chunk_order[chunk]
                sort = np.argsort(key, kind="stable")
                gid, key = gid[sort], key[sort]
            else:
                key = np.zeros(len(gid), np.int64)
            take = min(quota - have, len(gid))
            ids.append(gid[:take])
            keys.append(key[:take] + base)  # chunk keys stay distinct across passes
            have, base = have + take, base + int(key.max(initial=0)) + 1
        return np.concatenate(ids), np.concatenate(keys)

    def stream(self, epoch: int, rng: np.random.Generator | None = None) -> np.ndarray:
        """The epoch's chunk-shuffled sample ids (all of them, before the cut to whole batches)."""
        rng = np.random.default_rng([self.seed, epoch]) if rng is None else rng
        parts = [self._stream(rng, s, int(q)) for s, q in enumerate(self.quotas) if q > 0]
        gid = np.concatenate([p[0] for p in parts])
        if self.shuffle and len(parts) > 1:  # interleave the sources' chunks
            offsets = np.cumsum([0] + [int(p[1].max(initial=0)) + 1 for p in parts])
            key = np.concatenate([p[1] + off for p, off in zip(parts, offsets, strict=False)])
            uniq, inverse = np.unique(key, return_inverse=True)
            rank_of = rng.permutation(len(uniq))
            gid = gid[np.argsort(rank_of[inverse], kind="stable")]
        return gid

    def epoch(self, epoch: int) -> EpochOrder:
        rng = np.random.default_rng([self.seed, epoch])
        n = self.batches_per_epoch
        ids = self.stream(epoch, rng)[:n * self.batch_size]
        block_start = np.append(np.arange(0, n, self.block_batches), n).astype(np.int64)
        slot = np.zeros(n, np.int64)
        if self.shuffle:  # the order of a block's batches: a random permutation of its stride offsets
            block = np.arange(n) // self.block_batches
            order = np.lexsort((np.random.default_rng([self.seed, epoch, 1]).random(n), block))
            slot[order] = np.arange(n) - block_start[block]
        return EpochOrder(epoch, ids, self.batch_size, block_start, slot)
