"""Env workers against a policy server elsewhere (`roboscale eval --rollout.server=ws://HOST:PORT`).

An env worker predicts through ``RemotePolicy`` as it would through its own ``PolicyRunner``: each of its
environments is one client of the server (one websocket each, as each robot is), so the server batches the
observations of every environment of every worker together. A request carries the episode's noise seed and the
chunk's index, so the server draws the same noise as local inference would (``rollout.noise``) and every episode
ends as it does locally. The server speaks openpi's protocol (``roboscale serve``), so this is also how a
simulator whose dependencies clash with the policy's is evaluated from a venv of its own.

``RemotePolicy`` is a ``Predictor`` (``rollout.predictor``), so a worker holds either it or a ``PolicyRunner``
and asks the same way. The connection and the codec are the transport's (``transport.websocket``,
``transport.wire``), which knows nothing of the rollout; what is here is the rollout's side of it: a
``PredictItem`` as a message in the server's keys, and an answer as a ``Prediction``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from roboscale.errors import WorkerError
from roboscale.rollout.inference import Prediction, PredictItem
from roboscale.transport.websocket import connect
from roboscale.transport.wire import pack, unpack


@dataclass(frozen=True)
class RemoteSettings:
    """What a worker connects to its server with."""

    url: str
    api_key: str = ""
    timeout_s: float = 120.0
    """A request unanswered for this long fails the worker (the engine restarts it)."""

    def build(self) -> RemotePolicy:
        return RemotePolicy(self.url, self.api_key, self.timeout_s)


def observation_message(item: PredictItem, keys: dict[str, Any]) -> dict[str, Any]:
    """A worker's observation in the server's keys (its metadata's ``keys``), with the episode's noise seed."""
    if len(keys["state"]) != 1:
        raise WorkerError(f"the policy server reads the state from several keys {keys['state']}; evaluate against "
                          "one started with --keys=checkpoint")
    message: dict[str, Any] = {keys["images"][name]: image for name, image in item.images.items()
                               if name in keys["images"]}
    message[keys["state"][0]] = np.asarray(item.state, dtype=np.float32)
    message[keys["prompt"][0]] = item.instruction
    message["seed"], message["chunk_index"] = int(item.noise_seed), int(item.chunk_index)
    return message


class RemotePolicy:
    """A ``Predictor`` over websockets: one connection per environment slot, all asked at once."""

    def __init__(self, url: str, api_key: str = "", timeout_s: float = 120.0):
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.connections: dict[int, Any] = {}
        self.version = 0
        self.metadata: dict[str, Any] = {}

    def _connection(self, slot: int) -> Any:
        if slot not in self.connections:
            self.connections[slot], self.metadata = connect(self.url, self.api_key)
        return self.connections[slot]

    def predict(self, items: list[PredictItem]) -> list[Prediction]:
        """Every item's chunk; all requests are sent before any answer is read, so the server batches them."""
        from websockets.exceptions import WebSocketException

        try:
            connections = [self._connection(item.slot) for item in items]
            for item, ws in zip(items, connections, strict=True):
                ws.send(pack(observation_message(item, self.metadata["keys"])))
            replies = [ws.recv(timeout=self.timeout_s) for ws in connections]
        except (OSError, TimeoutError, WebSocketException) as exc:
            self.close()
            raise WorkerError(f"the policy server at {self.url} failed ({type(exc).__name__}: {exc})") from None
        predictions = []
        for reply in replies:
            if isinstance(reply, str):
                raise WorkerError(f"the policy server at {self.url} refused an observation: {reply}")
            answer = unpack(reply)
            predictions.append(Prediction(np.asarray(answer["actions"]), None, int(answer.get("policy_version", 0))))
        return predictions

    def load_state(self, state: Mapping[str, Any], version: int) -> None:
        raise WorkerError("weights cannot be published to a remote policy server (--rollout.server)")

    def close(self) -> None:
        """Close every connection (a later ``predict`` opens them again)."""
        for ws in self.connections.values():
            ws.close()
        self.connections.clear()
