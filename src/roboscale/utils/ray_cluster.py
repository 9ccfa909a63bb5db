"""Ray for our jobs (lake builds, training on Ray): join a cluster, or start one of our own that listens on
127.0.0.1 only, and fail in seconds on an address that cannot be reached."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from roboscale.errors import ConfigError


def start_or_join_ray(address: str | None, num_cpus: int | None, *, option: str, missing: str) -> bool:
    """Join the cluster at ``address``, or start a Ray of our own bound to 127.0.0.1; True when this call
    started it (and so should shut it down). ``option`` names the address option in errors; ``missing`` is the
    error when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError(missing) from None

    if ray.is_initialized():
        return False
    if address:
        try:
            ray.init(address=address, log_to_driver=True)
        except ConnectionError as e:
            raise ConfigError(
                f"{option} {address}: {e}. A cluster with token authentication (what `ray start` does "
                "by default since Ray 2.59) also needs RAY_AUTH_MODE=token in this shell, and its token in "
                "RAY_AUTH_TOKEN or ~/.ray/auth_token") from None
    else:
        # "local": a Ray of our own, even where `ray start` left a cluster address behind (ray.init() would
        # join that cluster, and refuse num_cpus); reachable from this machine only
        with _single_node_ray():
            ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=num_cpus, include_dashboard=False,
                     log_to_driver=True)
    return True


_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _single_node_ray() -> Iterator[None]:
    """Around ``ray.init(address="local", _node_ip_address="127.0.0.1")``: make the node IP stay 127.0.0.1.

    Why: Ray binds its GCS, raylet (node and object manager), runtime-env agent and the gRPC server of the driver
    and of every worker to loopback only when the node IP is loopback, and to every interface otherwise. On Linux
    ``ray.init`` replaces a loopback ``_node_ip_address`` by the host's outward IP unless multi-node Ray is off:
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the single-machine mode Ray runs in on macOS and Windows. Ray reads
    that variable once, into ``ray_constants.ENABLE_RAY_CLUSTER``, when it is first imported (before this call),
    so both are set here and both restored afterwards: a later ``ray.init`` of the user's is unaffected. The
    processes ray.init starts (raylet, agents, and the workers they start) inherit the variable; they get their
    node IP from the raylet anyway.
    """
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_SINGLE_NODE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_SINGLE_NODE_ENV, None)
        else:
            os.environ[_SINGLE_NODE_ENV] = saved_env


def reachable_or_raise(address: str, option: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on a wrong host:port: Ray itself retries for minutes before giving up."""
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{option} {address!r}: expected HOST:PORT (the head's GCS address, port 6379 by "
                          "default), ray://HOST:PORT, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"{option} {address}: cannot reach it ({e.strerror or e}); is the head running "
                          "(`ray start --head`) and is the address right?") from None
