"""The epoch plan: which sample ids each rank reads in an epoch, in which blocks, and the order in which the
loader's workers hand back their batches.

How an epoch is ordered (why: random access into video is what makes LeRobot's loader 20-40x slow; see
docs/architecture.md). Every rank computes the same plan from ``(seed, epoch)``:

1. Each episode is cut into *chunks* of ``chunk_frames`` consecutive frames, at a random phase per episode and
   epoch. Chunks are shuffled over the whole dataset (all mixture sources together; a source contributes
   ``weight / sum(weights)`` of the epoch's samples, repeating or truncating its own shuffled chunks).
2. The shuffled stream is cut into *blocks* of ``block_samples`` samples (rounded to whole batches); block ``j``
   goes to rank ``j % world_size``, so ranks never share a sample. Each rank keeps the same number of batches
   (the last partial batches are dropped), so data-parallel ranks never wait on each other.
3. Inside a block the samples are shuffled, and batches are cut from it. A block is decoded by one worker in one
   pass: each chunk is a run of consecutive frames, so decoders move forward through the file (one seek per
   chunk and camera, then ~0.5 ms per 224² AV1 frame instead of ~2 ms for a seek each). Batches hold samples
   from about ``block_samples / chunk_frames`` places in the dataset.

Blocks are dealt to workers round-robin, and torch's DataLoader hands task ``p`` to worker ``p % num_workers``,
so a worker receives the batches of its own blocks and keeps the current block decoded: worker memory is one
or two blocks of frames (``block_samples x cameras x H x W x 3`` bytes) plus bounded caches, whatever the dataset
size. The order depends on ``num_workers``; the *set* of samples does not, and ``load_state_dict`` continues with
exactly the samples not yet returned, even if ``num_workers`` changed. Without ``shuffle`` every block is one
batch, so batches come in dataset order. The main process holds the epoch plan (8 bytes per sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EpochPlan:
    """What every rank agrees on; ``epoch(e)`` gives this rank's blocks of sample ids."""

    lengths: np.ndarray  # frames per global episode (0 for excluded episodes)
    starts: np.ndarray  # first sample id of each global episode (of every episode: ids never shift when one is
    # excluded, since workers locate samples in the full id space)
    source_of: np.ndarray
    quotas: np.ndarray  # samples per source per epoch
    batch_size: int
    block_batches: int
    chunk_frames: int
    shuffle: bool
    seed: int
    rank: int
    world_size: int
    batches_per_epoch: int = 0

    def __post_init__(self) -> None:
        total = int(self.quotas.sum())
        block = self.block_batches * self.batch_size
        n_blocks = -(-total // block)
        per_rank = [sum(min(block, total - j * block) for j in range(r, n_blocks, self.world_size))
                    for r in range(self.world_size)]
        self.batches_per_epoch = min(per_rank) // self.batch_size if per_rank else 0

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

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """This rank's blocks (sample id arrays) for ``epoch``, truncated to ``batches_per_epoch`` batches."""
        rng = np.random.default_rng([self.seed, epoch])
        parts = [self._stream(rng, s, int(q)) for s, q in enumerate(self.quotas) if q > 0]
        gid = np.concatenate([p[0] for p in parts])
        if self.shuffle and len(parts) > 1:  # interleave the sources' chunks
            offsets = np.cumsum([0] + [int(p[1].max(initial=0)) + 1 for p in parts])
            key = np.concatenate([p[1] + off for p, off in zip(parts, offsets, strict=False)])
            uniq, inverse = np.unique(key, return_inverse=True)
            rank_of = rng.permutation(len(uniq))
            gid = gid[np.argsort(rank_of[inverse], kind="stable")]
        block = self.block_batches * self.batch_size
        mine = [gid[j: j + block] for j in range(self.rank * block, len(gid), self.world_size * block)]
        if self.shuffle:
            brng = np.random.default_rng([self.seed, epoch, 1 + self.rank])
            mine = [brng.permutation(b) for b in mine]
        out, left = [], self.batches_per_epoch * self.batch_size
        for b in mine:
            if left <= 0:
                break
            out.append(b[:left])
            left -= len(out[-1])
        return out


def batch_order(batches_per_block: list[int], num_workers: int) -> list[tuple[int, int]]:
    """Yield order of (block, batch in block): blocks dealt to workers round-robin, workers served round-robin
    (torch gives task p to worker p % num_workers), leftovers appended in the same rhythm."""
    workers = max(1, num_workers)
    queues = [[(blk, b) for blk in range(i, len(batches_per_block), workers) for b in range(batches_per_block[blk])]
              for i in range(workers)]
    out: list[tuple[int, int]] = []
    depth = max((len(tasks) for tasks in queues), default=0)
    for k in range(depth):
        out.extend(tasks[k] for tasks in queues if k < len(tasks))
    return out
