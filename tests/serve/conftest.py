"""A policy server on a free loopback port, run in a thread of the test process: `roboscale serve`'s (``served``), or
any ``PolicyServer`` (``running``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from roboscale.configs.serve import ServeConfig
from roboscale.serve.command import build_server
from roboscale.serve.server import PolicyServer
from tests.models.helpers import tiny_policy


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("served") / "pretrained_model"
    tiny_policy().save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def served(**options) -> Iterator[tuple[PolicyServer, str]]:
    """A running ``build_server(ServeConfig(port=0, **options))`` and its ws:// URL; stopped (and its thread
    joined) on exit."""
    with running(build_server(ServeConfig(port=0, **options))) as (server, url):
        yield server, url


@contextlib.contextmanager
def running(server: PolicyServer) -> Iterator[tuple[PolicyServer, str]]:
    """``server`` (built on this thread) running in a thread of its own, and its ws:// URL; stopped (and the thread
    joined) on exit."""
    ready = threading.Event()
    server.on_ready = lambda host, port: ready.set()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as exc:  # seen by the test, not lost in a thread
            errors.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="test-policy-server")
    thread.start()
    assert ready.wait(60), "the server did not start"
    if errors:
        raise errors[0]
    host, port = server.address
    try:
        yield server, f"ws://{host}:{port}"
    finally:
        server.stop()
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"
    if errors:
        raise errors[0]


def observation(seed: int | None = 7, size: tuple[int, int] = (32, 32), **extra) -> dict:
    """An observation in the tiny checkpoint's own feature names (2 cameras, 4-d state)."""
    rng = np.random.default_rng(0 if seed is None else seed)
    obs = {"observation.images.corner2": rng.integers(0, 255, (*size, 3), dtype=np.uint8),
           "observation.images.wrist": rng.integers(0, 255, (*size, 3), dtype=np.uint8),
           "observation.state": rng.uniform(-1, 1, 4).astype(np.float32), "prompt": "Open a drawer"}
    if seed is not None:
        obs["seed"] = seed
    obs.update(extra)
    return obs
