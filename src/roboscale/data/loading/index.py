"""The global sample-id space of a loader: one integer per frame over all its sources (a mixture's too).

The epoch plan (``roboscale.data.loading.plan``) shuffles and deals these ids, 8 bytes per sample whatever the
frames weigh; the workers (``roboscale.data.loading.worker``) turn them back into (source, episode, frame) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from roboscale.data.loading.source import FrameSource


@dataclass
class SampleIndex:
    """Sample ids over one or more sources: ids ``starts[g] .. starts[g+1]-1`` are the frames of global episode
    ``g`` (source ``source_of[g]``, position ``local[g]`` in it)."""

    sources: list[FrameSource]
    names: list[str]
    starts: np.ndarray
    source_of: np.ndarray
    local: np.ndarray
    episode_ids: np.ndarray

    @classmethod
    def build(cls, sources: list[FrameSource], names: list[str]) -> SampleIndex:
        lengths = [np.asarray(s.episode_lengths, dtype=np.int64) for s in sources]
        all_lengths = np.concatenate(lengths)
        return cls(
            sources=sources,
            names=names,
            starts=np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64),
            source_of=np.concatenate([np.full(len(x), i, np.int64) for i, x in enumerate(lengths)]),
            local=np.concatenate([np.arange(len(x), dtype=np.int64) for x in lengths]),
            episode_ids=np.concatenate([np.asarray(s.episode_ids, dtype=np.int64) for s in sources]),
        )

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def locate(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(global episode, frame) of sample ids."""
        ep = np.searchsorted(self.starts, gids, side="right") - 1
        return ep, gids - self.starts[ep]

    def describe(self, gid: int) -> str:
        ep, fr = self.locate(np.array([gid]))
        g = int(ep[0])
        return f"{self.names[self.source_of[g]]}: episode {int(self.episode_ids[g])}, frame {int(fr[0])}"
