"""torchrun across hosts of the cluster in a box, as the README's multi-node command runs it: a c10d rendezvous on
host 0's name, gloo on each host's eth0. Two hosts of one rank compute the 1-process losses (DDP and FSDP2); a
link cut mid-run ends every rank and both torchruns within ``--parallel.timeout_s`` plus a bound, never a hang,
on hosts whose ``net.ipv4.tcp_retries2`` is 5 (with the kernel's 15 the cut host's agent blocks in its
rendezvous-store call for ~15 minutes: README, "Clusters")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from roboscale.testing.cluster import Cluster, available
from tests.train.test_distributed import STEPS, _command, _losses, _train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(available()), reason=available() or "")]

ROOT = Path(__file__).resolve().parents[2]
PORT = 29431
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive", "ROBOSCALE_LOG": "WARNING", "GLOO_SOCKET_IFNAME": "eth0",
       "PYTHONPATH": str(ROOT / "src")}


def on_hosts(cluster: Cluster, dataset: Path, out: Path, *extra: str, ranks_per_host: int = 1
             ) -> list[subprocess.Popen]:
    """`roboscale train` on every host: torchrun with ``--nnodes`` = the hosts, rendezvous at host0."""
    head = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(cluster.hosts)}",
            f"--nproc-per-node={ranks_per_host}", "--rdzv-backend=c10d", f"--rdzv-endpoint=host0:{PORT}",
            f"--rdzv-id={cluster.name}"]
    train = _command(2, dataset, out, *extra)[len([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node=2"]):]
    return [host.popen([*head, *train], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       cwd=ROOT) for host in cluster.hosts]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _losses(_train(1, tiny_dataset, tmp_path_factory.mktemp("one") / "run"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_hosts_compute_the_one_process_losses(strategy: str, single: list[float], tiny_dataset: Path,
                                                  tmp_path: Path) -> None:
    with Cluster(2) as cluster:
        procs = on_hosts(cluster, tiny_dataset, tmp_path / "run", f"--parallel.strategy={strategy}")
        errors = [p.communicate(timeout=600)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
    rows = metrics(tmp_path / "run")
    assert len(rows) == STEPS and _losses(rows) == pytest.approx(single, rel=1e-4)


def test_a_cut_link_ends_every_process_within_the_collective_timeout(tiny_dataset: Path, tmp_path: Path) -> None:
    timeout_s, bound_s = 20, 30
    out = tmp_path / "run"
    with Cluster(2, tcp_retries2=5) as cluster:
        procs = on_hosts(cluster, tiny_dataset, out, "--parallel.strategy=fsdp", f"--parallel.timeout_s={timeout_s}",
                         "--steps=100000", "--save_freq=100000")
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file():  # training has begun: a step's collectives are in flight
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.5)
        cut = time.monotonic()
        cluster.cut(cluster.hosts[1])
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, timeout_s + bound_s - (time.monotonic() - cut)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a torchrun still ran {timeout_s + bound_s} s after host1's link was cut")
        ended_s = time.monotonic() - cut
    assert all(p.returncode != 0 for p in procs)  # a failure, said: not a hang, not a success
    assert ended_s < timeout_s + bound_s, ended_s
