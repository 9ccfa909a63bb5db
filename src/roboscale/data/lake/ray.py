"""Ray for ``lake build``: start a local Ray of its own (loopback only) or join a cluster, run one Ray Data task
per item, and the tasks themselves (build a shard, sum a group of shards' histograms).

Shards are Ray Data tasks with fractional CPUs (``cpus_per_task``, 0.5 by default so a 2-core machine runs four at
a time and the driver is never starved) on a local Ray that listens on 127.0.0.1 only (``ensure_ray``) or an
existing cluster (``ray_address``; the workers need roboscale installed and the output on a shared filesystem).
Tasks return their errors as records: Ray would wrap an exception into a traceback string.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from safetensors.numpy import save as safetensors_bytes

from roboscale.configs.lake import LakeConfig
from roboscale.data.lake.planning import ShardSpec
from roboscale.data.lake.shards import BuildContext, build_shard, shard_histograms
from roboscale.errors import ConfigError, DatasetError, from_record, to_record


def ensure_ray(cfg: LakeConfig) -> bool:
    """Start (or join) Ray; True when this call started it (and so should shut it down)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("`roboscale lake build` needs Ray Data: pip install 'roboscale[lake]' (reading a built "
                          "lake does not)") from None

    if ray.is_initialized():
        return False
    if cfg.ray_address:
        try:
            ray.init(address=cfg.ray_address, log_to_driver=True)
        except ConnectionError as e:
            raise ConfigError(
                f"--ray-address {cfg.ray_address}: {e}. A cluster with token authentication (what `ray start` does "
                "by default since Ray 2.59) also needs RAY_AUTH_MODE=token in this shell, and its token in "
                "RAY_AUTH_TOKEN or ~/.ray/auth_token") from None
    else:
        # "local": a Ray of our own, even where `ray start` left a cluster address behind (ray.init() would
        # join that cluster, and refuse num_cpus); reachable from this machine only
        with _single_node_ray():
            ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=cfg.num_cpus, include_dashboard=False,
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


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on a wrong host:port: Ray itself retries for minutes before giving up."""
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address!r}: expected HOST:PORT (the head's GCS address, port 6379 by "
                          "default), ray://HOST:PORT, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"--ray-address {address}: cannot reach it ({e.strerror or e}); is the head running "
                          "(`ray start --head`) and is the address right?") from None


def ray_map(items: list[dict[str, Any]], fn: Callable[[dict[str, Any]], dict[str, Any]], cpus: float,
             ) -> list[dict[str, Any]]:
    """One Ray Data task per item (so each shard is its own unit of retry), results in item order."""
    import ray.data

    if not items:
        return []
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    rows = ds.map(fn, num_cpus=cpus).take_all()
    return sorted(rows, key=lambda r: r["shard"])


def raise_task_errors(rows: Sequence[Mapping[str, Any]]) -> None:
    """Shard tasks return their DatasetError as a record: Ray would wrap the exception into a traceback string."""
    errors = [json.loads(r["error"]) for r in rows if r["error"]]
    if errors:
        more = f" ({len(errors) - 1} more shards failed; finished shards are kept, rerun to resume)" if len(
            errors) > 1 else " (finished shards are kept: rerun to resume)"
        raise from_record({**errors[0], "message": errors[0]["message"] + more})


class BuildShardTask:
    """Builds the shard of a row (``build_shard``) and returns its shard.json, or its error as a record."""

    def __init__(self, ctx: BuildContext, specs: Sequence[ShardSpec]):
        self.ctx, self.specs = ctx, {s.shard: s for s in specs}

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        # A bad episode fails its shard only: the other shards still finish (and are kept for the resumed build).
        try:
            meta = build_shard(self.specs[int(row["shard"])], self.ctx)
        except DatasetError as err:
            return {"shard": int(row["shard"]), "meta": "", "error": json.dumps(to_record(err))}
        return {"shard": int(row["shard"]), "meta": json.dumps(meta), "error": ""}


class HistogramTask:
    """Sum of the histograms of a group of shards (row ``shard`` = group index)."""

    def __init__(self, ctx: BuildContext, groups: Sequence[Sequence[str]], ranges: Mapping[str, Any], bins: int):
        self.ctx, self.groups, self.ranges, self.bins = ctx, [list(g) for g in groups], ranges, bins

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        group = int(row["shard"])
        features = {key: self.ctx.features[key] for key in self.ctx.numeric}
        total: dict[str, np.ndarray] = {}
        for name in self.groups[group]:
            counts = shard_histograms(self.ctx.shard_dir(name), features, self.ranges, self.bins)
            total = {k: total[k] + v for k, v in counts.items()} if total else counts
        return {"shard": group, "counts": safetensors_bytes(total)}
