"""Per-environment action queues: the policy predicts a chunk, the environment executes its first
``n_action_steps`` actions before asking again. Each environment has its own queue, so environments that reset at
different times can share one batched policy call."""

from __future__ import annotations

from collections import deque

import numpy as np


class ActionQueue:
    def __init__(self, n_action_steps: int):
        self.n_action_steps = n_action_steps
        self._actions: deque[np.ndarray] = deque()

    def __len__(self) -> int:
        return len(self._actions)

    def reset(self) -> None:
        """At the start of every episode: what the previous episode queued is not this one's."""
        self._actions.clear()

    def fill(self, chunk: np.ndarray) -> None:
        """Queue the first ``n_action_steps`` actions of a predicted chunk [T, A]."""
        self._actions.extend(np.asarray(chunk)[: self.n_action_steps])

    def pop(self) -> np.ndarray:
        return self._actions.popleft()
