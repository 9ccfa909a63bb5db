"""Ray across the hosts of a cluster in a box (``roboscale.testing.cluster``): a head on host0 and one worker node
on each other host, started with `ray start` in each host's namespace as a user starts them on real nodes, each
bound to its host's address, with token authentication (``RAY_AUTH_MODE=token``, one token for the cluster).

Each node keeps its sessions and logs in a temporary directory of its own (``--temp-dir``), so what ran on a host
can be read back from its logs (``ran_on``: Ray prefixes each task's and actor's output with its name), and its
object store is small (these hosts share one machine's memory). ``kill_raylet`` is a host's Ray dying (the GCS
marks the node dead and its tasks and actors fail); ``start_node`` brings one back, as a cluster manager would.

    with Cluster(2) as hosts, RayCluster(hosts, cpus=[2, 2], resources={1: {"sim": 4}}) as ray_cluster:
        hosts.hosts[0].run([..., "--ray.address", ray_cluster.address], env=ray_cluster.env)
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from roboscale.testing.cluster import PREFIX, Closing, Cluster, Host, owner_pid
from roboscale.utils.lifetime import alive

GCS_PORT = 6379
DASHBOARD_PORT = 8265
OBJECT_STORE_BYTES = 200 * 2**20
"""Each node's object store (Ray's default, 30% of the machine's memory per node, would be several GB each)."""
_WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while len([n for n in ray.nodes() if n["Alive"]]) != int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(f"alive nodes: {[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]}")
    time.sleep(0.5)
"""


TEMP_ROOT = "/tmp"
"""Each RayCluster's nodes keep their sessions in ``TEMP_ROOT/<cluster name>r<random>`` (short: Ray's socket
paths must fit in 107 characters)."""


def _sweep() -> None:
    """Remove the directories of Ray clusters whose owner died (``kill -9``: the cluster's reaper ended their
    processes, nothing removed their files)."""
    for root in Path(TEMP_ROOT).glob(f"{PREFIX}*x*r*"):
        if root.is_dir() and not alive(owner_pid(root.name)):
            shutil.rmtree(root, ignore_errors=True)


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


class RayCluster(Closing):
    """``with RayCluster(cluster) as ray_cluster:`` Ray on every host of ``cluster``; ``cpus``: each node's CPUs
    (one number for all, or one per host), ``resources``: custom resources by host index, ``dashboard``: the head's
    dashboard (the job server `ray job submit` talks to) on host0's address."""

    def __init__(self, cluster: Cluster, cpus: int | Sequence[int] = 2,
                 resources: Mapping[int, Mapping[str, float]] | None = None, dashboard: bool = False):
        self.cluster = cluster
        hosts = len(cluster.hosts)
        self.cpus = [cpus] * hosts if isinstance(cpus, int) else list(cpus)
        if len(self.cpus) != hosts:
            raise ValueError(f"cpus: one count per host ({hosts}), got {self.cpus}")
        self.resources = {i: dict(r) for i, r in (resources or {}).items()}
        self.dashboard = dashboard
        _sweep()
        self.root = Path(tempfile.mkdtemp(prefix=f"{cluster.name}r", dir=TEMP_ROOT))
        self.token = secrets.token_hex(32)

    @property
    def head(self) -> Host:
        return self.cluster.hosts[0]

    @property
    def address(self) -> str:
        """The GCS address every host reaches (``--ray.address``, ``--rollout.ray_address``, ``--ray-address``)."""
        return f"host0:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    @property
    def env(self) -> dict[str, str]:
        """What a process on a host needs to join: the token, and no Ray settings of this machine's."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_ADDRESS": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}

    def temp_dir(self, host: Host) -> Path:
        return self.root / host.name

    def open(self) -> None:
        for host in self.cluster.hosts:
            self.start_node(host, wait=False)
        self.wait_for_nodes(len(self.cluster.hosts))

    def start_node(self, host: Host, wait: bool = True) -> None:
        """`ray start` on ``host``: the head on host0, a worker node joining it elsewhere (again after
        ``kill_raylet``: the host's remaining Ray processes are ended first)."""
        index = self.cluster.hosts.index(host)
        head = index == 0
        if not head:
            host.kill_all()  # what a dead raylet left (its agents, workers)
        temp = self.temp_dir(host)
        temp.mkdir(parents=True, exist_ok=True)
        argv = [ray_cli(), "start", f"--node-ip-address={host.address}", f"--num-cpus={self.cpus[index]}",
                f"--temp-dir={temp}", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
        if self.resources.get(index):
            argv.append(f"--resources={json.dumps(self.resources[index])}")
        if head:
            argv += ["--head", f"--port={GCS_PORT}", f"--include-dashboard={str(self.dashboard).lower()}"]
            if self.dashboard:
                argv += [f"--dashboard-host={host.address}", f"--dashboard-port={DASHBOARD_PORT}"]
        else:
            argv.append(f"--address={self.address}")
        log = self.root / f"start-{host.name}.log"
        with log.open("ab") as out:
            done = host.run(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"`ray start` on {host.name} failed ({done.returncode}): "
                               f"{log.read_text(errors='replace')[-2000:]}")
        if wait:
            self.wait_for_nodes(len(self.alive_hosts()))

    def alive_hosts(self) -> list[Host]:
        """Hosts with a raylet running."""
        return [host for host in self.cluster.hosts if self._raylets(host)]

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        """Until the GCS counts ``count`` alive nodes (a killed node is dead once its health checks fail)."""
        done = self.head.run([sys.executable, "-c", _WAIT_FOR_NODES, self.address, str(count), str(timeout_s)],
                             env=self.env, capture_output=True, text=True, timeout=timeout_s + 60)
        if done.returncode != 0:
            raise RuntimeError(f"the Ray cluster did not reach {count} alive nodes: {done.stderr[-2000:]}")

    @staticmethod
    def _raylets(host: Host) -> list[int]:
        found = []
        for pid in host.pids():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    found.append(pid)
            except OSError:
                pass
        return found

    def kill_raylet(self, host: Host) -> None:
        """``host``'s raylet SIGKILLed: the node is lost (its workers end with it, the GCS marks it dead)."""
        raylets = self._raylets(host)
        if not raylets:
            raise RuntimeError(f"no raylet runs on {host.name}")
        for pid in raylets:
            os.kill(pid, signal.SIGKILL)

    def ran_on(self, host: Host, name: str) -> bool:
        """Whether a task or actor whose name contains ``name`` ran on ``host`` (its worker logs say so: Ray
        starts each task's output with ``:task_name:NAME`` and each actor's with ``:actor_name:NAME``)."""
        pattern = re.compile(rf"^:(task|actor)_name:.*{re.escape(name)}", re.M)
        return any(pattern.search(log.read_text(errors="replace"))
                   for log in self.temp_dir(host).glob("session_*/logs/worker-*"))

    def close(self) -> None:
        """Every Ray process on the hosts ended, the nodes' directories removed; idempotent."""
        for host in self.cluster.hosts:
            host.kill_all()
        deadline = time.monotonic() + 30
        while any(host.pids() for host in self.cluster.hosts) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)
