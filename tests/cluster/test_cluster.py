"""The cluster in a box (``roboscale.testing.cluster``): hosts that reach each other by name and only through the
bridge made for them, a rate limit on their links, a cut link, and a teardown that leaves nothing behind, also
when the process that made the cluster is killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roboscale.testing.cluster import Cluster, available, teardown

pytestmark = pytest.mark.skipif(bool(available()), reason=available() or "")

ROOT = Path(__file__).resolve().parents[2]
SERVE = ("import socket, sys\n"
         "s = socket.create_server(('0.0.0.0', 29811)); s.settimeout(30); print('listening', flush=True)\n"
         "c, _ = s.accept(); c.settimeout(30); print(c.recv(100).decode(), flush=True)")
ASK = ("import socket, sys\n"
       "c = socket.create_connection((sys.argv[1], 29811), timeout=float(sys.argv[2]))\n"
       "c.sendall(socket.gethostname().encode())")


def leftovers(name: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    etc = [p.name for p in Path("/etc/netns").glob(name + "*")] if Path("/etc/netns").is_dir() else []
    return [line for line in (netns + links).splitlines() if name in line] + etc


def exchange(cluster: Cluster, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
    """host1 listens, host0 connects to it by name and sends its own hostname; host1's output."""
    server = cluster.hosts[1].popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        asked = cluster.hosts[0].run([sys.executable, "-c", ASK, "host1", str(timeout_s)], capture_output=True,
                                     text=True, timeout=60)
        out = server.communicate(timeout=60)[0] if asked.returncode == 0 else ""
        return subprocess.CompletedProcess(asked.args, asked.returncode, out, asked.stderr)
    finally:
        server.kill()
        server.wait(timeout=10)


def test_hosts_reach_each_other_by_name_with_their_own_hostnames_and_leave_nothing_behind() -> None:
    with Cluster(2) as cluster:
        name = cluster.name
        done = exchange(cluster)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "host0"  # the UTS namespace's name, resolved through /etc/netns/NS/hosts
        # the machine itself has no address on the bridge: the hosts' subnet is theirs alone
        addresses = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=False).stdout
        assert cluster.subnet + "." not in addresses
    assert leftovers(name) == []


def test_a_cut_link_isolates_its_host_until_restored() -> None:
    with Cluster(2) as cluster:
        cluster.cut(cluster.hosts[1])
        assert exchange(cluster, timeout_s=2).returncode != 0
        cluster.restore(cluster.hosts[1])
        assert exchange(cluster).returncode == 0


def test_a_rate_limit_is_a_token_bucket_on_both_ends_of_every_link() -> None:
    with Cluster(2, rate_mbit=100) as cluster:
        for host in cluster.hosts:
            root = subprocess.run(["tc", "qdisc", "show", "dev", host.link], capture_output=True, text=True, check=False).stdout
            inside = subprocess.run(["tc", "-n", host.namespace, "qdisc", "show", "dev", "eth0"],
                                    capture_output=True, text=True, check=False).stdout
            assert "tbf" in root and "100Mbit" in root and "tbf" in inside and "100Mbit" in inside, root + inside
        cluster.limit(None)
        assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", cluster.hosts[0].link],
                                           capture_output=True, text=True, check=False).stdout
        assert exchange(cluster).returncode == 0


def test_a_cluster_whose_owner_is_killed_outright_is_torn_down_by_its_reaper() -> None:
    script = ("import signal, sys\n"
              "from roboscale.testing.cluster import Cluster\n"
              "c = Cluster(2).__enter__(); print(c.name, c.hosts[0].namespace, flush=True)\n"
              "signal.pause()")
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    name = ""
    try:
        name, namespace = owner.stdout.readline().split()
        sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "600"])  # a process on a host
        assert leftovers(name)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 30
        while leftovers(name) and time.monotonic() < deadline:  # the reaper's teardown, bounded
            time.sleep(0.2)
        assert leftovers(name) == []
        assert sleeper.wait(timeout=10) == -signal.SIGKILL  # the host's processes ended with it
    finally:
        owner.kill()
        if name:
            teardown(name)
