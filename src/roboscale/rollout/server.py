"""The inference server: one process (one per GPU) that holds the policy and answers the env workers' requests
in dynamic batches.

It waits for a first request, then keeps collecting until ``max_batch_size`` observations wait or
``batch_timeout_ms`` has passed since that first one, runs the policy once on all of them (in slices of at most
``max_batch_size``), and sends each worker the chunks of its own environments. Messages:

- in (shared requests channel): ``("predict", worker, generation, [PredictItem, ...])`` or ``("stop",)``
- out (the worker's own channel): ``("actions", generation, [(slot, chunk_index, chunk [T, A]), ...])``
- to the engine: ``("ready", name)``, ``("alive", name)`` while idle, ``("stats", name, {...})`` on stop,
  ``("error", name, record)`` if it cannot serve.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

from roboscale.errors import RoboscaleError, WorkerError, to_record


@dataclass
class ServerSettings:
    name: str
    checkpoint: str
    device: str
    threads: int
    max_batch_size: int
    batch_timeout_ms: float
    heartbeat_s: float = 1.0


def run_server(settings: ServerSettings, requests: Any, replies: list[Any], events: Any) -> None:
    try:
        from roboscale.rollout.inference import PolicyRunner

        runner = PolicyRunner(settings.checkpoint, settings.device, settings.threads)
        events.put(("ready", settings.name))
        stats = _serve(settings, runner, requests, replies, events)
        events.put(("stats", settings.name, stats))
    except RoboscaleError as exc:
        events.put(("error", settings.name, to_record(exc)))
    except Exception as exc:  # reported, never a silent death the engine must time out on
        events.put(("error", settings.name,
                    to_record(WorkerError(f"inference server failed: {type(exc).__name__}: {exc}"))))


def _serve(settings: ServerSettings, runner: Any, requests: Any, replies: list[Any], events: Any) -> dict:
    stats = {"inference_s": 0.0, "inference_calls": 0, "observations": 0}
    while True:
        try:
            first = requests.get(timeout=settings.heartbeat_s)
        except queue.Empty:
            events.put(("alive", settings.name))
            continue
        if first[0] == "stop":
            return stats
        messages, stop = _collect(first, requests, settings)
        items = [(message, item) for message in messages for item in message[3]]
        start = time.perf_counter()
        chunks = []
        for begin in range(0, len(items), settings.max_batch_size):
            part = [item for _, item in items[begin:begin + settings.max_batch_size]]
            chunks.extend(runner.predict(part))
            stats["inference_calls"] += 1
        stats["inference_s"] += time.perf_counter() - start
        stats["observations"] += len(items)
        answers: dict[tuple[int, int], list] = {}
        for (message, item), chunk in zip(items, chunks, strict=True):
            answers.setdefault((message[1], message[2]), []).append((item.slot, item.chunk_index, chunk))
        for (worker, generation), answer in answers.items():
            replies[worker].put(("actions", generation, answer))
        events.put(("alive", settings.name))
        if stop:
            return stats


def _collect(first: tuple, requests: Any, settings: ServerSettings) -> tuple[list[tuple], bool]:
    """The dynamic batch that starts with ``first``; True when a stop arrived meanwhile."""
    messages = [first]
    waiting = len(first[3])
    deadline = time.perf_counter() + settings.batch_timeout_ms / 1000.0
    while waiting < settings.max_batch_size:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        try:
            message = requests.get(timeout=remaining)
        except queue.Empty:
            break
        if message[0] == "stop":
            return messages, True
        messages.append(message)
        waiting += len(message[3])
    return messages, False
