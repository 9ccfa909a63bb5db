"""Env workers against a policy server elsewhere (`roboscale eval --rollout.server=ws://HOST:PORT`).

An env worker predicts through ``RemotePolicy`` as it would through its own ``PolicyRunner``: each of its
environments is one client of the server (one websocket each, as each robot is), so the server batches the
observations of every environment of every worker together. A request carries the episode's noise seed and the
chunk's index, so the server draws the same noise as local inference would (``rollout.noise``) and every episode
ends as it does locally. The server speaks openpi's protocol (``roboscale serve``), so this is also how a
simulator whose dependencies clash with the policy's is evaluated from a venv of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from roboscale.errors import ConfigError, WorkerError
from roboscale.rollout.inference import Prediction, PredictItem
from roboscale.rollout.wire import WireError, pack, unpack

CONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RemoteSettings:
    """What a worker connects to its server with."""

    url: str
    api_key: str = ""
    timeout_s: float = 120.0
    """A request unanswered for this long fails the worker (the engine restarts it)."""

    def build(self) -> RemotePolicy:
        return RemotePolicy(self.url, self.api_key, self.timeout_s)


def read_key(path: str, option: str) -> str:
    """The API key in the first line of ``path`` ('' for no path)."""
    if not path:
        return ""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{option}: cannot read {path} ({exc})") from None
    if not lines or not lines[0].strip():
        raise ConfigError(f"{option}: {path} is empty (its first line is the key)")
    return lines[0].strip()


def require_websockets(what: str) -> None:
    """ConfigError naming the extra to install when the websockets package is missing."""
    try:
        import websockets  # noqa: F401
    except ImportError:
        raise ConfigError(f"{what} needs the websockets package: pip install 'roboscale[serve]'") from None


def connect(url: str, api_key: str = "", timeout_s: float = CONNECT_TIMEOUT_S) -> tuple[Any, dict[str, Any]]:
    """A websocket to the policy server at ``url`` and the metadata it sends first; WorkerError saying why not."""
    require_websockets("--rollout.server")
    from websockets.exceptions import InvalidStatus, WebSocketException
    from websockets.sync.client import connect as ws_connect

    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
    try:
        ws = ws_connect(url, compression=None, max_size=None, additional_headers=headers, open_timeout=timeout_s,
                        legacy=True)  # a connection held open across calls, closed by ``close``
        metadata = unpack(ws.recv(timeout=timeout_s))
    except InvalidStatus as exc:
        code = exc.response.status_code
        hint = " (wrong or missing API key: --rollout.server_api_key_file)" if code == 401 else ""
        raise WorkerError(f"the policy server at {url} refused the connection: HTTP {code}{hint}") from None
    except (OSError, TimeoutError, WebSocketException, WireError) as exc:
        raise WorkerError(f"cannot reach the policy server at {url} ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, dict) or "keys" not in metadata:
        ws.close()
        raise WorkerError(f"{url} is not a roboscale policy server (its metadata has no 'keys')")
    return ws, metadata


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
    """``PolicyRunner``'s ``predict`` over websockets: one connection per environment slot, all asked at once."""

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

    def load_state(self, state: Any, version: int) -> None:
        raise WorkerError("weights cannot be published to a remote policy server (--rollout.server)")

    def close(self) -> None:
        for ws in self.connections.values():
            ws.close()
        self.connections.clear()
