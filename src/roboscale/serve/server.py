"""The policy server: a ``Predictor`` behind openpi's websocket policy protocol, for robots and remote simulators.

``PolicyServer(predictor, layout, metadata, options)`` serves what it is given, as openpi's server serves a policy:
a ``Predictor`` (``rollout.predictor``; `roboscale serve` gives it a checkpoint's ``PolicyRunner``, a test a fake),
an ``ObservationLayout`` (which client key feeds which input, ``serve.observation``), the metadata each client
gets on connect (the layout's ``keys`` added) and ``ServerOptions`` (where to listen, the API key, the limits, the
batching). Where those come from (resolving, hashing and loading a checkpoint) is the command's (``serve.command``).

The protocol is openpi's (``transport.websocket``; ``openpi_client.WebsocketClientPolicy`` drives it unchanged): on
connect the server sends its metadata (msgpack); each binary message is a msgpack-numpy observation
(``transport.wire``) and its answer a map with ``actions`` [chunk, action_dim] in the dataset's units plus
``server_timing``; a bad request is answered with a text frame (which the client raises) and the connection stays
usable. ``GET /healthz`` answers 200. This module is the websocket transport's server end; it sits here, not in
``roboscale.transport``, because it serves through the rollout's batcher and a ``Predictor``, which that low package
does not know. A second transport (gRPC, say) is one module beside this one, over the same batcher, predictor and
layout.

One process, two threads with one job each: the asyncio loop (a thread of its own) owns every connection (a slow,
stalled or vanished client only ever blocks its own handler), and the thread that calls ``run`` (the main one)
owns the policy, predicting the observations of all connections in dynamic batches
(``rollout.batcher.DynamicBatcher``, the engine's own; each connection has at most one request in flight, so a
batch goes as soon as every connection whose last message asked for a chunk has asked). Decoding a message and
fitting its images run on a small thread pool, off both: a client's large or malformed message delays only its
own answer. A chunk's noise is drawn from the
request's ``seed`` and ``chunk_index`` alone (``rollout.noise``), so the same observation and seed give the same
chunk whatever else shares its batch.

Security: the server binds to loopback unless told; any other interface needs an API key, checked (in constant
time) before the websocket handshake, so no model work is done for a client without it. Messages are size-limited
and decoded without pickle; nothing a client sends names code. LeRobot's async inference sends pickles over gRPC,
which is why it is not offered here (docs/architecture.md).

Shutdown (SIGINT/SIGTERM, or ``stop()``): the listening socket closes, requests in flight are answered (up to
``shutdown_grace_s``), requests that arrive meanwhile are refused with an error frame, then every connection is
closed with 1001 (going away).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import http
import itertools
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from roboscale.configs.rollout import RunnerConfig
from roboscale.configs.serve import ServeConfig, serve_runner
from roboscale.errors import ConfigError
from roboscale.rollout.batcher import DynamicBatcher
from roboscale.rollout.inference import Prediction, PredictItem
from roboscale.rollout.predictor import Predictor
from roboscale.serve.observation import ObservationError, ObservationLayout
from roboscale.transport.websocket import HEALTH_PATH, is_loopback, require_websockets
from roboscale.transport.wire import WireError, WireLimits, pack, unpack

log = logging.getLogger(__name__)

__all__ = ["HEALTH_PATH", "PolicyServer", "ServerOptions"]


@dataclass(frozen=True)
class ServerOptions:
    """Where the server listens and what it takes (`roboscale serve` fills them from its options)."""

    host: str = ServeConfig.host
    """Anything but a loopback interface needs an ``api_key`` (checked here, so no caller can forget it)."""
    port: int = ServeConfig.port
    """0: any free port (``PolicyServer.address`` once ready)."""
    api_key: str | None = None
    """What clients send as ``Authorization: Api-Key KEY`` (None: no key)."""
    max_message_bytes: int = int(ServeConfig.max_message_mb * 2 ** 20)
    """A larger message closes its connection (1009) before it is read."""
    limits: WireLimits = field(default_factory=WireLimits)
    """What one decoded message may hold (its strings: the prompt)."""
    batching: RunnerConfig = field(default_factory=serve_runner)
    """How observations of different connections are batched (its max_batch_size and batch_timeout_ms)."""
    shutdown_grace_s: float = ServeConfig.shutdown_grace_s
    """On stop: how long requests in flight get to be answered before the connections close."""

    def __post_init__(self) -> None:
        if self.api_key is None and not is_loopback(self.host):
            raise ConfigError(f"--host={self.host} listens beyond this machine: give --api_key_file (clients then "
                              "send 'Authorization: Api-Key KEY'), or serve on 127.0.0.1")


@dataclass
class _Answer:
    prediction: Prediction
    infer_ms: float
    batch_size: int


@dataclass
class _Connection:
    number: int
    peer: str
    opened: float = field(default_factory=time.monotonic)
    requests: int = 0
    errors: int = 0
    busy_s: float = 0.0
    predicting: bool = False
    """Its last message asked the model for a chunk: a batch waits for the connections that predict, and one whose
    messages are refused (a broken or hostile client) must not make every other robot wait out the timeout."""


class PolicyServer:
    """``PolicyServer(predictor, layout, metadata, options).run()`` serves until SIGINT/SIGTERM (in the main thread)
    or ``stop()``. The predictor runs on the thread that calls ``run`` (build it there: see ``run``); the server
    neither loads nor closes it."""

    def __init__(self, predictor: Predictor, layout: ObservationLayout, metadata: Mapping[str, Any],
                 options: ServerOptions | None = None, on_ready: Callable[[str, int], None] | None = None):
        require_websockets("roboscale serve")
        self.predictor = predictor
        self.layout = layout
        self.options = options if options is not None else ServerOptions()
        # the layout is what a client must send: its keys travel with whatever else the caller says
        self.metadata = {**metadata, "keys": layout.describe()}
        self.batcher = DynamicBatcher(self._predict, self.options.batching.max_batch_size,
                                      self.options.batching.batch_timeout_ms,
                                      producers=0)
        self.on_ready = on_ready
        self.address: tuple[str, int] | None = None
        self._numbers = itertools.count(1)
        self._connections: dict[Any, _Connection] = {}
        self._in_flight = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        # decoding a message and fitting its images are each connection's own work: off the loop that every
        # connection shares, and off the model's thread (a 15 MiB message held both for seconds: issue 31)
        self._parsing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="policy-parse")

    # --- lifetime -------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until SIGINT/SIGTERM (when called on the main thread) or ``stop()``; returns once the websocket
        thread has shut down (requests in flight answered) and the batcher is closed."""
        failure: list[BaseException] = []

        def websockets_main() -> None:
            try:
                asyncio.run(self._main())
            except BaseException as exc:  # re-raised on the calling thread: a port in use is the caller's error
                failure.append(exc)
            finally:
                self.batcher.close()  # answers whatever still waits and wakes the model loop below

        connections = threading.Thread(target=websockets_main, name="policy-websockets", daemon=True)
        previous = self._catch_signals()
        connections.start()
        try:
            # the model on the calling thread, the thread that built it: OpenMP keeps one thread team per thread
            # that runs parallel work, and a second team would share the cores with the first one's (the server
            # ran at 0.31x of in-process chunks/s that way: docs/benchmarks.md, "The policy server").
            # run_once waits without a timeout: it returns False only once the websocket thread closed the batcher.
            while self.batcher.run_once():
                pass
        finally:
            self.stop()
            connections.join(timeout=self.options.shutdown_grace_s + 30)
            self._parsing.shutdown(wait=False, cancel_futures=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if failure:
            if isinstance(failure[0], OSError) and failure[0].errno == errno.EADDRINUSE:
                raise ConfigError(f"--port={self.options.port}: already in use on {self.options.host} (another "
                                  "server?); choose another port, or 0 for any free one") from None
            raise failure[0]

    def stop(self) -> None:
        """Stop from any thread (as SIGTERM does)."""
        self._stop_requested.set()
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop has already closed
                pass

    async def _main(self) -> None:
        from websockets.asyncio.server import serve

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested.is_set():
            return
        async with serve(self._handle, self.options.host, self.options.port, compression=None,
                         max_size=self.options.max_message_bytes, process_request=self._check_request) as server:
            host, port = server.sockets[0].getsockname()[:2]
            self.address = (host, port)
            what = self.metadata.get("policy", type(self.predictor).__name__)
            where = f" ({self.metadata['checkpoint']})" if "checkpoint" in self.metadata else ""
            log.info("serving %s%s on ws://%s:%d%s", what, where, host, port,
                     "" if self.options.api_key is None else " (API key required)")
            if self.on_ready is not None:
                self.on_ready(host, port)
            await self._stop.wait()
            await self._shut_down(server)

    def _catch_signals(self) -> dict[int, Any]:
        """SIGINT and SIGTERM stop the server cleanly (only the main thread can catch them); the handlers they
        replace, to put back."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, lambda *_: self.stop()) for signum in (signal.SIGINT, signal.SIGTERM)}

    async def _shut_down(self, server: Any) -> None:
        log.info("shutting down: %d connections, %d requests in flight", len(self._connections), self._in_flight)
        server.close(close_connections=False)  # no new connections
        self._draining = True
        deadline = time.monotonic() + self.options.shutdown_grace_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.batcher.close()  # anything still waiting is answered with an error
        await asyncio.gather(*(ws.close(1001, "server shutting down") for ws in list(self._connections)),
                             return_exceptions=True)
        await server.wait_closed()

    # --- the model (on the thread that calls run) ----------------------------------------------------------
    def _predict(self, items: list[PredictItem]) -> list[_Answer]:
        start = time.perf_counter()
        predictions = self.predictor.predict(items)
        infer_ms = (time.perf_counter() - start) * 1000
        return [_Answer(p, infer_ms, len(items)) for p in predictions]

    # --- connections ----------------------------------------------------------------------------------------
    def _check_request(self, connection: Any, request: Any) -> Any:
        """Before the handshake: the health check, and the API key (a refused client costs no model work)."""
        from websockets.datastructures import MultipleValuesError

        if request.path == HEALTH_PATH:
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if self.options.api_key is not None:
            try:
                given = request.headers.get("Authorization", "")
            except MultipleValuesError:  # two Authorization headers are no key at all
                given = None
            if given is None:
                log.warning("refused %s: more than one Authorization header", _peer(connection))
                return connection.respond(http.HTTPStatus.UNAUTHORIZED,
                                          "send exactly one 'Authorization: Api-Key KEY' header\n")
            if not hmac.compare_digest(given.encode(), f"Api-Key {self.options.api_key}".encode()):
                log.warning("refused %s: %s API key", _peer(connection), "a wrong" if given else "no")
                return connection.respond(http.HTTPStatus.UNAUTHORIZED,
                                          "an API key is required: send 'Authorization: Api-Key KEY'\n")
        return None

    async def _handle(self, ws: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        info = _Connection(next(self._numbers), _peer(ws))
        self._connections[ws] = info
        log.info("connection %d from %s opened", info.number, info.peer)
        try:
            await ws.send(pack(self.metadata))
            async for message in ws:
                reply = await self._answer(message, info)
                await ws.send(reply)
        except ConnectionClosed:
            pass
        finally:
            del self._connections[ws]
            self._count_producers()
            mean = info.busy_s / info.requests * 1000 if info.requests else 0.0
            log.info("connection %d from %s closed (%s): %d requests, %d errors, mean %.1f ms", info.number,
                     info.peer, ws.close_code, info.requests, info.errors, mean)

    async def _answer(self, message: str | bytes, info: _Connection) -> str | bytes:
        """The reply to one message: packed actions, or an error text frame (the connection goes on)."""
        start = time.perf_counter()
        info.requests += 1
        try:
            if isinstance(message, str):
                raise ObservationError("send observations as binary msgpack frames, not text")
            if self._draining:
                raise ObservationError("the server is shutting down")
            item = await asyncio.get_running_loop().run_in_executor(self._parsing, self._parse, message)
            self._predicting(info, True)
            answer = await self._infer(item)
        except (WireError, ObservationError, ValueError) as exc:
            self._predicting(info, False)
            info.errors += 1
            log.info("connection %d: refused a request: %s", info.number, exc)
            return f"error: {exc}"
        except Exception as exc:  # the model failed on this batch: the client hears why, the server goes on
            info.errors += 1
            log.exception("connection %d: prediction failed", info.number)
            return f"error: prediction failed ({type(exc).__name__}: {exc})"
        chunk = np.asarray(answer.prediction.chunk, dtype=np.float32)
        if not np.isfinite(chunk).all():  # never a success: a robot must not execute NaN (it still predicts)
            info.errors += 1
            log.info("connection %d: the policy's chunk is not finite", info.number)
            return ("error: the policy's actions for this observation are not finite (NaN or Inf); the other clients "
                    "of its batch are unaffected")
        total_ms = (time.perf_counter() - start) * 1000
        info.busy_s += total_ms / 1000
        return pack({"actions": chunk,
                     "seed": item.noise_seed, "policy_version": answer.prediction.version,
                     "server_timing": {"infer_ms": answer.infer_ms, "total_ms": total_ms,
                                       "batch_size": answer.batch_size}})

    def _predicting(self, info: _Connection, predicting: bool) -> None:
        if info.predicting != predicting:
            info.predicting = predicting
            self._count_producers()

    def _count_producers(self) -> None:
        self.batcher.set_producers(sum(c.predicting for c in self._connections.values()))

    def _parse(self, message: bytes) -> PredictItem:
        """A message as the model's input (on a parsing thread): decoded within the limits, checked, images fitted."""
        return self.layout.parse(unpack(message, self.options.limits), default_seed=secrets.randbits(63))

    async def _infer(self, item: PredictItem) -> _Answer:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(outputs: list[_Answer] | None, error: BaseException | None) -> None:
            """On the model thread: hand the outcome to the loop (whose handler may have gone meanwhile)."""
            def resolve() -> None:
                if not future.done():
                    future.set_exception(error) if error is not None else future.set_result(outputs[0])
            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass

        self._in_flight += 1
        try:
            self.batcher.submit([item], settle)
            return await future
        finally:
            self._in_flight -= 1


def _peer(connection: Any) -> str:
    address = getattr(connection, "remote_address", None)
    return f"{address[0]}:{address[1]}" if address else "?"

