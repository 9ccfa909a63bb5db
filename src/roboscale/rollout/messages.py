"""The messages between the rollout engine, its env workers and its inference servers: one ``NamedTuple`` per kind,
dispatched on by type (``match message: case Job(job, attempt): ...``). They cross processes through
``multiprocessing`` or Ray queues, which pickle them; module-level NamedTuples pickle by reference to their class.
Nothing here comes from a network peer; the one payload that could someday (weights) is safetensors bytes.

Channels and what travels on them:

- a worker's inbox (engine -> worker): ``Job``, ``LoadWeights`` (``--rollout.inference=worker``), ``Report``,
  ``Stop``
- a server's control channel (engine -> that server): ``LoadWeights``, ``Report``, ``Stop``
- requests (workers -> servers, shared: whichever server is free takes it): ``Predict``, ``Producing`` (with one
  server only)
- a worker's replies (servers -> that worker): ``Actions``
- events (everyone -> engine), each naming its sender first: ``Ready``, ``Alive`` (a heartbeat), ``Started``,
  ``Result``, ``EpisodeFailed``, ``WeightsLoaded``, ``Stats``, ``Failed``
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from roboscale.rollout.episode import EpisodeJob
    from roboscale.rollout.inference import Prediction, PredictItem
    from roboscale.rollout.trajectory import Trajectory


# --- to a worker's inbox or a server's control channel ---------------------------------------------------------
class Job(NamedTuple):
    job: EpisodeJob
    attempt: int
    """1 for the first."""


class LoadWeights(NamedTuple):
    data: bytes
    """The state dict as safetensors bytes (``rollout.weights``)."""
    version: int


class Report(NamedTuple):
    """Send ``Stats`` for the work done since the last report."""


class Stop(NamedTuple):
    """Finish and exit."""


# --- workers <-> servers ---------------------------------------------------------------------------------------
class Predict(NamedTuple):
    worker: int
    """Which replies channel the answer goes to."""
    generation: int
    """The pool's generation (an answer for an earlier pool is dropped)."""
    items: list[PredictItem]


class Producing(NamedTuple):
    """How many of a worker's groups have episodes now (each may have one ``Predict`` unanswered): sent before a
    request that counts on it, and when the number falls (a server that knows every group has asked need not wait
    for more)."""

    worker: int
    groups: int


class Answer(NamedTuple):
    slot: int
    chunk_index: int
    prediction: Prediction


class Actions(NamedTuple):
    generation: int
    answers: list[Answer]


# --- events, to the engine -------------------------------------------------------------------------------------
class Ready(NamedTuple):
    name: str


class Alive(NamedTuple):
    name: str


class Started(NamedTuple):
    name: str
    key: tuple[str, int]
    attempt: int


class Result(NamedTuple):
    name: str
    result: dict[str, Any]
    """``EpisodeResult.to_dict()``."""
    trajectory: Trajectory | None


class EpisodeFailed(NamedTuple):
    """The simulator raised: the episode is retried."""

    name: str
    key: tuple[str, int]
    reason: str


class WeightsLoaded(NamedTuple):
    name: str
    version: int


class Stats(NamedTuple):
    name: str
    stats: dict[str, Any]
    """Counts and seconds since the last report, by ``RolloutStats`` field name (a worker's: env_steps, sim_s,
    render_s, inference_s, ..., worker_wait_s; a server's: inference_s, ..., server_cpu_s, and ``batching``, its
    batcher's ``BatcherStats``)."""


class Failed(NamedTuple):
    """The process cannot work at all (a bad checkpoint or env adapter, a server's failed prediction)."""

    name: str
    record: dict[str, Any]
    """``roboscale.errors.to_record`` of the error."""
