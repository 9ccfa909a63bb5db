"""Where the engine's processes run: local processes (spawned) or tasks on a Ray cluster, behind one interface.

A channel is a queue with ``put``, ``get(timeout=)`` and ``get_nowait`` (both raise ``queue.Empty``):
``multiprocessing.Queue`` locally, ``ray.util.queue.Queue`` on Ray. A handle says whether its process still runs
and kills it. The engine never shares a channel with a process it may kill while that process could be writing:
it restarts the whole pool instead (see engine.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any, Protocol

from roboscale.utils.lifetime import run_owned, signals_deferred


class Channel(Protocol):
    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...

    def get_nowait(self) -> Any: ...


class Handle(Protocol):
    name: str

    def alive(self) -> bool: ...

    def exit_reason(self) -> str: ...

    def kill(self) -> None: ...

    def join(self, timeout: float) -> None: ...


class Launcher(Protocol):
    def channel(self) -> Channel: ...

    def device(self, requested: str) -> str:
        """``--rollout.runner.device`` resolved where the processes will run (``auto``: cuda if there is a GPU)."""
        ...

    def start(self, target: Callable[..., None], args: tuple, *, name: str, cpus: float = 1.0,
              gpus: float = 0.0) -> Handle: ...

    def close(self) -> None: ...


class _ProcessHandle:
    def __init__(self, process: mp.Process, name: str):
        self.process = process
        self.name = name

    def alive(self) -> bool:
        return self.process.is_alive()

    def exit_reason(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)

    def join(self, timeout: float) -> None:
        self.process.join(timeout=timeout)


class LocalLauncher:
    """Spawned processes (a fresh interpreter: no locks inherited from the caller's threads, as with fork)."""

    def __init__(self) -> None:
        self._context = mp.get_context("spawn")
        self._channels: list[Any] = []

    def device(self, requested: str) -> str:
        from roboscale.rollout.inference import resolve_device

        return resolve_device(requested, "--rollout.runner.device")

    def channel(self) -> Channel:
        channel = self._context.Queue()
        self._channels.append(channel)
        return channel

    def start(self, target: Callable[..., None], args: tuple, *, name: str, cpus: float = 1.0,
              gpus: float = 0.0) -> Handle:
        # daemon: ended by our exit; run_owned: also by our death (kill -9 runs no exit handler)
        process = self._context.Process(target=run_owned, args=(os.getpid(), target, *args), name=name, daemon=True)
        with signals_deferred():  # a child cut off before it has its start data dies with a traceback
            process.start()
        return _ProcessHandle(process, name)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
            channel.cancel_join_thread()  # a channel nobody reads any more must not block our exit
        self._channels.clear()


class _RayHandle:
    def __init__(self, ref: Any, name: str):
        self.ref = ref
        self.name = name

    def alive(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return not ready

    def exit_reason(self) -> str:
        import ray

        try:
            ray.get(self.ref, timeout=0)
        except Exception as exc:  # the task's failure, as Ray reports it
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        return "returned"

    def kill(self) -> None:
        import ray

        ray.cancel(self.ref, force=True)

    def join(self, timeout: float) -> None:
        import ray

        ray.wait([self.ref], timeout=timeout)


class RayLauncher:
    """Ray tasks on the cluster at ``address`` (or a local Ray bound to 127.0.0.1 for ``address == "local"``),
    each also reserving the custom ``resources`` (which nodes may run it). The channels are actors on this
    process's node: a lost node takes its tasks with it, never the engine's channels to the others."""

    def __init__(self, address: str, resources: dict[str, float] | None = None):
        from roboscale.utils.ray_cluster import reachable_or_raise, start_or_join_ray

        self._resources = dict(resources or {})

        if address != "local":
            reachable_or_raise(address, option="--rollout.ray_address")
        self._owns_ray = start_or_join_ray(None if address == "local" else address, None,
                                           option="--rollout.ray_address",
                                           missing="--rollout.ray_address needs Ray: pip install 'ray[default]'")

    def device(self, requested: str) -> str:
        """``auto`` asks the cluster, not this machine: cuda when it has a GPU, which the process that predicts
        then reserves (a Ray task without ``num_gpus`` sees no GPU at all, so it would run on its CPU)."""
        import ray

        if requested != "auto":
            return requested
        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"

    def channel(self) -> Channel:
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})

    def start(self, target: Callable[..., None], args: tuple, *, name: str, cpus: float = 1.0,
              gpus: float = 0.0) -> Handle:
        import ray

        env = {k: v for k, v in os.environ.items() if k.startswith(("MUJOCO_", "PYOPENGL_", "OMP_"))}
        remote = ray.remote(num_cpus=cpus, num_gpus=gpus, resources=self._resources or None, max_retries=0,
                            runtime_env={"env_vars": env} if env else None)(target)
        return _RayHandle(remote.options(name=name).remote(*args), name)

    def close(self) -> None:
        if self._owns_ray:
            import ray

            ray.shutdown()


def launcher_for(ray_address: str, ray_resources: dict[str, float] | None = None) -> Launcher:
    return RayLauncher(ray_address, ray_resources) if ray_address else LocalLauncher()
