"""Policy weights on their way to the processes that predict: one ``WeightChannel`` per engine, and safetensors
bytes on the wire, never a pickle (a pickled state dict runs code when it is loaded; safetensors is tensors and a
JSON header).

The channel is the one way weights reach the generators. Whoever owns the weights (RL's job: the trainer's hook,
or under ``--rl.schedule=exact`` the rollout driver, which decides which version goes in when) ``publish``es the
latest state with its version and goes on at once; the engine the channel was given to
(``RolloutEngine(cfg, setup, weights=channel)``) takes the latest when a run starts and between the events of a
stream, sends it to every process that predicts (dealing no job until each has loaded it), and loads it into
every pool it starts, a pool restarted after a crash included, before that pool gets a job. Once every process
that predicts has loaded a version the engine acknowledges it here, and ``wait_acknowledged`` returns.
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """The state's tensors (detached, contiguous, on the CPU) as one safetensors blob."""
    from safetensors.torch import save

    return save({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()})


def decode_state(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(data)


class Published:
    """One published state and its version. Its safetensors bytes are encoded once, by the first that needs them
    (the engine, on its own thread: the publisher does not wait for the encoding), and the state is let go then:
    every pool the engine starts sends the same bytes."""

    def __init__(self, state: Mapping[str, torch.Tensor], version: int):
        self.version = version
        self._state: Mapping[str, torch.Tensor] | None = state
        self._data: bytes | None = None
        self._lock = threading.Lock()

    def data(self) -> bytes:
        with self._lock:
            if self._data is None:
                self._data, self._state = encode_state(self._state), None
            return self._data

    def __repr__(self) -> str:
        return f"Published(version={self.version})"


class WeightChannel:
    """The latest published weights and their version, between their owner and one engine (see the module
    docstring). ``publish`` never blocks on the engine; the engine calls ``latest``, ``acknowledge`` and ``refuse``.
    Versions do not go down (RL's count the trainer's steps)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._latest: Published | None = None
        self._acknowledged: Published | None = None
        """The last version every process that predicts loaded: what stays published if a later one is refused."""
        self._refused: dict[int, BaseException] = {}

    # --- the owner's side -----------------------------------------------------------------------------------
    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """``state`` (a copy the caller no longer changes) with ``version``, for the engine to take at its next
        chance; returns at once."""
        version = operator.index(version)
        with self._changed:
            if self._latest is not None and version < self._latest.version:
                raise ValueError(f"weights version {version} published after version {self._latest.version} "
                                 "(versions do not go down)")
            self._latest = Published(state, version)
            self._refused.pop(version, None)
            self._changed.notify_all()

    @property
    def version(self) -> int | None:
        """The latest published version (None: none yet; the engine predicts with the checkpoint's, version 0)."""
        with self._changed:
            return None if self._latest is None else self._latest.version

    def wait_acknowledged(self, version: int, timeout: float | None = None) -> bool:
        """Wait until every process that predicts has loaded ``version`` or a later one (True), or ``timeout``
        seconds (False). Weights the policy refused raise its error (a ``CheckpointError`` naming the tensor).
        The engine delivers while it works (a run's start, a stream's events, a pool's start): from the thread
        that calls the engine, and while it is idle, this waits for its next call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                if version in self._refused:
                    raise self._refused[version]
                if self._acknowledged is not None and self._acknowledged.version >= version:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)

    # --- the engine's side ----------------------------------------------------------------------------------
    def latest(self) -> Published | None:
        with self._changed:
            return self._latest

    def acknowledge(self, published: Published) -> None:
        """Every process that predicts has loaded ``published``."""
        with self._changed:
            if self._acknowledged is None or published.version >= self._acknowledged.version:
                self._acknowledged = published
            self._changed.notify_all()

    def refuse(self, published: Published, error: BaseException) -> None:
        """The policy refused ``published`` (``error`` says why): the last acknowledged weights are the latest
        again (None: the checkpoint's), unless newer ones were published meanwhile."""
        with self._changed:
            if self._latest is published:
                self._latest = self._acknowledged
            self._refused[published.version] = error
            self._changed.notify_all()
