"""openpi's websocket policy protocol: what its two ends share, and the client's connection.

The protocol (``openpi_client.WebsocketClientPolicy`` speaks it; `roboscale serve` serves it, ``serve.server``): on
connect the server sends its metadata, a msgpack map (``transport.wire``) whose ``keys`` say what an observation
holds; then each binary message from the client is one observation and its answer one binary map (``actions``
and ``server_timing``), or a text frame saying why not (the connection goes on). ``GET /healthz`` answers 200.
A server beyond loopback requires an API key, sent as ``Authorization: Api-Key KEY``.

Nothing here knows a policy or the rollout's types: what an observation means is the server's layout, and what a
caller does with a connection (``rollout.remote.RemotePolicy``, evaluation reading the metadata) is its own.
websockets is an optional dependency (``roboscale[serve]``), imported where a connection is made.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

from roboscale.errors import ConfigError, WorkerError
from roboscale.transport.wire import WireError, unpack

CONNECT_TIMEOUT_S = 30.0
HEALTH_PATH = "/healthz"
"""A plain HTTP GET here answers 200 (load balancers, supervisors), before any websocket handshake."""


def read_key(path: str, option: str) -> str:
    """The API key in the first line of ``path`` ('' for no path); ``option`` (the one that named the file) is
    named in the error."""
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


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` listens on a loopback interface only (where it may run without a key)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def connect(url: str, api_key: str = "", timeout_s: float = CONNECT_TIMEOUT_S, option: str = "--rollout.server",
            key_option: str = "--rollout.server_api_key_file") -> tuple[Any, dict[str, Any]]:
    """A websocket to the policy server at ``url`` and the metadata it sends first; WorkerError saying why not.
    ``option`` and ``key_option``: the caller's options for the URL and the key file, named in the errors.

    The connection is websockets' synchronous client, held open across requests (``close`` it): each ``send``
    of a packed observation is answered by one ``recv``, a bytes map or an error text."""
    require_websockets(option)
    from websockets.exceptions import InvalidStatus, WebSocketException
    from websockets.sync.client import connect as ws_connect

    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
    try:
        ws = ws_connect(url, compression=None, max_size=None, additional_headers=headers, open_timeout=timeout_s,
                        legacy=True)  # a connection held open across calls, closed by ``close``
        metadata = unpack(ws.recv(timeout=timeout_s))
    except InvalidStatus as exc:
        code = exc.response.status_code
        hint = f" (wrong or missing API key: {key_option})" if code == 401 else ""
        raise WorkerError(f"the policy server at {url} refused the connection: HTTP {code}{hint}") from None
    except (OSError, TimeoutError, WebSocketException, WireError) as exc:
        raise WorkerError(f"cannot reach the policy server at {url} ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, dict) or "keys" not in metadata:
        ws.close()
        raise WorkerError(f"{url} is not a roboscale policy server (its metadata has no 'keys')")
    return ws, metadata
