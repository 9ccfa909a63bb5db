"""Dynamic batching: requests of any size from any thread, answered by a model that runs on batches.

``DynamicBatcher(predict, max_batch_size, batch_timeout_ms, producers)`` collects requests (a list of items and a
callback for that request's outputs) and calls ``predict(items) -> outputs`` (one output per item, in order) on at
most ``max_batch_size`` items at a time: as soon as that many items wait; or as soon as each of the
``producers`` callers has a request waiting (each has at most one unanswered, as the env workers' groups do, so
nothing more can come before these are answered: waiting longer would only idle the model); or
``batch_timeout_ms`` after the first of the waiting ones arrived. A request larger than a batch is sliced over
several calls; a batch may hold parts of several requests. Each request's callback gets exactly its own outputs,
in its items' order, once all of them are computed: ``reply(outputs, None)``; or ``reply(None, error)`` if
``predict`` raised on a batch holding any of its items (the serving thread goes on with the next batch).

Why push (``submit`` from any thread) and one serving loop (``run_once`` called by the thread that owns the
model), rather than a pull interface (``next_request(timeout)``) the caller batches from: with push, the deadline,
the slicing and the fan-out of outputs live here once, and any number of producers can feed one model without
knowing of each other: the inference server process (a thread that reads the workers' request channel and
submits), and a websocket policy server (each connection's asyncio handler submits with a callback that resolves
its future through ``loop.call_soon_threadsafe``). The model stays on one thread, which is what CUDA and torch's
thread pool want, and a caller can swap weights between calls under its own lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from roboscale.errors import WorkerError

Reply = Callable[[list[Any] | None, BaseException | None], None]
"""``reply(outputs, None)`` with the request's outputs, or ``reply(None, error)``: called once per request, on the
serving thread (keep it short: put the answer on a queue, or hand it to an event loop)."""


@dataclass
class BatcherStats:
    calls: int = 0
    """``predict`` calls."""
    items: int = 0
    seconds: float = 0.0
    """Wall time inside ``predict``."""
    idle_s: float = 0.0
    """Wall time the serving thread waited for a first request (nothing to do)."""
    fill_s: float = 0.0
    """Wall time it waited, with requests at hand, for more to fill the batch."""
    sizes: Counter[int] = field(default_factory=Counter)
    """Batch size -> calls of that size."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Why each batch went: ``full``, ``all_waiting`` (every producer had a request waiting), ``timeout``."""

    @property
    def mean_batch_size(self) -> float:
        return self.items / self.calls if self.calls else 0.0

    def add(self, other: BatcherStats) -> None:
        """Count ``other``'s batches too (another server's, or a later report's)."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, Counter):
                mine.update(getattr(other, f.name))
            else:
                setattr(self, f.name, mine + getattr(other, f.name))


@dataclass(eq=False)  # identity: a request is itself, whatever its contents
class _Request:
    items: list[Any]
    reply: Reply
    arrived: float
    taken: int = 0
    """Items already handed to ``predict`` (a request larger than a batch goes in slices)."""
    outputs: list[Any] = field(default_factory=list)
    failed: bool = False


class DynamicBatcher:
    def __init__(self, predict: Callable[[list[Any]], Sequence[Any]], max_batch_size: int,
                 batch_timeout_ms: float, producers: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``producers``: how many callers there are that each have at most one request unanswered at a time (the
        env workers' groups that have episodes; ``set_producers`` as it changes). When that many requests wait,
        nothing more can come before they are answered, so the batch goes at once instead of waiting out the
        timeout. None: not known (a batch goes when full or at the timeout). ``clock``: seconds, for arrivals and
        deadlines (tests pass their own)."""
        if max_batch_size <= 0 or batch_timeout_ms < 0:
            raise ValueError(f"max_batch_size must be > 0 and batch_timeout_ms >= 0, got {max_batch_size}, "
                             f"{batch_timeout_ms}")
        self._predict = predict
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_ms / 1000.0
        self._clock = clock
        self._changed = threading.Condition()
        self._producers: int | None = None
        self._waiting: deque[_Request] = deque()
        self._items_waiting = 0
        self._closed = False
        self._stats = BatcherStats()
        self.set_producers(producers)

    # --- producers (any thread) -----------------------------------------------------------------------------
    def set_producers(self, producers: int | None) -> None:
        """How many callers may have a request unanswered now (None: not known); fewer than before may let the
        waiting requests go at once."""
        if producers is not None and producers < 0:
            raise ValueError(f"producers must be >= 0 or None, got {producers}")
        with self._changed:
            self._producers = producers
            self._changed.notify_all()

    def submit(self, items: Sequence[Any], reply: Reply) -> None:
        """Queue a request; ``reply`` gets its outputs (or the error) later, on the serving thread."""
        request = _Request(list(items), reply, self._clock())
        if not request.items:
            reply([], None)
            return
        with self._changed:
            if self._closed:
                closed = True
            else:
                closed = False
                self._waiting.append(request)
                self._items_waiting += len(request.items)
                self._changed.notify_all()
        if closed:
            reply(None, WorkerError("the batcher is closed"))

    # --- the serving thread ---------------------------------------------------------------------------------
    def run_once(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for a request, then for a full batch (or a request
        from every producer) until ``batch_timeout_ms`` after the oldest waiting request arrived; run ``predict``
        once and answer the requests it completed. False: nothing arrived (or the batcher is closed)."""
        with self._changed:
            start = self._clock()
            arrived = self._changed.wait_for(lambda: self._waiting or self._closed, timeout)
            filling = self._clock()
            self._stats.idle_s += filling - start
            if not arrived or self._closed:
                return False
            deadline = self._waiting[0].arrived + self.batch_timeout_s
            while (reason := self._why_now(deadline)) is None:
                self._changed.wait(deadline - self._clock())
            if self._closed:
                return False
            self._stats.fill_s += self._clock() - filling
            self._stats.reasons[reason] += 1
            parts = self._take_batch()
        self._answer(parts)
        return True

    def close(self) -> None:
        """Answer every waiting request with an error and refuse new ones (a request is never left unanswered)."""
        with self._changed:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            self._items_waiting = 0
            self._changed.notify_all()
        error = WorkerError("the batcher is closed")
        _call_all([(request.reply, None, error) for request in left if not request.failed])

    def stats(self) -> BatcherStats:
        """The counts so far (a copy)."""
        with self._changed:
            return replace(self._stats, sizes=Counter(self._stats.sizes), reasons=Counter(self._stats.reasons))

    def take_stats(self) -> BatcherStats:
        """The counts since the last ``take_stats``."""
        with self._changed:
            stats, self._stats = self._stats, BatcherStats()
            return stats

    # --- inside ---------------------------------------------------------------------------------------------
    def _why_now(self, deadline: float) -> str | None:
        """Why the waiting requests should go now (None: wait for more); the lock held."""
        if self._closed:
            return "closed"
        if self._items_waiting >= self.max_batch_size:
            return "full"
        if self._producers is not None and len(self._waiting) >= self._producers:
            return "all_waiting"
        if self._clock() >= deadline:
            return "timeout"
        return None

    def _take_batch(self) -> list[tuple[_Request, int, int]]:
        """(request, begin, end) slices of at most max_batch_size items from the oldest requests on (lock held)."""
        parts: list[tuple[_Request, int, int]] = []
        room = self.max_batch_size
        while room and self._waiting:
            request = self._waiting[0]
            begin = request.taken
            end = min(len(request.items), begin + room)
            parts.append((request, begin, end))
            request.taken = end
            room -= end - begin
            self._items_waiting -= end - begin
            if end == len(request.items):
                self._waiting.popleft()
        return parts

    def _answer(self, parts: list[tuple[_Request, int, int]]) -> None:
        items = [item for request, begin, end in parts for item in request.items[begin:end]]
        start = time.perf_counter()
        try:
            outputs = list(self._predict(items))
            if len(outputs) != len(items):
                raise WorkerError(f"predict returned {len(outputs)} outputs for {len(items)} items")
        except Exception as exc:  # the callers hear of it; the serving thread lives on
            self._fail([request for request, _, _ in parts], exc)
            return
        finally:
            with self._changed:
                self._stats.calls += 1
                self._stats.items += len(items)
                self._stats.seconds += time.perf_counter() - start
                self._stats.sizes[len(items)] += 1
        done = []
        position = 0
        for request, begin, end in parts:
            request.outputs.extend(outputs[position:position + end - begin])
            position += end - begin
            if end == len(request.items) and not request.failed:
                done.append((request.reply, request.outputs, None))
        _call_all(done)

    def _fail(self, requests: list[_Request], error: BaseException) -> None:
        """Every request with items in the failed batch gets the error, once; what is left of them is dropped."""
        failing = [request for request in dict.fromkeys(requests) if not request.failed]
        with self._changed:
            for request in failing:
                request.failed = True
                if request in self._waiting:
                    self._waiting.remove(request)
                    self._items_waiting -= len(request.items) - request.taken
        _call_all([(request.reply, None, error) for request in failing])


def _call_all(calls: list[tuple[Reply, list[Any] | None, BaseException | None]]) -> None:
    """Call every reply even if one raises (the others' callers must not wait for ever), then raise the first."""
    first: BaseException | None = None
    for reply, outputs, error in calls:
        try:
            reply(outputs, error)
        except BaseException as exc:
            first = first or exc
    if first is not None:
        raise first
