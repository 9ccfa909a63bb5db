"""A cluster in a box: N hosts on this machine as Linux network namespaces, for tests and benchmarks of what one
host never shows (a rendezvous across hosts, a host that dies, a slow or cut link).

Each host is a network namespace with its own stack, an ``eth0`` (one end of a veth pair whose other end is on a
bridge made for this cluster), an address in one private /24, and a name: commands run in a UTS namespace of their
own whose hostname is the host's (torchrun's c10d rendezvous decides which agent hosts the store by comparing
the endpoint with the machine's hostname and addresses), and ``/etc/netns/NS/hosts`` (which ``ip netns exec``
binds over ``/etc/hosts``) resolves every host's name. A link may be rate-limited (``tc``'s ``tbf``: this kernel
has no ``netem``, so no delay can be added) or cut (``ip link set ... down``).

These namespaces' addresses are the only non-loopback ones a test may use. Teardown always runs: on exit of the
``with`` block (also on an error or Ctrl-C), and, should the owner die without running it (``kill -9``), from a
reaper process that waits on the owner's pidfd (``python -m roboscale.testing.cluster reap OWNER NAME``); a later
cluster also sweeps what dead owners left (``sweep``). Needs root and iproute2 (``available()`` says why not).

    python -m roboscale.testing.cluster up --hosts 2 [--rate-mbit 100]   # prints the hosts; Ctrl-C tears down
    python -m roboscale.testing.cluster sweep                            # remove clusters of dead owners
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from roboscale.utils.lifetime import alive, when_gone

PREFIX = "rsc"
"""Every namespace, link and /etc/netns directory of a cluster starts with ``rsc<id>``; ``<id>`` is the owner's
pid (so ``sweep`` knows whose it is) and a counter."""
NETNS_ETC = Path("/etc/netns")
INTERFACE = "eth0"
"""Each host's interface (``GLOO_SOCKET_IFNAME``)."""


def available() -> str:
    """Empty when clusters can be made here, else why not (a test's skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if shutil.which("unshare") is None:
        return "util-linux's `unshare` is not installed"
    return ""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Closing:
    """A context manager that either comes up whole or leaves nothing: ``__enter__`` runs ``open``, and on any
    failure of it (an error, Ctrl-C) ``close``, which must undo whatever part of ``open`` ran; ``__exit__``
    runs ``close``."""

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Host:
    """One host of a cluster: its name (``host0``), namespace, address and the root-side end of its link."""

    name: str
    namespace: str
    address: str
    link: str
    """The veth end on the bridge (in the root namespace): what ``cut`` and ``limit`` act on."""

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """``argv`` as run on this host: in its namespace, under its hostname, with ``env`` set."""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        inner = f"hostname {self.name} && exec env {exports} {shlex.join(argv)}"
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "sh", "-c", inner]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **options: object
              ) -> subprocess.Popen:
        """Start ``argv`` on this host (in a session of its own, so that ``kill_all`` can end its process
        group); ``options`` go to ``subprocess.Popen``."""
        return subprocess.Popen(self.command(argv, env), start_new_session=True, **options)  # type: ignore[arg-type]

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 600.0,
            **options: object) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv, env), timeout=timeout, check=False, **options)  # type: ignore

    def pids(self) -> list[int]:
        """Every process in this host's namespace."""
        out = _ip("netns", "pids", self.namespace, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> None:
        """End every process on this host (a host that dies)."""
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


@dataclass
class Cluster(Closing):
    """``with Cluster(2) as cluster:`` N hosts ``host0`` .. on a bridge of their own (see the module docstring);
    ``rate_mbit``: every link limited to that rate (None: as fast as the machine)."""

    hosts_wanted: int
    rate_mbit: float | None = None
    tcp_retries2: int | None = None
    """The hosts' ``net.ipv4.tcp_retries2`` (None: the kernel's 15, ~15 minutes before an unanswered TCP request
    fails). A host whose link is cut keeps its torchrun agent blocked in a rendezvous-store call for that long;
    5 (~13 s), as clusters that want fast failure detection set it, ends it within the collective timeout."""
    name: str = ""
    hosts: list[Host] = field(default_factory=list)
    _reaper: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.hosts_wanted <= 250:
            raise ValueError(f"a cluster has 1 to 250 hosts, not {self.hosts_wanted}")
        if not self.name:
            self.name = f"{PREFIX}{os.getpid()}x{next(_counter)}"

    @property
    def bridge(self) -> str:
        return f"{self.name}b"[:15]  # Linux interface names: 15 characters

    @property
    def subnet(self) -> str:
        """A private /24 of this cluster's own (10.200-249.x.0/24, from its name)."""
        h = zlib.crc32(self.name.encode())
        return f"10.{200 + h % 50}.{(h >> 8) % 256}"

    def open(self) -> None:
        reason = available()
        if reason:
            raise RuntimeError(f"cannot make a cluster here: {reason}")
        sweep()
        self._reaper = subprocess.Popen([sys.executable, "-m", "roboscale.testing.cluster", "reap",
                                         str(os.getpid()), self.name], start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._build()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        names = [f"host{i}" for i in range(self.hosts_wanted)]
        addresses = [f"{self.subnet}.{i + 1}" for i in range(self.hosts_wanted)]
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(addresses, names, strict=True))
        for i, (host, address) in enumerate(zip(names, addresses, strict=True)):
            namespace, link, peer = f"{self.name}h{i}", f"{self.name}v{i}"[:15], f"{self.name}p{i}"[:15]
            _ip("netns", "add", namespace)
            _ip("link", "add", link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", link, "master", self.bridge, "up")
            _ip("link", "set", peer, "netns", namespace)
            _ip("-n", namespace, "link", "set", peer, "name", INTERFACE)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            if self.tcp_retries2 is not None:
                subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
                                f"net.ipv4.tcp_retries2={self.tcp_retries2}"], check=True, capture_output=True,
                               timeout=30)
            (NETNS_ETC / namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / namespace / "hosts").write_text(hosts_file)
            self.hosts.append(Host(host, namespace, address, link))
        if self.rate_mbit is not None:
            self.limit(self.rate_mbit)

    # --- links ----------------------------------------------------------------------------------------------
    def limit(self, rate_mbit: float | None, hosts: Sequence[Host] | None = None) -> None:
        """Every link (or those of ``hosts``) limited to ``rate_mbit`` each way (None: the limit removed)."""
        for host in hosts or self.hosts:
            # both ends: the bridge's side shapes what reaches the host, the host's side what it sends
            for tc in (["tc", "qdisc"], ["tc", "-n", host.namespace, "qdisc"]):
                dev = ["dev", host.link if len(tc) == 2 else INTERFACE, "root"]
                subprocess.run([*tc, "del", *dev], capture_output=True, check=False)
                if rate_mbit is not None:
                    # a bucket of ~10 ms at the rate (at least 32 kbit), packets queued at most 50 ms
                    burst = max(32, int(rate_mbit * 10))
                    subprocess.run([*tc, "add", *dev, "tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst}kbit",
                                    "latency", "50ms"], capture_output=True, check=True, timeout=30)

    def cut(self, host: Host) -> None:
        """``host``'s link down: it reaches no other host (its processes go on)."""
        _ip("link", "set", host.link, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.link, "up")

    def bytes_through(self, host: Host) -> int:
        """Bytes that crossed ``host``'s link so far, both directions (what it exchanged with the other hosts)."""
        stats = Path("/sys/class/net") / host.link / "statistics"
        return sum(int((stats / name).read_text()) for name in ("rx_bytes", "tx_bytes"))

    # --- teardown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Every process on the hosts killed, the namespaces, links, bridge and /etc/netns entries removed;
        idempotent."""
        teardown(self.name)
        self.hosts.clear()
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait(timeout=10)


_counter = itertools.count(1)


def teardown(name: str) -> None:
    """Remove everything of cluster ``name`` (whatever part of it exists)."""
    namespaces = [n.split()[0] for n in _ip("netns", "list", check=False).stdout.splitlines()
                  if n.startswith(name + "h")]
    for namespace in namespaces:
        for pid in _ip("netns", "pids", namespace, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for namespace in namespaces:
        for _ in range(50):  # a namespace whose processes are still dying is removed once they are gone
            if _ip("netns", "del", namespace, check=False).returncode == 0:
                break
            time.sleep(0.1)
        shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(name):
            _ip("link", "del", link, check=False)
    for leftover in NETNS_ETC.glob(name + "h*") if NETNS_ETC.is_dir() else []:
        shutil.rmtree(leftover, ignore_errors=True)


def owner_pid(name: str) -> int:
    """The pid of the process that made cluster ``name`` (or a directory named after it); -1 if not a cluster's."""
    digits = name.removeprefix(PREFIX).split("x")[0]
    return int(digits) if digits.isdigit() else -1


def sweep() -> list[str]:
    """Tear down the clusters whose owner has died (a ``kill -9`` before the reaper could act); returns them."""
    seen = {n.split()[0][: n.split()[0].rindex("h")] for n in _ip("netns", "list", check=False).stdout.splitlines()
            if n.startswith(PREFIX) and "h" in n.split()[0][len(PREFIX):]}
    seen |= {p.name[: p.name.rindex("h")] for p in NETNS_ETC.glob(PREFIX + "*")} if NETNS_ETC.is_dir() else set()
    dead = sorted(name for name in seen if not alive(owner_pid(name)))
    for name in dead:
        teardown(name)
    return dead


def _reap(owner: int, name: str) -> None:
    gone = threading.Event()
    when_gone(owner, gone.set)
    gone.wait()
    teardown(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m roboscale.testing.cluster", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make a cluster and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate-mbit", type=float, default=None)
    commands.add_parser("sweep", help="remove the clusters of owners that died")
    reap = commands.add_parser("reap", help=argparse.SUPPRESS)
    reap.add_argument("owner", type=int)
    reap.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "reap":
        _reap(args.owner, args.name)
    elif args.command == "sweep":
        print("\n".join(sweep()) or "nothing to sweep")
    else:
        with Cluster(args.hosts, args.rate_mbit) as cluster:
            for host in cluster.hosts:
                print(f"{host.name} {host.address} (ip netns exec {host.namespace} ...)", flush=True)
            print("Ctrl-C tears it down", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
