"""A SLURM cluster on this machine, for tests of what users submit with ``sbatch``: munged, slurmctld and one
slurmd per host of a cluster in a box (``roboscale.testing.cluster``: each host a network namespace with its own
hostname and address), so a job of N nodes is a true multi-node job: ``srun`` starts one task on each host and
torchrun's rendezvous crosses the bridge between them.

Everything runs from a temporary directory of its own (``/tmp/roboscale-slurm-<pid>-*``): the munge key (made
for this cluster), slurm.conf, the controller's state, the nodes' spool directories and every daemon's log. The
daemons run in the foreground (``-D``/``-F``) on host 0 (munged, slurmctld) and on every host (slurmd), on ports
of their own (6917/6918, not SLURM's 6817/6818). Client commands (``sbatch``, ``scontrol``, ...) run on host 0
with ``SLURM_CONF`` pointing at this cluster's slurm.conf (``LocalSlurm.command``/``run``).

Teardown always runs (on exit of the ``with`` block, also on an error or Ctrl-C): the cluster's teardown kills
every process on the hosts -- the daemons and also the jobs' ``slurmstepd`` and tasks, which slurmd starts as
daemons of their own (killing slurmd alone leaves them running) -- and the temporary directory is removed.
Should the owner die without running it (``kill -9``), the cluster's reaper still kills every process on the
hosts, and the next ``LocalSlurm`` removes the directories that dead owners left. Needs root, iproute2 and
Debian's ``slurm-wlm`` and ``munge`` (``available()`` says why not).

    with LocalSlurm(nodes=2) as slurm:
        job = slurm.submit("examples/slurm/train.sbatch", "--nodes=2", env={"DATASET": ...})
        slurm.wait_for(job, {"COMPLETED"}, timeout_s=300)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from roboscale.testing import cluster as box
from roboscale.utils.lifetime import alive

CTLD_PORT, SLURMD_PORT = 6917, 6918
"""Not SLURM's own 6817/6818: a real SLURM on this machine is not disturbed (each host is also a namespace of
its own, so the ports are free there anyway)."""
TMP_PREFIX = "roboscale-slurm-"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE", "PREEMPTED"})
"""Job states that do not change by themselves (a requeue makes such a job PENDING again)."""


def available() -> str:
    """Empty when a local SLURM can be started here, else why not (a test's skip reason)."""
    reason = box.available()
    if reason:
        return reason
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurm-wlm munge)"
    return ""


class SlurmError(RuntimeError):
    """The local SLURM did not come up, or a SLURM command failed; the message says which and why."""


@dataclass
class LocalSlurm(box.Closing):
    """``with LocalSlurm(nodes=2) as slurm:`` a SLURM of ``nodes`` hosts, each with ``cpus`` CPUs (default: this
    machine's) and an equal share of this machine's memory, in one partition ``debug``; see the module
    docstring."""

    nodes: int = 2
    cpus: int = 0
    start_timeout_s: float = 60.0
    directory: Path = field(init=False, default=Path())
    cluster: box.Cluster | None = field(init=False, default=None)
    _daemons: list[tuple[str, subprocess.Popen]] = field(init=False, default_factory=list)

    # --- lifetime -------------------------------------------------------------------------------------------
    def open(self) -> None:
        reason = available()
        if reason:
            raise SlurmError(f"cannot start a local SLURM here: {reason}")
        sweep()
        # munged requires every directory above its socket to be searchable by all (mkdtemp makes it 0700)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
        self.directory.chmod(0o755)
        self.cluster = box.Cluster(self.nodes).__enter__()
        self._start()

    def close(self) -> None:
        """Every process on the hosts killed (daemons and jobs), the hosts and the directory removed;
        idempotent."""
        pids = [pid for host in self.cluster.hosts for pid in host.pids()] if self.cluster is not None else []
        if self.cluster is not None:
            self.cluster.close()  # SIGKILL to everything in the hosts' namespaces
            self.cluster = None
        for _, daemon in self._daemons:
            daemon.wait(timeout=30)  # our children, reaped here
        self._daemons.clear()
        # the others (slurmscriptd, slurmstepd, the jobs' tasks) are reaped by init: gone before we return
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.directory != Path():
            shutil.rmtree(self.directory, ignore_errors=True)

    # --- start ----------------------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[box.Host]:
        assert self.cluster is not None, "use LocalSlurm in a with block"
        return self.cluster.hosts

    @property
    def conf(self) -> Path:
        return self.directory / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.directory / "munge" / "munge.socket"

    def _start(self) -> None:
        head = self.hosts[0]
        self._write_munge_key()
        self._write_conf()
        self._daemon("munged", head, ["munged", "-F", f"--socket={self.munge_socket}",
                                      f"--key-file={self.directory / 'key' / 'munge.key'}",
                                      f"--pid-file={self.directory / 'munge' / 'munged.pid'}",
                                      f"--seed-file={self.directory / 'munge' / 'munged.seed'}",
                                      f"--log-file={self.directory / 'log' / 'munged.log'}"])
        self._poll(lambda: self.munge_socket.is_socket(), "munged made no socket")
        self._daemon("slurmctld", head, ["slurmctld", "-D", "-f", str(self.conf)])
        for host in self.hosts:
            (self.directory / "spool" / host.name).mkdir(parents=True)
            self._daemon(f"slurmd on {host.name}", host, ["slurmd", "-D", "-f", str(self.conf), "-N", host.name])
        self._poll(self._all_idle, f"the nodes were not idle within {self.start_timeout_s:.0f} s")

    def _write_munge_key(self) -> None:
        # a key for this cluster alone; munged refuses a key that others can read, or in a directory others write
        keys = self.directory / "key"
        keys.mkdir(mode=0o700)
        (self.directory / "munge").mkdir(mode=0o755)
        (self.directory / "log").mkdir()
        (self.directory / "state").mkdir()
        key = keys / "munge.key"
        key.touch(mode=0o600)
        key.write_bytes(os.urandom(128))

    def _write_conf(self) -> None:
        self.conf.write_text(slurm_conf(self.directory, [(h.name, h.address) for h in self.hosts],
                                        self.cpus or os.cpu_count() or 1, _memory_mb() // self.nodes))

    def _daemon(self, name: str, host: box.Host, argv: list[str]) -> None:
        log = (self.directory / "log" / f"{name.replace(' ', '-')}.out").open("wb")
        with log:
            self._daemons.append((name, subprocess.Popen(on_host(host, argv), stdout=log, stderr=subprocess.STDOUT,
                                                         start_new_session=True)))

    def _poll(self, condition, failure: str) -> None:
        """Wait (bounded) until ``condition()``; a daemon that exits meanwhile is the error, with its log."""
        deadline = time.monotonic() + self.start_timeout_s
        while not condition():
            for name, daemon in self._daemons:
                if daemon.poll() is not None:
                    raise SlurmError(f"{name} exited with {daemon.returncode}: {self._log_tail(name)}")
            if time.monotonic() > deadline:
                raise SlurmError(f"{failure}; {self._log_tail('slurmctld')}")
            time.sleep(0.2)

    def _log_tail(self, name: str) -> str:
        path = self.directory / "log" / f"{name.replace(' ', '-')}.out"
        lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
        return " | ".join(lines[-5:]) or f"(nothing in {path})"

    def _all_idle(self) -> bool:
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        return done.returncode == 0 and all(states.get(h.name) == "idle" for h in self.hosts)

    # --- commands -------------------------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """What a SLURM command needs to reach this cluster (jobs submitted with ``--export=ALL`` inherit it)."""
        return {"SLURM_CONF": str(self.conf)}

    def command(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """``argv`` as run on host 0, where this cluster's controller is reachable."""
        return self.hosts[0].command(argv, {**self.env, **(env or {})})

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, check: bool = True,
            timeout_s: float = 60.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command(argv, env), capture_output=True, text=True, timeout=timeout_s,
                              check=False, cwd=cwd)
        if check and done.returncode != 0:
            raise SlurmError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()[-1000:]}")
        return done

    def submit(self, script: Path, *options: str, env: Mapping[str, str] | None = None,
               cwd: Path | None = None) -> int:
        """``sbatch [options] script``; the job's id. The job gets this process's environment plus ``env``."""
        done = self.run(["sbatch", "--parsable", "--export=ALL", *options, str(script)], env=env, cwd=cwd)
        return int(done.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, NodeList, ...)."""
        out = self.run(["scontrol", "--oneliner", "show", "job", str(job)]).stdout
        return dict(re.findall(r"(\w+(?::\w+)?)=(\S*)", out))

    def state(self, job: int) -> str:
        return self.job(job)["JobState"]

    def wait_for(self, job: int, states: Collection[str], timeout_s: float) -> str:
        """Wait (bounded) until ``job`` is in one of ``states``; a job that finishes in another state is an
        error."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state(job)) not in states:
            if state in FINISHED:
                raise SlurmError(f"job {job} ended {state}, not {'/'.join(sorted(states))}: {self.job(job)}")
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} still {state} after {timeout_s:.0f} s, not {'/'.join(sorted(states))}")
            time.sleep(0.2)
        return state

    def cancel(self, job: int) -> None:
        """``scancel``: the job ends for good (CANCELLED) unless it is requeued."""
        self.run(["scancel", str(job)])

    def requeue(self, job: int) -> None:
        """``scontrol requeue``: a running or finished batch job is pending again and starts from its script's
        beginning (SLURM_RESTART_COUNT one more). SLURM holds a requeued job back ~2 minutes (its EligibleTime)
        so its nodes can be cleaned up; here they are, so it may start at once."""
        self.run(["scontrol", "requeue", str(job)])
        self.start_now(job)

    def start_now(self, job: int) -> None:
        """A pending job may start at once (a requeued one is held back, see ``requeue``)."""
        self.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])

    def signal_batch(self, job: int, signal: str) -> None:
        """``scancel --signal --batch``: ``signal`` to the job's batch shell alone, as ``--signal=B:...`` sends
        it before the time limit."""
        self.run(["scancel", f"--signal={signal}", "--batch", str(job)])


def on_host(host: box.Host, argv: Sequence[str]) -> list[str]:
    """``argv`` as a daemon of ``host``: in its network namespace, under its name, with its /etc/hosts.

    Not ``Host.command``'s ``ip netns exec``, which mounts a sysfs of the namespace's own over /sys, where no
    cgroup filesystem is mounted: slurmd 22.05 initialises its cgroup plugin even with no cgroup plugins
    configured, and fails (``No filesystem mounted on /sys/fs/cgroup``). The jobs slurmd starts run where it
    runs, so they resolve the hosts' names and see their host's hostname (torchrun's rendezvous compares it)."""
    hosts = box.NETNS_ETC / host.namespace / "hosts"
    inner = f'hostname {host.name} && mount --bind {hosts} /etc/hosts && exec "$@"'
    return ["nsenter", f"--net=/run/netns/{host.namespace}", "unshare", "--uts", "--mount", "--propagation=private",
            "sh", "-c", inner, "sh", *argv]


def slurm_conf(directory: Path, nodes: Sequence[tuple[str, str]], cpus: int, memory_mb: int) -> str:
    """A minimal slurm.conf (SLURM 22.05) for ``nodes`` (name, address), the first also the controller."""
    # no cgroups (a container may have none writable): processes are tracked by their parent chain, tasks are not
    # bound; no accounting database; the builtin scheduler starts a job as soon as it fits (no backfill cycle)
    lines = [
        "ClusterName=roboscale",
        f"SlurmctldHost={nodes[0][0]}({nodes[0][1]})",
        f"SlurmctldPort={CTLD_PORT}", f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={directory / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={directory / 'state'}",
        f"SlurmdSpoolDir={directory / 'spool' / '%n'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}", f"SlurmdPidFile={directory / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={directory / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={directory / 'log' / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "MpiDefault=none", "MailProg=/bin/true",
        # a node's hardware is what slurm.conf says (the hosts share this machine); a node that was down comes back
        "SlurmdParameters=config_overrides", "ReturnToService=2",
        # batch jobs may be requeued (`scontrol requeue`, --requeue); a cancelled job's tasks get 5 s after SIGTERM
        "JobRequeue=1", "KillWait=5",
        *(f"NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
          for name, address in nodes),
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def sweep() -> list[Path]:
    """Remove the directories of local SLURMs whose owner died (their processes went with the cluster's hosts)."""
    dead = []
    for path in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"):
        owner = path.name.removeprefix(TMP_PREFIX).split("-")[0]
        if owner.isdigit() and not alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            dead.append(path)
    return dead
