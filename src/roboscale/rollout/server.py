"""The inference server: one process (one per GPU) that holds the policy and answers the env workers' requests
in dynamic batches (``rollout.batcher``: ``max_batch_size`` observations waiting, a request from every env worker
group, or ``batch_timeout_ms`` after the first of them), sending each worker the predictions for its own environments.

Three threads, so that nothing waits on the wrong channel: the main one runs the batcher (the policy's one thread
of use), one reads the shared requests channel and submits, one reads this server's control channel. New weights
are loaded under the lock each batch's ``predict`` holds, so a batch is predicted by one version, and the
acknowledgement goes out only once they are in. Messages (``rollout.messages``):

- in (shared requests channel): ``Predict``, ``Producing`` (how many requests may come: a batch goes at once
  when every group with episodes has asked)
- in (its own control channel): ``LoadWeights`` (answered by ``WeightsLoaded``), ``Report`` (answered by
  ``Stats``), ``Stop``
- out (the worker's own channel): ``Actions``
- to the engine: ``Ready``, ``Alive`` at least every ``heartbeat_s`` while it works or waits, ``WeightsLoaded``,
  ``Stats``, ``Failed`` if it cannot serve (a bad checkpoint or weights, a failed prediction).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from roboscale.errors import RoboscaleError, WorkerError, to_record
from roboscale.rollout import messages
from roboscale.rollout.batcher import DynamicBatcher, Reply
from roboscale.rollout.inference import PredictItem, RunnerSettings
from roboscale.rollout.weights import decode_state

POLL_S = 0.1
"""How often a reader thread looks up from its channel to see whether the server is stopping."""

@dataclass
class ServerSettings:
    name: str
    runner: RunnerSettings
    max_batch_size: int
    batch_timeout_ms: float
    heartbeat_s: float = 1.0


def run_server(settings: ServerSettings, requests: Any, control: Any, replies: list[Any], events: Any) -> None:
    try:
        _Server(settings, requests, control, replies, events).run()
    except RoboscaleError as exc:
        events.put(messages.Failed(settings.name, to_record(exc)))
    except Exception as exc:  # reported, never a silent death the engine must time out on
        events.put(messages.Failed(settings.name,
                          to_record(WorkerError(f"inference server failed: {type(exc).__name__}: {exc}"))))


class _Server:
    def __init__(self, settings: ServerSettings, requests: Any, control: Any, replies: list[Any], events: Any):
        self.s = settings
        self.requests, self.control, self.replies, self.events = requests, control, replies, events
        self.runner = settings.runner.build()
        self.weights_lock = threading.Lock()
        self.batcher = DynamicBatcher(self._predict, settings.max_batch_size, settings.batch_timeout_ms)
        self.producing: dict[int, int] = {}
        """Worker -> its groups with episodes (``Producing``); the batcher's producers are their sum."""
        self.cpu_reported = time.process_time()
        self.stopping = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        self.events.put(messages.Ready(self.s.name))
        readers = [threading.Thread(target=self._guarded, args=(read,), daemon=True, name=read.__name__)
                   for read in (self._read_requests, self._read_control)]
        for reader in readers:
            reader.start()
        last_heartbeat = time.monotonic()
        while not self.stopping.is_set():
            self.batcher.run_once(timeout=self.s.heartbeat_s)
            now = time.monotonic()
            if now - last_heartbeat >= self.s.heartbeat_s:
                self.events.put(messages.Alive(self.s.name))
                last_heartbeat = now
        self.batcher.close()
        for reader in readers:
            reader.join(timeout=1.0)
        if self.failure is not None:
            raise self.failure

    def _predict(self, items: list[PredictItem]) -> list:
        with self.weights_lock:
            return self.runner.predict(items)

    def _reply_to(self, worker: int, generation: int, items: list[PredictItem]) -> Reply:
        def reply(predictions: list | None, error: BaseException | None) -> None:
            if error is not None:
                self._fail(error)
                return
            answers = [messages.Answer(item.slot, item.chunk_index, prediction)
                       for item, prediction in zip(items, predictions, strict=True)]
            self.replies[worker].put(messages.Actions(generation, answers))

        return reply

    # --- the reader threads ---------------------------------------------------------------------------------
    def _guarded(self, read: Callable[[], None]) -> None:
        try:
            read()
        except BaseException as exc:  # the main thread raises it: the server reports it and ends
            self._fail(exc)

    def _fail(self, error: BaseException) -> None:
        self.failure = self.failure or error
        self._stop()

    def _stop(self) -> None:
        self.stopping.set()
        self.batcher.close()  # wakes the main thread at once

    def _messages(self, channel: Any) -> Iterator[Any]:
        while not self.stopping.is_set():
            try:
                yield channel.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def _read_requests(self) -> None:
        for message in self._messages(self.requests):
            match message:
                case messages.Predict(worker, generation, items):
                    self.batcher.submit(items, self._reply_to(worker, generation, items))
                case messages.Producing(worker, groups):
                    self.producing[worker] = groups
                    self.batcher.set_producers(sum(self.producing.values()))

    def _read_control(self) -> None:
        for message in self._messages(self.control):
            match message:
                case messages.LoadWeights(data, version):
                    state = decode_state(data)
                    with self.weights_lock:
                        self.runner.load_state(state, version)
                    self.events.put(messages.WeightsLoaded(self.s.name, version))
                case messages.Report():
                    stats = self.batcher.take_stats()
                    cpu_now = time.process_time()  # every thread's: unpickling requests counts too
                    cpu, self.cpu_reported = cpu_now - self.cpu_reported, cpu_now
                    self.events.put(messages.Stats(self.s.name, {
                        "inference_s": stats.seconds, "inference_calls": stats.calls, "observations": stats.items,
                        "server_cpu_s": cpu, "batching": stats}))
                case messages.Stop():
                    self._stop()
